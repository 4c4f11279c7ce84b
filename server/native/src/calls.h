// The unary RPCs of inference.GRPCInferenceService, one small state machine per call.
//
// A call object requests its call on its worker's queue, then lives through its events:
// started (the call arrived: request the next one, check the token, parse, handle), possibly an
// executor answer (ModelInfer, and the calls forwarded to the executor), finished (the reply
// went out) and done (gRPC's notice that the call is over, cancelled or not).
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/async_unary_call.h>

#include <chrono>
#include <string>

#include "frontend.h"
#include "wire_scan.h"
#include "worker.h"

namespace batchgate {

// Requests one call of every RPC on `worker`'s queue (a worker does this once, at start).
void ListenForEveryRpc(Worker& worker);
// Requests the next call of `rpc` on `worker`'s queue, unless the worker is quitting.
void Listen(Worker& worker, const RpcInfo& rpc);

// Parses a raw request; false, with the one-process server's status for it, when it does not
// parse (grpcio's deserializer raising DecodeError: UNKNOWN "Unexpected ...").
bool ParseRequest(grpc::ByteBuffer* bytes, google::protobuf::Message* message,
                  const RpcInfo& rpc, grpc::Status* error);
// The same, the message's type named by `input_type` ("grpc.health.v1.HealthCheckRequest").
bool ParseRequest(grpc::ByteBuffer* bytes, google::protobuf::Message* message,
                  const std::string& input_type, grpc::Status* error);
// A ModelInferRequest, once its bytes were scanned against `limits` (wire_scan.h): false with
// RESOURCE_EXHAUSTED and the rule's refusal when they pass one, or with ParseRequest's error
// when they do not parse.
bool ParseInferRequest(grpc::ByteBuffer* bytes, inference::ModelInferRequest* message,
                       const RpcInfo& rpc, const WireLimits& limits, grpc::Status* error);

// Every unary RPC but ModelInfer.
class UnaryCall final : public CallBase, public AnswerTarget {
 public:
  UnaryCall(Worker& worker, const RpcInfo& rpc);

  AnswerMailbox& mailbox() override { return worker_; }
  void OnExecutorAnswer(ExecutorAnswer answer) override;

 private:
  void OnStarted(bool ok);
  void OnFinished(bool ok);
  void OnDone(bool ok);
  void Serve() override;

  void Handle();
  // Forwards `call` to the executor; its Reply answers this RPC.
  void Forward(std::unique_ptr<wire::Call> call);
  void Reply(grpc::ByteBuffer reply);
  void Fail(const grpc::Status& status);

  const RpcInfo& rpc_;
  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&context_};
  CallEvent<UnaryCall, &UnaryCall::OnStarted> started_{this};
  CallEvent<UnaryCall, &UnaryCall::OnFinished> finished_{this};
  CallEvent<UnaryCall, &UnaryCall::OnDone> done_{this};
};

// ModelInfer.
class InferCall final : public CallBase, public AnswerTarget {
 public:
  InferCall(Worker& worker, const RpcInfo& rpc);

  AnswerMailbox& mailbox() override { return worker_; }
  void OnExecutorAnswer(ExecutorAnswer answer) override;

 private:
  void OnStarted(bool ok);
  void OnFinished(bool ok);
  void OnDone(bool ok);
  void Serve() override;

  // Finishes the call: counted, logged at debug when failed (service.py ModelInfer()).
  void Answer(const grpc::Status& status, grpc::ByteBuffer* reply);

  const RpcInfo& rpc_;
  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&context_};
  CallEvent<InferCall, &InferCall::OnStarted> started_{this};
  CallEvent<InferCall, &InferCall::OnFinished> finished_{this};
  CallEvent<InferCall, &InferCall::OnDone> done_{this};

  std::chrono::steady_clock::time_point started_at_;
  std::string model_name_;  // as the client sent it: the metrics' label
  std::string id_;
  InferTicket ticket_;
  bool at_executor_ = false;  // an answer is still to come
  bool answered_ = false;     // counted: answered, or the client went away
  bool served_ = false;       // Serve() ran (not parked, or let go)
  bool call_over_ = false;    // gRPC's done event came: the call is over
};

}  // namespace batchgate
