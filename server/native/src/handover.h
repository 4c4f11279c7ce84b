// What the supervisor tells a front end on its stdin: one JSON object (server/supervisor.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "log.h"
#include "wire_scan.h"

namespace batchgate {

struct Handover {
  int slot = 0;
  int arena_fd = -1;
  uint64_t arena_bytes = 0;
  uint64_t input_region_offset = 0;
  uint64_t input_region_bytes = 0;
  std::string executor_socket;  // abstract-namespace name, without the leading NUL
  std::string metrics_socket;
  int grpc_port = 0;
  std::string version;
  std::vector<std::string> extensions;
  std::vector<double> seconds_buckets;
  // What a request's wire bytes may hold: each rule's bound and refusal, as
  // server/request_limits.py declares them.
  WireLimits wire_limits;

  // settings
  std::string host;
  int64_t max_message_bytes = 0;
  int64_t max_request_bytes = 0;
  int64_t max_tensor_elements = 0;
  double drain_timeout_s = 0;
  bool reflection = true;
  std::optional<std::string> tls_cert, tls_key, tls_client_ca;
  std::optional<std::string> admin_token, infer_token;
  int frontend_threads = 0;  // 0: the CPUs this process may run on
  bool shared_memory = false;  // requests may name shared-memory regions
  bool batch_scheduling = true;  // the process's threads under SCHED_BATCH (request_scheduling)
  std::vector<int> model_cpus;  // the executor's model threads' CPUs: this process runs on the others
  LogLevel log_level = LogLevel::kInfo;
};

// The handover in `json`, or false with `error` naming the key that is missing, of the wrong
// type or out of range (keys of `settings` as "settings.<key>").
bool ParseHandover(const std::string& json, Handover* out, std::string* error);

}  // namespace batchgate
