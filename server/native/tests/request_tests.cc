// Unit tests: decode_request()'s checks and conversions (shared-memory parameters too), a
// placed output's reply, a call's deadline.
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

// What the one-process server (server/frontend/codec.py) answers for the shared-memory cases of
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

}  // namespace

void RunRequestTests() {
  TestDecode();
  TestSharedMemoryDecode();
  TestPlacedOutputReply();
  TestDeadlines();
}
