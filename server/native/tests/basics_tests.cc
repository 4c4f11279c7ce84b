// Unit tests: text as Python writes it, the input region allocator, bearer tokens, the
// handover, the metrics exposition. Expected texts were produced by the Python code they mirror.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "auth.h"
#include "codec.h"
#include "executor_link.h"
#include "frame_reader.h"
#include "frontend.h"
#include "handover.h"
#include "protos/handover.pb.h"
#include "input_region.h"
#include "metrics.h"
#include "model_table.h"
#include "text.h"
#include "wire_columns.h"
#include "wire_scan.h"
#include "check.h"

namespace {

using batchgate::DataType;
using batchgate::ModelState;

void TestQuotingAndCutting() {
  using batchgate::Bounded;
  using batchgate::Quoted;
  CHECK_EQ(Quoted("a'b\\c\x01\x7f\xc3\xa9\n"), std::string("'a\\'b\\\\c\\x01\\x7f\xc3\xa9\\x0a'"));
  CHECK_EQ(Quoted(""), std::string("''"));
  CHECK_EQ(batchgate::QuotedList(std::vector<std::string>{"a", "b'"}), std::string("['a', 'b\\'']"));
  CHECK_EQ(batchgate::QuotedList(std::vector<std::string>{}), std::string("[]"));
  // bounded(): 600 x "é" (1200 bytes) -> 1024 bytes ending in " ... (message cut)".
  std::string e600;
  for (int i = 0; i < 600; ++i) e600 += "\xc3\xa9";
  const std::string cut = Bounded(e600);
  CHECK_EQ(cut.size(), size_t{1024});
  CHECK(cut.compare(cut.size() - 18, 18, " ... (message cut)") == 0);
  // A 4-byte character straddling the cut is dropped whole: Python's result is 1023 bytes.
  std::string bombs = "a";
  for (int i = 0; i < 300; ++i) bombs += "\xf0\x9f\x92\xa5";
  CHECK_EQ(Bounded(bombs).size(), size_t{1023});
  CHECK_EQ(Bounded("short"), std::string("short"));
  CHECK_EQ(Bounded(std::string(1024, 'x')).size(), size_t{1024});
  CHECK(batchgate::IsValidUtf8("\xc3\xa9\xef\xbf\xbd"));
  CHECK(!batchgate::IsValidUtf8("\xc3\x28"));
  CHECK(!batchgate::IsValidUtf8("\xed\xa0\x80"));  // a surrogate
}

void TestShapes() {
  google::protobuf::RepeatedField<int64_t> shape;
  CHECK_EQ(batchgate::ShapeText(shape), std::string("[]"));
  for (int i = 0; i < 8; ++i) shape.Add(i);
  CHECK_EQ(batchgate::ShapeText(shape), std::string("[0, 1, 2, 3, 4, 5, 6, 7]"));
  shape.Add(-5);
  CHECK_EQ(batchgate::ShapeText(shape), std::string("[0, 1, 2, 3, 4, 5, 6, 7, ...] (9 dimensions)"));
  CHECK_EQ(batchgate::ShapeList(shape), std::string("[0, 1, 2, 3, 4, 5, 6, 7, -5]"));
}

void TestFloats() {
  struct Case {
    double value;
    const char* repr;
    const char* go;
  };
  // repr(v) and prometheus_client's floatToGoString(v).
  const Case cases[] = {
      {0.0001, "0.0001", "0.0001"},
      {0.00025, "0.00025", "0.00025"},
      {1.0, "1.0", "1.0"},
      {10.0, "10.0", "10.0"},
      {1e-05, "1e-05", "1e-05"},
      {123456789.0, "123456789.0", "1.23456789e+08"},
      {1e+16, "1e+16", "1e+16"},
      {12.5, "12.5", "12.5"},
      {1e+22, "1e+22", "1e+22"},
      {3e-07, "3e-07", "3e-07"},
      {0.30000000000000004, "0.30000000000000004", "0.30000000000000004"},
      {1234567.0, "1234567.0", "1.234567e+06"},
      {10000000.0, "10000000.0", "1e+07"},
      {9007199254740992.0, "9007199254740992.0", "9.007199254740992e+15"},
      {10000000000.0, "10000000000.0", "1e+10"},
      {5e-324, "5e-324", "5e-324"},
      {1.7976931348623157e+308, "1.7976931348623157e+308", "1.7976931348623157e+308"},
      {0.5, "0.5", "0.5"},
      {123.456, "123.456", "123.456"},
      {30.0, "30.0", "30.0"},
      {0.0, "0.0", "0.0"},
  };
  for (const Case& c : cases) {
    CHECK_EQ(batchgate::PythonFloat(c.value), std::string(c.repr));
    CHECK_EQ(batchgate::PrometheusFloat(c.value), std::string(c.go));
  }
  CHECK_EQ(batchgate::PrometheusFloat(1.0 / 0.0), std::string("+Inf"));
}

void TestJson() {
  std::string out;
  batchgate::AppendJsonString(out, "m\xc3\xa9\xf0\x9f\x92\xa5\x7f\"\\\n\x01");
  // json.dumps("mé💥\x7f\"\\\n\x01")
  CHECK_EQ(out, std::string("\"m\\u00e9\\ud83d\\udca5\\u007f\\\"\\\\\\n\\u0001\""));
  out.clear();
  batchgate::AppendJsonString(out, "\xff");
  CHECK_EQ(out, std::string("\"\\ufffd\""));
}

void TestInputRegion() {
  using batchgate::InputRegion;
  InputRegion region(4096, 256 * 64);
  std::string problem;
  CHECK(region.CheckInvariants(&problem));
  const auto a = region.Allocate(0);
  CHECK(a.has_value());
  CHECK_EQ(region.bytes_in_use(), uint64_t{256});
  CHECK(!region.Allocate(256 * 64).has_value());  // one block is taken: the whole does not fit
  CHECK(region.Free(*a));
  CHECK(!region.Free(*a));  // a second free of the same block is refused
  CHECK(region.Allocate(256 * 64).has_value());
  CHECK(!region.Allocate(1).has_value());

  // Random traffic: the blocks tile the region, never overlap, coalesce when freed.
  InputRegion busy(0, 1 << 20);
  std::mt19937 rng(7);
  std::map<uint64_t, uint64_t> live;  // offset -> requested bytes
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t n = rng() % 20000;
      const auto offset = busy.Allocate(n);
      if (offset) {
        const auto next = live.lower_bound(*offset);
        CHECK(next == live.end() || next->first >= *offset + n);
        live.emplace(*offset, n);
      }
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      CHECK(busy.Free(it->first));
      live.erase(it);
    }
    if (step % 997 == 0) CHECK(busy.CheckInvariants(&problem));
  }
  for (const auto& [offset, n] : live) CHECK(busy.Free(offset));
  CHECK_EQ(busy.bytes_in_use(), uint64_t{0});
  CHECK(busy.CheckInvariants(&problem));
  CHECK(busy.Allocate(1 << 20).has_value());  // everything coalesced back into one block

  // Reserve: exactly where it is asked, only out of free space, given back by Free.
  InputRegion exact(4096, 256 * 16);
  CHECK(exact.Reserve(4096 + 256 * 5, 300));  // two units
  CHECK(!exact.Reserve(4096 + 256 * 6, 1));   // its second unit
  CHECK(!exact.Reserve(4096 + 256 * 4, 512)); // runs into it
  CHECK(!exact.Reserve(4096 + 100, 1));       // not aligned
  CHECK(!exact.Reserve(4096 + 256 * 15, 512));  // past the end
  CHECK(!exact.Reserve(0, 1));                // before the region
  CHECK_EQ(exact.bytes_in_use(), uint64_t{512});
  CHECK(exact.CheckInvariants(&problem));
  CHECK(!exact.Allocate(256 * 11).has_value());  // the free space is cut in two: 5 and 9 units
  CHECK(exact.Allocate(256 * 9).has_value());
  CHECK(exact.Free(4096 + 256 * 5));
  CHECK(exact.CheckInvariants(&problem));
}

