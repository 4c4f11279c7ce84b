// Unit tests of the native front end's pure parts, run by ctest: text as Python writes it, the
// input region allocator, bearer-token parsing, decode_request()'s checks and conversions, the
// metrics exposition. Expected texts were produced by the Python code they mirror. No framework:
// a failed check prints where and what, and the exit status counts the failures.
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

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(condition)                                                     \
  do {                                                                       \
    ++g_checks;                                                              \
    if (!(condition)) {                                                      \
      ++g_failures;                                                          \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #condition); \
    }                                                                        \
  } while (0)

#define CHECK_EQ(actual, expected)                                                         \
  do {                                                                                     \
    ++g_checks;                                                                            \
    const auto a_ = (actual);                                                              \
    const auto e_ = (expected);                                                            \
    if (!(a_ == e_)) {                                                                     \
      ++g_failures;                                                                        \
      std::fprintf(stderr, "%s:%d: %s == %s\n  got:      %s\n  expected: %s\n", __FILE__, \
                   __LINE__, #actual, #expected, Show(a_).c_str(), Show(e_).c_str());      \
    }                                                                                      \
  } while (0)

std::string Show(const std::string& s) { return "\"" + s + "\""; }
template <typename T>
std::string Show(const T& v) { return std::to_string(v); }

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
std::shared_ptr<const ModelState> EchoModel() {
  batchgate::wire::ModelState wire;
  wire.set_name("echo");
  wire.set_state("READY");
  wire.set_handle(7);
  auto* spec = wire.mutable_spec();
  spec->set_name("echo");
  spec->set_version("1");
  spec->set_max_batch_size(4);
  for (const char* t : {"BOOL", "INT8", "UINT16", "FP32", "BYTES", "FP16"}) {
    auto* in = spec->add_inputs();
    in->set_name(std::string("IN_") + t);
    in->set_datatype(t);
    in->add_dims(3);
    auto* out = spec->add_outputs();
    out->set_name(std::string("OUT_") + t);
    out->set_datatype(t);
    out->add_dims(3);
  }
  return batchgate::MakeModelState(wire, 1);
}

inference::ModelInferRequest TypedEchoRequest() {
  inference::ModelInferRequest r;
  r.set_model_name("echo");
  const auto add = [&](const char* name, const char* datatype) {
    auto* t = r.add_inputs();
    t->set_name(name);
    t->set_datatype(datatype);
    t->add_shape(1);
    t->add_shape(3);
    return t->mutable_contents();
  };
  auto* b = add("IN_BOOL", "BOOL");
  b->add_bool_contents(true), b->add_bool_contents(false), b->add_bool_contents(true);
  auto* i8 = add("IN_INT8", "INT8");
  i8->add_int_contents(-128), i8->add_int_contents(0), i8->add_int_contents(127);
  auto* u16 = add("IN_UINT16", "UINT16");
  u16->add_uint_contents(65535), u16->add_uint_contents(1), u16->add_uint_contents(2);
  auto* f = add("IN_FP32", "FP32");
  f->add_fp32_contents(1.5f), f->add_fp32_contents(-2), f->add_fp32_contents(0);
  auto* s = add("IN_BYTES", "BYTES");
  s->add_bytes_contents("ab"), s->add_bytes_contents(""), s->add_bytes_contents("xyz");
  return r;
}

void TestDecode() {
  const auto model = EchoModel();
  batchgate::RequestLimits limits;
  limits.max_request_bytes = 1 << 20;
  limits.max_tensor_elements = 1000;

  // Everything but FP16, which has no typed field: "missing inputs ['IN_FP16']".
  inference::ModelInferRequest r = TypedEchoRequest();
  batchgate::DecodedRequest decoded;
  grpc::Status status = batchgate::DecodeRequest(r, *model, limits, false, &decoded);
  CHECK_EQ(status.error_message(), std::string("model 'echo': missing inputs ['IN_FP16']"));

  auto* fp16 = r.add_inputs();
  fp16->set_name("IN_FP16");
  fp16->set_datatype("FP16");
  fp16->add_shape(1);
  fp16->add_shape(3);
  decoded = {};
  status = batchgate::DecodeRequest(r, *model, limits, false, &decoded);
  CHECK_EQ(status.error_message(),
           std::string("model 'echo': input 'IN_FP16' is FP16, which has no typed contents field; "
                       "send it in raw_input_contents"));
  fp16->mutable_contents()->add_fp32_contents(1);  // typed contents of a raw-only type

  // Raw instead: then every input converts, and the typed ones are written as raw bytes.
  inference::ModelInferRequest typed = TypedEchoRequest();
  typed.mutable_inputs()->RemoveLast();  // IN_BYTES
  const auto state_without = [&] {
    batchgate::wire::ModelState wire;
    wire.set_name("echo");
    wire.set_state("READY");
    auto* spec = wire.mutable_spec();
    spec->set_name("echo");
    spec->set_version("1");
    spec->set_max_batch_size(4);
    for (const char* t : {"BOOL", "INT8", "UINT16", "FP32"}) {
      auto* in = spec->add_inputs();
      in->set_name(std::string("IN_") + t);
      in->set_datatype(t);
      in->add_dims(3);
    }
    return batchgate::MakeModelState(wire, 1);
  }();
  decoded = {};
  status = batchgate::DecodeRequest(typed, *state_without, limits, false, &decoded);
  CHECK(status.ok());
  CHECK_EQ(decoded.batch_size, uint32_t{1});
  const uint64_t sizes[] = {3, 3, 6, 12};
  for (size_t i = 0; i < 4; ++i) CHECK_EQ(decoded.inputs[i].nbytes, sizes[i]);
  uint8_t buffer[16];
  batchgate::WriteInput(typed, decoded.inputs[1], state_without->inputs[1], buffer);
  CHECK(buffer[0] == 0x80 && buffer[1] == 0 && buffer[2] == 0x7F);
  batchgate::WriteInput(typed, decoded.inputs[2], state_without->inputs[2], buffer);
  CHECK(buffer[0] == 0xFF && buffer[1] == 0xFF && buffer[2] == 1 && buffer[3] == 0);

  // A value outside INT8's range.
  typed.mutable_inputs(1)->mutable_contents()->set_int_contents(1, 128);
  decoded = {};
  status = batchgate::DecodeRequest(typed, *state_without, limits, false, &decoded);
  CHECK_EQ(status.error_message(),
           std::string("model 'echo': input 'IN_INT8' has values outside the range of INT8"));

  // BYTES typed contents become the 4-byte-length encoding.
  const auto bytes_model = [&] {
    batchgate::wire::ModelState wire;
    wire.set_name("s");
    wire.set_state("READY");
    auto* spec = wire.mutable_spec();
    spec->set_name("s");
    spec->set_max_batch_size(0);
    auto* in = spec->add_inputs();
    in->set_name("T");
    in->set_datatype("BYTES");
    in->add_dims(-1);
    return batchgate::MakeModelState(wire, 1);
  }();
  inference::ModelInferRequest strings;
  auto* t = strings.add_inputs();
  t->set_name("T");
  t->set_datatype("BYTES");
  t->add_shape(2);
  t->mutable_contents()->add_bytes_contents("ab");
  t->mutable_contents()->add_bytes_contents("");
  decoded = {};
  CHECK(batchgate::DecodeRequest(strings, *bytes_model, limits, false, &decoded).ok());
  CHECK_EQ(decoded.inputs[0].nbytes, uint64_t{10});
  batchgate::WriteInput(strings, decoded.inputs[0], bytes_model->inputs[0], buffer);
  CHECK(std::memcmp(buffer, "\x02\0\0\0ab\0\0\0\0", 10) == 0);

  // Shapes: rank first, then negative dimensions, then the element limit (never a product
  // that passes it), then the model's dimensions.
  t->clear_shape();
  t->add_shape(1LL << 62);
  t->add_shape(1LL << 62);
  decoded = {};
  status = batchgate::DecodeRequest(strings, *bytes_model, limits, false, &decoded);
  CHECK_EQ(status.error_message(),
           std::string("model 's': input 'T' must have shape [-1] (-1: any), got [4611686018427387904, "
                       "4611686018427387904]"));
  t->clear_shape();
  t->add_shape(1LL << 62);
  decoded = {};
  status = batchgate::DecodeRequest(strings, *bytes_model, limits, false, &decoded);
  CHECK(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_EQ(status.error_message(),
           std::string("model 's': input 'T' of shape [4611686018427387904] has more elements than "
                       "this server allows (--max-tensor-elements 1000)"));
}

// What the one-process server (server/codec.py) answers for the shared-memory cases of
// TestSharedMemoryDecode.
#define SHM_RAW_COUNT_MESSAGE                                                                  \
  "model 'pair': 2 raw_input_contents for 1 inputs; send one raw buffer per input that is not " \
  "in shared memory, in the order of 'inputs'"
#define SHM_BYTE_SIZE_MESSAGE                                                                 \
  "model 'pair': input 'IN_FP32' of shape [2, 3] and datatype FP32 needs 24 bytes, "           \
  "shared_memory_byte_size is 20"
#define SHM_REGION_TYPE_MESSAGE \
  "model 'pair': input 'IN_FP32': parameter 'shared_memory_region' must be a string, got int64_param"
#define SHM_SIZE_TYPE_MESSAGE                                                                 \
  "model 'pair': input 'IN_FP32': parameter 'shared_memory_byte_size' must be an integer, got " \
  "string_param"
#define SHM_OFFSET_NEGATIVE_MESSAGE \
  "model 'pair': input 'IN_FP32': parameter 'shared_memory_offset' must be >= 0, got -1"
#define SHM_NOT_TOGETHER_MESSAGE                                                                 \
  "model 'pair': input 'IN_FP32': the parameters 'shared_memory_region' and "                    \
  "'shared_memory_byte_size' go together ('shared_memory_offset' is optional)"
#define SHM_CONTENTS_MESSAGE \
  "model 'pair': input 'IN_FP32' is in shared memory and has contents too; use one or the other"
#define SHM_OFF_MESSAGE                                                                        \
  "shared-memory tensors are off on this server (start it with --shared-memory to turn them " \
  "on); send tensor data in raw_input_contents"
#define SHM_OUTPUT_SIZE_TYPE_MESSAGE                                                          \
  "model 'pair': output 'OUT_BYTES': parameter 'shared_memory_byte_size' must be an integer, " \
  "got double_param"

inference::InferParameter Int64Parameter(int64_t value) {
  inference::InferParameter p;
  p.set_int64_param(value);
  return p;
}

inference::InferParameter StringParameter(const std::string& value) {
  inference::InferParameter p;
  p.set_string_param(value);
  return p;
}

// A model of two inputs, FP32 [3] and BYTES [-1], and their two outputs; max_batch_size 4.
std::shared_ptr<const ModelState> PairModel() {
  batchgate::wire::ModelState wire;
  wire.set_name("pair");
  wire.set_state("READY");
  auto* spec = wire.mutable_spec();
  spec->set_name("pair");
  spec->set_version("1");
  spec->set_max_batch_size(4);
  for (const char* t : {"FP32", "BYTES"}) {
    auto* in = spec->add_inputs();
    in->set_name(std::string("IN_") + t);
    in->set_datatype(t);
    in->add_dims(std::string(t) == "FP32" ? 3 : -1);
    auto* out = spec->add_outputs();
    out->set_name(std::string("OUT_") + t);
    out->set_datatype(t);
    out->add_dims(std::string(t) == "FP32" ? 3 : -1);
  }
  return batchgate::MakeModelState(wire, 1);
}

// IN_FP32 [2, 3] in region "r" (24 bytes at 8), IN_BYTES [2, 1] as a raw buffer.
inference::ModelInferRequest PlacedPairRequest() {
  inference::ModelInferRequest r;
  r.set_model_name("pair");
  auto* f = r.add_inputs();
  f->set_name("IN_FP32");
  f->set_datatype("FP32");
  f->add_shape(2);
  f->add_shape(3);
  (*f->mutable_parameters())["shared_memory_region"].set_string_param("r");
  (*f->mutable_parameters())["shared_memory_offset"].set_int64_param(8);
  (*f->mutable_parameters())["shared_memory_byte_size"].set_int64_param(24);
  auto* b = r.add_inputs();
  b->set_name("IN_BYTES");
  b->set_datatype("BYTES");
  b->add_shape(2);
  b->add_shape(1);
  r.add_raw_input_contents(std::string("\x01\0\0\0a\0\0\0\0", 9));
  return r;
}

void TestSharedMemoryDecode() {
  const auto model = PairModel();
  batchgate::RequestLimits limits;
  limits.max_request_bytes = 64u << 20;
  const auto decode = [&](const inference::ModelInferRequest& r, batchgate::DecodedRequest* d,
                          bool enabled = true) {
    *d = {};
    return batchgate::DecodeRequest(r, *model, limits, enabled, d);
  };
  batchgate::DecodedRequest decoded;

  // The placed input takes no raw buffer and nothing in the arena; the next one takes raw 0.
  inference::ModelInferRequest r = PlacedPairRequest();
  grpc::Status status = decode(r, &decoded);
  CHECK(status.ok());
  CHECK(decoded.inputs[0].placed);
  CHECK_EQ(decoded.inputs[0].raw, -1);
  CHECK_EQ(decoded.inputs[0].nbytes, uint64_t{0});
  CHECK_EQ(decoded.inputs[0].placement.region(), std::string("r"));
  CHECK_EQ(decoded.inputs[0].placement.offset(), uint64_t{8});
  CHECK_EQ(decoded.inputs[0].placement.nbytes(), uint64_t{24});
  CHECK(!decoded.inputs[1].placed);
  CHECK_EQ(decoded.inputs[1].raw, 0);
  CHECK_EQ(decoded.inputs[1].nbytes, uint64_t{9});
  CHECK_EQ(decoded.batch_size, uint32_t{2});
  CHECK(decoded.placements.empty());

  // uint64_param is an integer too, and the offset may be left out (tritonclient sends none
  // for 0). A BYTES input in shared memory has no size to check here.
  inference::ModelInferRequest u = PlacedPairRequest();
  auto& params = *u.mutable_inputs(0)->mutable_parameters();
  params.erase("shared_memory_offset");
  params["shared_memory_byte_size"].set_uint64_param(24);
  auto& bytes_params = *u.mutable_inputs(1)->mutable_parameters();
  bytes_params["shared_memory_region"].set_string_param("s");
  bytes_params["shared_memory_byte_size"].set_int64_param(1000);
  u.clear_raw_input_contents();
  CHECK(decode(u, &decoded).ok());
  CHECK_EQ(decoded.inputs[0].placement.offset(), uint64_t{0});
  CHECK(decoded.inputs[1].placed);
  CHECK_EQ(decoded.inputs[1].placement.nbytes(), uint64_t{1000});

  // A raw buffer for every input, the placed one too: the count is wrong.
  r = PlacedPairRequest();
  r.add_raw_input_contents(std::string(24, '\0'));
  CHECK_EQ(decode(r, &decoded).error_message(),
           std::string(SHM_RAW_COUNT_MESSAGE));

  // Without shared-memory inputs, the message of before.
  r = PlacedPairRequest();
  r.mutable_inputs(0)->clear_parameters();
  CHECK_EQ(decode(r, &decoded).error_message(),
           std::string("model 'pair': 1 raw_input_contents for 2 inputs; send one raw buffer per "
                       "input, in the order of 'inputs'"));

  // The byte size must be the shape's.
  r = PlacedPairRequest();
  (*r.mutable_inputs(0)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(20);
  CHECK_EQ(decode(r, &decoded).error_message(), std::string(SHM_BYTE_SIZE_MESSAGE));

  // Parameters of the wrong type, negative, missing.
  const struct {
    const char* key;
    inference::InferParameter value;
    const char* message;
  } bad[] = {
      {"shared_memory_region", Int64Parameter(1), SHM_REGION_TYPE_MESSAGE},
      {"shared_memory_byte_size", StringParameter("24"), SHM_SIZE_TYPE_MESSAGE},
      {"shared_memory_offset", Int64Parameter(-1), SHM_OFFSET_NEGATIVE_MESSAGE},
  };
  for (const auto& b : bad) {
    r = PlacedPairRequest();
    (*r.mutable_inputs(0)->mutable_parameters())[b.key] = b.value;
    status = decode(r, &decoded);
    CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_EQ(status.error_message(), std::string(b.message));
  }
  r = PlacedPairRequest();
  r.mutable_inputs(0)->mutable_parameters()->erase("shared_memory_byte_size");
  CHECK_EQ(decode(r, &decoded).error_message(), std::string(SHM_NOT_TOGETHER_MESSAGE));
  r = PlacedPairRequest();
  r.mutable_inputs(0)->mutable_parameters()->erase("shared_memory_region");
  CHECK_EQ(decode(r, &decoded).error_message(), std::string(SHM_NOT_TOGETHER_MESSAGE));

  // Typed contents beside the region.
  r = PlacedPairRequest();
  r.clear_raw_input_contents();
  r.mutable_inputs(1)->mutable_contents()->add_bytes_contents("a");
  r.mutable_inputs(1)->mutable_contents()->add_bytes_contents("");
  for (int i = 0; i < 6; ++i) r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
  CHECK_EQ(decode(r, &decoded).error_message(), std::string(SHM_CONTENTS_MESSAGE));

  // The extension turned off.
  status = decode(PlacedPairRequest(), &decoded, false);
  CHECK(status.error_code() == grpc::StatusCode::UNIMPLEMENTED);
  CHECK_EQ(status.error_message(), std::string(SHM_OFF_MESSAGE));

  // Outputs: one placement per output asked for once any is placed, "" for the others.
  r = PlacedPairRequest();
  r.add_outputs()->set_name("OUT_FP32");
  auto* placed = r.add_outputs();
  placed->set_name("OUT_BYTES");
  (*placed->mutable_parameters())["shared_memory_region"].set_string_param("out");
  (*placed->mutable_parameters())["shared_memory_offset"].set_uint64_param(16);
  (*placed->mutable_parameters())["shared_memory_byte_size"].set_int64_param(64);
  CHECK(decode(r, &decoded).ok());
  CHECK_EQ(decoded.outputs.size(), size_t{2});
  CHECK_EQ(decoded.placements.size(), size_t{2});
  CHECK_EQ(decoded.placements[0].region(), std::string());
  CHECK_EQ(decoded.placements[1].region(), std::string("out"));
  CHECK_EQ(decoded.placements[1].offset(), uint64_t{16});
  CHECK_EQ(decoded.placements[1].nbytes(), uint64_t{64});
  // The other way round: "" after the placed one.
  inference::ModelInferRequest reversed = r;
  reversed.mutable_outputs()->SwapElements(0, 1);
  CHECK(decode(reversed, &decoded).ok());
  CHECK_EQ(decoded.placements.size(), size_t{2});
  CHECK_EQ(decoded.placements[0].region(), std::string("out"));
  CHECK_EQ(decoded.placements[1].region(), std::string());
  // An output asked for twice (placed or not): refused, as Triton does.
  reversed.add_outputs()->set_name("OUT_BYTES");
  CHECK_EQ(decode(reversed, &decoded).error_message(),
           std::string("model 'pair': output 'OUT_BYTES' is requested twice"));
  (*placed->mutable_parameters())["shared_memory_byte_size"].set_double_param(64);
  CHECK_EQ(decode(r, &decoded).error_message(), std::string(SHM_OUTPUT_SIZE_TYPE_MESSAGE));

  // A BYTES input's byte size is the client's word, up to 2**64 - 1: with the placed FP32
  // input's 24 bytes it must not wrap round below --max-request-bytes.
  r = PlacedPairRequest();
  r.clear_raw_input_contents();
  auto* text = r.mutable_inputs(1);
  (*text->mutable_parameters())["shared_memory_region"].set_string_param("r");
  (*text->mutable_parameters())["shared_memory_byte_size"].set_uint64_param(
      std::numeric_limits<uint64_t>::max() - 10);
  status = decode(r, &decoded);
  CHECK(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_EQ(status.error_message(),
           std::string("model 'pair': the request's inputs take more bytes than this server "
                       "allows (--max-request-bytes 67108864)"));
  (*text->mutable_parameters())["shared_memory_byte_size"].set_uint64_param(64);
  CHECK(decode(r, &decoded).ok());
}

// An output placed in the client's region: its metadata in the reply, no contents.
void TestPlacedOutputReply() {
  const auto model = PairModel();
  const int fd = memfd_create("unit-test-arena", 0);
  CHECK(fd >= 0 && ftruncate(fd, 4096) == 0);
  batchgate::Arena arena;
  std::string error;
  CHECK(arena.Map(fd, 4096, &error));
  close(fd);
  std::memcpy(arena.data() + 256, "\x01\0\0\0z", 5);
  batchgate::wire::Result result;
  auto* first = result.add_outputs();
  first->set_placed(true);
  first->add_shape(2);
  first->add_shape(3);
  auto* second = result.add_outputs();
  second->set_block(256);
  second->set_offset(256);
  second->set_nbytes(5);
  second->add_shape(1);
  second->add_shape(1);
  grpc::ByteBuffer reply;
  std::string problem;
  CHECK(batchgate::EncodeResponse(*model, "id", {}, result, arena, false, 1 << 20, &reply,
                                  &problem).ok());
  inference::ModelInferResponse response;
  std::vector<grpc::Slice> slices;
  CHECK(reply.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  CHECK(response.ParseFromString(bytes));
  CHECK_EQ(response.outputs_size(), 2);
  CHECK_EQ(response.outputs(0).name(), std::string("OUT_FP32"));
  CHECK_EQ(response.outputs(0).datatype(), std::string("FP32"));
  CHECK_EQ(response.outputs(0).shape_size(), 2);
  CHECK_EQ(response.outputs(0).shape(1), int64_t{3});
  // An empty entry for the placed one keeps raw_output_contents aligned with outputs.
  CHECK_EQ(response.raw_output_contents_size(), 2);
  CHECK_EQ(response.raw_output_contents(0), std::string());
  CHECK_EQ(response.raw_output_contents(1), std::string("\x01\0\0\0z", 5));
  // Past the reply's limit, by a byte: refused before it is built, naming the size; in a
  // stream the wrapper's two bytes count too.
  const uint64_t size = bytes.size();
  grpc::ByteBuffer none;
  grpc::Status refused = batchgate::EncodeResponse(*model, "id", {}, result, arena, false,
                                                   size - 1, &none, &problem);
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_EQ(refused.error_message(),
           "model 'pair': the reply would take " + std::to_string(size) +
               " bytes, more than this server sends (--max-message-bytes " +
               std::to_string(size - 1) + ")");
  CHECK(none.Length() == 0);
  CHECK(batchgate::EncodeResponse(*model, "id", {}, result, arena, false, size, &none, &problem)
            .ok());
  refused = batchgate::EncodeResponse(*model, "id", {}, result, arena, true, size + 1, &none,
                                      &problem);
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(refused.error_message().find(" " + std::to_string(size + 2) + " bytes") !=
        std::string::npos);
}

// The handover (protos/handover.proto): settings.shared_memory and the rest read from it; the wire
// limits' bounds from it, their refusals' words from rules.h (server/request_limits.py).
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

using batchgate::ScanOutcome;
using batchgate::WireRule;

// `bytes` scanned as gRPC may hand them over: in one slice, or cut at each of `cuts`.
batchgate::ScanResult ScanBytes(const std::string& bytes, const batchgate::WireLimits& limits,
                                const std::vector<size_t>& cuts = {}) {
  std::vector<batchgate::WireSpan> spans;
  size_t from = 0;
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  for (const size_t cut : cuts) {
    spans.push_back({data + from, cut - from});
    from = cut;
  }
  spans.push_back({data + from, bytes.size() - from});
  return batchgate::ScanInferRequest(spans, limits);
}

std::string Outcome(const batchgate::ScanResult& result) {
  switch (result.outcome) {
    case ScanOutcome::kWithin: return "within";
    case ScanOutcome::kMalformed: return "malformed";
    case ScanOutcome::kOverLimit: break;
  }
  return std::string("over ") + batchgate::rules::kWireRuleKeys[static_cast<int>(result.rule)];
}

// A request with something of every kind a rule counts.
inference::ModelInferRequest EveryKind() {
  inference::ModelInferRequest r;
  r.set_model_name("model");
  r.set_model_version("1");
  r.set_id("id");
  (*r.mutable_parameters())["priority"].set_uint64_param(1);
  (*r.mutable_parameters())["key"].set_string_param("value");
  for (int i = 0; i < 2; ++i) {
    auto* t = r.add_inputs();
    t->set_name("IN" + std::to_string(i));
    t->set_datatype("BYTES");
    t->add_shape(1);
    t->add_shape(int64_t{1} << 40);
    (*t->mutable_parameters())["p"].set_double_param(1.5);
    t->mutable_contents()->add_bytes_contents("a");
    t->mutable_contents()->add_int64_contents(-1);
    t->mutable_contents()->add_fp32_contents(1);
    t->mutable_contents()->add_fp64_contents(2);
    r.add_raw_input_contents("raw");
  }
  auto* out = r.add_outputs();
  out->set_name("OUT");
  (*out->mutable_parameters())["shared_memory_region"].set_string_param("r");
  (*out->mutable_parameters())["shared_memory_byte_size"].set_int64_param(8);
  return r;
}

void TestWireScanCounts() {
  const inference::ModelInferRequest request = EveryKind();
  const std::string bytes = request.SerializeAsString();
  const auto unlimited = batchgate::UnlimitedWireLimits();
  CHECK_EQ(Outcome(ScanBytes(bytes, unlimited)), std::string("within"));
  // Cut anywhere, in two or in three: the same.
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    CHECK_EQ(Outcome(ScanBytes(bytes, unlimited, {cut})), std::string("within"));
    CHECK_EQ(Outcome(ScanBytes(bytes, unlimited, {cut / 2, cut})), std::string("within"));
  }
  // Each rule at what the request has is within, one less is over.
  const struct {
    WireRule rule;
    uint64_t has;
  } counts[] = {{WireRule::kInputs, 2}, {WireRule::kRawInputContents, 2}, {WireRule::kOutputs, 1},
                {WireRule::kParameters, 2}, {WireRule::kDimensions, 2},
                {WireRule::kBytesContents, 2}, {WireRule::kNameBytes, 23},
                {WireRule::kUnknownFields, 0}, {WireRule::kContentsBytes, 40}};
  for (const auto& count : counts) {
    auto limits = unlimited;
    limits.most[static_cast<int>(count.rule)] = count.has;
    CHECK_EQ(Outcome(ScanBytes(bytes, limits)), std::string("within"));
    if (count.has == 0) continue;
    limits.most[static_cast<int>(count.rule)] = count.has - 1;
    CHECK_EQ(Outcome(ScanBytes(bytes, limits)),
             std::string("over ") + batchgate::rules::kWireRuleKeys[static_cast<int>(count.rule)]);
  }
  // Each kind of name on its own: the longest is the parameter's string value.
  const auto longest = [&](inference::ModelInferRequest r) {
    auto limits = unlimited;
    limits.most[static_cast<int>(WireRule::kNameBytes)] = 4;
    return Outcome(ScanBytes(r.SerializeAsString(), limits));
  };
  const std::string five = "12345";
  inference::ModelInferRequest named;
  named.set_model_name(five);
  CHECK_EQ(longest(named), std::string("over name_bytes"));
  named.set_model_name("1234");
  CHECK_EQ(longest(named), std::string("within"));
  for (int kind = 0; kind < 7; ++kind) {
    inference::ModelInferRequest r;
    auto* t = r.add_inputs();
    switch (kind) {
      case 0: r.set_model_version(five); break;
      case 1: r.set_id(five); break;
      case 2: t->set_name(five); break;
      case 3: t->set_datatype(five); break;
      case 4: (*t->mutable_parameters())[five].set_bool_param(true); break;
      case 5: (*r.mutable_parameters())["k"].set_string_param(five); break;
      default: r.add_outputs()->set_name(five); break;
    }
    CHECK_EQ(longest(r), std::string("over name_bytes"));
  }
  // Each input's and output's map counts apart; the request's own map across its fields.
  auto two = unlimited;
  two.most[static_cast<int>(WireRule::kParameters)] = 2;
  inference::ModelInferRequest maps;
  for (int i = 0; i < 3; ++i) {
    auto* t = maps.add_inputs();
    (*t->mutable_parameters())["a"].set_bool_param(true);
    (*t->mutable_parameters())["b"].set_bool_param(true);
  }
  CHECK_EQ(Outcome(ScanBytes(maps.SerializeAsString(), two)), std::string("within"));
  (*maps.mutable_outputs()->Add()->mutable_parameters())["c"].set_bool_param(true);
  (*maps.mutable_inputs(1)->mutable_parameters())["c"].set_bool_param(true);
  CHECK_EQ(Outcome(ScanBytes(maps.SerializeAsString(), two)), std::string("over parameters"));
  // A shape packed or not, in several fields of one tensor: the dimensions add up; a packed
  // one long past the bound is given up on early, cut across slices or not.
  auto dims = unlimited;
  dims.most[static_cast<int>(WireRule::kDimensions)] = 3;
  const std::string packed_two = std::string("\x2a\x04\x1a\x02\x01\x05", 6);       // [1, 5]
  const std::string unpacked_one = std::string("\x2a\x02\x18\x07", 4);             // [7]
  const std::string unpacked_two = std::string("\x2a\x04\x18\x07\x18\x80\x01", 7);  // cut varint
  CHECK_EQ(Outcome(ScanBytes(packed_two, dims)), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(std::string("\x2a\x06\x1a\x02\x01\x05\x18\x07", 8), dims)),
           std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(std::string("\x2a\x0a\x1a\x02\x01\x05\x18\x07\x1a\x02\x80\x01", 12),
                             dims)),
           std::string("over dimensions"));
  CHECK_EQ(Outcome(ScanBytes(unpacked_one, dims)), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(unpacked_two, dims)), std::string("malformed"));
  inference::ModelInferRequest wide;
  for (int i = 0; i < 100000; ++i) wide.add_inputs();
  wide.mutable_inputs(0)->mutable_shape()->Resize(1 << 20, 3);
  const std::string wide_bytes = wide.SerializeAsString();
  CHECK_EQ(Outcome(ScanBytes(wide_bytes, dims, {7, 4096, 70000})), std::string("over dimensions"));
  // Typed contents count as parsed (request_scan.py's cases): 1-byte int64 values 8 each.
  const auto contents_limit = [&](uint64_t most) {
    auto limits = unlimited;
    limits.most[static_cast<int>(WireRule::kContentsBytes)] = most;
    return limits;
  };
  const auto in_contents = [](const std::string& contents) {
    const auto wrap = [](char tag, const std::string& payload) {
      std::string out(1, tag);
      uint64_t n = payload.size();
      while (n >= 0x80) {
        out += static_cast<char>(0x80 | (n & 0x7f));
        n >>= 7;
      }
      out += static_cast<char>(n);
      return out + payload;
    };
    return wrap('\x2a', wrap('\x2a', contents));
  };
  inference::InferTensorContents zeros;
  for (int i = 0; i < 1000000; ++i) zeros.add_int64_contents(0);
  const std::string million = in_contents(zeros.SerializeAsString());
  CHECK_EQ(Outcome(ScanBytes(million, contents_limit(8000000), {4096, 70000})),
           std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(million, contents_limit(7999999), {4096, 70000})),
           std::string("over contents_bytes"));
  const std::string unpacked = std::string("\x18\x01", 2) + std::string("\x18\x01", 2) +
                               std::string("\x18\x01", 2) + std::string("\x18\x01", 2) +
                               std::string("\x18\x01", 2) + std::string("\x18\xff\x01", 3) +
                               std::string("\x18\xff\x01", 3);  // 7 int64 values
  const std::string two_inputs = in_contents(unpacked) + in_contents(unpacked);
  CHECK_EQ(Outcome(ScanBytes(two_inputs, contents_limit(112))), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(two_inputs, contents_limit(111))), std::string("over contents_bytes"));
  const std::string fixed = std::string("\x35" "abcd" "\x35" "abcd" "\x35" "abcd" "\x39" "xxxxxxxx", 24);
  CHECK_EQ(Outcome(ScanBytes(in_contents(fixed.substr(0, 15)), contents_limit(12))),
           std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(fixed), contents_limit(96))), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(fixed), contents_limit(95))),
           std::string("over contents_bytes"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(unpacked + "\x18"), contents_limit(55))),
           std::string("over contents_bytes"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(unpacked + "\x18"), contents_limit(56))),
           std::string("malformed"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(std::string("\x98\x00\x01", 3)), contents_limit(7))),
           std::string("over contents_bytes"));
  // Many empty outputs: refused at the first past the bound, whatever follows.
  auto few = unlimited;
  few.most[static_cast<int>(WireRule::kOutputs)] = 1024;
  std::string empty_outputs;
  for (int i = 0; i < 2000; ++i) empty_outputs += std::string("\x32\x00", 2);
  CHECK_EQ(Outcome(ScanBytes(empty_outputs + "\xff", few)), std::string("over outputs"));
  CHECK_EQ(Outcome(ScanBytes(empty_outputs.substr(0, 2048) + "\xff", few)),
           std::string("malformed"));
}

