// grpc.health.v1.Health (Check and Watch), served on the workers' completion queues.
//
// gRPC C++'s default health service is a callback service: the first one in a server starts
// gRPC's "callback alternative" queue and its two polling threads, which then take part in the
// network work of every call of the server (one more thread hand-off per call). Served here on
// the workers' own queues, health costs nothing per inference call, and answers as the Python
// front end's grpcio-health-checking servicer does: Check of an unknown service is NOT_FOUND
// with no message, whatever the name's length; Watch of one sends SERVICE_UNKNOWN and then
// each status it takes; after Shutdown() (the drain) every service is NOT_SERVING for good.
#pragma once

#include <grpcpp/impl/rpc_service_method.h>
#include <grpcpp/impl/service_type.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/async_stream.h>
#include <grpcpp/support/async_unary_call.h>

#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "grpc_health/v1/health.pb.h"
#include "worker.h"

namespace batchgate {

using HealthStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

// Every service's status; any thread.
class HealthStatuses {
 public:
  // `on_change` runs after each change, outside the lock, on the thread that made it.
  explicit HealthStatuses(std::function<void()> on_change) : on_change_(std::move(on_change)) {}

  void Set(const std::string& service, bool serving);
  // Every service known is NOT_SERVING from now on; later Set()s are ignored.
  void Shutdown();
  // The service's status; nullopt when it was never set.
  std::optional<HealthStatus> Get(const std::string& service) const;

 private:
  const std::function<void()> on_change_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, HealthStatus> statuses_;
  bool shut_down_ = false;
};

// The service's two methods, with raw payloads (a request that does not parse gets the Python
// front end's answer).
class RawHealthService final : public grpc::Service {
 public:
  RawHealthService();
  void RequestCheck(grpc::ServerContext* context, grpc::ByteBuffer* request,
                    grpc::ServerAsyncResponseWriter<grpc::ByteBuffer>* responder,
                    grpc::ServerCompletionQueue* cq, void* tag);
  void RequestWatch(grpc::ServerContext* context, grpc::ByteBuffer* request,
                    grpc::ServerAsyncWriter<grpc::ByteBuffer>* writer,
                    grpc::ServerCompletionQueue* cq, void* tag);
};

// Requests one Check and one Watch on `worker`'s queue, unless the worker is quitting.
void ListenForHealth(Worker& worker);

class HealthCheckCall final : public CallBase {
 public:
  explicit HealthCheckCall(Worker& worker);

 private:
  void OnStarted(bool ok);
  void OnFinished(bool ok);
  void OnDone(bool ok);
  void Serve() override;

  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&context_};
  CallEvent<HealthCheckCall, &HealthCheckCall::OnStarted> started_{this};
  CallEvent<HealthCheckCall, &HealthCheckCall::OnFinished> finished_{this};
  CallEvent<HealthCheckCall, &HealthCheckCall::OnDone> done_{this};
};

class HealthWatchCall final : public CallBase {
 public:
  explicit HealthWatchCall(Worker& worker);
  ~HealthWatchCall() override;

  // A status may have changed (the worker's thread): write it if it did.
  void Refresh();
  // The server drains: finish with UNAVAILABLE once the status being written is out (a
  // stream left open would be cancelled by the shutdown).
  void EndForDrain();

 private:
  void OnStarted(bool ok);
  void OnWritten(bool ok);
  void OnFinished(bool ok);
  void OnDone(bool ok);
  void Serve() override;
  void Finish(const grpc::Status& status);

  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ServerAsyncWriter<grpc::ByteBuffer> writer_{&context_};
  CallEvent<HealthWatchCall, &HealthWatchCall::OnStarted> started_{this};
  CallEvent<HealthWatchCall, &HealthWatchCall::OnWritten> written_{this};
  CallEvent<HealthWatchCall, &HealthWatchCall::OnFinished> finished_{this};
  CallEvent<HealthWatchCall, &HealthWatchCall::OnDone> done_{this};
  grpc::ByteBuffer message_;  // the status being written
  std::string service_;
  std::optional<HealthStatus> sent_;  // the last status written
  bool registered_ = false;  // in the worker's set of watches
  bool writing_ = false;
  bool ending_ = false;      // to finish with UNAVAILABLE once the write is out
  bool over_ = false;        // finished, or the client went away: nothing more is written
};

}  // namespace batchgate
