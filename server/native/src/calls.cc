#include "calls.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include "health.h"
#include "log.h"
#include "metrics.h"
#include "rules.h"
#include "stream_call.h"
#include "text.h"

namespace batchgate {
namespace {


grpc::Status BoundedStatus(const grpc::Status& status) {
  return grpc::Status(status.error_code(), Bounded(status.error_message()));
}

// What grpcio answers a request its deserializer cannot parse.
grpc::Status ParseError(const std::string& input_type) {
  return grpc::Status(grpc::StatusCode::UNKNOWN,
                      "Unexpected <class 'google.protobuf.message.DecodeError'>: Error parsing "
                      "message with type '" + input_type + "'");
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The request field of `call` that a shared-memory RPC parses into.
google::protobuf::Message* SharedMemoryRequest(Rpc rpc, wire::Call* call) {
  switch (rpc) {
    case Rpc::kSystemSharedMemoryStatus: return call->mutable_system_status();
    case Rpc::kSystemSharedMemoryRegister: return call->mutable_system_register();
    case Rpc::kSystemSharedMemoryUnregister: return call->mutable_system_unregister();
    case Rpc::kCudaSharedMemoryStatus: return call->mutable_cuda_status();
    case Rpc::kCudaSharedMemoryRegister: return call->mutable_cuda_register();
    default: return call->mutable_cuda_unregister();
  }
}

}  // namespace

void ListenForEveryRpc(Worker& worker) {
  for (const RpcInfo& rpc : worker.frontend().rpcs()) Listen(worker, rpc);
  ListenForHealth(worker);
}

void Listen(Worker& worker, const RpcInfo& rpc) {
  if (!worker.listening()) return;
  switch (rpc.rpc) {
    case Rpc::kModelInfer: worker.Adopt(std::make_unique<InferCall>(worker, rpc)); break;
    case Rpc::kModelStreamInfer: worker.Adopt(std::make_unique<StreamInferCall>(worker, rpc)); break;
    default: worker.Adopt(std::make_unique<UnaryCall>(worker, rpc)); break;
  }
}

bool ParseRequest(grpc::ByteBuffer* bytes, google::protobuf::Message* message, const RpcInfo& rpc,
                  grpc::Status* error) {
  return ParseRequest(bytes, message, rpc.input_type, error);
}

bool ParseRequest(grpc::ByteBuffer* bytes, google::protobuf::Message* message,
                  const std::string& input_type, grpc::Status* error) {
  if (grpc::SerializationTraits<google::protobuf::Message>::Deserialize(bytes, message).ok()) {
    return true;
  }
  *error = ParseError(input_type);
  return false;
}

bool ParseInferRequest(grpc::ByteBuffer* bytes, inference::ModelInferRequest* message,
                       const RpcInfo& rpc, const WireLimits& limits, grpc::Status* error) {
  std::vector<grpc::Slice> slices;
  std::vector<WireSpan> spans;
  if (bytes->Dump(&slices).ok()) {
    spans.reserve(slices.size());
    for (const grpc::Slice& slice : slices) spans.push_back({slice.begin(), slice.size()});
    const ScanResult scanned = ScanInferRequest(spans, limits);
    if (scanned.outcome == ScanOutcome::kOverLimit) {
      *error = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, limits.Refusal(scanned.rule));
      return false;
    }
    if (scanned.outcome == ScanOutcome::kMalformed) {
      *error = ParseError(rpc.input_type);  // the parser's answer, without parsing
      return false;
    }
  }
  return ParseRequest(bytes, message, rpc, error);
}

// -- UnaryCall ----------------------------------------------------------------------------------

UnaryCall::UnaryCall(Worker& worker, const RpcInfo& rpc) : CallBase(worker), rpc_(rpc) {
  context_.AsyncNotifyWhenDone(done_.tag());
  worker.frontend().service().RequestUnary(rpc.index, &context_, &request_, &responder_,
                                           worker.cq(), started_.tag());
}

void UnaryCall::OnStarted(bool ok) {
  if (!ok) {  // the server is shutting down: no call came
    Unref();
    return;
  }
  Arrived(rpc_);
}

void UnaryCall::Serve() {
  const grpc::Status refusal = worker_.frontend().auth().Check(rpc_.index, context_);
  if (refusal.ok()) {
    Handle();
  } else {
    Fail(refusal);
  }
}

void UnaryCall::Handle() {
  Frontend& frontend = worker_.frontend();
  grpc::Status error;
  switch (rpc_.rpc) {
    case Rpc::kServerLive: {
      inference::ServerLiveRequest request;
      if (!ParseRequest(&request_, &request, rpc_, &error)) return Fail(error);
      inference::ServerLiveResponse response;
      response.set_live(true);
      return Reply(Serialize(response));
    }
    case Rpc::kServerReady: {
      inference::ServerReadyRequest request;
      if (!ParseRequest(&request_, &request, rpc_, &error)) return Fail(error);
      inference::ServerReadyResponse response;
      response.set_ready(frontend.ready() && !frontend.draining());
      return Reply(Serialize(response));
    }
    case Rpc::kModelReady: {
      inference::ModelReadyRequest request;
      if (!ParseRequest(&request_, &request, rpc_, &error)) return Fail(error);
      const auto snapshot = frontend.models().Current();
      std::shared_ptr<const ModelState> model;
      const bool known =
          ModelTable::Lookup(*snapshot, request.name(), request.version(), &model).ok();
      inference::ModelReadyResponse response;
      response.set_ready(known && snapshot->connected && !frontend.draining());
      return Reply(Serialize(response));
    }
    case Rpc::kServerMetadata: {
      inference::ServerMetadataRequest request;
      if (!ParseRequest(&request_, &request, rpc_, &error)) return Fail(error);
      inference::ServerMetadataResponse response;
      response.set_name("batchgate");
      response.set_version(frontend.handover().version);
      for (const std::string& extension : frontend.handover().extensions) {
        response.add_extensions(extension);
      }
      return Reply(Serialize(response));
    }
    case Rpc::kModelMetadata:
    case Rpc::kModelConfig: {
      // ModelMetadataRequest and ModelConfigRequest are both {name = 1, version = 2}, but each
      // parses as its own type, for the parse error to name it.
      std::string name, version;
      if (rpc_.rpc == Rpc::kModelMetadata) {
        inference::ModelMetadataRequest parsed;
        if (!ParseRequest(&request_, &parsed, rpc_, &error)) return Fail(error);
        name = parsed.name();
        version = parsed.version();
      } else {
        inference::ModelConfigRequest parsed;
        if (!ParseRequest(&request_, &parsed, rpc_, &error)) return Fail(error);
        name = parsed.name();
        version = parsed.version();
      }
      std::shared_ptr<const ModelState> model;
      const grpc::Status found =
          ModelTable::Lookup(*frontend.models().Current(), name, version, &model);
      if (!found.ok()) return Fail(BoundedStatus(found));
      return Reply(BytesOf(rpc_.rpc == Rpc::kModelMetadata ? model->metadata_response
                                                            : model->config_response));
    }
    case Rpc::kModelStatistics: {
      auto call = std::make_unique<wire::Call>();
      auto* request = call->mutable_statistics();
      if (!ParseRequest(&request_, request, rpc_, &error)) return Fail(error);
      if (!request->name().empty()) {
        // As the one-process server's statistics: a model named must be one this front end serves.
        std::shared_ptr<const ModelState> model;
        const grpc::Status found = ModelTable::Lookup(*frontend.models().Current(),
                                                      request->name(), request->version(), &model);
        if (!found.ok()) return Fail(BoundedStatus(found));
      }
      return Forward(std::move(call));
    }
    case Rpc::kRepositoryIndex: {
      auto call = std::make_unique<wire::Call>();
      if (!ParseRequest(&request_, call->mutable_index(), rpc_, &error)) return Fail(error);
      return Forward(std::move(call));
    }
    case Rpc::kRepositoryModelLoad: {
      auto call = std::make_unique<wire::Call>();
      if (!ParseRequest(&request_, call->mutable_load(), rpc_, &error)) return Fail(error);
      return Forward(std::move(call));
    }
    case Rpc::kRepositoryModelUnload: {
      auto call = std::make_unique<wire::Call>();
      if (!ParseRequest(&request_, call->mutable_unload(), rpc_, &error)) return Fail(error);
      return Forward(std::move(call));
    }
    // The shared-memory registrations are the executor's: it maps the regions. The request
    // parses first, as grpcio parses it before the handler runs.
    case Rpc::kSystemSharedMemoryStatus:
    case Rpc::kSystemSharedMemoryRegister:
    case Rpc::kSystemSharedMemoryUnregister:
    case Rpc::kCudaSharedMemoryStatus:
    case Rpc::kCudaSharedMemoryRegister:
    case Rpc::kCudaSharedMemoryUnregister: {
      auto call = std::make_unique<wire::Call>();
      google::protobuf::Message* request = SharedMemoryRequest(rpc_.rpc, call.get());
      if (!ParseRequest(&request_, request, rpc_, &error)) return Fail(error);
      if (!frontend.handover().shared_memory) {
        return Fail(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, rules::kSharedMemoryOff));
      }
      return Forward(std::move(call));
    }
    case Rpc::kTraceSetting:
    case Rpc::kLogSettings: {
      // grpcio parses the request before the handler refuses it: a malformed one gets the
      // parse error, so parse it as its own type too.
      const auto* descriptor =
          google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(rpc_.input_type);
      std::unique_ptr<google::protobuf::Message> request(
          google::protobuf::MessageFactory::generated_factory()->GetPrototype(descriptor)->New());
      if (!ParseRequest(&request_, request.get(), rpc_, &error)) return Fail(error);
      if (rpc_.rpc == Rpc::kTraceSetting) {
        return Fail(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, rules::kTracingUnsupported));
      }
      return Fail(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, rules::kLogSettingsFixed));
    }
    case Rpc::kModelInfer:
    case Rpc::kModelStreamInfer:
      break;  // their own call classes
  }
  Fail(grpc::Status(grpc::StatusCode::INTERNAL, rules::kInternal));
}

