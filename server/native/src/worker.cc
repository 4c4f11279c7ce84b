#include "worker.h"

#include <grpc/support/time.h>
#include <pthread.h>

#include <string>

#include "calls.h"
#include "log.h"
#include "stream_call.h"

namespace batchgate {

void CallBase::Unref() {
  if (--refs_ == 0) worker_.Retire(this);
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
  while (cq_->Next(&tag, &ok)) static_cast<Event*>(tag)->Complete(ok);
}

void Worker::Adopt(std::unique_ptr<CallBase> call) {
  ++live_calls_;
  call.release();  // owned by the tags gRPC will return; Retire() takes it back
}

void Worker::Retire(CallBase* call) {
  --live_calls_;
  std::unique_ptr<CallBase> owned(call);
}

void Worker::Post(AnswerTarget* target, ExecutorAnswer answer) {
  Enqueue(Mail{Command::kAnswer, target, std::move(answer)});
}

void Worker::EndStreams() { Enqueue(Mail{Command::kEndStreams, nullptr, {}}); }

void Worker::Quit() { Enqueue(Mail{Command::kQuit, nullptr, {}}); }

void Worker::Enqueue(Mail mail) {
  std::lock_guard<std::mutex> lock(mailbox_mu_);
  if (mailbox_closed_) {
    // Quit comes after the executor link is closed, which answers everything: never here.
    Log(LogLevel::kError, "mail_after_quit", {LogField("worker", index_)});
    return;
  }
  mailbox_.push_back(std::move(mail));
  if (!doorbell_armed_) {
    doorbell_armed_ = true;
    // Under the mailbox's lock, so that the queue cannot be shut down in between.
    doorbell_.Set(cq_.get(), gpr_now(GPR_CLOCK_MONOTONIC), doorbell_event_.tag());
  }
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
    case Command::kAnswer:
      mail.target->OnExecutorAnswer(std::move(mail.answer));
      break;
    case Command::kEndStreams: {
      // A copy: ending a stream may finish it and take it out of the set.
      const std::vector<StreamInferCall*> streams(streams_.begin(), streams_.end());
      for (StreamInferCall* stream : streams) stream->EndForDrain();
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
