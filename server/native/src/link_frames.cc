#include "link_frames.h"

#include <sys/socket.h>
#include <sys/types.h>

#include <cerrno>
#include <string>

namespace batchgate {
namespace {

// What a frame holds beyond its entries, at most: the tags and lengths of its packed lists.
constexpr size_t kFrameSlackBytes = 64;
// An entry's own tag and length (a length under 2**28), and a packed list's number.
constexpr size_t kEntryBytes = 5;
constexpr size_t kNumberBytes = 10;
// What the writer aims a frame at when one would pass kMaxFrameBytes.
constexpr size_t kSplitFrameBytes = 16u << 20;

// Appends one frame, header and body, to `buffer`, so that everything goes out in one system
// call.
void AppendFrame(const google::protobuf::MessageLite& message, std::string& buffer) {
  const size_t size = message.ByteSizeLong();
  const size_t at = buffer.size();
  buffer.resize(at + 4 + size);
  for (int i = 0; i < 4; ++i) buffer[at + i] = static_cast<char>((size >> (8 * i)) & 0xFF);
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(&buffer[at + 4]));
}

}  // namespace

bool SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool SendFrame(int fd, const google::protobuf::MessageLite& message, std::string& buffer) {
  buffer.clear();
  AppendFrame(message, buffer);
  return SendAll(fd, buffer.data(), buffer.size());
}

// `frame` as the bytes of one frame, or of several when it would pass kMaxFrameBytes (only a
// flood of large calls gets there): Infers, groups and Calls first, cancels and frees last, so
// that each cancel still finds its request already sent. Each entry's size is checked before it
// goes in: the part filled so far goes out first when the entry would take it past the limit
// (no entry passes it alone: SubmitInfer and SubmitCall refuse those), or once the part has
// reached kSplitFrameBytes. Empties `frame`'s repeated fields when it splits.
void Encode(wire::ToExecutor& frame, std::string& buffer) {
  buffer.clear();
  if (frame.ByteSizeLong() <= kMaxFrameBytes) {
    AppendFrame(frame, buffer);
    return;
  }
  // ByteSizeLong() above left every entry's size cached.
  wire::ToExecutor part;
  size_t part_bytes = 0;  // a bound on part's size
  const auto flush = [&] {
    if (part_bytes > 0) AppendFrame(part, buffer);
    part.Clear();
    part_bytes = 0;
  };
  const auto make_room = [&](size_t bytes) {
    if (part_bytes + bytes > kMaxFrameBytes - kFrameSlackBytes || part_bytes >= kSplitFrameBytes) {
      flush();
    }
    part_bytes += bytes;
  };
  const auto entry = [](const google::protobuf::MessageLite& message) {
    return static_cast<size_t>(message.GetCachedSize()) + kEntryBytes;
  };
  for (auto& infer : *frame.mutable_infer()) {
    make_room(entry(infer));
    part.add_infer()->Swap(&infer);
  }
  for (auto& group : *frame.mutable_groups()) {
    make_room(entry(group));
    part.add_groups()->Swap(&group);
  }
  for (auto& call : *frame.mutable_call()) {
    make_room(entry(call));
    part.add_call()->Swap(&call);
  }
  flush();
  for (const uint64_t rid : frame.cancel()) {
    make_room(kNumberBytes);
    part.add_cancel(rid);
  }
  for (const uint64_t block : frame.free()) {
    make_room(kNumberBytes);
    part.add_free(block);
  }
  flush();
  frame.clear_cancel();
  frame.clear_free();
}

// Whether `entry` fits a frame alone (Encode splits frames between entries, never inside one);
// RESOURCE_EXHAUSTED in `refusal` when not.
bool FitsAFrame(const google::protobuf::MessageLite& entry, grpc::Status* refusal) {
  if (entry.ByteSizeLong() + kEntryBytes <= kMaxFrameBytes - kFrameSlackBytes) return true;
  *refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "the request is larger than the " + std::to_string(kMaxFrameBytes) +
                              " bytes a front end forwards to the executor process");
  return false;
}

// Writes what the socket takes now without blocking: the bytes written, or -1 when the
// connection is broken.
ssize_t SendSome(int fd, const char* data, size_t size) {
  size_t sent = 0;
  while (sent < size) {
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return -1;
    }
    sent += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(sent);
}

}  // namespace batchgate
