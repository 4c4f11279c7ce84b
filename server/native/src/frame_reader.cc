#include "frame_reader.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace batchgate {
namespace {

constexpr size_t kPrefixBytes = 4;

uint32_t LengthAt(const char* prefix) {
  uint32_t size = 0;
  for (size_t i = 0; i < kPrefixBytes; ++i) {
    size |= static_cast<uint32_t>(static_cast<uint8_t>(prefix[i])) << (8 * i);
  }
  return size;
}

}  // namespace

FrameReader::FrameReader(uint32_t max_frame_bytes, size_t read_bytes)
    : max_frame_bytes_(max_frame_bytes), read_bytes_(read_bytes) {}

void FrameReader::MakeRoom() {
  size_t wanted = read_bytes_;
  if (end_ - start_ >= kPrefixBytes) {
    // A frame larger than one read: room for all of it, so that it needs no second move.
    const size_t frame = kPrefixBytes + LengthAt(buffer_.data() + start_);
    if (frame > wanted) wanted = frame - (end_ - start_);
  }
  if (buffer_.size() - end_ >= wanted) return;
  if (start_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + start_, end_ - start_);
    end_ -= start_;
    start_ = 0;
  }
  // Grows only for a frame larger than any before: the buffer is kept between reads.
  if (buffer_.size() - end_ < wanted) buffer_.resize(end_ + wanted);
}

FrameReader::Status FrameReader::Fill(int fd) {
  if (oversize_ != 0) return Status::kOversize;
  MakeRoom();
  while (true) {
    const ssize_t n = ::recv(fd, buffer_.data() + end_, buffer_.size() - end_, 0);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      return Status::kFrames;
    }
    if (n < 0 && errno == EINTR) continue;
    return Status::kClosed;  // 0: the peer closed the connection
  }
}

bool FrameReader::Next(const char** body, uint32_t* size) {
  if (oversize_ != 0 || end_ - start_ < kPrefixBytes) return false;
  const uint32_t length = LengthAt(buffer_.data() + start_);
  // Before any more of it is read: the next Fill() refuses it.
  if (length > max_frame_bytes_) {
    oversize_ = length;
    return false;
  }
  if (end_ - start_ - kPrefixBytes < length) return false;
  *body = buffer_.data() + start_ + kPrefixBytes;
  *size = length;
  start_ += kPrefixBytes + length;
  if (start_ == end_) start_ = end_ = 0;  // all yielded: the next read starts at the front
  return true;
}

}  // namespace batchgate
