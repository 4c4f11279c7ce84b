#include "executor_link.h"

#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "input_region.h"
#include "log.h"
#include "model_table.h"
#include "text.h"

namespace batchgate {
namespace {

// wire.proto's WireLimit: a frame larger than this is a protocol error (frames carry
// descriptors only). The Python end reads the same definition.
constexpr uint32_t kMaxFrameBytes = wire::MAX_FRAME_BYTES;
// What a frame holds beyond its entries, at most: the tags and lengths of its packed lists.
constexpr size_t kFrameSlackBytes = 64;
// An entry's own tag and length (a length under 2**28), and a packed list's number.
constexpr size_t kEntryBytes = 5;
constexpr size_t kNumberBytes = 10;
// What the writer aims a frame at when one would pass kMaxFrameBytes.
constexpr size_t kSplitFrameBytes = 16u << 20;
// The most requests an InferGroup holds (wire.proto): with ids of kMaxForwardedIdBytes, ~4 MiB.
constexpr int kMaxGroupRequests = 4096;
constexpr auto kReconnectInterval = std::chrono::milliseconds(50);
// A connection lost sooner than this after it was made (an executor that accepts and drops,
// or crashes at once) is tried again after a delay that doubles from kReconnectInterval up to
// kMaxReconnectDelay; one that lasted is tried again at once.
constexpr auto kStableSession = std::chrono::seconds(1);
constexpr auto kMaxReconnectDelay = std::chrono::milliseconds(2000);
// The executor_lost warning of connections lost soon after they were made, at most this often.
constexpr auto kLostLogInterval = std::chrono::seconds(10);
constexpr int kSocketBufferBytes = 4 << 20;
// How long returned output blocks may wait for a request's frame to carry them. Under load the
// next request comes long before; a client that sends one request at a time sends its next
// within a round trip, and a frame of their own would cost the executor a wake-up per request.
// Held blocks stay taken meanwhile: at most this long's worth of outputs, once traffic stops.
constexpr auto kFreeDelay = std::chrono::milliseconds(10);

const char* const kRestarted = "the executor process restarted; retry the request";
const char* const kNotConnected = "the executor process is not connected; retry";
const char* const kRestarting = "the executor is restarting";

bool SameUser(int fd) {
  ucred peer{};
  socklen_t length = sizeof peer;
  return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) == 0 && peer.uid == getuid();
}

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

bool ReceiveAll(int fd, char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::recv(fd, data, size, 0);
    if (n == 0) return false;  // the peer closed the connection
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Appends one frame, header and body, to `buffer`, so that everything goes out in one system
// call.
void AppendFrame(const google::protobuf::MessageLite& message, std::string& buffer) {
  const size_t size = message.ByteSizeLong();
  const size_t at = buffer.size();
  buffer.resize(at + 4 + size);
  for (int i = 0; i < 4; ++i) buffer[at + i] = static_cast<char>((size >> (8 * i)) & 0xFF);
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(&buffer[at + 4]));
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

// A writing thread's frame and bytes, kept between frames so that their memory is reused.
struct WriteScratch {
  wire::ToExecutor frame;
  std::vector<bool> groupable;  // per Infer of `frame`
  std::string bytes;
};

WriteScratch& ThreadScratch() {
  thread_local WriteScratch scratch;
  return scratch;
}

// Whether `infer` has inputs, all in the arena, each with batch_size rows (what a group says
// of its requests).
bool InArenaWithRows(const wire::Infer& infer) {
  if (infer.inputs_size() == 0) return false;
  for (const wire::Tensor& tensor : infer.inputs()) {
    if (tensor.shape_size() == 0 || tensor.has_placement() ||
        tensor.shape(0) != static_cast<int64_t>(infer.batch_size())) {
      return false;
    }
  }
  return true;
}

using Dims = google::protobuf::RepeatedField<int64_t>;

// Whether `shape` is a batch dimension followed by the dimensions [tail, tail_end).
bool HasTail(const Dims& shape, Dims::const_iterator tail, Dims::const_iterator tail_end) {
  return shape.size() == tail_end - tail + 1 && std::equal(tail, tail_end, shape.begin() + 1);
}

// Whether `a` and `b` (each InArenaWithRows) go in the same group: one model, the same shapes
// past the batch dimension.
bool SameGroup(const wire::Infer& a, const wire::Infer& b) {
  if (a.model() != b.model() || a.inputs_size() != b.inputs_size()) return false;
  for (int k = 0; k < a.inputs_size(); ++k) {
    const auto& shape = b.inputs(k).shape();
    if (!HasTail(a.inputs(k).shape(), shape.begin() + 1, shape.end())) return false;
  }
  return true;
}

// A new InferGroup of `frame` for `infer`'s model and shapes past the batch dimension.
wire::InferGroup* NewGroup(const wire::Infer& infer, wire::ToExecutor& frame) {
  wire::InferGroup* group = frame.add_groups();
  group->set_model(infer.model());
  for (const wire::Tensor& tensor : infer.inputs()) {
    group->add_inputs()->mutable_tail()->Add(tensor.shape().begin() + 1, tensor.shape().end());
  }
  return group;
}

// `infer`'s entry in each of `group`'s columns.
void AppendToGroup(const wire::Infer& infer, wire::InferGroup& group) {
  group.add_rids(infer.rid());
  group.add_batch_sizes(infer.batch_size());
  group.add_priorities(infer.priority());
  group.add_deadlines_ns(infer.deadline_ns());
  group.add_timeouts_us(infer.timeout_us());
  group.add_ids(infer.id());
  for (int k = 0; k < infer.inputs_size(); ++k) {
    group.mutable_inputs(k)->add_offsets(infer.inputs(k).offset());
  }
}

grpc::StatusCode CodeOf(uint32_t number) {
  // Numbers gRPC does not define are UNKNOWN (server/frontend/errors.py grpc_code()); so is 0, which no
  // failure can carry.
  return number >= 1 && number <= 16 ? static_cast<grpc::StatusCode>(number)
                                     : grpc::StatusCode::UNKNOWN;
}

}  // namespace

bool AppendBatchResults(const wire::Batch& batch, std::vector<std::unique_ptr<wire::Result>>* results) {
  const int count = batch.rids_size();
  if (batch.first_rows_size() != count || batch.rows_size() != count) return false;
  results->reserve(results->size() + static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    auto result = std::make_unique<wire::Result>();
    result->set_rid(batch.rids(i));
    result->set_released(batch.released());
    const uint64_t first = batch.first_rows(i);
    const uint64_t rows = batch.rows(i);
    for (const wire::BatchOutput& output : batch.outputs()) {
      wire::Output* out = result->add_outputs();
      out->set_block(output.block());
      out->set_offset(output.block() + first * output.row_bytes());
      out->set_nbytes(rows * output.row_bytes());
      out->mutable_shape()->Reserve(output.tail_size() + 1);
      out->add_shape(static_cast<int64_t>(rows));
      for (const int64_t dim : output.tail()) out->add_shape(dim);
    }
    results->push_back(std::move(result));
  }
  return true;
}

void GroupInfers(wire::ToExecutor& frame, const std::vector<bool>& groupable) {
  const int count = frame.infer_size();
  if (count < 2 || groupable.size() != static_cast<size_t>(count)) return;
  // Per Infer that may go in a group: the first such Infer of its group (itself, or one before
  // it); -1 for the others. Per first Infer: how many share its group.
  std::vector<int> first(static_cast<size_t>(count), -1);
  std::vector<int> members(static_cast<size_t>(count), 0);
  std::vector<int> leaders;  // the first Infer of each group: a frame's requests share a few
  bool any = false;
  for (int i = 0; i < count; ++i) {
    if (!groupable[static_cast<size_t>(i)] || !InArenaWithRows(frame.infer(i))) continue;
    int lead = i;
    for (const int j : leaders) {
      if (SameGroup(frame.infer(i), frame.infer(j))) {
        lead = j;
        break;
      }
    }
    if (lead == i) leaders.push_back(i);
    first[static_cast<size_t>(i)] = lead;
    any = ++members[static_cast<size_t>(lead)] > 1 || any;
  }
  if (!any) return;
  // Per first Infer of a group of two or more: the InferGroup being filled (a full one is
  // followed by a new one). A RepeatedPtrField's elements stay where they are as it grows.
  std::vector<wire::InferGroup*> filling(static_cast<size_t>(count), nullptr);
  auto* infers = frame.mutable_infer();
  int kept = 0;
  for (int i = 0; i < count; ++i) {
    const int lead = first[static_cast<size_t>(i)];
    if (lead >= 0 && members[static_cast<size_t>(lead)] > 1) {
      wire::InferGroup*& group = filling[static_cast<size_t>(lead)];
      if (group == nullptr || group->rids_size() >= kMaxGroupRequests) {
        group = NewGroup(infers->Get(i), frame);
      }
      AppendToGroup(infers->Get(i), *group);
      continue;
    }
    if (kept != i) infers->SwapElements(kept, i);
    ++kept;
  }
  while (infers->size() > kept) infers->RemoveLast();
}

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

ExecutorLink::ExecutorLink(std::string socket_name, uint32_t slot, InputRegion& region,
                           ModelTable& models, LinkObserver& observer)
    : socket_name_(std::move(socket_name)),
      slot_(slot),
      region_(region),
      models_(models),
      observer_(observer) {}

ExecutorLink::~ExecutorLink() { Close(); }

void ExecutorLink::Start() {
  reader_ = std::thread([this] { ReadLoop(); });
  writer_ = std::thread([this] { WriteLoop(); });
}

void ExecutorLink::Close() {
  std::shared_ptr<Socket> socket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    socket = socket_;
  }
  if (socket) socket->Shutdown();
  wake_reader_.notify_all();
  wake_writer_.notify_all();
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
}

