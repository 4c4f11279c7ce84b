// This front end's metrics, and the socket the supervisor scrapes them from.
//
// The Python processes' families, names and HELP texts (server/metrics.py, batcher/metrics.py):
// the supervisor parses this process's text with prometheus_client's parser and merges it into
// the server's one /metrics, so the series must read exactly as Python's would.
#pragma once

#include <grpcpp/support/status_code_enum.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace batchgate {

// "OK", "INVALID_ARGUMENT", ...: grpc.StatusCode's names.
const char* StatusCodeName(grpc::StatusCode code);

class RequestMetrics {
 public:
  // (model, status) pairs with their own batchgate_requests_total series; the rest count under
  // the unknown-model label (service.py MAX_LABELLED_COUNTERS).
  static constexpr size_t kMaxLabelledCounters = 4096;

  // `unknown_label`: the model label of requests for models the executor does not know
  // (server/metrics.py UNKNOWN_MODEL_LABEL).
  RequestMetrics(std::vector<double> seconds_buckets, std::string region,
                 std::function<uint64_t()> bytes_in_use, std::string unknown_label);

  // One answered inference request; `seconds` is its end-to-end time, observed for OK only
  // (service.py _count()). `model` is the name as the client sent it, a label only when
  // `known` (a model the executor knows): client-sent names never become series.
  void Count(const std::string& model, bool known, grpc::StatusCode code, double seconds);

  // Reply bytes held for ModelStreamInfer clients: added as a reply is queued, taken away as
  // it is written (or dropped with its stream).
  void AddStreamBacklog(int64_t bytes) {
    stream_backlog_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  // A stream stopped reading: its backlog passed --max-stream-backlog-bytes.
  void CountStreamPause() { stream_pauses_.fetch_add(1, std::memory_order_relaxed); }

  // The text exposition (format 0.0.4) of every series.
  std::string Exposition() const;

 private:
  struct Histogram {
    std::vector<uint64_t> buckets;  // per bucket, not cumulative; the last one is +Inf
    uint64_t count = 0;
    double sum = 0;
  };
  struct CounterKey {
    std::string model;
    int code;
    bool operator==(const CounterKey& o) const { return code == o.code && model == o.model; }
  };
  struct CounterKeyHash {
    size_t operator()(const CounterKey& k) const {
      return std::hash<std::string>()(k.model) * 31 + static_cast<size_t>(k.code);
    }
  };
  using Counters = std::unordered_map<CounterKey, uint64_t, CounterKeyHash>;
  using Histograms = std::unordered_map<std::string, Histogram>;

  const std::vector<double> bounds_;
  const std::string region_;
  const std::function<uint64_t()> bytes_in_use_;
  const std::string unknown_label_;
  std::atomic<int64_t> stream_backlog_bytes_{0};
  std::atomic<uint64_t> stream_pauses_{0};
  mutable std::mutex mu_;
  // Each label once, in its map; the series in the order they were first counted
  // (prometheus_client writes them so), as pointers to the maps' entries (which never move).
  Counters counters_;
  std::vector<const Counters::value_type*> counter_order_;
  Histograms histograms_;
  std::vector<const Histograms::value_type*> histogram_order_;
};

// Serves RequestMetrics::Exposition() on an abstract Unix socket: each connection from a
// process of this user gets the text and is closed; any other is closed at once.
class MetricsEndpoint {
 public:
  explicit MetricsEndpoint(const RequestMetrics& metrics) : metrics_(metrics) {}
  ~MetricsEndpoint();

  // Listens on `name` and starts serving; false with `error` when it cannot listen.
  bool Start(const std::string& name, std::string* error);
  void Stop();

 private:
  void Serve();

  const RequestMetrics& metrics_;
  int listener_ = -1;
  int wake_ = -1;  // eventfd that Stop() signals
  std::thread thread_;
};

}  // namespace batchgate