void UnaryCall::Forward(std::unique_ptr<wire::Call> call) {
  Ref();  // the executor's answer
  grpc::Status refusal;
  if (!worker_.frontend().link().SubmitCall(std::move(call), this, &refusal)) {
    Unref();
    Fail(refusal);
  }
}

namespace {

// The Reply outcome that answers `rpc` (Reply::OUTCOME_NOT_SET for an RPC not forwarded).
wire::Reply::OutcomeCase ReplyOf(Rpc rpc) {
  switch (rpc) {
    case Rpc::kModelStatistics: return wire::Reply::kStatistics;
    case Rpc::kRepositoryIndex: return wire::Reply::kIndex;
    case Rpc::kRepositoryModelLoad: return wire::Reply::kLoad;
    case Rpc::kRepositoryModelUnload: return wire::Reply::kUnload;
    case Rpc::kSystemSharedMemoryStatus: return wire::Reply::kSystemStatus;
    case Rpc::kSystemSharedMemoryRegister: return wire::Reply::kSystemRegister;
    case Rpc::kSystemSharedMemoryUnregister: return wire::Reply::kSystemUnregister;
    case Rpc::kCudaSharedMemoryStatus: return wire::Reply::kCudaStatus;
    case Rpc::kCudaSharedMemoryRegister: return wire::Reply::kCudaRegister;
    case Rpc::kCudaSharedMemoryUnregister: return wire::Reply::kCudaUnregister;
    default: return wire::Reply::OUTCOME_NOT_SET;
  }
}

// The response a Reply carries.
const google::protobuf::MessageLite* ResponseOf(const wire::Reply& reply) {
  switch (reply.outcome_case()) {
    case wire::Reply::kStatistics: return &reply.statistics();
    case wire::Reply::kIndex: return &reply.index();
    case wire::Reply::kLoad: return &reply.load();
    case wire::Reply::kUnload: return &reply.unload();
    case wire::Reply::kSystemStatus: return &reply.system_status();
    case wire::Reply::kSystemRegister: return &reply.system_register();
    case wire::Reply::kSystemUnregister: return &reply.system_unregister();
    case wire::Reply::kCudaStatus: return &reply.cuda_status();
    case wire::Reply::kCudaRegister: return &reply.cuda_register();
    case wire::Reply::kCudaUnregister: return &reply.cuda_unregister();
    case wire::Reply::kError:
    case wire::Reply::OUTCOME_NOT_SET: break;
  }
  return nullptr;
}

}  // namespace