void TestWireScanMalformed() {
  const auto unlimited = batchgate::UnlimitedWireLimits();
  const auto scan = [&](const std::string& bytes) { return Outcome(ScanBytes(bytes, unlimited)); };
  const auto parses = [](const std::string& bytes) {
    inference::ModelInferRequest r;
    return r.ParseFromString(bytes);
  };
  const std::string ten_byte_varint = std::string("\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 10);
  // What the parser accepts, which the scan passes: unknown fields of every wire type, a
  // group holding a group, a varint of ten bytes, a known field of the wrong wire type.
  const std::string fine[] = {
      std::string("\x40\x01", 2),                       // field 8 varint
      std::string("\x41") + std::string(8, '\0'),       // fixed64
      std::string("\x45") + std::string(4, '\0'),       // fixed32
      std::string("\x42\x02xy"),                        // length-delimited
      std::string("\x43\x0b\x08\x01\x0c\x44", 6),       // group 8 { group 1 { 1: 1 } }
      "\x40" + ten_byte_varint,
      std::string("\x08\x01", 2),                       // model_name as a varint: unknown
      std::string("\x2a\x04\x1b\x08\x01\x1c", 6),       // inputs { group 3 { 1: 1 } }
      std::string("\x22\x07\x12\x05\x2d\x00\x00\x00\x00", 9),  // map { value { 5: fixed32 } }
      std::string("\xaa\x00\x00", 3),                   // inputs, its tag in two bytes
  };
  for (const std::string& bytes : fine) {
    CHECK_EQ(scan(bytes), std::string("within"));
    CHECK(parses(bytes));
  }
  const std::string bad[] = {
      std::string("\x28", 1),                           // a tag and no value
      std::string("\x28\x80", 2),                       // a varint cut short
      "\x28" + ten_byte_varint.substr(0, 9) + "\x80\x01",  // eleven bytes
      std::string("\x0a\x05" "abc"),                    // a length past the end
      std::string("\x2a\x03\x0a\x05" "a", 5),           // ... past its message's end
      std::string("\x02\x00", 2),                       // field number 0
      std::string("\x00", 1),
      std::string("\x46\x00", 2),                       // wire type 6
      std::string("\x47\x00", 2),                       // wire type 7
      std::string("\x44", 1),                           // a group's end, none began
      std::string("\x43\x4c", 2),                       // group 8 ended as 9
      std::string("\x43\x08\x01", 3),                   // group 8 never ended
      std::string("\x2a\x02\x43\x44\x44", 5),           // its end outside its message
      std::string("\x80\x80\x80\x80\x80\x08", 6),       // a tag in six bytes
  };
  for (const std::string& bytes : bad) {
    CHECK_EQ(scan(bytes), std::string("malformed"));
    CHECK(!parses(bytes));
  }
  // Where the two parsers differ, the scans take the stricter: a length in six bytes (this
  // parser refuses it, upb does not), a tag past 32 bits (upb refuses it, this parser wraps it
  // round to field 1).
  const std::string long_length = std::string("\x0a\x80\x80\x80\x80\x80\x00", 7);
  CHECK_EQ(scan(long_length), std::string("malformed"));
  CHECK(!parses(long_length));
  const std::string wide_tag = std::string("\x8a\x80\x80\x80\x10\x00", 6);
  CHECK_EQ(scan(wide_tag), std::string("malformed"));
  CHECK(parses(wide_tag));
  // Groups nested 100 deep parse; 101 do not.
  const auto nested = [](int depth) {
    std::string bytes;
    for (int i = 0; i < depth; ++i) bytes += "\x43";
    for (int i = 0; i < depth; ++i) bytes += "\x44";
    return bytes;
  };
  CHECK_EQ(scan(nested(99)), std::string("within"));
  CHECK(parses(nested(99)));
  CHECK_EQ(scan(nested(101)), std::string("malformed"));
  CHECK(!parses(nested(101)));
  // Every cut of a valid request that the parser refuses, the scan calls malformed (or, cut
  // inside a string, passes on for the parser to refuse); none that parses is refused.
  const std::string whole = EveryKind().SerializeAsString();
  for (size_t size = 0; size < whole.size(); ++size) {
    const std::string cut = whole.substr(0, size);
    if (scan(cut) == "malformed") CHECK(!parses(cut));
  }
}

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

// A Batch stands for one Result per request (wire.proto).
void TestBatchResults() {
  batchgate::wire::Batch batch;
  for (const uint64_t rid : {7u, 9u}) batch.add_rids(rid);
  for (const uint64_t first : {0u, 3u}) batch.add_first_rows(first);
  for (const uint64_t rows : {3u, 1u}) batch.add_rows(rows);
  batch.set_released(true);
  auto* output = batch.add_outputs();
  output->set_block(4096);
  output->set_row_bytes(8);
  output->add_tail(2);
  std::vector<std::unique_ptr<batchgate::wire::Result>> results;
  CHECK(batchgate::AppendBatchResults(batch, &results));
  CHECK(results.size() == 2);
  CHECK(results[1]->rid() == 9 && results[1]->released());
  CHECK(results[1]->outputs_size() == 1);
  const auto& out = results[1]->outputs(0);
  CHECK(out.block() == 4096 && out.offset() == 4096 + 3 * 8 && out.nbytes() == 8);
  CHECK(out.shape_size() == 2 && out.shape(0) == 1 && out.shape(1) == 2);
  CHECK(results[0]->outputs(0).offset() == 4096 && results[0]->outputs(0).nbytes() == 24);
  batch.add_rows(5);  // the lists no longer line up: nothing is appended
  CHECK(!batchgate::AppendBatchResults(batch, &results));
  CHECK(results.size() == 2);
}

// An Infer of `model` with one tensor per shape in `shapes`, each in the arena at `offset`.
batchgate::wire::Infer MakeInfer(uint64_t rid, uint32_t model,
                                 const std::vector<std::vector<int64_t>>& shapes,
                                 uint64_t offset) {
  batchgate::wire::Infer infer;
  infer.set_rid(rid);
  infer.set_model(model);
  infer.set_batch_size(shapes.empty() || shapes[0].empty() ? 1 : shapes[0][0]);
  infer.set_priority(rid % 3);
  infer.set_deadline_ns(1000 + static_cast<int64_t>(rid));
  infer.set_timeout_us(10 * rid);
  infer.set_id("r" + std::to_string(rid));
  for (const auto& shape : shapes) {
    auto* tensor = infer.add_inputs();
    tensor->set_offset(offset);
    tensor->set_nbytes(64);
    for (const int64_t dim : shape) tensor->add_shape(dim);
  }
  return infer;
}

void TestGroupInfers() {
  // Requests that may share a group and have company go in one; lone ones, and those that may
  // not (SubmitInfer's flag false, an input in a client's region), stay Infers in their order.
  batchgate::wire::ToExecutor frame;
  *frame.add_infer() = MakeInfer(1, 1, {{1, 4}, {1, 2, 2}}, 100);
  *frame.add_infer() = MakeInfer(2, 1, {{1, 5}, {1, 2, 2}}, 200);  // another tail: alone
  *frame.add_infer() = MakeInfer(3, 1, {{3, 4}, {3, 2, 2}}, 300);  // joins rid 1
  *frame.add_infer() = MakeInfer(4, 2, {{1, 4}, {1, 2, 2}}, 400);  // another model: alone
  *frame.add_infer() = MakeInfer(5, 1, {{1, 4}, {1, 2, 2}}, 500);  // not groupable
  *frame.add_infer() = MakeInfer(6, 1, {{1, 4}, {1, 2, 2}}, 600);  // placed
  frame.mutable_infer(5)->mutable_inputs(1)->mutable_placement()->set_region("r");
  *frame.add_infer() = MakeInfer(7, 1, {{2, 4}, {2, 2, 2}}, 700);  // joins rid 1
  batchgate::GroupInfers(frame, {true, true, true, true, false, true, true});
  std::vector<uint64_t> left;
  for (const auto& infer : frame.infer()) left.push_back(infer.rid());
  CHECK((left == std::vector<uint64_t>{2, 4, 5, 6}));
  CHECK_EQ(frame.groups_size(), 1);
  const auto& group = frame.groups(0);
  CHECK(group.model() == 1);
  CHECK((std::vector<uint64_t>(group.rids().begin(), group.rids().end()) ==
         std::vector<uint64_t>{1, 3, 7}));
  CHECK((std::vector<uint32_t>(group.batch_sizes().begin(), group.batch_sizes().end()) ==
         std::vector<uint32_t>{1, 3, 2}));
  CHECK(group.priorities(1) == 0 && group.priorities(2) == 1);
  CHECK(group.deadlines_ns(2) == 1007 && group.timeouts_us(1) == 30 && group.ids(2) == "r7");
  CHECK_EQ(group.inputs_size(), 2);
  CHECK(group.inputs(0).tail_size() == 1 && group.inputs(0).tail(0) == 4);
  CHECK(group.inputs(1).tail_size() == 2 && group.inputs(1).tail(1) == 2);
  CHECK((std::vector<uint64_t>(group.inputs(1).offsets().begin(), group.inputs(1).offsets().end())
         == std::vector<uint64_t>{100, 300, 700}));

  // Nobody to share a group with: the frame stays as it is.
  batchgate::wire::ToExecutor alone;
  *alone.add_infer() = MakeInfer(1, 1, {{1, 4}}, 0);
  *alone.add_infer() = MakeInfer(2, 2, {{1, 4}}, 64);
  batchgate::GroupInfers(alone, {true, true});
  CHECK(alone.infer_size() == 2 && alone.groups_size() == 0);
  // Nor do requests without inputs: a group's requests are its offset columns.
  batchgate::wire::ToExecutor empty;
  *empty.add_infer() = MakeInfer(1, 1, {}, 0);
  *empty.add_infer() = MakeInfer(2, 1, {}, 0);
  batchgate::GroupInfers(empty, {true, true});
  CHECK(empty.infer_size() == 2 && empty.groups_size() == 0);
  // Nor do those whose rows are not their batch_size (a group's shapes are (batch_size, tail)).
  batchgate::wire::ToExecutor zero;
  *zero.add_infer() = MakeInfer(1, 1, {{0, 4}}, 0);
  *zero.add_infer() = MakeInfer(2, 1, {{0, 4}}, 64);
  zero.mutable_infer(0)->set_batch_size(1);
  zero.mutable_infer(1)->set_batch_size(1);
  batchgate::GroupInfers(zero, {true, true});
  CHECK(zero.infer_size() == 2 && zero.groups_size() == 0);
  // A group holds 4096 requests at most: the next ones of its kind start another, in order.
  batchgate::wire::ToExecutor many;
  constexpr int kMany = 4096 + 3;
  for (int i = 0; i < kMany; ++i) {
    *many.add_infer() = MakeInfer(static_cast<uint64_t>(i + 1), 1, {{1, 4}},
                                  static_cast<uint64_t>(i) * 16);
  }
  batchgate::GroupInfers(many, std::vector<bool>(kMany, true));
  CHECK(many.infer_size() == 0 && many.groups_size() == 2);
  CHECK(many.groups(0).rids_size() == 4096 && many.groups(1).rids_size() == 3);
  CHECK(many.groups(1).rids(0) == 4097 && many.groups(1).inputs(0).offsets(2) == (kMany - 1) * 16);
}

// -- the executor link's writing --------------------------------------------------------------

// The executor's end of a link, played by the test: one abstract socket, frames read and written
// whole.
class FakeExecutor {
 public:
  explicit FakeExecutor(const std::string& name) {
    listener_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name.data(), name.size());
    const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    CHECK(bind(listener_, reinterpret_cast<sockaddr*>(&address), length) == 0);
    CHECK(listen(listener_, 1) == 0);
  }
  ~FakeExecutor() {
    if (fd_ >= 0) close(fd_);
    close(listener_);
  }
  void Accept() {
    fd_ = accept(listener_, nullptr, nullptr);
    CHECK(fd_ >= 0);
    // A frame that never comes fails the test instead of hanging it.
    const timeval limit{10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  }
  bool Read(batchgate::wire::ToExecutor* frame) {
    unsigned char header[4];
    if (!ReadAll(reinterpret_cast<char*>(header), 4)) return false;
    const uint32_t size = header[0] | header[1] << 8 | header[2] << 16 | uint32_t{header[3]} << 24;
    largest_frame = std::max<uint64_t>(largest_frame, size);
    std::string body(size, '\0');
    return ReadAll(body.data(), size) && frame->ParseFromString(body);
  }
  // The largest frame body read so far.
  uint64_t largest_frame = 0;
  // Drops the accepted connection (the link sees its executor go).
  void CloseConnection() {
    close(fd_);
    fd_ = -1;
  }
  // Whether bytes wait to be read, without reading them.
  bool Pending() {
    char byte;
    return recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }
  void Write(const batchgate::wire::ToFrontend& frame) { WriteBytes(FrameBytes(frame)); }
  // Several frames in one send: the link's reader finds them all in one read.
  void WriteTogether(const std::vector<batchgate::wire::ToFrontend>& frames) {
    std::string all;
    for (const auto& frame : frames) all += FrameBytes(frame);
    WriteBytes(all);
  }
  void WriteBytes(const std::string& bytes) {
    CHECK(send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
  }
  static std::string FrameBytes(const batchgate::wire::ToFrontend& frame) {
    std::string bytes = frame.SerializeAsString();
    const uint32_t size = static_cast<uint32_t>(bytes.size());
    std::string all(4, '\0');
    for (int i = 0; i < 4; ++i) all[i] = static_cast<char>((size >> (8 * i)) & 0xFF);
    return all + bytes;
  }

 private:
  bool ReadAll(char* data, size_t size) {
    while (size > 0) {
      const ssize_t n = recv(fd_, data, size, 0);
      if (n <= 0) return false;
      data += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }
  int listener_ = -1;
  int fd_ = -1;
};

class LinkEvents final : public batchgate::LinkObserver {
 public:
  void OnConnectionChange(bool connected, size_t /*models*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    connected_ = connected;
    changed_.notify_all();
  }
  void OnModelChange(const std::string& /*name*/, bool /*serving*/) override {}
  bool WaitConnected() {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, std::chrono::seconds(10), [&] { return connected_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  bool connected_ = false;
};

// Counts the answers the link hands over (when it closes, everything in flight is answered).
class CountingTarget final : public batchgate::AnswerTarget, public batchgate::AnswerMailbox {
 public:
  batchgate::AnswerMailbox& mailbox() override { return *this; }
  void Post(std::vector<batchgate::PostedAnswer>& answers) override {
    for (const auto& posted : answers) {
      if (posted.answer.status.error_code() == grpc::StatusCode::UNAVAILABLE) ++unavailable;
    }
    answers.clear();
  }
  void OnExecutorAnswer(batchgate::ExecutorAnswer /*answer*/) override {}
  std::atomic<int> unavailable{0};
};

// Accepts the link's connection, reads its Hello and welcomes it.
void Welcome(FakeExecutor& executor, LinkEvents& events) {
  executor.Accept();
  batchgate::wire::ToExecutor frame;
  CHECK(executor.Read(&frame) && frame.has_hello());
  batchgate::wire::ToFrontend welcome;
  welcome.set_welcome(true);
  executor.Write(welcome);
  CHECK(events.WaitConnected());
}

// A link connected to a FakeExecutor of its own and welcomed; `target` counts its answers.
struct ConnectedLink {
  explicit ConnectedLink(const std::string& name)
      : executor(name), region(0, 1 << 20), link(name, 0, region, models, events) {
    link.Start();
    Welcome(executor, events);
  }
  // Submits `infer` for `target`, which must be accepted: its rid.
  uint64_t Submit(batchgate::wire::Infer infer = {}, bool groupable = false) {
    uint64_t rid = 0;
    grpc::Status refusal;
    CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(std::move(infer)), {}, 1,
                           &target, &rid, &refusal, groupable));
    return rid;
  }
  FakeExecutor executor;
  batchgate::InputRegion region;
  batchgate::ModelTable models;
  LinkEvents events;
  CountingTarget target;
  batchgate::ExecutorLink link;  // last: it goes first
};

void TestLinkWritesEveryEntryInOrder() {
  // Several threads submit while the executor reads nothing: far more than a socket holds (the
  // link asks for 4 MiB buffers), so a submitter's write stops part-way and the writer thread
  // finishes it, while later entries wait. Submitting never blocks. Every Infer must reach the
  // executor once, in rid order (rids are taken in the order entries join the frame), each
  // cancel after its Infer.
  ConnectedLink connected("batchgate-unit-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  CountingTarget& target = connected.target;
  batchgate::ExecutorLink& link = connected.link;
  batchgate::wire::ToExecutor frame;

  constexpr int kThreads = 3;
  constexpr int kPerThread = 40;
  const std::string id(128 << 10, 'x');  // 15 MiB in all
  std::atomic<int> refused{0};
  std::vector<std::thread> submitters;
  for (int t = 0; t < kThreads; ++t) {
    submitters.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        auto infer = std::make_unique<batchgate::wire::Infer>();
        infer->set_id(id);
        uint64_t rid = 0;
        grpc::Status refusal;
        if (!link.SubmitInfer(std::move(infer), {}, 1, &target, &rid, &refusal)) {
          ++refused;
          continue;
        }
        if (rid % 7 == 0) link.Cancel(rid);
      }
    });
  }
  for (auto& thread : submitters) thread.join();
  uint64_t last = 0;
  int infers = 0;
  bool ordered = true;
  std::map<uint64_t, bool> cancel_after_infer;  // rid -> its Infer came first
  while (infers < kThreads * kPerThread && executor.Read(&frame)) {
    for (const auto& infer : frame.infer()) {
      ordered = ordered && infer.rid() == last + 1 && infer.id() == id;
      last = infer.rid();
      ++infers;
    }
    for (const uint64_t rid : frame.cancel()) cancel_after_infer[rid] = rid <= last;
  }
  CHECK_EQ(refused.load(), 0);
  CHECK_EQ(infers, kThreads * kPerThread);
  CHECK(ordered);
  // Cancels of the last rids may come in a frame after the last Infer: read until all are in.
  const size_t cancels = static_cast<size_t>(kThreads * kPerThread / 7);
  while (cancel_after_infer.size() < cancels && executor.Read(&frame)) {
    for (const uint64_t rid : frame.cancel()) cancel_after_infer[rid] = rid <= last;
  }
  CHECK_EQ(cancel_after_infer.size(), cancels);
  bool all_after = true;
  for (const auto& [rid, after] : cancel_after_infer) all_after = all_after && after;
  CHECK(all_after);
  link.Close();  // answers what is in flight: every request, UNAVAILABLE
  CHECK_EQ(target.unavailable.load(), kThreads * kPerThread);
}

void TestLinkDefersWritesWhileRequestsAreInFlight() {
  // Inside DeferredWrites (a worker's thread), a request that finds none in flight is written at
  // once; later ones wait for FlushDeferredWrites (or the scope's end) and go in one frame.
  ConnectedLink connected("batchgate-unit-defer-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  CountingTarget& target = connected.target;
  batchgate::ExecutorLink& link = connected.link;
  auto submit = [&] { return connected.Submit(); };
  auto read_rids = [&] {
    batchgate::wire::ToExecutor frame;
    std::vector<uint64_t> rids;
    if (executor.Read(&frame)) {
      for (const auto& infer : frame.infer()) rids.push_back(infer.rid());
    }
    return rids;
  };
  uint64_t second = 0, fourth = 0;
  {
    const batchgate::ExecutorLink::DeferredWrites deferred;
    const uint64_t first = submit();
    CHECK(!batchgate::ExecutorLink::HasDeferredWrites());
    CHECK(read_rids() == std::vector<uint64_t>{first});
    second = submit();
    const uint64_t third = submit();
    CHECK(batchgate::ExecutorLink::HasDeferredWrites());
    CHECK(!executor.Pending());
    batchgate::ExecutorLink::FlushDeferredWrites();
    CHECK(!batchgate::ExecutorLink::HasDeferredWrites());
    CHECK((read_rids() == std::vector<uint64_t>{second, third}));
    fourth = submit();
    link.Cancel(second);  // joins the unwritten frame
    CHECK(!executor.Pending());
  }  // the scope's end writes what is left
  batchgate::wire::ToExecutor frame;
  CHECK(executor.Read(&frame));
  CHECK(frame.infer_size() == 1 && frame.infer(0).rid() == fourth);
  CHECK(frame.cancel_size() == 1 && frame.cancel(0) == second);
  // Outside the scope every request is written at once, in flight or not.
  const uint64_t fifth = submit();
  CHECK(read_rids() == std::vector<uint64_t>{fifth});
  link.Close();
  CHECK_EQ(target.unavailable.load(), 5);
}

void TestLinkGroupsRequestsOfOneFrame() {
  // Requests the front end marks groupable go in an InferGroup when they share a frame; a lone
  // one stays an Infer. Requests in a group are in flight like any other: closing the link
  // answers them.
  ConnectedLink connected("batchgate-unit-group-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  CountingTarget& target = connected.target;
  batchgate::ExecutorLink& link = connected.link;
  auto submit = [&] { return connected.Submit(MakeInfer(0, 1, {{1, 4}}, 0), true); };
  batchgate::wire::ToExecutor frame;
  {
    const batchgate::ExecutorLink::DeferredWrites deferred;
    const uint64_t first = submit();  // none in flight: written at once, alone
    CHECK(executor.Read(&frame));
    CHECK(frame.infer_size() == 1 && frame.infer(0).rid() == first && frame.groups_size() == 0);
    const uint64_t second = submit();
    const uint64_t third = submit();
    batchgate::ExecutorLink::FlushDeferredWrites();
    CHECK(executor.Read(&frame));
    CHECK(frame.infer_size() == 0 && frame.groups_size() == 1);
    CHECK(frame.groups(0).rids_size() == 2 && frame.groups(0).rids(0) == second &&
          frame.groups(0).rids(1) == third);
  }
  link.Close();
  CHECK_EQ(target.unavailable.load(), 3);
}

// Hands answers to the test's thread as a worker's mailbox would.
class MailboxTarget final : public batchgate::AnswerTarget, public batchgate::AnswerMailbox {
 public:
  batchgate::AnswerMailbox& mailbox() override { return *this; }
  void Post(std::vector<batchgate::PostedAnswer>& answers) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& posted : answers) answers_.push_back(std::move(posted.answer));
    answers.clear();
    ++posts;
    arrived_.notify_all();
  }
  // How many answers have come, without taking them.
  size_t Waiting() {
    std::lock_guard<std::mutex> lock(mu_);
    return answers_.size();
  }
  std::atomic<int> posts{0};
  void OnExecutorAnswer(batchgate::ExecutorAnswer /*answer*/) override {}
  batchgate::ExecutorAnswer Take() {
    std::unique_lock<std::mutex> lock(mu_);
    CHECK(arrived_.wait_for(lock, std::chrono::seconds(10), [&] { return !answers_.empty(); }));
    if (answers_.empty()) return {};
    batchgate::ExecutorAnswer answer = std::move(answers_.front());
    answers_.erase(answers_.begin());
    return answer;
  }

 private:
  std::mutex mu_;
  std::condition_variable arrived_;
  std::vector<batchgate::ExecutorAnswer> answers_;
};

batchgate::wire::ToFrontend ResultFor(uint64_t rid, uint64_t block) {
  batchgate::wire::ToFrontend frame;
  auto* result = frame.add_results();
  result->set_rid(rid);
  result->set_released(true);
  auto* output = result->add_outputs();
  output->set_block(block);
  output->set_offset(block);
  output->set_nbytes(16);
  return frame;
}

void TestLinkStopsReadingOutputsOfALostConnection() {
  // Two answers arrive; the first is being copied (an OutputRead holds), the second still waits
  // in its worker's mailbox when the executor drops the connection. The link says Hello again
  // only once the copy is done (the executor then reuses the blocks), and the waiting answer is
  // never read: it becomes UNAVAILABLE.
  const std::string name = "batchgate-unit-reads-" + std::to_string(getpid());
  FakeExecutor executor(name);
  batchgate::InputRegion region(0, 1 << 20);
  batchgate::ModelTable models;
  LinkEvents events;
  MailboxTarget copying, waiting;
  batchgate::ExecutorLink link(name, 0, region, models, events);
  link.Start();
  Welcome(executor, events);
  uint64_t first = 0, second = 0;
  grpc::Status refusal;
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {}, 1, &copying, &first,
                         &refusal));
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {}, 1, &waiting, &second,
                         &refusal));
  batchgate::wire::ToExecutor frame;
  int infers = 0;
  while (infers < 2 && executor.Read(&frame)) infers += frame.infer_size();
  executor.Write(ResultFor(first, 1 << 20));
  batchgate::ExecutorAnswer copied = copying.Take();
  CHECK(copied.result != nullptr);
  auto read = std::make_unique<batchgate::ExecutorLink::OutputRead>(link, copied);
  CHECK(read->ok());
  executor.Write(ResultFor(second, 2 << 20));
  batchgate::ExecutorAnswer unread = waiting.Take();
  std::atomic<int> order{0};
  int copy_done = 0, hello_came = 0;
  std::thread copier([&] {
    // Long enough for a link that does not wait to have said Hello already.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    copy_done = ++order;
    read.reset();
  });
  executor.CloseConnection();
  executor.Accept();
  CHECK(executor.Read(&frame) && frame.has_hello());
  hello_came = ++order;
  copier.join();
  CHECK(copy_done > 0 && copy_done < hello_came);
  {
    const batchgate::ExecutorLink::OutputRead late(link, unread);
    CHECK(!late.ok());
  }
  CHECK(unread.result == nullptr);
  CHECK_EQ(static_cast<int>(unread.status.error_code()),
           static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  link.Close();
}