bool ExecutorLink::SubmitInfer(std::unique_ptr<wire::Infer> infer, std::vector<uint64_t> blocks,
                               uint64_t model_generation, AnswerTarget* target,
                               uint64_t* rid, grpc::Status* refusal, bool groupable) {
  if (!FitsAFrame(*infer, refusal)) return false;
  std::unique_lock<std::mutex> lock(mu_);
  if (!socket_ || !welcomed_) {
    *refusal = grpc::Status(grpc::StatusCode::UNAVAILABLE, kNotConnected);
    return false;
  }
  if (model_generation != generation_) {
    // Checked against a state of the executor process before this one: its handle means
    // nothing to this one.
    *refusal = grpc::Status(grpc::StatusCode::UNAVAILABLE, kRestarted);
    return false;
  }
  *rid = next_id_++;
  infer->set_rid(*rid);
  infers_.emplace(*rid, PendingInfer{target, std::move(blocks)});
  pending_.mutable_infer()->AddAllocated(infer.release());
  pending_groupable_.push_back(groupable);
  Flush(lock, true);
  return true;
}

void ExecutorLink::Cancel(uint64_t rid) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!socket_ || !infers_.count(rid)) return;  // answered meanwhile, or the connection is gone
  pending_.add_cancel(rid);
  Flush(lock, true);
}

