#include "executor_link.h"

#include <pthread.h>

#include <chrono>

#include "link_frames.h"
#include "wire_columns.h"

namespace batchgate {
namespace {

// How long returned output blocks may wait for a request's frame to carry them. Under load the
// next request comes long before; a client that sends one request at a time sends its next
// within a round trip, and a frame of their own would cost the executor a wake-up per request.
// Held blocks stay taken meanwhile: at most this long's worth of outputs, once traffic stops.
constexpr auto kFreeDelay = std::chrono::milliseconds(10);

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

}  // namespace

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

}  // namespace batchgate
