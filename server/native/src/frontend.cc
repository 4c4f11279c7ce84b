#include "frontend.h"

#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include "grpc_health/v1/health.pb.h"
#include "log.h"
#include "rules.h"
#include "text.h"
#include "worker.h"

namespace batchgate {
namespace {

const char* const kServiceName = "inference.GRPCInferenceService";
// The drain's parking of new calls before the shutdown (Frontend::Drain): no arrival for this
// long means the clients are waiting for answers; parking lasts this long at most; the GOAWAY
// is given this long to reach the clients before the parked calls are answered.
// A client answered just before the parking began needs the quiet period to send its next call
// (and have it parked); a GOAWAY needs a round trip and the client's reading to take effect.
constexpr auto kQuietArrivals = std::chrono::milliseconds(50);
constexpr auto kMaxParking = std::chrono::milliseconds(1000);
constexpr auto kGoawayPropagation = std::chrono::milliseconds(250);

// gRPC's reflection library registers its plugin with every ServerBuilder as soon as the
// library is loaded (a static initializer), so not calling InitProtoReflectionServerBuilderPlugin
// is not enough: with reflection off, this option takes the plugin out of the builder again.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
                                    return plugin->name() == "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

struct RpcName {
  Rpc rpc;
  const char* name;
};
constexpr RpcName kRpcNames[] = {
    {Rpc::kServerLive, "ServerLive"},
    {Rpc::kServerReady, "ServerReady"},
    {Rpc::kModelReady, "ModelReady"},
    {Rpc::kServerMetadata, "ServerMetadata"},
    {Rpc::kModelMetadata, "ModelMetadata"},
    {Rpc::kModelInfer, "ModelInfer"},
    {Rpc::kModelStreamInfer, "ModelStreamInfer"},
    {Rpc::kModelConfig, "ModelConfig"},
    {Rpc::kModelStatistics, "ModelStatistics"},
    {Rpc::kRepositoryIndex, "RepositoryIndex"},
    {Rpc::kRepositoryModelLoad, "RepositoryModelLoad"},
    {Rpc::kRepositoryModelUnload, "RepositoryModelUnload"},
    {Rpc::kSystemSharedMemoryStatus, "SystemSharedMemoryStatus"},
    {Rpc::kSystemSharedMemoryRegister, "SystemSharedMemoryRegister"},
    {Rpc::kSystemSharedMemoryUnregister, "SystemSharedMemoryUnregister"},
    {Rpc::kCudaSharedMemoryStatus, "CudaSharedMemoryStatus"},
    {Rpc::kCudaSharedMemoryRegister, "CudaSharedMemoryRegister"},
    {Rpc::kCudaSharedMemoryUnregister, "CudaSharedMemoryUnregister"},
    {Rpc::kTraceSetting, "TraceSetting"},
    {Rpc::kLogSettings, "LogSettings"},
};

const google::protobuf::ServiceDescriptor* ServiceDescriptor() {
  return google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(kServiceName);
}

bool ReadFile(const std::string& path, std::string* contents) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return false;
  std::ostringstream text;
  text << file.rdbuf();
  *contents = text.str();
  return static_cast<bool>(file) || file.eof();
}

int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

}  // namespace

// -- the service ------------------------------------------------------------------------------

RawInferenceService::RawInferenceService() {
  for (int i = 0; i < ServiceDescriptor()->method_count(); ++i) MarkMethodRaw(i);
}

void RawInferenceService::RequestUnary(int index, grpc::ServerContext* context,
                                       grpc::ByteBuffer* request,
                                       grpc::ServerAsyncResponseWriter<grpc::ByteBuffer>* responder,
                                       grpc::ServerCompletionQueue* cq, void* tag) {
  RequestAsyncUnary(index, context, request, responder, cq, cq, tag);
}

void RawInferenceService::RequestBidi(
    int index, grpc::ServerContext* context,
    grpc::ServerAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
    grpc::ServerCompletionQueue* cq, void* tag) {
  RequestAsyncBidiStreaming(index, context, stream, cq, cq, tag);
}