void ExecutorLink::FreeOutputs(uint64_t generation, const wire::Result& result) {
  bool any = false;
  for (const wire::Output& output : result.outputs()) any = any || !output.placed();
  if (!any) return;
  std::unique_lock<std::mutex> lock(mu_);
  // The output region of an executor that went away started afresh with the next one.
  if (!socket_ || generation != generation_) return;
  for (const wire::Output& output : result.outputs()) {
    // One written into the client's region has no block.
    if (!output.placed()) pending_.add_free(output.block());
  }
  Flush(lock, false);
}

bool ExecutorLink::SubmitCall(std::unique_ptr<wire::Call> call, AnswerTarget* target,
                              grpc::Status* refusal) {
  if (!FitsAFrame(*call, refusal)) return false;
  std::unique_lock<std::mutex> lock(mu_);
  if (!socket_ || !welcomed_) {
    *refusal = grpc::Status(grpc::StatusCode::UNAVAILABLE, kNotConnected);
    return false;
  }
  const uint64_t cid = next_id_++;
  call->set_cid(cid);
  calls_.emplace(cid, target);
  pending_.mutable_call()->AddAllocated(call.release());
  Flush(lock, true);
  return true;
}

size_t ExecutorLink::InFlightInfers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return infers_.size();
}

namespace {
// The calling thread's DeferredWrites state: whether it defers, and the link it left an entry
// unwritten on (there is one link a process).
thread_local bool t_defer_writes = false;
thread_local ExecutorLink* t_deferred = nullptr;
}  // namespace

ExecutorLink::DeferredWrites::DeferredWrites() { t_defer_writes = true; }

ExecutorLink::DeferredWrites::~DeferredWrites() {
  FlushDeferredWrites();
  t_defer_writes = false;
}

bool ExecutorLink::HasDeferredWrites() { return t_deferred != nullptr; }

