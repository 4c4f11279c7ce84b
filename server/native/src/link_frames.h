// What both of the executor link's ends share (executor_link.cc writes, link_reader.cc reads):
// the wire's frame limit, frames encoded and split under it, sends that block and sends that
// do not, the connection itself, and the words of its refusals.
#pragma once

#include <grpcpp/support/status.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "executor_link.h"
#include "protos/wire.pb.h"

namespace batchgate {

// wire.proto's WireLimit: a frame larger than this is a protocol error (frames carry
// descriptors only). The Python end reads the same definition.
constexpr uint32_t kMaxFrameBytes = wire::MAX_FRAME_BYTES;

inline const char* const kRestarted = "the executor process restarted; retry the request";
inline const char* const kNotConnected = "the executor process is not connected; retry";

// A connected socket, closed when the last thread using it lets it go.
struct ExecutorLink::Socket {
  explicit Socket(int descriptor) : fd(descriptor) {}
  ~Socket() { close(fd); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  // Wakes whichever thread blocks in a read or write on it.
  void Shutdown() const { ::shutdown(fd, SHUT_RDWR); }
  const int fd;
};

// Writes all of `data`, blocking; false when the connection is broken.
bool SendAll(int fd, const char* data, size_t size);
// Writes what the socket takes now without blocking: the bytes written, or -1 when the
// connection is broken.
ssize_t SendSome(int fd, const char* data, size_t size);
// `message` as one frame in `buffer` (emptied first), sent with SendAll.
bool SendFrame(int fd, const google::protobuf::MessageLite& message, std::string& buffer);
// `frame` as the bytes of one frame in `buffer`, or of several when it would pass
// kMaxFrameBytes; empties `frame`'s repeated fields when it splits.
void Encode(wire::ToExecutor& frame, std::string& buffer);
// Whether `entry` fits a frame alone (Encode splits frames between entries, never inside one);
// RESOURCE_EXHAUSTED in `refusal` when not.
bool FitsAFrame(const google::protobuf::MessageLite& entry, grpc::Status* refusal);

}  // namespace batchgate