// -- the front end ----------------------------------------------------------------------------

Frontend::Frontend(Handover handover) : handover_(std::move(handover)) {
  limits_.max_request_bytes = static_cast<uint64_t>(handover_.max_request_bytes);
  limits_.max_tensor_elements = static_cast<uint64_t>(handover_.max_tensor_elements);
}

Frontend::~Frontend() = default;

void Frontend::RequestStop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_requested_ = true;
  }
  changed_.notify_all();
}

int Frontend::Run() {
  std::string error;
  if (!Start(&error)) {
    Log(LogLevel::kError, "frontend_start_failed", {LogField("error", error)});
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now());
      for (auto& worker : workers_) worker->Quit();
      for (auto& thread : threads_) thread.join();
    }
    return 1;
  }
  KeepOffModelCpus();
  {
    // Ready only once the executor has welcomed this front end: before, every request would
    // get UNAVAILABLE.
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] { return welcomed_ || stop_requested_; });
    if (welcomed_ && !stop_requested_) {
      lock.unlock();
      Announce("frontend_ready",
               {LogField("slot", handover_.slot), LogField("grpc_port", grpc_port_),
                LogField("pid", static_cast<int>(getpid())),
                LogField("grpc_memory_bytes", handover_.grpc_memory_bytes),
                LogField("grpc_max_threads", handover_.grpc_max_threads)});
      lock.lock();
    }
    changed_.wait(lock, [&] { return stop_requested_; });
  }
  Drain();
  return 0;
}

// --model-cpus: the executor's model threads run on those CPUs, and every thread of this
// process on the others. Set once the gRPC server and the workers run: gRPC sizes its own
// threads and pollers from the CPUs it sees as it starts, and with one CPU in view the c=1 p50
// was ~0.1 ms worse than with the same threads moved after the start. Threads started later
// inherit the set from the thread that starts them; a second pass takes any that a thread
// started while the first one ran.
void Frontend::KeepOffModelCpus() {
  if (handover_.model_cpus.empty()) return;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  std::string why;
  if (sched_getaffinity(0, sizeof(cpus), &cpus) != 0) {
    why = std::string("sched_getaffinity: ") + std::strerror(errno);
  } else {
    for (int cpu : handover_.model_cpus) CPU_CLR(cpu, &cpus);
    if (CPU_COUNT(&cpus) == 0) why = "the model CPUs are every CPU this process may run on";
  }
  for (int pass = 0; pass < 2 && why.empty(); ++pass) {
    DIR* tasks = opendir("/proc/self/task");
    if (tasks == nullptr) {
      why = std::string("/proc/self/task: ") + std::strerror(errno);
      break;
    }
    while (const dirent* task = readdir(tasks)) {
      if (task->d_name[0] == '.') continue;
      const pid_t tid = static_cast<pid_t>(std::atoi(task->d_name));
      if (sched_setaffinity(tid, sizeof(cpus), &cpus) != 0 && errno != ESRCH) {
        why = std::string("sched_setaffinity: ") + std::strerror(errno);
        break;
      }
    }
    closedir(tasks);
  }
  if (!why.empty()) {
    Log(LogLevel::kWarning, "model_cpus_not_applied",
        {LogField("reason", why),
         LogField("effect", std::string(rules::kCpusNotAppliedEffect))});
  }
}

