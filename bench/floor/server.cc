// batchgate-floor: the serving benchmark's yardstick, not a server to deploy.
//
// What a gateway with no Python anywhere would reach on this machine: the KServe v2 gRPC
// service on the native front end's threading (gRPC's async API, one completion queue and one
// thread per worker, answers handed back through a doorbell alarm), and one C++ thread running a
// TorchScript model through libtorch, in work-conserving batches of whatever waits (up to the
// model's max batch size). No executor process, no shared memory, no checks beyond the shapes.
// Models of one FP32 input [-1, in] and one FP32 output [-1, out] only.
//
//   batchgate-floor MODEL.pt NAME INPUT OUTPUT IN_WIDTH OUT_WIDTH MAX_BATCH WORKERS INTRA_OP
//
// INTRA_OP: the model thread's intra-op threads (0: libtorch's default).
// It listens on 127.0.0.1 on a port of the kernel's choosing and prints
// {"event": "listening", "port": N} on stdout; each line read on stdin is answered on stdout
// with one JSON line of counters (requests answered, batches, samples, the model thread's CPU
// seconds inside forward()); SIGTERM or the end of stdin shuts it down, and it exits 0.

#include <ATen/Parallel.h>
#include <absl/synchronization/mutex.h>
#include <grpc/support/time.h>
#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <torch/script.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "protos/inference.grpc.pb.h"

namespace {

using inference::GRPCInferenceService;
using Service = GRPCInferenceService::AsyncService;

struct Model {
  std::string name, input, output;
  int64_t in_width = 0, out_width = 0;
  size_t max_batch = 0;
  int intra_op = 1;
};

class Call {
 public:
  virtual ~Call() = default;
  virtual void Proceed(bool ok) = 0;
};

// One thread and one completion queue; answers reach it through its mailbox and an alarm set
// in the past (gRPC rounds an alarm set for "now" up to the next millisecond).
struct Worker {
  Service* service = nullptr;
  size_t index = 0;  // in the server's list of workers
  std::unique_ptr<grpc::ServerCompletionQueue> cq;
  std::thread thread;
  std::mutex mutex;
  std::vector<Call*> mailbox;
  bool rung = false;
  grpc::Alarm doorbell;
  int doorbell_tag = 0;

  void Post(const std::vector<Call*>& calls) {
    bool ring;
    {
      std::lock_guard<std::mutex> lock(mutex);
      mailbox.insert(mailbox.end(), calls.begin(), calls.end());
      ring = !rung;
      rung = true;
    }
    if (ring) doorbell.Set(cq.get(), gpr_inf_past(GPR_CLOCK_MONOTONIC), &doorbell_tag);
  }
};

class InferCall;

// Set once SIGTERM (or the end of stdin) asks the server to stop: no call is requested after.
std::atomic<bool> stopping{false};

// The model's thread: takes every request waiting (up to max_batch), runs them as one batch.
class Batcher {
 public:
  explicit Batcher(const Model& model, torch::jit::Module module)
      : model_(model), module_(std::move(module)) {}

  void Submit(InferCall* call) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake = queue_.empty();
      queue_.push_back(call);
    }
    if (wake) ready_.notify_one();
  }
  void Run(const std::vector<std::unique_ptr<Worker>>& workers);
  std::string Counters() const;

 private:
  const Model& model_;
  torch::jit::Module module_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<InferCall*> queue_;
  std::atomic<uint64_t> batches_{0}, samples_{0};
  std::atomic<int64_t> forward_ns_{0};
};