void TestLinkKeepsInputsTheExecutorStillReads() {
  // Requests in flight when the connection is lost keep their input blocks; the next welcome
  // says which the executor still reads (held): the others are free again at once, the held
  // ones once released_inputs names them. A held block this process does not hold (its
  // predecessor's) is taken in the region until then.
  const std::string name = "batchgate-unit-kept-" + std::to_string(getpid());
  FakeExecutor executor(name);
  batchgate::InputRegion region(0, 1 << 20);
  batchgate::ModelTable models;
  LinkEvents events;
  CountingTarget target;
  batchgate::ExecutorLink link(name, 0, region, models, events);
  link.Start();
  Welcome(executor, events);
  const uint64_t read_still = *region.Allocate(1000);
  const uint64_t not_read = *region.Allocate(1000);
  uint64_t rid = 0;
  grpc::Status refusal;
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {read_still}, 1, &target,
                         &rid, &refusal));
  CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {not_read}, 1, &target,
                         &rid, &refusal));
  batchgate::wire::ToExecutor frame;
  int infers = 0;
  while (infers < 2 && executor.Read(&frame)) infers += frame.infer_size();
  executor.CloseConnection();
  executor.Accept();
  CHECK(executor.Read(&frame) && frame.has_hello());
  CHECK_EQ(region.bytes_in_use(), uint64_t{2048});  // both kept while disconnected
  const uint64_t predecessors = 512 << 10;
  batchgate::wire::ToFrontend welcome;
  welcome.set_welcome(true);
  auto* held = welcome.add_held();
  held->set_offset(read_still);
  held->set_nbytes(1000);
  held = welcome.add_held();
  held->set_offset(predecessors);
  held->set_nbytes(256);
  executor.Write(welcome);
  CHECK(events.WaitConnected());
  // A frame after the welcome is handled after it: once its reply comes, so has the welcome.
  MailboxTarget call_target;
  auto call = std::make_unique<batchgate::wire::Call>();
  call->mutable_index();
  CHECK(link.SubmitCall(std::move(call), &call_target, &refusal));
  while (executor.Read(&frame) && frame.call_size() == 0) {
  }
  batchgate::wire::ToFrontend reply;
  reply.add_replies()->set_cid(frame.call(0).cid());
  executor.Write(reply);
  call_target.Take();
  CHECK_EQ(region.bytes_in_use(), uint64_t{1024 + 256});  // not_read freed; the others taken
  CHECK(!region.Reserve(read_still, 1) && !region.Reserve(predecessors, 1));
  CHECK(region.Reserve(not_read, 1000) && region.Free(not_read));
  batchgate::wire::ToFrontend released;
  released.add_released_inputs(read_still);
  released.add_released_inputs(predecessors);
  released.add_replies()->set_cid(0);  // answers nothing: a marker only
  executor.Write(released);
  auto second = std::make_unique<batchgate::wire::Call>();
  second->mutable_index();
  CHECK(link.SubmitCall(std::move(second), &call_target, &refusal));
  while (executor.Read(&frame) && frame.call_size() == 0) {
  }
  batchgate::wire::ToFrontend second_reply;
  second_reply.add_replies()->set_cid(frame.call(0).cid());
  executor.Write(second_reply);
  call_target.Take();
  CHECK_EQ(region.bytes_in_use(), uint64_t{0});
  link.Close();
}