bool Frontend::Start(std::string* error) {
  const Handover& h = handover_;
  const auto* service = ServiceDescriptor();
  for (const RpcName& entry : kRpcNames) {
    const auto* method = service->FindMethodByName(entry.name);
    if (method == nullptr) {
      *error = std::string("protos/inference.proto has no RPC ") + entry.name;
      return false;
    }
    rpcs_.push_back({entry.rpc, entry.name, method->index(), method->input_type()->full_name()});
  }
  std::vector<std::string> method_names;
  for (int i = 0; i < service->method_count(); ++i) method_names.push_back(service->method(i)->name());
  auth_ = std::make_unique<TokenAuth>(h.admin_token, h.infer_token, method_names);

  if (!arena_.Map(h.arena_fd, h.arena_bytes, error)) return false;
  close(h.arena_fd);  // the mapping stays; the descriptor is not needed any more
  if (h.input_region_offset % InputRegion::kAlignment || h.input_region_bytes % InputRegion::kAlignment ||
      !arena_.Contains(h.input_region_offset, h.input_region_bytes)) {
    *error = "input_region [" + std::to_string(h.input_region_offset) + ", " +
             std::to_string(h.input_region_bytes) + "] must be 256-aligned and inside the arena";
    return false;
  }
  region_ = std::make_unique<InputRegion>(h.input_region_offset, h.input_region_bytes);
  const InputRegion* region = region_.get();
  metrics_ = std::make_unique<RequestMetrics>(h.seconds_buckets, "input-" + std::to_string(h.slot),
                                              [region] { return region->bytes_in_use(); },
                                              h.unknown_model_label);
  metrics_endpoint_ = std::make_unique<MetricsEndpoint>(*metrics_);
  if (!metrics_endpoint_->Start(h.metrics_socket, error)) return false;

  // -- the gRPC server
  // grpc.health.v1 is ours (health.h), on the workers' queues.
  grpc::EnableDefaultHealthCheckService(false);
  if (h.reflection) {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    // Reflection describes what is in the generated descriptor pool: naming one of health's
    // messages links its file in (an unreferenced object of a static library would be left
    // out).
    static_cast<void>(grpc::health::v1::HealthCheckRequest::descriptor());
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (h.tls_cert) {
    grpc::SslServerCredentialsOptions options(
        h.tls_client_ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                        : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    for (const auto& [path, into] : {std::pair{*h.tls_cert, &pair.cert_chain},
                                     std::pair{*h.tls_key, &pair.private_key}}) {
      if (!ReadFile(path, into)) {
        *error = "could not read " + path;
        return false;
      }
    }
    options.pem_key_cert_pairs.push_back(pair);
    if (h.tls_client_ca && !ReadFile(*h.tls_client_ca, &options.pem_root_certs)) {
      *error = "could not read " + *h.tls_client_ca;
      return false;
    }
    credentials = grpc::SslServerCredentials(options);
  }
  const std::string address = h.host.find(':') == std::string::npos
                                  ? h.host + ":" + std::to_string(h.grpc_port)
                                  : "[" + h.host + "]:" + std::to_string(h.grpc_port);
  grpc::ServerBuilder builder;
  if (!h.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.AddListeningPort(address, credentials, &grpc_port_);
  // The supervisor holds the port with a bound, non-listening SO_REUSEPORT socket; every front
  // end binds it too and the kernel spreads connections over those that listen.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 1);
  builder.SetMaxReceiveMessageSize(static_cast<int>(h.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(h.max_message_bytes));
  // Streams per connection, keepalive and connection age (server/rules/connections.py); memory and
  // threads for all connections together.
  for (const auto& [name, value] : h.grpc_arguments) builder.AddChannelArgument(name, value);
  grpc::ResourceQuota quota("batchgate-frontend");
  quota.Resize(static_cast<size_t>(h.grpc_memory_bytes));
  quota.SetMaxThreads(h.grpc_max_threads);
  builder.SetResourceQuota(quota);
  builder.RegisterService(&service_);
  builder.RegisterService(&health_service_);
  // Reflection is gRPC's synchronous service, which brings its own polling threads; they take
  // part in the network work of every call, so keep them to one (more are started while one
  // is busy serving reflection).
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::NUM_CQS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 1);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 1);
  const int threads = h.frontend_threads > 0 ? h.frontend_threads : UsableCpus();
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
  for (int i = 0; i < threads; ++i) queues.push_back(builder.AddCompletionQueue());
  server_ = builder.BuildAndStart();
  if (!server_ || grpc_port_ == 0) {
    *error = h.tls_cert ? rules::TlsBindFailed(address, "") : rules::BindFailed(address);
    server_.reset();
    return false;
  }
  // Not serving before the executor is here.
  SetHealth("", false);
  SetHealth(kServiceName, false);
  for (int i = 0; i < threads; ++i) {
    workers_.push_back(std::make_unique<Worker>(*this, i, std::move(queues[static_cast<size_t>(i)])));
  }
  for (auto& worker : workers_) threads_.emplace_back([w = worker.get()] { w->Run(); });

  link_ = std::make_unique<ExecutorLink>(h.executor_socket, static_cast<uint32_t>(h.slot), *region_,
                                         models_, *this);
  link_->Start();
  return true;
}

void Frontend::SetHealth(const std::string& service, bool serving) {
  health_.Set(service, serving);
}

void Frontend::OnConnectionChange(bool connected, size_t /*models*/) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (connected) welcomed_ = true;
  }
  changed_.notify_all();
  // A front end's executor came or went: the whole server's health follows it (app.py).
  if (draining()) return;
  ready_.store(connected, std::memory_order_release);
  SetHealth("", connected);
  SetHealth(kServiceName, connected);
}

