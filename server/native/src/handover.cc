#include "handover.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <sched.h>

#include <cmath>
#include <limits>

namespace batchgate {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// Reads keys of one JSON object, remembering the first problem (its message names the key).
class Fields {
 public:
  Fields(const Struct& object, std::string prefix) : object_(object), prefix_(std::move(prefix)) {}

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

  const Value* Get(const std::string& key, Value::KindCase kind, const char* what) {
    const auto it = object_.fields().find(key);
    if (it == object_.fields().end()) return Fail(key, "is missing");
    if (it->second.kind_case() != kind) return Fail(key, std::string("must be ") + what);
    return &it->second;
  }

  std::string String(const std::string& key) {
    const Value* v = Get(key, Value::kStringValue, "a string");
    return v ? v->string_value() : std::string();
  }

  // A list of integers in minimum..maximum, or null: empty.
  std::vector<int> OptionalIntegers(const std::string& key, int64_t minimum, int64_t maximum) {
    std::vector<int> values;
    const auto it = object_.fields().find(key);
    if (it == object_.fields().end()) {
      Fail(key, "is missing");
      return values;
    }
    if (it->second.kind_case() == Value::kNullValue) return values;
    if (it->second.kind_case() != Value::kListValue) {
      Fail(key, "must be a list of integers or null");
      return values;
    }
    for (const Value& item : it->second.list_value().values()) {
      if (item.kind_case() != Value::kNumberValue) {
        Fail(key, "must be a list of integers or null");
        return {};
      }
      values.push_back(static_cast<int>(CheckInteger(key, item.number_value(), minimum, maximum)));
    }
    return values;
  }

  // A string, or null: absent.
  std::optional<std::string> OptionalString(const std::string& key) {
    const auto it = object_.fields().find(key);
    if (it == object_.fields().end()) {
      Fail(key, "is missing");
      return std::nullopt;
    }
    if (it->second.kind_case() == Value::kNullValue) return std::nullopt;
    if (it->second.kind_case() != Value::kStringValue) {
      Fail(key, "must be a string or null");
      return std::nullopt;
    }
    return it->second.string_value();
  }

  bool Bool(const std::string& key) {
    const Value* v = Get(key, Value::kBoolValue, "true or false");
    return v && v->bool_value();
  }

  double Number(const std::string& key, double minimum) {
    const Value* v = Get(key, Value::kNumberValue, "a number");
    if (!v) return 0;
    if (!(v->number_value() >= minimum)) {
      Fail(key, "must be >= " + std::to_string(minimum));
      return 0;
    }
    return v->number_value();
  }

  // JSON numbers arrive as doubles: exact up to 2**53, which every size here is far below.
  int64_t Integer(const std::string& key, int64_t minimum, int64_t maximum) {
    const Value* v = Get(key, Value::kNumberValue, "an integer");
    return v ? CheckInteger(key, v->number_value(), minimum, maximum) : 0;
  }

  int64_t CheckInteger(const std::string& key, double value, int64_t minimum, int64_t maximum) {
    if (std::floor(value) != value || value < static_cast<double>(minimum) ||
        value > static_cast<double>(maximum)) {
      Fail(key, "must be an integer in " + std::to_string(minimum) + ".." +
                    std::to_string(maximum));
      return 0;
    }
    return static_cast<int64_t>(value);
  }

  const google::protobuf::ListValue* List(const std::string& key) {
    const Value* v = Get(key, Value::kListValue, "a list");
    return v ? &v->list_value() : nullptr;
  }

  const Struct* Object(const std::string& key) {
    const Value* v = Get(key, Value::kStructValue, "an object");
    return v ? &v->struct_value() : nullptr;
  }

  // The first problem `inner` (a nested object's reader) found, as this one's.
  void Adopt(const Fields& inner) {
    if (error_.empty()) error_ = inner.error();
  }

  std::nullptr_t Fail(const std::string& key, const std::string& problem) {
    if (error_.empty()) error_ = "handover key '" + prefix_ + key + "' " + problem;
    return nullptr;
  }

 private:
  const Struct& object_;
  std::string prefix_;
  std::string error_;
};

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxSize = int64_t{1} << 53;

}  // namespace

