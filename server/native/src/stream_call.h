// ModelStreamInfer: many inference requests over one bidirectional stream (service.py
// ModelStreamInfer()).
//
// Requests are read one after another and each goes to the executor as it comes; answers are
// written in the order they complete, one write at a time. A client that reads slowly holds
// its replies here: once they pass --max-stream-backlog-bytes (with the requests still at the
// executor counted as large as the largest reply so far), the stream stops reading until
// replies drain, and HTTP/2's flow control holds the client back; nothing is dropped. A request that fails is answered by
// its own message with error_message set, and the stream goes on. When the client half-closes,
// the stream finishes OK once every answer is written; when the client goes away, the requests
// still queued at the executor are cancelled. A message that does not parse ends the stream as
// grpcio ends it: OK at once, the requests still in flight cancelled and unanswered.
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/async_stream.h>

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>

#include "frontend.h"
#include "worker.h"

namespace batchgate {

class StreamInferCall final : public CallBase {
 public:
  StreamInferCall(Worker& worker, const RpcInfo& rpc);
  ~StreamInferCall() override;

  // The server drains: stop taking requests, and finish with UNAVAILABLE once the answers of
  // those in flight are written (a stream left open would be cancelled by the shutdown).
  void EndForDrain();

 private:
  // One request of this stream that went to the executor.
  class Request final : public AnswerTarget {
   public:
    Request(StreamInferCall& stream, std::string model_name,
            std::chrono::steady_clock::time_point started, std::string id)
        : stream_(stream), model_name_(std::move(model_name)), started_(started), id_(std::move(id)) {}
    AnswerMailbox& mailbox() override { return stream_.worker_; }
    void OnExecutorAnswer(ExecutorAnswer answer) override {
      stream_.OnAnswer(this, std::move(answer));
    }

    StreamInferCall& stream_;
    const std::string model_name_;
    const std::chrono::steady_clock::time_point started_;
    const std::string id_;
    InferTicket ticket_;
  };

  void OnStarted(bool ok);
  void Serve() override;
  void OnRead(bool ok);
  void OnWritten(bool ok);
  void OnFinished(bool ok);
  void OnDone(bool ok);

  void StartRead();
  void HandleRequest(inference::ModelInferRequest& request);
  void OnAnswer(Request* request, ExecutorAnswer answer);
  void Queue(grpc::ByteBuffer message);
  void StartWrite();
  // The client will not hear from us any more: let the executor drop what it still queues.
  void Abandon();
  void MaybeFinish();
  // Whether the stream holds so much that it is not to read another request now.
  bool OverBacklog() const;
  // The written (or dropped) reply at the front of writes_ leaves the backlog.
  void PopWrite();

  const RpcInfo& rpc_;
  grpc::ServerContext context_;
  grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer> stream_{&context_};
  CallEvent<StreamInferCall, &StreamInferCall::OnStarted> started_{this};
  CallEvent<StreamInferCall, &StreamInferCall::OnRead> read_{this};
  CallEvent<StreamInferCall, &StreamInferCall::OnWritten> written_{this};
  CallEvent<StreamInferCall, &StreamInferCall::OnFinished> finished_{this};
  CallEvent<StreamInferCall, &StreamInferCall::OnDone> done_{this};

  grpc::ByteBuffer incoming_;
  int64_t deadline_ns_ = 0;  // the stream's deadline, every request's (service.py)
  std::unordered_map<Request*, std::unique_ptr<Request>> requests_;  // at the executor
  std::deque<grpc::ByteBuffer> writes_;
  uint64_t held_bytes_ = 0;     // the bytes of writes_ (the one being written included)
  uint64_t largest_reply_ = 0;  // the largest reply queued so far; 0: none yet
  grpc::Status end_status_;     // what the stream finishes with
  bool registered_ = false;     // in the worker's set of open streams
  bool reading_ = false;        // a read is outstanding
  bool read_paused_ = false;    // too much in flight: reading resumes as answers go out
  bool no_more_requests_ = false;
  bool client_half_closed_ = false;
  bool writing_ = false;
  bool abandoned_ = false;      // the client is gone: nothing more is written
  bool abandoned_requests_ = false;  // a message did not parse: those in flight go unanswered
  bool finished_called_ = false;
};

}  // namespace batchgate