void TestBearerTokens() {
  using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;
  const auto token = [](std::vector<std::pair<std::string, std::string>>* entries) {
    Metadata m;
    for (const auto& [k, v] : *entries) m.emplace(grpc::string_ref(k), grpc::string_ref(v));
    return batchgate::BearerToken(m);
  };
  std::vector<std::pair<std::string, std::string>> none;
  CHECK(!token(&none).has_value());
  std::vector<std::pair<std::string, std::string>> plain = {{"authorization", "Bearer abc"}};
  CHECK(token(&plain) == std::optional<std::string_view>("abc"));
  std::vector<std::pair<std::string, std::string>> lower = {{"authorization", "bEaReR \t abc \x0b"}};
  CHECK(token(&lower) == std::optional<std::string_view>("abc"));
  std::vector<std::pair<std::string, std::string>> basic = {{"authorization", "Basic abc"}};
  CHECK(token(&basic) == std::optional<std::string_view>(""));
  std::vector<std::pair<std::string, std::string>> bare = {{"authorization", "Bearer"}};
  CHECK(token(&bare) == std::optional<std::string_view>(""));
  std::vector<std::pair<std::string, std::string>> first = {{"authorization", "Bearer one"},
                                                            {"authorization", "Bearer two"}};
  CHECK(token(&first) == std::optional<std::string_view>("one"));
  CHECK(batchgate::ConstantTimeEquals("abc", "abc"));
  CHECK(!batchgate::ConstantTimeEquals("abc", "abd"));
  CHECK(!batchgate::ConstantTimeEquals("abc", "abcd"));
  CHECK(!batchgate::ConstantTimeEquals("", "a"));
}