// A frame's bytes: its 4-byte little-endian length, then `body`.
std::string FrameOf(const std::string& body) {
  std::string bytes(4, '\0');
  const auto size = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((size >> (8 * i)) & 0xFF);
  return bytes + body;
}

void TestFrameReader() {
  // One read yields every whole frame the socket holds; a frame split across reads, or a
  // length prefix cut short, waits for its rest; a frame larger than one read gets room of its
  // own; a length past the limit is refused before its body is read.
  using Status = batchgate::FrameReader::Status;
  int fds[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  const auto send_bytes = [&](const std::string& bytes) {
    CHECK(send(fds[0], bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(bytes.size()));
  };
  const auto next = [](batchgate::FrameReader& reader) -> std::string {
    const char* body = nullptr;
    uint32_t size = 0;
    if (!reader.Next(&body, &size)) return "<none>";
    return std::string(body, size);
  };
  batchgate::FrameReader reader(1000);
  send_bytes(FrameOf("one") + FrameOf("") + FrameOf("three"));
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("one"));
  CHECK_EQ(next(reader), std::string(""));
  CHECK_EQ(next(reader), std::string("three"));
  CHECK_EQ(next(reader), std::string("<none>"));
  CHECK_EQ(reader.buffered(), size_t{0});

  const std::string split = FrameOf("split across reads");
  send_bytes(split.substr(0, 2));  // half a length prefix
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("<none>"));
  CHECK_EQ(reader.buffered(), size_t{2});
  send_bytes(split.substr(2, 7));  // the rest of the prefix, part of the body
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("<none>"));
  send_bytes(split.substr(9) + FrameOf("after"));
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("split across reads"));
  CHECK_EQ(next(reader), std::string("after"));
  CHECK_EQ(next(reader), std::string("<none>"));

  // Reads of 16 bytes: the first brings the prefix, the second all the rest of a 100-byte body.
  batchgate::FrameReader small(1000, 16);
  const std::string large(100, 'L');
  send_bytes(FrameOf(large));
  int fills = 0;
  std::string got = "<none>";
  while (got == "<none>" && fills < 10 && small.Fill(fds[1]) == Status::kFrames) {
    ++fills;
    got = next(small);
  }
  CHECK_EQ(got, large);
  CHECK_EQ(fills, 2);

  // 1001 bytes, one past the limit: refused at its prefix, and its body is never read.
  send_bytes(FrameOf(std::string(1001, 'x')).substr(0, 4));
  CHECK(reader.Fill(fds[1]) == Status::kFrames);
  CHECK_EQ(next(reader), std::string("<none>"));
  send_bytes(std::string(1001, 'x'));
  CHECK(reader.Fill(fds[1]) == Status::kOversize);
  CHECK_EQ(reader.oversize_bytes(), uint32_t{1001});
  char byte = 0;
  CHECK(recv(fds[1], &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 1);  // still in the socket
  CHECK(reader.buffered() <= size_t{4});

  batchgate::FrameReader closed(1000);
  close(fds[0]);
  while (recv(fds[1], &byte, 1, MSG_DONTWAIT) > 0) {
  }
  CHECK(closed.Fill(fds[1]) == Status::kClosed);
  close(fds[1]);
}

