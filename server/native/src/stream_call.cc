#include "stream_call.h"

#include <algorithm>

#include "calls.h"
#include "codec.h"
#include "log.h"
#include "metrics.h"
#include "rules.h"

namespace batchgate {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

StreamInferCall::StreamInferCall(Worker& worker, const RpcInfo& rpc) : CallBase(worker), rpc_(rpc) {
  context_.AsyncNotifyWhenDone(done_.tag());
  worker.frontend().service().RequestBidi(rpc.index, &context_, &stream_, worker.cq(),
                                          started_.tag());
}

StreamInferCall::~StreamInferCall() {
  if (registered_) worker_.RemoveStream(this);
  while (!writes_.empty()) PopWrite();
}

bool StreamInferCall::OverBacklog() const {
  const Handover& h = worker_.frontend().handover();
  if (requests_.size() + writes_.size() >= static_cast<size_t>(h.max_stream_backlog_messages)) {
    return true;
  }
  if (requests_.empty() && writes_.empty()) return false;  // one request is always taken
  // A request at the executor will add its reply: counted as large as the largest this stream
  // has had, and before the first as large as any may be.
  const uint64_t estimate =
      largest_reply_ != 0 ? largest_reply_ : static_cast<uint64_t>(h.max_message_bytes);
  return held_bytes_ + requests_.size() * estimate >=
         static_cast<uint64_t>(h.max_stream_backlog_bytes);
}

void StreamInferCall::PopWrite() {
  const uint64_t bytes = writes_.front().Length();
  writes_.pop_front();
  held_bytes_ -= bytes;
  worker_.frontend().metrics().AddStreamBacklog(-static_cast<int64_t>(bytes));
}

void StreamInferCall::OnStarted(bool ok) {
  if (!ok) {
    Unref();
    return;
  }
  Arrived(rpc_);
}

void StreamInferCall::Serve() {
  worker_.AddStream(this);
  registered_ = true;
  const grpc::Status refusal = worker_.frontend().auth().Check(rpc_.index, context_);
  if (!refusal.ok()) {
    // Refused without reading a message, as server/frontend/auth.py's refusal handlers are.
    end_status_ = refusal;
    no_more_requests_ = true;
    MaybeFinish();
  } else if (worker_.ending_streams()) {
    EndForDrain();  // arrived after the drain ended the streams
  } else {
    deadline_ns_ = DeadlineNs(context_);
    StartRead();
  }
}

void StreamInferCall::StartRead() {
  if (reading_ || no_more_requests_ || abandoned_) return;
  if (OverBacklog()) {
    if (!read_paused_) worker_.frontend().metrics().CountStreamPause();
    read_paused_ = true;
    return;
  }
  read_paused_ = false;
  reading_ = true;
  Ref();
  stream_.Read(&incoming_, read_.tag());
}

void StreamInferCall::OnRead(bool ok) {
  reading_ = false;
  if (!ok) {  // the client half-closed (or went away)
    no_more_requests_ = true;
    client_half_closed_ = true;
    MaybeFinish();
    Unref();
    return;
  }
  if (no_more_requests_ || abandoned_) {  // ended meanwhile (drain): nothing more is taken
    Unref();
    return;
  }
  inference::ModelInferRequest request;
  grpc::Status error;
  const bool parsed = ParseInferRequest(&incoming_, &request, rpc_,
                                        worker_.frontend().handover().wire_limits, &error);
  if (!parsed && error.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
    // grpcio's request iterator raises, which ends service.py's stream at once: OK, with the
    // answers already queued, and the requests still in flight cancelled.
    no_more_requests_ = true;
    for (const auto& [pointer, pending] : requests_) worker_.frontend().link().Cancel(pending->ticket_.rid);
    abandoned_requests_ = true;
    MaybeFinish();
    Unref();
    return;
  }
  if (parsed) {
    HandleRequest(request);
  } else {
    // Past a wire limit: answered in the stream as any refusal, and the stream goes on.
    Queue(StreamError(error.error_message()));
  }
  StartRead();
  Unref();
}

void StreamInferCall::HandleRequest(inference::ModelInferRequest& request) {
  Frontend& frontend = worker_.frontend();
  auto pending = std::make_unique<Request>(*this, request.model_name(),
                                           std::chrono::steady_clock::now(), request.id());
  const grpc::Status status = frontend.StartInfer(request, deadline_ns_, pending.get(),
                                                  &pending->ticket_);
  if (!status.ok()) {
    frontend.metrics().Count(pending->model_name_, frontend.KnowsModel(pending->model_name_),
                             status.error_code(), SecondsSince(pending->started_));
    Queue(StreamError(status.error_message()));
    return;
  }
  Ref();  // the executor's answer
  Request* key = pending.get();
  requests_.emplace(key, std::move(pending));
}

void StreamInferCall::OnAnswer(Request* key, ExecutorAnswer answer) {
  const auto it = requests_.find(key);
  std::unique_ptr<Request> request = std::move(it->second);
  requests_.erase(it);
  Frontend& frontend = worker_.frontend();
  const bool wanted = !abandoned_ && !abandoned_requests_;
  if (answer.status.ok()) {
    if (wanted) {
      grpc::ByteBuffer reply;
      std::string problem;
      const grpc::Status encoded = EncodeResponse(
          *request->ticket_.model, request->id_, request->ticket_.outputs, *answer.result,
          frontend.arena(), true, static_cast<uint64_t>(frontend.handover().max_message_bytes),
          &reply, &problem);
      if (!problem.empty()) {
        Log(LogLevel::kError, "executor_protocol_error", {LogField("error", problem)});
      }
      frontend.metrics().Count(request->model_name_, true, encoded.error_code(),
                               SecondsSince(request->started_));
      Queue(encoded.ok() ? std::move(reply) : StreamError(encoded.error_message()));
    }
    frontend.link().FreeOutputs(answer.generation, *answer.result);
  } else if (wanted) {
    frontend.metrics().Count(request->model_name_, true, answer.status.error_code(),
                             SecondsSince(request->started_));
    Queue(StreamError(answer.status.error_message()));
  }
  if (read_paused_) StartRead();
  MaybeFinish();
  Unref();
}

void StreamInferCall::Queue(grpc::ByteBuffer message) {
  if (abandoned_) return;
  const uint64_t bytes = message.Length();
  held_bytes_ += bytes;
  largest_reply_ = std::max(largest_reply_, bytes);
  worker_.frontend().metrics().AddStreamBacklog(static_cast<int64_t>(bytes));
  writes_.push_back(std::move(message));
  StartWrite();
}

void StreamInferCall::StartWrite() {
  if (writing_ || writes_.empty() || abandoned_ || finished_called_) return;
  writing_ = true;
  Ref();
  stream_.Write(writes_.front(), written_.tag());
}

void StreamInferCall::OnWritten(bool ok) {
  writing_ = false;
  PopWrite();
  if (ok) {
    StartWrite();
    if (read_paused_) StartRead();
  } else {
    Abandon();  // the stream is broken: the client is gone
  }
  MaybeFinish();
  Unref();
}

void StreamInferCall::Abandon() {
  if (abandoned_) return;
  abandoned_ = true;
  no_more_requests_ = true;
  // The write in flight (if any) stays until its event: OnWritten pops it.
  while (writes_.size() > (writing_ ? 1u : 0u)) {
    const uint64_t bytes = writes_.back().Length();
    writes_.pop_back();
    held_bytes_ -= bytes;
    worker_.frontend().metrics().AddStreamBacklog(-static_cast<int64_t>(bytes));
  }
  for (const auto& [key, request] : requests_) worker_.frontend().link().Cancel(request->ticket_.rid);
}

void StreamInferCall::EndForDrain() {
  if (finished_called_ || abandoned_) return;
  if (!client_half_closed_) {
    end_status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, rules::kShuttingDown);
  }
  no_more_requests_ = true;
  read_paused_ = false;
  MaybeFinish();
}

void StreamInferCall::MaybeFinish() {
  if (finished_called_ || abandoned_ || !no_more_requests_) return;
  if (!abandoned_requests_ && !requests_.empty()) return;
  if (writing_ || !writes_.empty()) return;
  // While the drain parks calls, a stream's client waits for its end instead of opening the
  // next stream into gRPC's shutdown (Frontend::Drain); EndForDrain() comes back here after.
  if (worker_.parking()) return;
  finished_called_ = true;
  Ref();
  stream_.Finish(end_status_, finished_.tag());
}

void StreamInferCall::OnFinished(bool /*ok*/) { Unref(); }

void StreamInferCall::OnDone(bool /*ok*/) {
  if (context_.IsCancelled()) Abandon();
  Unref();
}

}  // namespace batchgate