void ExecutorLink::FlushDeferredWrites() {
  ExecutorLink* link = t_deferred;
  if (link == nullptr) return;
  t_deferred = nullptr;
  const bool deferring = t_defer_writes;
  t_defer_writes = false;
  {
    std::unique_lock<std::mutex> lock(link->mu_);
    // Written meanwhile by another thread's round, or dropped with a lost connection: nothing.
    if (link->pending_urgent_) link->Flush(lock, true);
  }
  t_defer_writes = deferring;
}

void ExecutorLink::Flush(std::unique_lock<std::mutex>& lock, bool urgent) {
  // Returned output blocks are not urgent: they wait for the next request's frame, or
  // kFreeDelay at most (the writer thread's), so that answering a request does not cost a frame
  // of its own.
  bool wake;
  if (!urgent) {
    if (!pending_frees_) frees_since_ = std::chrono::steady_clock::now();
    pending_frees_ = true;
    wake = !writing_ && writer_state_ == WriterState::kIdle;
  } else {
    pending_urgent_ = true;
    // Whoever holds the write token takes this entry in its next round.
    if (writing_) return;
    // Deferred only while other requests are in flight: the executor is busy with them, and
    // the entries the worker takes next join this frame; with nothing in flight it goes now.
    if (t_defer_writes && infers_.size() > 1 && (t_deferred == nullptr || t_deferred == this)) {
      t_deferred = this;  // written by this thread's FlushDeferredWrites
      return;
    }
    writing_ = true;
    WriteNow(lock);
    wake = (pending_urgent_ && writer_state_ != WriterState::kBusy) ||
           (pending_frees_ && writer_state_ == WriterState::kIdle) || !handoff_.empty();
  }
  lock.unlock();
  if (wake) wake_writer_.notify_one();
}

void ExecutorLink::WriteNow(std::unique_lock<std::mutex>& lock) {
  // A few rounds at most: a worker's calls wait while it writes for the others.
  constexpr int kRounds = 4;
  WriteScratch& scratch = ThreadScratch();
  for (int round = 0; round < kRounds && pending_urgent_; ++round) {
    scratch.frame.Swap(&pending_);
    scratch.groupable.swap(pending_groupable_);
    pending_urgent_ = pending_frees_ = false;
    const std::shared_ptr<Socket> socket = socket_;
    lock.unlock();
    ssize_t written = 0;
    if (socket) {
      GroupInfers(scratch.frame, scratch.groupable);
      Encode(scratch.frame, scratch.bytes);
      written = SendSome(socket->fd, scratch.bytes.data(), scratch.bytes.size());
      // A broken connection: the reader sees it end and handles the loss, in one place.
      if (written < 0) socket->Shutdown();
    }
    scratch.frame.Clear();  // keeps the messages allocated, for the next frames to reuse
    scratch.groupable.clear();
    lock.lock();
    if (written >= 0 && static_cast<size_t>(written) < scratch.bytes.size() && socket) {
      // The socket buffer is full: the writer thread writes the rest, blocking, and holds the
      // token until then. Nothing else may go out in between.
      handoff_.assign(scratch.bytes, static_cast<size_t>(written), std::string::npos);
      handoff_socket_ = socket;
      return;
    }
  }
  writing_ = false;
}

void ExecutorLink::WriteLoop() {
  pthread_setname_np(pthread_self(), "bg-link-write");
  std::unique_lock<std::mutex> lock(mu_);
  while (!closing_) {
    if (!handoff_.empty()) {
      // The rest of a worker's frame; the token is ours until it is written.
      writer_state_ = WriterState::kBusy;
      std::string bytes;
      bytes.swap(handoff_);
      const std::shared_ptr<Socket> socket = std::move(handoff_socket_);
      handoff_socket_.reset();
      lock.unlock();
      if (!SendAll(socket->fd, bytes.data(), bytes.size())) socket->Shutdown();
      lock.lock();
      writing_ = false;
      continue;
    }
    if (!writing_ && pending_frees_ && !pending_urgent_) {
      // Returned blocks wait for a request's frame to carry them, kFreeDelay at most.
      const auto due = frees_since_ + kFreeDelay;
      if (std::chrono::steady_clock::now() < due) {
        writer_state_ = WriterState::kHoldingFrees;
        wake_writer_.wait_until(lock, due);
        continue;
      }
      pending_urgent_ = true;  // due: they go now
    }
    if (!writing_ && pending_urgent_) {
      writer_state_ = WriterState::kBusy;
      writing_ = true;
      WriteNow(lock);
      continue;
    }
    writer_state_ = WriterState::kIdle;
    wake_writer_.wait(lock);
  }
}