class InferCall final : public Call {
 public:
  InferCall(Worker* worker, Batcher* batcher, const Model* model)
      : worker_(worker), batcher_(batcher), model_(model), responder_(&context_) {
    worker_->service->RequestModelInfer(&context_, &request_, &responder_, worker_->cq.get(),
                                        worker_->cq.get(), this);
  }
  void Proceed(bool ok) override {
    switch (state_) {
      case State::kWaiting:
        if (!ok) {  // the server is shutting down
          delete this;
          return;
        }
        if (!stopping) new InferCall(worker_, batcher_, model_);
        if (request_.inputs_size() != 1 || request_.raw_input_contents_size() != 1 ||
            request_.raw_input_contents(0).size() !=
                static_cast<size_t>(model_->in_width) * sizeof(float)) {
          state_ = State::kFinishing;
          responder_.Finish(response_,
                            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                         "one FP32 input of one row, as raw_input_contents"),
                            this);
          return;
        }
        state_ = State::kComputing;
        batcher_->Submit(this);
        return;
      case State::kComputing:  // answered by the batcher, through the worker's mailbox
        state_ = State::kFinishing;
        responder_.Finish(response_, grpc::Status::OK, this);
        return;
      case State::kFinishing:
        delete this;
        return;
    }
  }
  const std::string& input() const { return request_.raw_input_contents(0); }
  void Answer(const float* row) {
    response_.set_model_name(model_->name);
    response_.set_id(request_.id());
    auto* output = response_.add_outputs();
    output->set_name(model_->output);
    output->set_datatype("FP32");
    output->add_shape(1);
    output->add_shape(model_->out_width);
    response_.add_raw_output_contents(reinterpret_cast<const char*>(row),
                                      static_cast<size_t>(model_->out_width) * sizeof(float));
  }
  Worker* worker() const { return worker_; }

 private:
  enum class State { kWaiting, kComputing, kFinishing };
  Worker* worker_;
  Batcher* batcher_;
  const Model* model_;
  grpc::ServerContext context_;
  inference::ModelInferRequest request_;
  inference::ModelInferResponse response_;
  grpc::ServerAsyncResponseWriter<inference::ModelInferResponse> responder_;
  State state_ = State::kWaiting;
};

int64_t ThreadCpuNs() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

void Batcher::Run(const std::vector<std::unique_ptr<Worker>>& workers) {
  // Per thread, as the server's model threads set it; 0 leaves libtorch's default.
  if (model_.intra_op > 0) at::set_num_threads(model_.intra_op);
  c10::InferenceMode inference_mode;
  std::vector<InferCall*> batch;
  std::vector<std::vector<Call*>> answers(workers.size());
  for (;;) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return !queue_.empty(); });
      while (!queue_.empty() && batch.size() < model_.max_batch) {
        batch.push_back(queue_.front());
        queue_.pop_front();
      }
    }
    const auto rows = static_cast<int64_t>(batch.size());
    torch::Tensor input = torch::empty({rows, model_.in_width});
    auto* in = input.data_ptr<float>();
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(in + i * model_.in_width, batch[i]->input().data(),
                  static_cast<size_t>(model_.in_width) * sizeof(float));
    }
    const int64_t started = ThreadCpuNs();
    torch::Tensor output = module_.forward({input}).toTensor().contiguous();
    forward_ns_ += ThreadCpuNs() - started;
    batches_ += 1;
    samples_ += static_cast<uint64_t>(rows);
    const auto* out = output.data_ptr<float>();
    for (int64_t i = 0; i < rows; ++i) {
      batch[i]->Answer(out + i * model_.out_width);
      answers[batch[i]->worker()->index].push_back(batch[i]);
    }
    for (size_t w = 0; w < workers.size(); ++w) {
      if (answers[w].empty()) continue;
      workers[w]->Post(answers[w]);
      answers[w].clear();
    }
  }
}

std::string Batcher::Counters() const {
  char line[256];
  std::snprintf(line, sizeof line,
                "{\"batches\": %llu, \"samples\": %llu, \"model_cpu_s\": %.9f}",
                static_cast<unsigned long long>(batches_.load()),
                static_cast<unsigned long long>(samples_.load()), forward_ns_.load() / 1e9);
  return line;
}

