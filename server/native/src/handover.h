// What the supervisor tells the front end on its stdin: a FrontendHandover (protos/handover.proto,
// written by server/supervisor/supervisor.py frontend_handover()), as the request path reads it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
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
  // What a request's wire bytes may hold: each rule's bound (handed over) and refusal (its
  // words from rules.h, with the bound).
  WireLimits wire_limits;
  // gRPC server arguments, each added to the builder as it is (server/rules/connections.py).
  std::vector<std::pair<std::string, int>> grpc_arguments;
  // The label requests for models the executor does not know count under (server/metrics.py).
  std::string unknown_model_label;

  // settings
  std::string host;
  int64_t max_message_bytes = 0;
  int64_t max_request_bytes = 0;
  int64_t max_tensor_elements = 0;
  int64_t grpc_memory_bytes = 0;  // the ResourceQuota's memory
  int grpc_max_threads = 0;       // and its threads
  int64_t max_stream_backlog_bytes = 0;
  // Requests at the executor plus replies not yet written past which a stream stops reading
  // (server/rules/connections.py STREAM_BACKLOG_MESSAGES).
  int64_t max_stream_backlog_messages = 0;
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

// The handover serialized in `bytes`, or false with `error` naming the field that is missing or
// out of range (fields of `settings` as "settings.<field>").
bool ParseHandover(const std::string& bytes, Handover* out, std::string* error);

}  // namespace batchgate