void ExecutorLink::ReadLoop() {
  pthread_setname_np(pthread_self(), "bg-link-read");
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
    }
    const auto started = std::chrono::steady_clock::now();
    std::chrono::milliseconds wait = kReconnectInterval;  // nobody listens yet
    if (Session()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
      wait = NoteLoss(std::chrono::steady_clock::now() - started);
    }
    if (wait.count() > 0) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_reader_.wait_for(lock, wait, [&] { return closing_; });
    }
  }
}

std::chrono::milliseconds ExecutorLink::NoteLoss(std::chrono::steady_clock::duration session) {
  const auto now = std::chrono::steady_clock::now();
  const bool lasted = session >= kStableSession;
  using Delay = std::chrono::milliseconds;
  reconnect_delay_ =
      lasted ? Delay(0)
             : std::min<Delay>(kMaxReconnectDelay,
                               std::max<Delay>(kReconnectInterval, reconnect_delay_ * 2));
  ++losses_unlogged_;
  if (lasted || last_lost_log_ == std::chrono::steady_clock::time_point{} ||
      now - last_lost_log_ >= kLostLogInterval) {
    Log(LogLevel::kWarning, "executor_lost",
        {LogField("slot", static_cast<int>(slot_)), LogField("losses", losses_unlogged_),
         LogField("reconnect_in_ms", static_cast<int64_t>(reconnect_delay_.count()))});
    losses_unlogged_ = 0;
    last_lost_log_ = now;
  }
  return reconnect_delay_;
}

bool ExecutorLink::Session() {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_name_.size() + 1 > sizeof address.sun_path) return false;
  // Abstract namespace: a leading NUL, and no file anywhere.
  std::memcpy(address.sun_path + 1, socket_name_.data(), socket_name_.size());
  const auto length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + socket_name_.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), length) != 0) {
    close(fd);
    return false;
  }
  // An abstract socket has no file permissions: only a process of this user may be the
  // executor, or another user could read what clients sent and answer for the executor.
  if (!SameUser(fd)) {
    Log(LogLevel::kDebug, "executor_refused",
        {LogField("reason", "the socket is served by another user's process")});
    close(fd);
    return false;
  }
  for (const int option : {SO_SNDBUF, SO_RCVBUF}) {
    setsockopt(fd, SOL_SOCKET, option, &kSocketBufferBytes, sizeof kSocketBufferBytes);
  }
  auto socket = std::make_shared<Socket>(fd);
  std::string buffer;
  {
    // The first frame carries Hello and nothing else; it goes out before the writer can see
    // this socket.
    wire::ToExecutor hello;
    hello.mutable_hello()->set_slot(slot_);
    if (!SendFrame(fd, hello, buffer)) return true;
  }
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) return true;
    socket_ = socket;
    welcomed_ = false;
    generation = ++generation_;
    readable_generation_.store(generation);
    pending_.Clear();
    pending_groupable_.clear();
    pending_urgent_ = pending_frees_ = false;
  }
  wire::ToFrontend frame;
  while (true) {
    char header[4];
    if (!ReceiveAll(fd, header, sizeof header)) break;
    uint32_t size = 0;
    for (int i = 0; i < 4; ++i) size |= static_cast<uint32_t>(static_cast<uint8_t>(header[i])) << (8 * i);
    if (size > kMaxFrameBytes) {
      Log(LogLevel::kError, "executor_protocol_error",
          {LogField("error", "the executor sent a " + std::to_string(size) + "-byte frame")});
      break;
    }
    buffer.resize(size);
    if (!ReceiveAll(fd, buffer.data(), size)) break;
    if (!frame.ParseFromArray(buffer.data(), static_cast<int>(size))) {
      Log(LogLevel::kError, "executor_protocol_error",
          {LogField("error", "the executor sent a malformed frame")});
      break;
    }
    HandleFrame(frame, generation);
    frame.Clear();
  }
  bool closing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing = closing_;
  }
  Lose(closing);
  return true;
}

