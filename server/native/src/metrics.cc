#include "metrics.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "log.h"
#include "rules.h"
#include "text.h"

namespace batchgate {
namespace {

constexpr const char* kStatusNames[] = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED"};

bool SameUser(int fd) {
  ucred peer{};
  socklen_t length = sizeof peer;
  return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) == 0 && peer.uid == getuid();
}

void WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::send(fd, text.data() + done, text.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace

const char* StatusCodeName(grpc::StatusCode code) {
  const auto index = static_cast<size_t>(code);
  return index < std::size(kStatusNames) ? kStatusNames[index] : "UNKNOWN";
}

RequestMetrics::RequestMetrics(std::vector<double> seconds_buckets, std::string region,
                               std::function<uint64_t()> bytes_in_use, std::string unknown_label)
    : bounds_(std::move(seconds_buckets)),
      region_(std::move(region)),
      bytes_in_use_(std::move(bytes_in_use)),
      unknown_label_(std::move(unknown_label)) {}

void RequestMetrics::Count(const std::string& model, bool known, grpc::StatusCode code,
                           double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  CounterKey key{known ? model : unknown_label_, static_cast<int>(code)};
  auto it = counters_.find(key);
  if (it == counters_.end()) {
    // Past the bound (models loaded and unloaded under ever new names), new pairs share the
    // unknown label too, so this process's memory stays bounded whatever is loaded.
    if (counters_.size() >= kMaxLabelledCounters) {
      key.model = unknown_label_;
      it = counters_.find(key);
    }
    if (it == counters_.end()) {
      it = counters_.emplace(std::move(key), 0).first;
      counter_order_.push_back(&*it);
    }
  }
  ++it->second;
  if (code != grpc::StatusCode::OK) return;
  const std::string& label = it->first.model;
  auto h = histograms_.find(label);
  if (h == histograms_.end()) {
    Histogram fresh;
    fresh.buckets.assign(bounds_.size() + 1, 0);
    h = histograms_.emplace(label, std::move(fresh)).first;
    histogram_order_.push_back(&*h);
  }
  Histogram& histogram = h->second;
  // An observation counts in the first bucket whose bound it does not exceed.
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), seconds) - bounds_.begin());
  ++histogram.buckets[bucket];
  ++histogram.count;
  histogram.sum += seconds;
}

std::string RequestMetrics::Exposition() const {
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  out += rules::kRequestsHeader;
  for (const auto* entry : counter_order_) {
    const auto& [key, count] = *entry;
    out += rules::kRequestsFamily;
    out += "{model=\"";
    AppendLabelValue(out, key.model);
    out += "\",status=\"";
    out += StatusCodeName(static_cast<grpc::StatusCode>(key.code));
    out += "\"} ";
    out += PrometheusFloat(static_cast<double>(count));
    out += '\n';
  }
  out += rules::kRequestSecondsHeader;
  const std::string family = rules::kRequestSecondsFamily;
  for (const auto* entry : histogram_order_) {
    const auto& [model, histogram] = *entry;
    std::string label;
    AppendLabelValue(label, model);
    uint64_t cumulative = 0;
    for (size_t i = 0; i <= bounds_.size(); ++i) {
      cumulative += histogram.buckets[i];
      // Labels sorted by name, as prometheus_client writes them: le before model.
      out += family + "_bucket{le=\"";
      out += i < bounds_.size() ? PrometheusFloat(bounds_[i]) : "+Inf";
      out += "\",model=\"" + label + "\"} ";
      out += PrometheusFloat(static_cast<double>(cumulative));
      out += '\n';
    }
    out += family + "_count{model=\"" + label + "\"} " +
           PrometheusFloat(static_cast<double>(histogram.count)) + "\n";
    out += family + "_sum{model=\"" + label + "\"} " +
           PrometheusFloat(histogram.sum) + "\n";
  }
  out += rules::kArenaBytesInUseHeader;
  out += rules::kArenaBytesInUseFamily;
  out += "{region=\"";
  AppendLabelValue(out, region_);
  out += "\"} " + PrometheusFloat(static_cast<double>(bytes_in_use_())) + "\n";
  out += rules::kStreamBacklogBytesHeader;
  out += rules::kStreamBacklogBytesFamily;
  out += " " +
         PrometheusFloat(static_cast<double>(stream_backlog_bytes_.load())) + "\n";
  out += rules::kStreamPausesHeader;
  out += rules::kStreamPausesFamily;
  out += " " +
         PrometheusFloat(static_cast<double>(stream_pauses_.load())) + "\n";
  return out;
}

MetricsEndpoint::~MetricsEndpoint() { Stop(); }

bool MetricsEndpoint::Start(const std::string& name, std::string* error) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof address.sun_path) {
    *error = "metrics_socket must be 1.." + std::to_string(sizeof address.sun_path - 1) +
             " bytes long";
    return false;
  }
  // Abstract namespace: a leading NUL, and no file anywhere.
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  listener_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener_ < 0 || bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
      listen(listener_, 16) != 0) {
    *error = "could not listen on the metrics socket '" + name + "': " + std::strerror(errno);
    return false;
  }
  wake_ = eventfd(0, EFD_CLOEXEC);
  if (wake_ < 0) {
    *error = std::string("eventfd: ") + std::strerror(errno);
    return false;
  }
  thread_ = std::thread([this] { Serve(); });
  return true;
}

void MetricsEndpoint::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_, &one, sizeof one);
    thread_.join();
  }
  if (listener_ >= 0) close(listener_);
  if (wake_ >= 0) close(wake_);
  listener_ = wake_ = -1;
}

void MetricsEndpoint::Serve() {
  pthread_setname_np(pthread_self(), "bg-metrics");
  while (true) {
    pollfd fds[2] = {{listener_, POLLIN, 0}, {wake_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      Log(LogLevel::kError, "metrics_socket_failed", {LogField("error", std::strerror(errno))});
      return;
    }
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    const int client = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    // An abstract socket has no file permissions: only a process of this user may read.
    if (SameUser(client)) WriteAll(client, metrics_.Exposition());
    close(client);
  }
}

}  // namespace batchgate