void TestLinkPostsAReadsAnswersAtOnce() {
  // Three results in one send come in one read: they reach their worker's mailbox as one post
  // (one lock, one doorbell), in the order they came. A frame past the limit then ends the
  // connection: the request still in flight is answered UNAVAILABLE and the link says Hello
  // again.
  const std::string name = "batchgate-unit-posts-" + std::to_string(getpid());
  FakeExecutor executor(name);
  batchgate::InputRegion region(0, 1 << 20);
  batchgate::ModelTable models;
  LinkEvents events;
  MailboxTarget target;
  batchgate::ExecutorLink link(name, 0, region, models, events);
  link.Start();
  Welcome(executor, events);
  uint64_t rids[4] = {};
  grpc::Status refusal;
  for (uint64_t& rid : rids) {
    CHECK(link.SubmitInfer(std::make_unique<batchgate::wire::Infer>(), {}, 1, &target, &rid,
                           &refusal));
  }
  batchgate::wire::ToExecutor frame;
  int infers = 0;
  while (infers < 4 && executor.Read(&frame)) infers += frame.infer_size();
  executor.WriteTogether({ResultFor(rids[0], 1 << 20), ResultFor(rids[1], 2 << 20),
                          ResultFor(rids[2], 3 << 20)});
  for (int i = 0; i < 3; ++i) {
    const batchgate::ExecutorAnswer answer = target.Take();
    CHECK(answer.result != nullptr && answer.result->rid() == rids[i]);
  }
  CHECK_EQ(target.posts.load(), 1);

  const uint32_t oversize = batchgate::wire::MAX_FRAME_BYTES + 1u;
  std::string prefix(4, '\0');
  for (int i = 0; i < 4; ++i) prefix[i] = static_cast<char>((oversize >> (8 * i)) & 0xFF);
  executor.WriteBytes(prefix);
  const batchgate::ExecutorAnswer lost = target.Take();
  CHECK(lost.result == nullptr);
  CHECK_EQ(static_cast<int>(lost.status.error_code()),
           static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  executor.CloseConnection();
  executor.Accept();
  CHECK(executor.Read(&frame) && frame.has_hello());
  link.Close();
}

void TestDeadlines() {
  // A grpc-timeout of 99999999 hours (gRPC's largest) overflowed int64 nanoseconds: UBSan
  // aborted, a release build carried a garbage deadline. It saturates.
  constexpr int64_t kLast = std::numeric_limits<int64_t>::max();
  const int64_t now = 5'000'000'000;
  CHECK_EQ(batchgate::DeadlineAfter(now, 2, 500), now + 2'000'000'500);
  CHECK_EQ(batchgate::DeadlineAfter(now, int64_t{99999999} * 3600, 0), kLast);
  CHECK_EQ(batchgate::DeadlineAfter(now, kLast / 1'000'000'000, 999'999'999), kLast);
  CHECK_EQ(batchgate::DeadlineAfter(kLast - 10, 0, 11), kLast);
  // Already past: at once (1), never 0, which means no deadline.
  CHECK_EQ(batchgate::DeadlineAfter(now, -6, 0), int64_t{1});
  CHECK_EQ(batchgate::DeadlineAfter(now, std::numeric_limits<int64_t>::min() / 2, 0), int64_t{1});
}

void TestLinkFramesStayUnderTheLimit() {
  // Deferred entries pile up into one frame past wire.proto's limit: 15 MiB of requests, then a
  // call of 60 MiB. The writer splits the frame before the call goes in (its size is checked
  // before appending), so no frame passes MAX_FRAME_BYTES; a call too large for any frame is
  // refused up front.
  ConnectedLink connected("batchgate-unit-limit-" + std::to_string(getpid()));
  FakeExecutor& executor = connected.executor;
  batchgate::ExecutorLink& link = connected.link;
  const std::string id(1 << 20, 'i');
  CountingTarget call_target;
  constexpr int kInfers = 16;
  {
    const batchgate::ExecutorLink::DeferredWrites deferred;
    for (int i = 0; i < kInfers; ++i) {
      batchgate::wire::Infer infer;
      infer.set_id(id);
      connected.Submit(std::move(infer));
    }
    auto call = std::make_unique<batchgate::wire::Call>();
    call->mutable_statistics()->set_name(std::string(60 << 20, 'n'));
    grpc::Status refusal;
    CHECK(link.SubmitCall(std::move(call), &call_target, &refusal));
    auto too_large = std::make_unique<batchgate::wire::Call>();
    too_large->mutable_statistics()->set_name(std::string(batchgate::wire::MAX_FRAME_BYTES, 'n'));
    CHECK(!link.SubmitCall(std::move(too_large), &call_target, &refusal));
    CHECK_EQ(static_cast<int>(refusal.error_code()),
             static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
    CHECK_EQ(refusal.error_message(),
             std::string("the request is larger than the 67108864 bytes a front end forwards "
                         "to the executor process"));
  }
  int infers = 0, calls = 0;
  batchgate::wire::ToExecutor frame;
  while ((infers < kInfers || calls < 1) && executor.Read(&frame)) {
    infers += frame.infer_size();
    calls += frame.call_size();
  }
  CHECK_EQ(infers, kInfers);
  CHECK_EQ(calls, 1);
  CHECK(executor.largest_frame <= static_cast<uint64_t>(batchgate::wire::MAX_FRAME_BYTES));
  link.Close();
}

int main() {
  TestQuotingAndCutting();
  TestShapes();
  TestFloats();
  TestJson();
  TestInputRegion();
  TestBearerTokens();
  TestDecode();
  TestSharedMemoryDecode();
  TestPlacedOutputReply();
  TestWireScanCounts();
  TestWireScanMalformed();
  TestHandover();
  TestMetrics();
  TestBatchResults();
  TestLinkWritesEveryEntryInOrder();
  TestLinkDefersWritesWhileRequestsAreInFlight();
  TestGroupInfers();
  TestLinkGroupsRequestsOfOneFrame();
  TestLinkFramesStayUnderTheLimit();
  TestDeadlines();
  TestLinkStopsReadingOutputsOfALostConnection();
  TestLinkKeepsInputsTheExecutorStillReads();
  TestFrameReader();
  TestLinkPostsAReadsAnswersAtOnce();
  std::fprintf(stderr, "%d of %d checks failed\n", g_failures, g_checks);
  return g_failures ? 1 : 0;
}