void ExecutorLink::HandleFrame(wire::ToFrontend& frame, uint64_t generation) {
  // 0. what the welcome says of the lost connections' input blocks: before any model is
  // served, so that no request can be given one of them.
  if (frame.welcome()) SettleKeptInputs(frame);
  for (const uint64_t offset : frame.released_inputs()) {
    if (kept_inputs_.erase(offset) && !region_.Free(offset)) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", offset)});
    }
  }
  // 1. models (and the welcome)
  if (frame.welcome() || frame.models_size() > 0) {
    bool connected;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (frame.welcome()) welcomed_ = true;
      connected = welcomed_;
    }
    for (const auto& change : models_.Apply(frame.models(), frame.welcome(), connected, generation)) {
      observer_.OnModelChange(change.name, change.serving);
    }
    if (frame.welcome()) {
      Log(LogLevel::kInfo, "executor_connected",
          {LogField("slot", static_cast<int>(slot_)), LogField("models", frame.models_size())});
      observer_.OnConnectionChange(true, static_cast<size_t>(frame.models_size()));
    }
  }

  // 2.-3. results and failures: each to its request's worker.
  std::vector<std::pair<AnswerTarget*, ExecutorAnswer>> answers;
  std::vector<uint64_t> released;
  std::vector<std::unique_ptr<wire::Result>> orphans;
  // Taken out of the frame in its order, so that a stream answers in the order results came;
  // a batch's after them.
  std::vector<wire::Result*> extracted(static_cast<size_t>(frame.results_size()));
  frame.mutable_results()->ExtractSubrange(0, frame.results_size(), extracted.data());
  std::vector<std::unique_ptr<wire::Result>> results(extracted.begin(), extracted.end());
  for (const wire::Batch& batch : frame.batches()) {
    if (!AppendBatchResults(batch, &results)) {
      Log(LogLevel::kError, "executor_protocol_error",
          {LogField("error", std::string("a batch's rids, first_rows and rows differ in length"))});
    }
  }
  answers.reserve(results.size() + static_cast<size_t>(frame.failures_size()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto settle = [&](uint64_t rid, bool inputs_released) -> AnswerTarget* {
      const auto it = infers_.find(rid);
      if (it == infers_.end()) return nullptr;
      AnswerTarget* target = it->second.target;
      if (inputs_released) {
        released.insert(released.end(), it->second.blocks.begin(), it->second.blocks.end());
      } else {
        unreleased_.emplace(rid, std::move(it->second.blocks));
      }
      infers_.erase(it);
      return target;
    };
    for (std::unique_ptr<wire::Result>& result : results) {
      AnswerTarget* target = settle(result->rid(), result->released());
      if (target == nullptr) {
        orphans.push_back(std::move(result));
        continue;
      }
      ExecutorAnswer answer;
      answer.generation = generation;
      answer.result = std::move(result);
      answers.emplace_back(target, std::move(answer));
    }
    for (const wire::Failure& failure : frame.failures()) {
      AnswerTarget* target = settle(failure.rid(), failure.released());
      if (target == nullptr) continue;
      ExecutorAnswer answer;
      answer.generation = generation;
      answer.status = grpc::Status(CodeOf(failure.code()), Bounded(failure.message()));
      answers.emplace_back(target, std::move(answer));
    }
    // 4. released: inputs of requests answered earlier with released false.
    for (const uint64_t rid : frame.released()) {
      const auto it = unreleased_.find(rid);
      if (it == unreleased_.end()) continue;
      released.insert(released.end(), it->second.begin(), it->second.end());
      unreleased_.erase(it);
    }
    // 5. replies to calls
    std::vector<wire::Reply*> replies(static_cast<size_t>(frame.replies_size()));
    frame.mutable_replies()->ExtractSubrange(0, frame.replies_size(), replies.data());
    for (wire::Reply* released_reply : replies) {
      std::unique_ptr<wire::Reply> reply(released_reply);
      const auto it = calls_.find(reply->cid());
      if (it == calls_.end()) continue;
      ExecutorAnswer answer;
      answer.generation = generation;
      if (reply->has_error()) {
        answer.status = grpc::Status(CodeOf(reply->error().code()), Bounded(reply->error().message()));
      } else {
        answer.reply = std::move(reply);
      }
      answers.emplace_back(it->second, std::move(answer));
      calls_.erase(it);
    }
  }
  FreeBlocks(released);
  for (const auto& orphan : orphans) {
    // No request of ours has this rid (an executor bug): still return its output blocks.
    Log(LogLevel::kWarning, "executor_unknown_request", {LogField("rid", orphan->rid())});
    FreeOutputs(generation, *orphan);
  }
  for (auto& [target, answer] : answers) target->Deliver(std::move(answer));
}