// The echo-like model of tests/conftest.py: max_batch_size 4, one input per datatype, dims [3].

// The handover (protos/handover.proto): settings.shared_memory and the rest read from it; the wire
// limits' bounds from it, their refusals' words from rules.h (server/rules/request_limits.py).
batchgate::handover::FrontendHandover ValidHandover() {
  batchgate::handover::FrontendHandover in;
  in.set_arena_fd(3);
  in.set_arena_bytes(1048576);
  in.set_input_region_bytes(524288);
  in.set_executor_socket("s");
  in.set_metrics_socket("m");
  in.set_version("0.1.0");
  in.add_extensions("health");
  in.add_extensions("system_shared_memory");
  in.add_seconds_buckets(0.001);
  in.add_seconds_buckets(0.01);
  for (int i = 0; i < batchgate::rules::kWireRules; ++i) {
    (*in.mutable_wire_limits())[batchgate::rules::kWireRuleKeys[i]] = 3 + static_cast<uint64_t>(i);
  }
  auto* argument = in.add_grpc_arguments();
  argument->set_name("grpc.max_concurrent_streams");
  argument->set_value(7);
  argument = in.add_grpc_arguments();
  argument->set_name("grpc.keepalive_time_ms");
  argument->set_value(500);
  in.set_unknown_model_label("<unknown>");
  in.set_max_stream_backlog_messages(256);
  auto* s = in.mutable_settings();
  s->set_host("127.0.0.1");
  s->set_max_message_bytes(1024);
  s->set_max_request_bytes(4096);
  s->set_max_tensor_elements(100);
  s->set_drain_timeout_s(1);
  s->set_grpc_memory_bytes(1048576);
  s->set_grpc_max_threads(4);
  s->set_max_stream_backlog_bytes(2048);
  s->set_reflection(true);
  s->set_frontend_threads(1);
  s->set_request_scheduling("normal");
  s->set_log_level("info");
  s->set_shared_memory(true);
  return in;
}

bool Parse(const batchgate::handover::FrontendHandover& in, batchgate::Handover* out,
           std::string* error) {
  return batchgate::ParseHandover(in.SerializeAsString(), out, error);
}

void TestHandover() {
  std::string error;
  batchgate::Handover handover;
  CHECK(Parse(ValidHandover(), &handover, &error));
  CHECK(handover.shared_memory);
  CHECK_EQ(handover.wire_limits.Most(batchgate::WireRule::kInputs), uint64_t{3});
  CHECK_EQ(handover.wire_limits.Refusal(batchgate::WireRule::kInputs),
           std::string("the request has more inputs than this server allows "
                       "(--max-request-inputs 3)"));
  CHECK_EQ(handover.wire_limits.Most(batchgate::WireRule::kContentsBytes), uint64_t{11});
  CHECK_EQ(handover.extensions.size(), size_t{2});
  CHECK_EQ(handover.grpc_arguments.size(), size_t{2});
  CHECK_EQ(handover.grpc_arguments[0].first, std::string("grpc.max_concurrent_streams"));
  CHECK_EQ(handover.grpc_arguments[1].second, 500);
  CHECK_EQ(handover.unknown_model_label, std::string("<unknown>"));
  CHECK_EQ(handover.grpc_memory_bytes, int64_t{1048576});
  CHECK_EQ(handover.grpc_max_threads, 4);
  CHECK_EQ(handover.max_stream_backlog_bytes, int64_t{2048});
  CHECK_EQ(handover.max_stream_backlog_messages, int64_t{256});
  CHECK(!handover.batch_scheduling);
  CHECK(handover.model_cpus.empty());
  CHECK(!handover.tls_cert.has_value());

  batchgate::Handover refused;
  CHECK(!batchgate::ParseHandover("{\"slot\": 0}", &refused, &error));
  CHECK(error.find("is not a serialized batchgate.handover.FrontendHandover") !=
        std::string::npos);
  auto without_rule = ValidHandover();
  without_rule.mutable_wire_limits()->erase("outputs");
  CHECK(!Parse(without_rule, &refused, &error));
  CHECK_EQ(error, std::string("handover field 'wire_limits.outputs' is missing"));
  auto without_settings = ValidHandover();
  without_settings.clear_settings();
  CHECK(!Parse(without_settings, &refused, &error));
  CHECK_EQ(error, std::string("handover field 'settings' is missing"));

  auto batch = ValidHandover();
  batch.mutable_settings()->set_request_scheduling("batch");
  batchgate::Handover batched;
  CHECK(Parse(batch, &batched, &error));
  CHECK(batched.batch_scheduling);
  auto other = ValidHandover();
  other.mutable_settings()->set_request_scheduling("fifo");
  CHECK(!Parse(other, &refused, &error));
  CHECK_EQ(error, std::string("handover field 'settings.request_scheduling' must be batch or normal"));

  auto pinned = ValidHandover();
  pinned.mutable_settings()->add_model_cpus(1);
  pinned.mutable_settings()->add_model_cpus(3);
  batchgate::Handover split;
  CHECK(Parse(pinned, &split, &error));
  CHECK_EQ(split.model_cpus.size(), size_t{2});
  CHECK_EQ(split.model_cpus[0], 1);
  CHECK_EQ(split.model_cpus[1], 3);
  auto negative = ValidHandover();
  negative.mutable_settings()->add_model_cpus(-1);
  CHECK(!Parse(negative, &refused, &error));
  CHECK(error.find("handover field 'settings.model_cpus' must hold CPUs in 0..") == 0);

  auto half_tls = ValidHandover();
  half_tls.mutable_settings()->set_tls_cert("/cert.pem");
  CHECK(!Parse(half_tls, &refused, &error));
  CHECK_EQ(error, std::string("handover field 'settings.tls_key' must be set with the other of "
                              "tls_cert/tls_key"));
  auto threads = ValidHandover();
  threads.mutable_settings()->set_grpc_max_threads(1);
  CHECK(!Parse(threads, &refused, &error));
  CHECK_EQ(error, std::string("handover field 'settings.grpc_max_threads' must be in "
                              "2..2147483647, got 1"));
}