// The other RPCs perf_analyzer and batchgate bench ask: answered on the worker's thread.
template <class Request, class Response, class Ask, class Fill>
class UnaryCall final : public Call {
 public:
  UnaryCall(Worker* worker, Ask ask, Fill fill)
      : worker_(worker), ask_(ask), fill_(fill), responder_(&context_) {
    ask_(worker_, &context_, &request_, &responder_, this);
  }
  void Proceed(bool ok) override {
    if (finishing_ || !ok) {  // answered, or the server is shutting down
      delete this;
      return;
    }
    if (!stopping) new UnaryCall(worker_, ask_, fill_);
    finishing_ = true;
    grpc::Status status = fill_(request_, &response_);
    responder_.Finish(response_, status, this);
  }

 private:
  Worker* worker_;
  Ask ask_;
  Fill fill_;
  grpc::ServerContext context_;
  Request request_;
  Response response_;
  grpc::ServerAsyncResponseWriter<Response> responder_;
  bool finishing_ = false;
};

template <class Request, class Response, class Ask, class Fill>
void Serve(Worker* worker, Ask ask, Fill fill) {
  new UnaryCall<Request, Response, Ask, Fill>(worker, ask, fill);
}

#define ASK(METHOD)                                                                  \
  [](Worker* w, grpc::ServerContext* c, auto* request, auto* responder, void* tag) { \
    w->service->Request##METHOD(c, request, responder, w->cq.get(), w->cq.get(), tag); \
  }

void ServeControl(Worker* worker, const Model* model) {
  using namespace inference;
  const auto known = [model](const std::string& name) {
    return name == model->name ? grpc::Status::OK
                               : grpc::Status(grpc::StatusCode::NOT_FOUND,
                                              "no model '" + name + "' here");
  };
  Serve<ServerLiveRequest, ServerLiveResponse>(worker, ASK(ServerLive), [](auto&, auto* r) {
    r->set_live(true);
    return grpc::Status::OK;
  });
  Serve<ServerReadyRequest, ServerReadyResponse>(worker, ASK(ServerReady), [](auto&, auto* r) {
    r->set_ready(true);
    return grpc::Status::OK;
  });
  Serve<ServerMetadataRequest, ServerMetadataResponse>(
      worker, ASK(ServerMetadata), [](auto&, auto* r) {
        r->set_name("batchgate-floor");
        r->set_version("0");
        return grpc::Status::OK;
      });
  Serve<ModelReadyRequest, ModelReadyResponse>(worker, ASK(ModelReady),
                                               [known](auto& q, auto* r) {
                                                 r->set_ready(known(q.name()).ok());
                                                 return grpc::Status::OK;
                                               });
  Serve<ModelMetadataRequest, ModelMetadataResponse>(
      worker, ASK(ModelMetadata), [model, known](auto& q, auto* r) {
        if (!known(q.name()).ok()) return known(q.name());
        r->set_name(model->name);
        r->add_versions("1");
        r->set_platform("pytorch_libtorch");
        auto* in = r->add_inputs();
        in->set_name(model->input);
        in->set_datatype("FP32");
        in->add_shape(-1);
        in->add_shape(model->in_width);
        auto* out = r->add_outputs();
        out->set_name(model->output);
        out->set_datatype("FP32");
        out->add_shape(-1);
        out->add_shape(model->out_width);
        return grpc::Status::OK;
      });
  Serve<ModelConfigRequest, ModelConfigResponse>(
      worker, ASK(ModelConfig), [model, known](auto& q, auto* r) {
        if (!known(q.name()).ok()) return known(q.name());
        auto* config = r->mutable_config();
        config->set_name(model->name);
        config->set_platform("pytorch_libtorch");
        config->set_max_batch_size(static_cast<int32_t>(model->max_batch));
        auto* in = config->add_input();
        in->set_name(model->input);
        in->set_data_type(inference::TYPE_FP32);
        in->add_dims(model->in_width);
        auto* out = config->add_output();
        out->set_name(model->output);
        out->set_data_type(inference::TYPE_FP32);
        out->add_dims(model->out_width);
        config->mutable_dynamic_batching();
        return grpc::Status::OK;
      });
  Serve<ModelStatisticsRequest, ModelStatisticsResponse>(
      worker, ASK(ModelStatistics), [model](auto&, auto* r) {
        auto* stats = r->add_model_stats();
        stats->set_name(model->name);
        stats->set_version("1");
        return grpc::Status::OK;
      });
}

