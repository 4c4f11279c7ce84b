#include "handover.h"

#include <sched.h>

#include <cmath>
#include <limits>

#include "protos/handover.pb.h"
#include "rules.h"

namespace batchgate {
namespace {

constexpr uint64_t kMaxInt = std::numeric_limits<int32_t>::max();

// Remembers the first problem; its message names the field.
class Problems {
 public:
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

  void Fail(const std::string& field, const std::string& problem) {
    if (error_.empty()) error_ = "handover field '" + field + "' " + problem;
  }

  uint64_t InRange(const std::string& field, uint64_t value, uint64_t minimum, uint64_t maximum) {
    if (value < minimum || value > maximum) {
      Fail(field, "must be in " + std::to_string(minimum) + ".." + std::to_string(maximum) +
                      ", got " + std::to_string(value));
    }
    return value;
  }

 private:
  std::string error_;
};

std::optional<std::string> Optional(bool has, const std::string& value) {
  return has ? std::optional<std::string>(value) : std::nullopt;
}

}  // namespace

bool ParseHandover(const std::string& bytes, Handover* out, std::string* error) {
  handover::FrontendHandover in;
  if (!in.ParseFromString(bytes)) {
    *error = "the handover on stdin is not a serialized batchgate.handover.FrontendHandover";
    return false;
  }
  Problems p;
  out->slot = static_cast<int>(p.InRange("slot", in.slot(), 0, kMaxInt));
  out->arena_fd = in.arena_fd();
  if (in.arena_fd() < 0) p.Fail("arena_fd", "must be >= 0");
  out->arena_bytes = p.InRange("arena_bytes", in.arena_bytes(), 1,
                               std::numeric_limits<uint64_t>::max());
  out->input_region_offset = in.input_region_offset();
  out->input_region_bytes = p.InRange("input_region_bytes", in.input_region_bytes(), 1,
                                      std::numeric_limits<uint64_t>::max());
  out->executor_socket = in.executor_socket();
  out->metrics_socket = in.metrics_socket();
  out->grpc_port = static_cast<int>(p.InRange("grpc_port", in.grpc_port(), 0, 65535));
  out->version = in.version();
  out->extensions.assign(in.extensions().begin(), in.extensions().end());
  double previous = -std::numeric_limits<double>::infinity();
  for (const double bound : in.seconds_buckets()) {
    if (!(bound > previous)) {
      p.Fail("seconds_buckets", "must be increasing");
      break;
    }
    previous = bound;
    out->seconds_buckets.push_back(bound);
  }
  for (int i = 0; i < rules::kWireRules; ++i) {
    const auto found = in.wire_limits().find(rules::kWireRuleKeys[i]);
    if (found == in.wire_limits().end()) {
      p.Fail(std::string("wire_limits.") + rules::kWireRuleKeys[i], "is missing");
      break;
    }
    out->wire_limits.most[i] = found->second;
    out->wire_limits.refusal[i] = rules::LimitRefusal(
        rules::kWireRuleRefused[i], rules::kWireRuleFlags[i], std::to_string(found->second));
  }
  for (const auto& argument : in.grpc_arguments()) {
    out->grpc_arguments.emplace_back(argument.name(), argument.value());
  }
  out->unknown_model_label = in.unknown_model_label();
  out->max_stream_backlog_messages = static_cast<int64_t>(
      p.InRange("max_stream_backlog_messages", in.max_stream_backlog_messages(), 1, kMaxInt));
  if (!in.has_settings()) p.Fail("settings", "is missing");

  const handover::FrontendSettings& s = in.settings();
  out->host = s.host();
  constexpr uint64_t kMaxSize = uint64_t{1} << 62;
  out->max_message_bytes =
      static_cast<int64_t>(p.InRange("settings.max_message_bytes", s.max_message_bytes(), 1, kMaxInt));
  out->max_request_bytes =
      static_cast<int64_t>(p.InRange("settings.max_request_bytes", s.max_request_bytes(), 1, kMaxSize));
  out->max_tensor_elements = static_cast<int64_t>(
      p.InRange("settings.max_tensor_elements", s.max_tensor_elements(), 1, kMaxSize));
  out->grpc_memory_bytes =
      static_cast<int64_t>(p.InRange("settings.grpc_memory_bytes", s.grpc_memory_bytes(), 1, kMaxSize));
  out->grpc_max_threads =
      static_cast<int>(p.InRange("settings.grpc_max_threads", s.grpc_max_threads(), 2, kMaxInt));
  out->max_stream_backlog_bytes = static_cast<int64_t>(
      p.InRange("settings.max_stream_backlog_bytes", s.max_stream_backlog_bytes(), 1, kMaxSize));
  if (!(s.drain_timeout_s() >= 0)) p.Fail("settings.drain_timeout_s", "must be >= 0");
  out->drain_timeout_s = s.drain_timeout_s();
  out->reflection = s.reflection();
  out->tls_cert = Optional(s.has_tls_cert(), s.tls_cert());
  out->tls_key = Optional(s.has_tls_key(), s.tls_key());
  out->tls_client_ca = Optional(s.has_tls_client_ca(), s.tls_client_ca());
  out->admin_token = Optional(s.has_admin_token(), s.admin_token());
  out->infer_token = Optional(s.has_infer_token(), s.infer_token());
  out->frontend_threads =
      static_cast<int>(p.InRange("settings.frontend_threads", s.frontend_threads(), 0, 4096));
  out->shared_memory = s.shared_memory();
  if (s.request_scheduling() != "batch" && s.request_scheduling() != "normal") {
    p.Fail("settings.request_scheduling", "must be batch or normal");
  }
  out->batch_scheduling = s.request_scheduling() == "batch";
  for (const int32_t cpu : s.model_cpus()) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      p.Fail("settings.model_cpus", "must hold CPUs in 0.." + std::to_string(CPU_SETSIZE - 1));
      break;
    }
    out->model_cpus.push_back(cpu);
  }
  if (!ParseLogLevel(s.log_level(), &out->log_level)) {
    p.Fail("settings.log_level", "must be debug, info, warning, error or critical");
  }
  if (out->tls_cert.has_value() != out->tls_key.has_value()) {
    p.Fail(out->tls_cert ? "settings.tls_key" : "settings.tls_cert",
           "must be set with the other of tls_cert/tls_key");
  }
  if (out->tls_client_ca && !out->tls_cert) p.Fail("settings.tls_client_ca", rules::kTlsClientCaNeeds);
  if (!p.ok()) {
    *error = p.error();
    return false;
  }
  return true;
}

}  // namespace batchgate