// -- the wire scan (wire_scan.h) -----------------------------------------------------------------


void TestMetrics() {
  batchgate::RequestMetrics metrics({0.001, 0.01}, "input-3", [] { return uint64_t{512}; },
                                    "<unknown>");
  metrics.Count("m\"x", true, grpc::StatusCode::OK, 0.005);
  metrics.Count("m\"x", true, grpc::StatusCode::OK, 0.01);
  metrics.Count("m\"x", true, grpc::StatusCode::NOT_FOUND, 0.5);
  const std::string text = metrics.Exposition();
  CHECK(text.find("batchgate_requests_total{model=\"m\\\"x\",status=\"OK\"} 2.0\n") != std::string::npos);
  CHECK(text.find("batchgate_requests_total{model=\"m\\\"x\",status=\"NOT_FOUND\"} 1.0\n") != std::string::npos);
  CHECK(text.find("batchgate_request_seconds_bucket{le=\"0.001\",model=\"m\\\"x\"} 0.0\n") != std::string::npos);
  CHECK(text.find("batchgate_request_seconds_bucket{le=\"0.01\",model=\"m\\\"x\"} 2.0\n") != std::string::npos);
  CHECK(text.find("batchgate_request_seconds_bucket{le=\"+Inf\",model=\"m\\\"x\"} 2.0\n") != std::string::npos);
  CHECK(text.find("batchgate_request_seconds_count{model=\"m\\\"x\"} 2.0\n") != std::string::npos);
  CHECK(text.find("batchgate_arena_bytes_in_use{region=\"input-3\"} 512.0\n") != std::string::npos);
  CHECK(text.find("batchgate_stream_backlog_bytes 0.0\n") != std::string::npos);
  // Names the executor does not know never become labels, however many and long.
  for (int i = 0; i < 3000; ++i) {
    metrics.Count(std::string(60000, 'n') + std::to_string(i), false, grpc::StatusCode::NOT_FOUND, 0);
  }
  const std::string flooded = metrics.Exposition();
  CHECK(flooded.size() < 4096);
  CHECK(flooded.find("model=\"<unknown>\",status=\"NOT_FOUND\"} 3000.0") != std::string::npos);
  // Past 4096 (model, status) pairs, even known names count under the unknown label.
  for (int i = 0; i < 5000; ++i) metrics.Count("model" + std::to_string(i), true, grpc::StatusCode::OK, 0);
  const std::string full = metrics.Exposition();
  CHECK(full.find("model=\"<unknown>\",status=\"OK\"} 907.0") != std::string::npos);
  CHECK(full.find("model=\"model4092\"") != std::string::npos);  // the 4096th pair
  CHECK(full.find("model=\"model4093\"") == std::string::npos);
  metrics.AddStreamBacklog(300);
  metrics.AddStreamBacklog(-100);
  metrics.CountStreamPause();
  const std::string streams = metrics.Exposition();
  CHECK(streams.find("batchgate_stream_backlog_bytes 200.0\n") != std::string::npos);
  CHECK(streams.find("batchgate_stream_pauses_total 1.0\n") != std::string::npos);
}

}  // namespace

void RunBasicsTests() {
  TestQuotingAndCutting();
  TestShapes();
  TestFloats();
  TestJson();
  TestInputRegion();
  TestBearerTokens();
  TestHandover();
  TestMetrics();
}