void UnaryCall::OnExecutorAnswer(ExecutorAnswer answer) {
  if (!answer.status.ok()) {
    Fail(answer.status);
  } else if (answer.reply->outcome_case() != ReplyOf(rpc_.rpc) ||
             ResponseOf(*answer.reply) == nullptr) {
    Log(LogLevel::kError, "executor_protocol_error",
        {LogField("error", "a reply of the wrong kind for " + rpc_.name)});
    Fail(grpc::Status(grpc::StatusCode::INTERNAL, rules::kInternal));
  } else {
    Reply(Serialize(*ResponseOf(*answer.reply)));
  }
  Unref();
}

void UnaryCall::Reply(grpc::ByteBuffer reply) {
  Ref();
  responder_.Finish(reply, grpc::Status::OK, finished_.tag());
}

void UnaryCall::Fail(const grpc::Status& status) {
  Ref();
  responder_.FinishWithError(status, finished_.tag());
}

void UnaryCall::OnFinished(bool /*ok*/) { Unref(); }
void UnaryCall::OnDone(bool /*ok*/) { Unref(); }

// -- InferCall ----------------------------------------------------------------------------------

InferCall::InferCall(Worker& worker, const RpcInfo& rpc) : CallBase(worker), rpc_(rpc) {
  context_.AsyncNotifyWhenDone(done_.tag());
  worker.frontend().service().RequestUnary(rpc.index, &context_, &request_, &responder_,
                                           worker.cq(), started_.tag());
}