bool ParseHandover(const std::string& json, Handover* out, std::string* error) {
  Struct root;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &root);
  if (!status.ok()) {
    *error = "the handover on stdin is not a JSON object: " + status.ToString();
    return false;
  }
  Fields top(root, "");
  out->slot = static_cast<int>(top.Integer("slot", 0, kMaxInt));
  out->arena_fd = static_cast<int>(top.Integer("arena_fd", 0, kMaxInt));
  out->arena_bytes = static_cast<uint64_t>(top.Integer("arena_bytes", 1, kMaxSize));
  if (const auto* region = top.List("input_region")) {
    if (region->values_size() != 2 || region->values(0).kind_case() != Value::kNumberValue ||
        region->values(1).kind_case() != Value::kNumberValue) {
      top.Fail("input_region", "must be [offset, size]");
    } else {
      out->input_region_offset = static_cast<uint64_t>(
          top.CheckInteger("input_region", region->values(0).number_value(), 0, kMaxSize));
      out->input_region_bytes = static_cast<uint64_t>(
          top.CheckInteger("input_region", region->values(1).number_value(), 1, kMaxSize));
    }
  }
  out->executor_socket = top.String("executor_socket");
  out->metrics_socket = top.String("metrics_socket");
  out->grpc_port = static_cast<int>(top.Integer("grpc_port", 0, 65535));
  out->version = top.String("version");
  if (const auto* list = top.List("extensions")) {
    for (const Value& v : list->values()) {
      if (v.kind_case() != Value::kStringValue) {
        top.Fail("extensions", "must be a list of strings");
        break;
      }
      out->extensions.push_back(v.string_value());
    }
  }
  if (const auto* list = top.List("seconds_buckets")) {
    double previous = -std::numeric_limits<double>::infinity();
    for (const Value& v : list->values()) {
      if (v.kind_case() != Value::kNumberValue || !(v.number_value() > previous)) {
        top.Fail("seconds_buckets", "must be a list of increasing numbers");
        break;
      }
      previous = v.number_value();
      out->seconds_buckets.push_back(previous);
    }
  }
  if (const Struct* rules = top.Object("wire_limits")) {
    Fields r(*rules, "wire_limits.");
    for (int i = 0; i < kWireRules; ++i) {
      const auto* rule = r.List(kWireRuleKeys[i]);
      if (rule == nullptr) break;
      if (rule->values_size() != 2 || rule->values(0).kind_case() != Value::kNumberValue ||
          rule->values(1).kind_case() != Value::kStringValue) {
        r.Fail(kWireRuleKeys[i], "must be [bound, refusal]");
        break;
      }
      out->wire_limits.most[i] = static_cast<uint64_t>(
          r.CheckInteger(kWireRuleKeys[i], rule->values(0).number_value(), 0, kMaxSize));
      out->wire_limits.refusal[i] = rule->values(1).string_value();
    }
    top.Adopt(r);
  }
  if (const auto* list = top.List("grpc_arguments")) {
    for (const Value& v : list->values()) {
      const auto& pair = v.list_value();
      if (v.kind_case() != Value::kListValue || pair.values_size() != 2 ||
          pair.values(0).kind_case() != Value::kStringValue ||
          pair.values(1).kind_case() != Value::kNumberValue) {
        top.Fail("grpc_arguments", "must be a list of [name, integer]");
        break;
      }
      out->grpc_arguments.emplace_back(
          pair.values(0).string_value(),
          static_cast<int>(top.CheckInteger("grpc_arguments", pair.values(1).number_value(),
                                            std::numeric_limits<int32_t>::min(), kMaxInt)));
    }
  }
  out->unknown_model_label = top.String("unknown_model_label");
  out->max_stream_backlog_messages = top.Integer("max_stream_backlog_messages", 1, kMaxInt);
  const Struct* settings = top.Object("settings");
  if (!top.ok()) {
    *error = top.error();
    return false;
  }
  Fields s(*settings, "settings.");
  out->host = s.String("host");
  out->max_message_bytes = s.Integer("max_message_bytes", 1, kMaxInt);
  out->max_request_bytes = s.Integer("max_request_bytes", 1, kMaxSize);
  out->max_tensor_elements = s.Integer("max_tensor_elements", 1, kMaxSize);
  out->grpc_memory_bytes = s.Integer("grpc_memory_bytes", 1, kMaxSize);
  out->grpc_max_threads = static_cast<int>(s.Integer("grpc_max_threads", 2, kMaxInt));
  out->max_stream_backlog_bytes = s.Integer("max_stream_backlog_bytes", 1, kMaxSize);
  out->drain_timeout_s = s.Number("drain_timeout_s", 0);
  out->reflection = s.Bool("reflection");
  out->tls_cert = s.OptionalString("tls_cert");
  out->tls_key = s.OptionalString("tls_key");
  out->tls_client_ca = s.OptionalString("tls_client_ca");
  out->admin_token = s.OptionalString("admin_token");
  out->infer_token = s.OptionalString("infer_token");
  out->frontend_threads = static_cast<int>(s.Integer("frontend_threads", 0, 4096));
  out->shared_memory = s.Bool("shared_memory");
  const std::string scheduling = s.String("request_scheduling");
  if (s.ok() && scheduling != "batch" && scheduling != "normal") {
    s.Fail("request_scheduling", "must be batch or normal");
  }
  out->batch_scheduling = scheduling == "batch";
  out->model_cpus = s.OptionalIntegers("model_cpus", 0, CPU_SETSIZE - 1);
  const std::string level = s.String("log_level");
  if (s.ok() && !ParseLogLevel(level, &out->log_level)) {
    s.Fail("log_level", "must be debug, info, warning, error or critical");
  }
  if (s.ok() && out->tls_cert.has_value() != out->tls_key.has_value()) {
    s.Fail(out->tls_cert ? "tls_key" : "tls_cert", "must be set with the other of tls_cert/tls_key");
  }
  if (s.ok() && out->tls_client_ca && !out->tls_cert) {
    s.Fail("tls_client_ca", "needs tls_cert and tls_key");
  }
  if (!s.ok()) {
    *error = s.error();
    return false;
  }
  return true;
}

}  // namespace batchgate