void ExecutorLink::SettleKeptInputs(const wire::ToFrontend& welcome) {
  std::unordered_map<uint64_t, uint64_t> still;
  for (const wire::InputBlock& block : welcome.held()) {
    if (!kept_inputs_.count(block.offset()) && !region_.Reserve(block.offset(), block.nbytes())) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", block.offset())});
      continue;
    }
    still.emplace(block.offset(), block.nbytes());
  }
  for (const auto& [offset, nbytes] : kept_inputs_) {
    if (!still.count(offset) && !region_.Free(offset)) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", offset)});
    }
  }
  kept_inputs_.swap(still);
}

ExecutorLink::OutputRead::OutputRead(ExecutorLink& link, ExecutorAnswer& answer) : link_(link) {
  if (!answer.result) return;
  // Counted before the generation is read: Lose() clears the generation, then waits for the
  // count, so a read it does not wait for is one that saw the generation gone.
  link_.output_reads_.fetch_add(1);
  if (link_.readable_generation_.load() == answer.generation) {
    reading_ = true;
    return;
  }
  link_.EndOutputRead();
  answer.result.reset();
  answer.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, kRestarted);
}

ExecutorLink::OutputRead::~OutputRead() {
  if (reading_) link_.EndOutputRead();
}

void ExecutorLink::EndOutputRead() {
  // Only StopReadingOutputs() waits, and only once the generation is cleared.
  if (output_reads_.fetch_sub(1) == 1 && readable_generation_.load() == 0) {
    std::lock_guard<std::mutex> lock(reads_mu_);
    reads_done_.notify_all();
  }
}

void ExecutorLink::StopReadingOutputs() {
  readable_generation_.store(0);
  std::unique_lock<std::mutex> lock(reads_mu_);
  reads_done_.wait(lock, [&] { return output_reads_.load() == 0; });
}

void ExecutorLink::Lose(bool closing) {
  // Before anything else, and before the next Hello: the lost connection's output blocks are
  // the executor's again once it has that Hello.
  StopReadingOutputs();
  std::unordered_map<uint64_t, PendingInfer> infers;
  std::unordered_map<uint64_t, std::vector<uint64_t>> unreleased;
  std::unordered_map<uint64_t, AnswerTarget*> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    socket_.reset();
    welcomed_ = false;
    infers.swap(infers_);
    unreleased.swap(unreleased_);
    calls.swap(calls_);
    pending_.Clear();
    pending_groupable_.clear();
    pending_urgent_ = pending_frees_ = false;
    if (!handoff_.empty()) {
      // The rest of a frame for the lost connection, not taken yet: it goes nowhere, and the
      // token it held is free.
      handoff_.clear();
      handoff_socket_.reset();
      writing_ = false;
    }
  }
  // The executor may still read them (it lives on, and a batch of it runs): kept until the
  // next welcome says which it does.
  for (const auto& [rid, pending] : infers) {
    for (const uint64_t offset : pending.blocks) kept_inputs_.emplace(offset, 0);
  }
  for (const auto& [rid, blocks] : unreleased) {
    for (const uint64_t offset : blocks) kept_inputs_.emplace(offset, 0);
  }
  const grpc::Status lost(grpc::StatusCode::UNAVAILABLE, kRestarted);
  for (const auto& [rid, pending] : infers) {
    ExecutorAnswer answer;
    answer.status = lost;
    pending.target->Deliver(std::move(answer));
  }
  for (const auto& [cid, target] : calls) {
    ExecutorAnswer answer;
    answer.status = lost;
    target->Deliver(std::move(answer));
  }
  for (const auto& change : models_.Disconnect(kRestarting)) {
    observer_.OnModelChange(change.name, change.serving);
  }
  if (!closing) observer_.OnConnectionChange(false, 0);  // ReadLoop logs it (NoteLoss)
}

void ExecutorLink::FreeBlocks(const std::vector<uint64_t>& blocks) {
  for (const uint64_t offset : blocks) {
    if (!region_.Free(offset)) {
      Log(LogLevel::kError, "input_block_unknown", {LogField("offset", offset)});
    }
  }
}

}  // namespace batchgate