void InferCall::OnStarted(bool ok) {
  if (!ok) {
    Unref();
    return;
  }
  Arrived(rpc_);
}

void InferCall::Serve() {
  if (call_over_) return;  // the client went away while the call was parked: nothing to answer
  served_ = true;
  Frontend& frontend = worker_.frontend();
  grpc::Status status = frontend.auth().Check(rpc_.index, context_);
  inference::ModelInferRequest request;
  if (status.ok()) {
    started_at_ = std::chrono::steady_clock::now();
    ParseInferRequest(&request_, &request, rpc_, frontend.handover().wire_limits, &status);
  }
  if (!status.ok()) {
    // Refused before the handler ran (the token, a request that does not parse or is past a
    // wire limit, so that nothing names its model yet): not an inference answer, so neither
    // counted nor logged as one.
    answered_ = true;
    Ref();
    responder_.FinishWithError(status, finished_.tag());
    return;
  }
  model_name_ = request.model_name();
  id_ = request.id();
  status = frontend.StartInfer(request, DeadlineNs(context_), this, &ticket_);
  if (status.ok()) {
    at_executor_ = true;
    Ref();  // the executor's answer
  } else {
    Answer(status, nullptr);
  }
}

void InferCall::OnExecutorAnswer(ExecutorAnswer answer) {
  at_executor_ = false;
  Frontend& frontend = worker_.frontend();
  if (answer.status.ok()) {
    if (!answered_) {
      grpc::ByteBuffer reply;
      std::string problem;
      const grpc::Status encoded = EncodeResponse(
          *ticket_.model, id_, ticket_.outputs, *answer.result, frontend.arena(), false,
          static_cast<uint64_t>(frontend.handover().max_message_bytes), &reply, &problem);
      if (!problem.empty()) {
        Log(LogLevel::kError, "executor_protocol_error", {LogField("error", problem)});
      }
      Answer(encoded, encoded.ok() ? &reply : nullptr);
    }
    // Copied out (or not wanted any more): the executor may reuse the output blocks.
    frontend.link().FreeOutputs(answer.generation, *answer.result);
  } else if (!answered_) {
    Answer(answer.status, nullptr);
  }
  Unref();
}

void InferCall::Answer(const grpc::Status& status, grpc::ByteBuffer* reply) {
  answered_ = true;
  Frontend& frontend = worker_.frontend();
  frontend.metrics().Count(model_name_, ticket_.model || frontend.KnowsModel(model_name_),
                           status.error_code(), SecondsSince(started_at_));
  Ref();
  if (status.ok()) {
    responder_.Finish(*reply, status, finished_.tag());
    return;
  }
  if (LogEnabled(LogLevel::kDebug)) {
    Log(LogLevel::kDebug, "request_failed",
        {LogField("model", model_name_), LogField("request", id_),
         LogField("code", StatusCodeName(status.error_code())),
         LogField("error", status.error_message())});
  }
  responder_.FinishWithError(status, finished_.tag());
}

void InferCall::OnFinished(bool /*ok*/) { Unref(); }

void InferCall::OnDone(bool /*ok*/) {
  call_over_ = true;
  if (context_.IsCancelled() && served_ && !answered_) {
    // The client went away (or its deadline passed) before the answer: counted as Python
    // counts a cancelled handler, and the request leaves the executor's queue.
    answered_ = true;
    worker_.frontend().metrics().Count(
        model_name_, ticket_.model || worker_.frontend().KnowsModel(model_name_),
        grpc::StatusCode::CANCELLED, SecondsSince(started_at_));
    if (at_executor_) worker_.frontend().link().Cancel(ticket_.rid);
  }
  Unref();
}

}  // namespace batchgate