void Frontend::OnModelChange(const std::string& name, bool serving) { SetHealth(name, serving); }

void Frontend::NoteArrival() {
  last_arrival_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count(),
                         std::memory_order_relaxed);
}

void Frontend::Drain() {
  // server/frontend/app.py Gateway.stop(): NOT_SERVING first, new requests UNAVAILABLE, those in flight
  // finish (bounded), then the server stops.
  using Clock = std::chrono::steady_clock;
  draining_.store(true, std::memory_order_release);
  for (auto& worker : workers_) worker->ListenDeeper();
  health_.Shutdown();
  Log(LogLevel::kInfo, "draining", {LogField("drain_timeout_s", handover_.drain_timeout_s)});
  const auto grace = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(handover_.drain_timeout_s));
  const auto deadline = Clock::now() + grace;
  while (link_ && link_->InFlightInfers() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (link_ && link_->InFlightInfers() > 0) {
    Log(LogLevel::kWarning, "frontend_drain_timed_out",
        {LogField("slot", handover_.slot), LogField("left", link_->InFlightInfers())});
  }
  // What is still in flight (after a timeout) is answered UNAVAILABLE, as a lost executor.
  if (link_) link_->Close();

  // gRPC's shutdown cancels every call that reaches the server after it began and before the
  // client has heard the GOAWAY it sends: the client would see CANCELLED for a request that
  // reached the server. So new calls are parked, unanswered, first: a client waiting for its
  // answer sends no other, and once arrivals have been quiet for a moment the shutdown begins
  // with (nearly) nothing on its way. The parked calls are answered once the GOAWAY has had
  // time to reach the clients, who then retry elsewhere. Workers keep many calls of each RPC
  // requested meanwhile (ListenDeeper), so that no call waits unmatched inside gRPC either.
  for (auto& worker : workers_) worker->Park();
  const auto parked_at = Clock::now();
  const auto park_until = std::min(parked_at + kMaxParking, deadline);
  while (Clock::now() < park_until) {
    const auto last = std::max(
        parked_at, Clock::time_point(std::chrono::nanoseconds(last_arrival_ns_.load())));
    if (Clock::now() - last >= kQuietArrivals) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::thread shutdown([&] {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + grace);
  });
  std::this_thread::sleep_for(kGoawayPropagation);
  // Open streams end now, once their answers are written, with UNAVAILABLE (the shutdown would
  // cancel them): not before, or their clients would open new ones while the GOAWAY travels.
  for (auto& worker : workers_) {
    worker->ReleaseParked();
    worker->EndStreams();
  }
  shutdown.join();
  for (auto& worker : workers_) worker->Quit();
  for (auto& thread : threads_) thread.join();
  threads_.clear();
  server_.reset();
  workers_.clear();
  if (metrics_endpoint_) metrics_endpoint_->Stop();
  Log(LogLevel::kInfo, "stopped");
}

}  // namespace batchgate
