// The front-end process as a whole: the gRPC server and its workers, the executor link, the
// model table, the input region, the metrics endpoint, and the order they start and drain in
// (server/frontend/app.py Gateway, server/frontend.py).
#pragma once

#include <grpcpp/server.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "auth.h"
#include "codec.h"
#include "executor_link.h"
#include "handover.h"
#include "health.h"
#include "input_region.h"
#include "metrics.h"
#include "model_table.h"
#include "protos/inference.grpc.pb.h"

namespace batchgate {

class Worker;

// The RPCs of inference.GRPCInferenceService.
enum class Rpc {
  kServerLive, kServerReady, kModelReady, kServerMetadata, kModelMetadata, kModelInfer,
  kModelStreamInfer, kModelConfig, kModelStatistics, kRepositoryIndex, kRepositoryModelLoad,
  kRepositoryModelUnload, kSystemSharedMemoryStatus, kSystemSharedMemoryRegister,
  kSystemSharedMemoryUnregister, kCudaSharedMemoryStatus, kCudaSharedMemoryRegister,
  kCudaSharedMemoryUnregister, kTraceSetting, kLogSettings,
};

struct RpcInfo {
  Rpc rpc;
  std::string name;        // "ModelInfer"
  int index;               // the method's index in the service (its declaration order)
  std::string input_type;  // "inference.ModelInferRequest", for the parse-error message
};

// Every method of the service served with raw payloads: each call's bytes reach our code
// unparsed, so that the token check comes before parsing (server/frontend/auth.py never reads a refused
// call's request), and a request that does not parse gets the one-process server's answer.
class RawInferenceService final : public inference::GRPCInferenceService::Service {
 public:
  RawInferenceService();
  void RequestUnary(int index, grpc::ServerContext* context, grpc::ByteBuffer* request,
                    grpc::ServerAsyncResponseWriter<grpc::ByteBuffer>* responder,
                    grpc::ServerCompletionQueue* cq, void* tag);
  void RequestBidi(int index, grpc::ServerContext* context,
                   grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                   grpc::ServerCompletionQueue* cq, void* tag);
};

// What a request in flight keeps to build its reply.
struct InferTicket {
  std::shared_ptr<const ModelState> model;  // the state it was checked against
  std::vector<uint32_t> outputs;            // requested outputs; empty: all
  uint64_t rid = 0;
};

class Frontend final : public LinkObserver {
 public:
  explicit Frontend(Handover handover);
  ~Frontend();

  // Starts everything, reports ready once the executor welcomed this front end, serves until
  // RequestStop(), drains; returns the process's exit code.
  int Run();
  // Any thread (the signal thread): begin the drain.
  void RequestStop();

  // -- for the calls ---------------------------------------------------------------------------
  const Handover& handover() const { return handover_; }
  const TokenAuth& auth() const { return *auth_; }
  RawInferenceService& service() { return service_; }
  RawHealthService& health_service() { return health_service_; }
  const HealthStatuses& health() const { return health_; }
  ModelTable& models() { return models_; }
  ExecutorLink& link() { return *link_; }
  const Arena& arena() const { return arena_; }
  RequestMetrics& metrics() { return *metrics_; }
  const std::vector<RpcInfo>& rpcs() const { return rpcs_; }
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  bool ready() const { return ready_.load(std::memory_order_acquire); }

  // The inference path up to the executor, shared by ModelInfer and ModelStreamInfer
  // (service.py _infer()): draining, the model, decode_request()'s checks,
  // the inputs into the arena, the Infer queued. On OK, `target` gets exactly one answer.
  grpc::Status StartInfer(const inference::ModelInferRequest& request, int64_t deadline_ns,
                          AnswerTarget* target, InferTicket* ticket);

  // Whether the executor knows a model of this name (in any state): only such names become
  // metric labels.
  bool KnowsModel(const std::string& name) const;

  // A call arrived while draining (any worker thread).
  void NoteArrival();

  // LinkObserver, on the link's reader thread.
  void OnConnectionChange(bool connected, size_t models) override;
  void OnModelChange(const std::string& name, bool serving) override;

 private:
  bool Start(std::string* error);
  void KeepOffModelCpus();
  void Drain();
  void SetHealth(const std::string& service, bool serving);

  Handover handover_;
  Arena arena_;
  std::unique_ptr<InputRegion> region_;
  ModelTable models_;
  std::unique_ptr<RequestMetrics> metrics_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::unique_ptr<TokenAuth> auth_;
  std::unique_ptr<ExecutorLink> link_;
  RawInferenceService service_;
  RawHealthService health_service_;
  std::vector<RpcInfo> rpcs_;
  RequestLimits limits_;
  std::unique_ptr<grpc::Server> server_;
  // Every change wakes the workers, whose watches write what changed.
  HealthStatuses health_{[this] { for (auto& worker : workers_) worker->HealthChanged(); }};
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::thread> threads_;
  int grpc_port_ = 0;

  std::atomic<bool> draining_{false};
  std::atomic<int64_t> last_arrival_ns_{0};  // steady clock, while draining
  std::atomic<bool> ready_{false};
  std::mutex mu_;
  std::condition_variable changed_;
  bool stop_requested_ = false;
  bool welcomed_ = false;
};

// Nanoseconds on CLOCK_MONOTONIC of the call's gRPC deadline; 0 when it has none.
int64_t DeadlineNs(const grpc::ServerContext& context);
// The deadline `left_s` seconds and `left_ns` nanoseconds after `now_ns`, saturated: a
// grpc-timeout may say 99999999 hours (3.6e20 ns, past int64), which becomes the largest
// deadline the wire carries (it never passes); one already past is 1 (at once, not "none").
int64_t DeadlineAfter(int64_t now_ns, int64_t left_s, int64_t left_ns);

}  // namespace batchgate
