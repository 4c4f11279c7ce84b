#include "worker.h"

#include <grpc/support/time.h>
#include <pthread.h>

#include <string>

#include "calls.h"
#include "executor_link.h"
#include "health.h"
#include "log.h"
#include "stream_call.h"

namespace batchgate {
namespace {

// Calls of each RPC a worker keeps requested once the server drains. gRPC holds a call that
// finds no requested one in a queue of its own, and cancels what it holds there when the server
// shuts down: the client would see CANCELLED for a request that reached the server. While
// serving, one per RPC and worker is what spreads a connection's calls over the workers (gRPC
// hands a call to the connection's own queue first, if it has one requested); while draining,
// calls are refused at once, and this many leave no call unmatched when the shutdown comes.
constexpr int kDrainListenDepth = 64;

}  // namespace

void CallBase::Unref() {
  if (--refs_ == 0) worker_.Retire(this);
}

void CallBase::Arrived(const RpcInfo& rpc) {
  Ref();  // the done event, which now will come
  Listen(worker_, rpc);
  if (worker_.ParkArrival(this)) return;  // keeps the arrival's reference until Resume()
  Serve();
  Unref();
}

void CallBase::Resume() {
  Serve();
  Unref();
}

bool Worker::ParkArrival(CallBase* call) {
  if (frontend_.draining()) frontend_.NoteArrival();
  if (!parking_) return false;
  parked_.push_back(call);
  return true;
}

Worker::Worker(Frontend& frontend, int index, std::unique_ptr<grpc::ServerCompletionQueue> cq)
    : frontend_(frontend), index_(index), cq_(std::move(cq)) {}

Worker::~Worker() {
  if (live_calls_ != 0) {
    Log(LogLevel::kError, "calls_left_behind",
        {LogField("worker", index_), LogField("calls", live_calls_)});
  }
}

void Worker::Run() {
  const std::string name = "bg-worker-" + std::to_string(index_);
  pthread_setname_np(pthread_self(), name.c_str());
  ListenForEveryRpc(*this);
  void* tag = nullptr;
  bool ok = false;
  // The requests this thread takes while events are ready go to the executor in one frame
  // (ExecutorLink::DeferredWrites): written once the queue has no event ready, or
  // kEventsPerWrite events later. The queue is asked without waiting only while something waits
  // to be written; a request that finds none in flight was written at once.
  constexpr int kEventsPerWrite = 16;
  const ExecutorLink::DeferredWrites deferred;
  int events_since = 0;  // events run since the oldest entry left unwritten
  while (true) {
    if (ExecutorLink::HasDeferredWrites()) {
      const auto status = cq_->AsyncNext(&tag, &ok, gpr_inf_past(GPR_CLOCK_MONOTONIC));
      if (status == grpc::CompletionQueue::GOT_EVENT && events_since < kEventsPerWrite) {
        ++events_since;
        static_cast<Event*>(tag)->Complete(ok);
        continue;
      }
      ExecutorLink::FlushDeferredWrites();
      events_since = 0;
      if (status == grpc::CompletionQueue::SHUTDOWN) break;
      if (status == grpc::CompletionQueue::GOT_EVENT) {
        static_cast<Event*>(tag)->Complete(ok);
        continue;
      }
    }
    if (!cq_->Next(&tag, &ok)) break;
    static_cast<Event*>(tag)->Complete(ok);
  }
}

void Worker::Adopt(std::unique_ptr<CallBase> call) {
  ++live_calls_;
  call.release();  // owned by the tags gRPC will return; Retire() takes it back
}

void Worker::Retire(CallBase* call) {
  --live_calls_;
  std::unique_ptr<CallBase> owned(call);
}

void Worker::Post(std::vector<PostedAnswer>& answers) {
  bool ring;
  {
    std::lock_guard<std::mutex> lock(mailbox_mu_);
    if (mailbox_closed_) {
      // Quit comes after the executor link is closed, which answers everything: never here.
      Log(LogLevel::kError, "mail_after_quit", {LogField("worker", index_)});
      answers.clear();
      return;
    }
    for (PostedAnswer& posted : answers) {
      mailbox_.push_back(Mail{Command::kAnswer, posted.target, std::move(posted.answer)});
    }
    answers.clear();
    ring = !doorbell_armed_;
    doorbell_armed_ = true;
  }
  // Outside the lock, as Enqueue() rings it.
  if (ring) doorbell_.Set(cq_.get(), gpr_inf_past(GPR_CLOCK_MONOTONIC), doorbell_event_.tag());
}

void Worker::ListenDeeper() { Enqueue(Mail{Command::kListenDeeper, nullptr, {}}); }

void Worker::EndStreams() { Enqueue(Mail{Command::kEndStreams, nullptr, {}}); }

void Worker::HealthChanged() { Enqueue(Mail{Command::kHealthChanged, nullptr, {}}); }

void Worker::Park() { Enqueue(Mail{Command::kPark, nullptr, {}}); }

void Worker::ReleaseParked() { Enqueue(Mail{Command::kReleaseParked, nullptr, {}}); }

void Worker::Quit() { Enqueue(Mail{Command::kQuit, nullptr, {}}); }

void Worker::Enqueue(Mail mail) {
  bool ring;
  {
    std::lock_guard<std::mutex> lock(mailbox_mu_);
    if (mailbox_closed_) {
      // Quit comes after the executor link is closed, which answers everything: never here.
      Log(LogLevel::kError, "mail_after_quit", {LogField("worker", index_)});
      return;
    }
    mailbox_.push_back(std::move(mail));
    ring = !doorbell_armed_;
    doorbell_armed_ = true;
  }
  // Outside the lock: the doorbell wakes the worker (a system call). Nothing can shut the queue
  // down in between: the worker handles mail (Quit included) only once this doorbell rang.
  if (ring) doorbell_.Set(cq_.get(), gpr_inf_past(GPR_CLOCK_MONOTONIC), doorbell_event_.tag());
}

void Worker::OnDoorbell(bool /*ok*/) {
  std::vector<Mail> mail;
  {
    std::lock_guard<std::mutex> lock(mailbox_mu_);
    doorbell_armed_ = false;
    mail.swap(mailbox_);
  }
  for (Mail& m : mail) Deliver(std::move(m));
}

void Worker::Deliver(Mail mail) {
  switch (mail.command) {
    case Command::kAnswer: {
      // The answer's outputs are copied into its reply inside OnExecutorAnswer: only while
      // its connection is the current one (an answer of a lost one becomes UNAVAILABLE), and
      // the link waits for the copy before it lets the executor reuse them.
      const ExecutorLink::OutputRead read(frontend_.link(), mail.answer);
      mail.target->OnExecutorAnswer(std::move(mail.answer));
      break;
    }
    case Command::kListenDeeper:
      // Every arriving call takes a requested one and requests the next, so the depth stays.
      for (int i = 1; i < kDrainListenDepth; ++i) ListenForEveryRpc(*this);
      break;
    case Command::kPark:
      parking_ = true;
      break;
    case Command::kReleaseParked: {
      parking_ = false;
      std::vector<CallBase*> parked;
      parked.swap(parked_);
      for (CallBase* call : parked) call->Resume();
      break;
    }
    case Command::kEndStreams: {
      ending_streams_ = true;
      // A copy: ending a stream may finish it and take it out of the set.
      const std::vector<StreamInferCall*> streams(streams_.begin(), streams_.end());
      for (StreamInferCall* stream : streams) stream->EndForDrain();
      const std::vector<HealthWatchCall*> watches(watches_.begin(), watches_.end());
      for (HealthWatchCall* watch : watches) watch->EndForDrain();
      break;
    }
    case Command::kHealthChanged: {
      const std::vector<HealthWatchCall*> watches(watches_.begin(), watches_.end());
      for (HealthWatchCall* watch : watches) watch->Refresh();
      break;
    }
    case Command::kQuit: {
      quitting_ = true;
      {
        std::lock_guard<std::mutex> lock(mailbox_mu_);
        mailbox_closed_ = true;
      }
      // The server has shut down: what is left on the queue are failed requests for new calls
      // (and their objects), which Run() drains before it returns.
      cq_->Shutdown();
      break;
    }
  }
}

}  // namespace batchgate
