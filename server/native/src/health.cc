#include "health.h"

#include "calls.h"
#include "codec.h"
#include "frontend.h"
#include "rules.h"

namespace batchgate {
namespace {

constexpr int kCheck = 0;
constexpr int kWatch = 1;
const char* const kRequestType = "grpc.health.v1.HealthCheckRequest";

grpc::ByteBuffer StatusMessage(HealthStatus status) {
  grpc::health::v1::HealthCheckResponse response;
  response.set_status(status);
  return Serialize(response);
}

}  // namespace

// -- HealthStatuses ---------------------------------------------------------------------------

void HealthStatuses::Set(const std::string& service, bool serving) {
  const HealthStatus status = serving ? grpc::health::v1::HealthCheckResponse::SERVING
                                      : grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    auto [it, added] = statuses_.emplace(service, status);
    if (!added) {
      if (it->second == status) return;
      it->second = status;
    }
  }
  on_change_();
}

void HealthStatuses::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [service, status] : statuses_) {
      status = grpc::health::v1::HealthCheckResponse::NOT_SERVING;
    }
  }
  on_change_();
}

std::optional<HealthStatus> HealthStatuses::Get(const std::string& service) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = statuses_.find(service);
  if (it == statuses_.end()) return std::nullopt;
  return it->second;
}

// -- the service ------------------------------------------------------------------------------

RawHealthService::RawHealthService() {
  AddMethod(new grpc::internal::RpcServiceMethod(
      "/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
  AddMethod(new grpc::internal::RpcServiceMethod(
      "/grpc.health.v1.Health/Watch", grpc::internal::RpcMethod::SERVER_STREAMING, nullptr));
  MarkMethodRaw(kCheck);
  MarkMethodRaw(kWatch);
}

void RawHealthService::RequestCheck(grpc::ServerContext* context, grpc::ByteBuffer* request,
                                    grpc::ServerAsyncResponseWriter<grpc::ByteBuffer>* responder,
                                    grpc::ServerCompletionQueue* cq, void* tag) {
  RequestAsyncUnary(kCheck, context, request, responder, cq, cq, tag);
}

void RawHealthService::RequestWatch(grpc::ServerContext* context, grpc::ByteBuffer* request,
                                    grpc::ServerAsyncWriter<grpc::ByteBuffer>* writer,
                                    grpc::ServerCompletionQueue* cq, void* tag) {
  RequestAsyncServerStreaming(kWatch, context, request, writer, cq, cq, tag);
}

void ListenForHealth(Worker& worker) {
  if (!worker.listening()) return;
  worker.Adopt(std::make_unique<HealthCheckCall>(worker));
  worker.Adopt(std::make_unique<HealthWatchCall>(worker));
}

// Health calls are never parked by the drain (CallBase::Arrived): a probe is to hear
// NOT_SERVING at once, and its arrival does not hold the shutdown back.

// -- Check ------------------------------------------------------------------------------------

HealthCheckCall::HealthCheckCall(Worker& worker) : CallBase(worker) {
  context_.AsyncNotifyWhenDone(done_.tag());
  worker.frontend().health_service().RequestCheck(&context_, &request_, &responder_, worker.cq(),
                                                  started_.tag());
}

void HealthCheckCall::OnStarted(bool ok) {
  if (!ok) {  // the server is shutting down: no call came
    Unref();
    return;
  }
  Ref();  // the done event, which now will come
  if (worker_.listening()) worker_.Adopt(std::make_unique<HealthCheckCall>(worker_));
  Serve();
  Unref();
}

void HealthCheckCall::Serve() {
  grpc::health::v1::HealthCheckRequest request;
  grpc::Status error;
  Ref();  // the finish
  if (!ParseRequest(&request_, &request, kRequestType, &error)) {
    responder_.FinishWithError(error, finished_.tag());
    return;
  }
  const std::optional<HealthStatus> status = worker_.frontend().health().Get(request.service());
  if (!status) {
    responder_.FinishWithError(grpc::Status(grpc::StatusCode::NOT_FOUND, ""), finished_.tag());
    return;
  }
  responder_.Finish(StatusMessage(*status), grpc::Status::OK, finished_.tag());
}

void HealthCheckCall::OnFinished(bool /*ok*/) { Unref(); }

void HealthCheckCall::OnDone(bool /*ok*/) { Unref(); }

// -- Watch ------------------------------------------------------------------------------------

HealthWatchCall::HealthWatchCall(Worker& worker) : CallBase(worker) {
  context_.AsyncNotifyWhenDone(done_.tag());
  worker.frontend().health_service().RequestWatch(&context_, &request_, &writer_, worker.cq(),
                                                  started_.tag());
}

HealthWatchCall::~HealthWatchCall() {
  if (registered_) worker_.RemoveWatch(this);
}

void HealthWatchCall::OnStarted(bool ok) {
  if (!ok) {
    Unref();
    return;
  }
  Ref();  // the done event
  if (worker_.listening()) worker_.Adopt(std::make_unique<HealthWatchCall>(worker_));
  Serve();
  Unref();
}

void HealthWatchCall::Serve() {
  grpc::health::v1::HealthCheckRequest request;
  grpc::Status error;
  if (!ParseRequest(&request_, &request, kRequestType, &error)) return Finish(error);
  service_ = request.service();
  worker_.AddWatch(this);
  registered_ = true;
  if (worker_.ending_streams()) {
    // Arrived after the drain ended the streams: the status (NOT_SERVING by now), then the end.
    ending_ = true;
  }
  Refresh();
}

void HealthWatchCall::Refresh() {
  if (over_ || writing_) return;
  const HealthStatus status = worker_.frontend().health().Get(service_).value_or(
      grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN);
  if (sent_ == status) {
    if (ending_) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, rules::kShuttingDown));
    }
    return;
  }
  sent_ = status;
  message_ = StatusMessage(status);
  writing_ = true;
  Ref();
  writer_.Write(message_, written_.tag());
}

void HealthWatchCall::EndForDrain() {
  ending_ = true;
  Refresh();  // writes a change still unwritten first, then finishes
}

void HealthWatchCall::OnWritten(bool ok) {
  writing_ = false;
  if (!ok) {
    over_ = true;  // the stream is broken: the client is gone
  } else {
    Refresh();
  }
  Unref();
}

void HealthWatchCall::Finish(const grpc::Status& status) {
  if (over_) return;
  over_ = true;
  Ref();
  writer_.Finish(status, finished_.tag());
}

void HealthWatchCall::OnFinished(bool /*ok*/) { Unref(); }

void HealthWatchCall::OnDone(bool /*ok*/) {
  over_ = true;
  Unref();
}

}  // namespace batchgate
