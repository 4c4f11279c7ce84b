// This front end's metrics, and the socket the supervisor scrapes them from.
//
// The Python front ends' families, names and HELP texts (server/metrics.py, batcher/metrics.py):
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
  // model "_unknown" (service.py MAX_LABELLED_COUNTERS).
  static constexpr size_t kMaxLabelledCounters = 4096;

  RequestMetrics(std::vector<double> seconds_buckets, std::string region,
                 std::function<uint64_t()> bytes_in_use);

  // One answered inference request; `seconds` is its end-to-end time, observed for OK only
  // (service.py _count()). `model` is the name as the client sent it.
  void Count(const std::string& model, grpc::StatusCode code, double seconds);

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

  const std::vector<double> bounds_;
  const std::string region_;
  const std::function<uint64_t()> bytes_in_use_;
  mutable std::mutex mu_;
  // Series in the order they were first counted (prometheus_client writes them so).
  std::vector<std::pair<CounterKey, uint64_t>> counters_;
  std::unordered_map<CounterKey, size_t, CounterKeyHash> counter_index_;
  std::vector<std::pair<std::string, Histogram>> histograms_;
  std::unordered_map<std::string, size_t> histogram_index_;
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
