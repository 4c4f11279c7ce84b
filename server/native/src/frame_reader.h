// The executor's frames as the link's reader takes them off the socket: one recv() fills a
// buffer with whatever the socket holds, and Next() yields every whole frame in it, so that a
// burst of answers costs one system call rather than two per frame (a length prefix, then its
// body).
//
// A frame is a 4-byte little-endian length and that many bytes (protos/wire.proto). Its length
// is checked against the limit as soon as its prefix is in, before its body is read into the
// buffer: a peer cannot make the buffer grow past one frame under the limit plus what one
// read takes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace batchgate {

class FrameReader {
 public:
  enum class Status {
    kFrames,    // Fill(): bytes came; Next() may have frames
    kClosed,    // the peer closed the connection, or the socket failed
    kOversize,  // a frame's length passes the limit (oversize_bytes() says which)
  };

  // `max_frame_bytes`: the largest frame body accepted; `read_bytes`: what one recv() asks for
  // at least (a frame larger than that is read into room made for it alone).
  explicit FrameReader(uint32_t max_frame_bytes, size_t read_bytes = 256 << 10);

  // One recv() from `fd` (again on EINTR) into the buffer.
  Status Fill(int fd);
  // The next whole frame's body in the buffer, valid until the next Fill(); false when none is
  // whole yet, or once a length passed the limit (Fill() then says kOversize).
  bool Next(const char** body, uint32_t* size);
  // The length that passed the limit.
  uint32_t oversize_bytes() const { return oversize_; }
  // Bytes held that belong to no whole frame yet.
  size_t buffered() const { return end_ - start_; }

 private:
  // Room for the frame that starts at start_ (or read_bytes_, at least) past end_: what the
  // buffer holds is moved to its front first.
  void MakeRoom();

  const uint32_t max_frame_bytes_;
  const size_t read_bytes_;
  std::vector<char> buffer_;
  size_t start_ = 0;  // the first byte of the first frame not yet yielded
  size_t end_ = 0;    // one past the last byte received
  uint32_t oversize_ = 0;
};

}  // namespace batchgate