void Work(Worker* worker, Batcher* batcher, const Model* model) {
  for (int i = 0; i < 16; ++i) new InferCall(worker, batcher, model);
  ServeControl(worker, model);
  void* tag = nullptr;
  bool ok = false;
  while (worker->cq->Next(&tag, &ok)) {
    if (tag == &worker->doorbell_tag) {
      std::vector<Call*> answered;
      {
        std::lock_guard<std::mutex> lock(worker->mutex);
        answered.swap(worker->mailbox);
        worker->rung = false;
      }
      for (Call* call : answered) call->Proceed(true);
      continue;
    }
    static_cast<Call*>(tag)->Proceed(ok);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr,
                 "usage: %s MODEL.pt NAME INPUT OUTPUT IN_WIDTH OUT_WIDTH MAX_BATCH WORKERS "
                 "INTRA_OP\n",
                 argv[0]);
    return 2;
  }
  Model model;
  model.name = argv[2];
  model.input = argv[3];
  model.output = argv[4];
  model.in_width = std::stoll(argv[5]);
  model.out_width = std::stoll(argv[6]);
  model.max_batch = std::stoul(argv[7]);
  const int workers_wanted = std::stoi(argv[8]);
  model.intra_op = std::stoi(argv[9]);
  // Debian's Abseil checks lock order on every lock gRPC takes, as batchgate-frontend turns off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // SIGTERM is taken by one thread (sigwait); every thread started after this inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  torch::jit::Module module;
  try {
    module = torch::jit::load(argv[1]);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "batchgate-floor: cannot load %s: %s\n", argv[1], error.what());
    return 1;
  }
  module.eval();
  Batcher batcher(model, std::move(module));

  Service service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < workers_wanted; ++i) {
    workers.push_back(std::make_unique<Worker>());
    workers.back()->service = &service;
    workers.back()->index = workers.size() - 1;
    workers.back()->cq = builder.AddCompletionQueue();
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "batchgate-floor: could not listen on 127.0.0.1\n");
    return 1;
  }
  std::thread model_thread([&] { batcher.Run(workers); });
  model_thread.detach();
  for (auto& worker : workers) {
    Worker* w = worker.get();
    w->thread = std::thread([w, &batcher, &model] { Work(w, &batcher, &model); });
    w->thread.detach();
  }

  std::mutex stop_mutex;
  std::condition_variable stop_cv;
  bool stop = false;
  const auto request_stop = [&] {
    std::lock_guard<std::mutex> lock(stop_mutex);
    stop = true;
    stop_cv.notify_all();
  };
  std::thread signals([&] {
    int signal = 0;
    sigwait(&stop_signals, &signal);
    request_stop();
  });
  signals.detach();  // may still wait when stdin ends: the process exits around it
  std::thread commands([&] {
    std::string line;
    while (std::getline(std::cin, line)) {
      std::cout << batcher.Counters() << std::endl;
    }
    request_stop();
  });
  commands.detach();
  std::cout << "{\"event\": \"listening\", \"port\": " << port << "}" << std::endl;

  {
    std::unique_lock<std::mutex> lock(stop_mutex);
    stop_cv.wait(lock, [&] { return stop; });
  }
  stopping = true;
  // Calls in flight get a second to finish; the threads and the calls still parked in the
  // batcher are the process's to reclaim at exit, which is all a yardstick needs.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  std::fflush(stdout);
  std::_Exit(0);
}
