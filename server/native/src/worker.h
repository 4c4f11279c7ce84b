// A gRPC worker: one thread, one completion queue, and every call that lands on that queue.
//
// gRPC's async API hands each call to the completion queue it was requested on; with one queue
// per thread, a call's whole life (its events, the executor's answer, its reply) runs on one
// thread, so a call's state needs no lock. Answers from the executor link's reader thread reach
// a worker through its mailbox: the reader appends under the mailbox's mutex and rings a
// doorbell (a grpc::Alarm that expires at once) only when the mailbox was empty, so one wake-up
// carries every answer of a read (several frames) for this worker.
#pragma once

#include <grpcpp/alarm.h>
#include <grpcpp/server_context.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "executor_link.h"

namespace batchgate {

class Frontend;
class HealthWatchCall;
class StreamInferCall;
class Worker;
struct RpcInfo;

// A completion-queue tag: what to run when its operation completes.
class Event {
 public:
  virtual void Complete(bool ok) = 0;

 protected:
  ~Event() = default;
};

// The tag of one kind of operation of a call object: Complete() runs `Method` on it.
template <typename Call, void (Call::*Method)(bool)>
class CallEvent final : public Event {
 public:
  explicit CallEvent(Call* call) : call_(call) {}
  void Complete(bool ok) override { (call_->*Method)(ok); }
  void* tag() { return static_cast<Event*>(this); }

 private:
  Call* const call_;
};

// One gRPC call's state, alive while any of its operations (or an executor answer) is
// outstanding. Calls are created by their worker and destroyed by it when the last reference
// goes: gRPC's async API owns a call only through the tags it will return, so this count is
// what ties the object to them.
class CallBase {
 public:
  virtual ~CallBase() = default;
  CallBase(const CallBase&) = delete;
  CallBase& operator=(const CallBase&) = delete;

  // For the worker: a parked call goes on (Serve(), then the arrival's reference goes).
  void Resume();

 protected:
  explicit CallBase(Worker& worker) : worker_(worker) {}
  void Ref() { ++refs_; }
  void Unref();

  // The call arrived (its started event, ok): requests the next call of `rpc`, then serves this
  // one now, or once the worker lets parked calls go (the end of a drain).
  void Arrived(const RpcInfo& rpc);
  // What the call does once it may go on; runs with the arrival's reference held.
  virtual void Serve() = 0;

  Worker& worker_;

 private:
  int refs_ = 1;  // the first operation: the request for a new call
};

class Worker final : public AnswerMailbox {
 public:
  Worker(Frontend& frontend, int index, std::unique_ptr<grpc::ServerCompletionQueue> cq);
  ~Worker();

  // The thread body: requests every RPC once, then runs events until the queue is shut down
  // and drained.
  void Run();

  // Any thread (the link's reader): every answer, run on this worker's thread, for one lock
  // and at most one doorbell.
  void Post(std::vector<PostedAnswer>& answers) override;
  // Any thread, when the drain starts: keep many more calls of each RPC requested (see
  // kDrainListenDepth in worker.cc).
  void ListenDeeper();
  // Any thread: end every open ModelStreamInfer stream once its answers are written, and every
  // health Watch once its status is (drain); streams that arrive later end at once.
  void EndStreams();
  // Any thread: a health status changed; the open Watch calls write it.
  void HealthChanged();
  // Any thread: calls that arrive from now on wait, unanswered, until ReleaseParked().
  void Park();
  // Any thread: the parked calls go on.
  void ReleaseParked();
  // Any thread, after the server has shut down: stop, and let Run() return.
  void Quit();

  Frontend& frontend() { return frontend_; }
  grpc::ServerCompletionQueue* cq() { return cq_.get(); }
  int index() const { return index_; }
  // Whether new calls may still be requested on this queue.
  bool listening() const { return !quitting_; }
  // Whether streams are to end as soon as they can (the drain is past its wait).
  bool ending_streams() const { return ending_streams_; }
  // Whether calls wait (the drain parks them until the GOAWAY has reached the clients).
  bool parking() const { return parking_; }
  // A call arrived: true when it is to wait (parked) instead of being served now.
  bool ParkArrival(CallBase* call);

  // Takes ownership of a new call object (its constructor requested the call).
  void Adopt(std::unique_ptr<CallBase> call);
  // Destroys a call whose last reference went (CallBase::Unref).
  void Retire(CallBase* call);

  void AddStream(StreamInferCall* stream) { streams_.insert(stream); }
  void RemoveStream(StreamInferCall* stream) { streams_.erase(stream); }
  void AddWatch(HealthWatchCall* watch) { watches_.insert(watch); }
  void RemoveWatch(HealthWatchCall* watch) { watches_.erase(watch); }

 private:
  enum class Command {
    kAnswer, kListenDeeper, kEndStreams, kHealthChanged, kPark, kReleaseParked, kQuit
  };
  struct Mail {
    Command command;
    AnswerTarget* target;
    ExecutorAnswer answer;
  };

  void Enqueue(Mail mail);
  void Deliver(Mail mail);
  void OnDoorbell(bool ok);

  Frontend& frontend_;
  const int index_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  bool quitting_ = false;  // this thread only
  bool ending_streams_ = false;  // this thread only
  bool parking_ = false;         // this thread only
  std::vector<CallBase*> parked_;  // this thread only
  size_t live_calls_ = 0;  // this thread only
  std::unordered_set<StreamInferCall*> streams_;  // this thread only
  std::unordered_set<HealthWatchCall*> watches_;  // this thread only

  std::mutex mailbox_mu_;
  std::vector<Mail> mailbox_;
  bool doorbell_armed_ = false;
  bool mailbox_closed_ = false;
  grpc::Alarm doorbell_;
  CallEvent<Worker, &Worker::OnDoorbell> doorbell_event_{this};
};

}  // namespace batchgate
