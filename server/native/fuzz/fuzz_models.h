// What the fuzz targets check requests and results against: a model table like the tests'
// (every datatype, fixed and variable dimensions, batching and not), the wire limits at
// smaller bounds than the defaults (so that the fuzzer reaches past them), and an arena.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "codec.h"
#include "input_region.h"
#include "model_table.h"
#include "wire_scan.h"

namespace batchgate::fuzz {

inline std::shared_ptr<const ModelState> Model(const std::string& name, int max_batch_size,
                                               const std::vector<std::string>& datatypes,
                                               int64_t dim) {
  wire::ModelState state;
  state.set_name(name);
  state.set_state("READY");
  state.set_handle(1);
  auto* spec = state.mutable_spec();
  spec->set_name(name);
  spec->set_version("1");
  spec->set_max_batch_size(max_batch_size);
  for (const std::string& type : datatypes) {
    auto* in = spec->add_inputs();
    in->set_name("IN_" + type);
    in->set_datatype(type);
    in->add_dims(dim);
    auto* out = spec->add_outputs();
    out->set_name("OUT_" + type);
    out->set_datatype(type);
    out->add_dims(dim);
  }
  return MakeModelState(state, 1);
}

// "echo": every datatype, dims [3], batching; "any": FP32, INT64 and BYTES of any length, no
// batching.
inline const std::vector<std::shared_ptr<const ModelState>>& Models() {
  static const auto* models = new std::vector<std::shared_ptr<const ModelState>>{
      Model("echo", 4,
            {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES"},
            3),
      Model("any", 0, {"FP32", "INT64", "BYTES"}, -1)};
  return *models;
}

inline WireLimits Limits() {
  WireLimits limits;
  const uint64_t most[kWireRules] = {8, 8, 8, 8, 8, 64, 64, 8, 1 << 16};
  for (int i = 0; i < kWireRules; ++i) {
    limits.most[i] = most[i];
    limits.refusal[i] = rules::kWireRuleKeys[i];
  }
  return limits;
}

constexpr uint64_t kArenaBytes = 1 << 16;

// An arena of kArenaBytes filled with a pattern, as the executor's would hold outputs.
inline const Arena& TheArena() {
  static const Arena* arena = [] {
    auto* mapped = new Arena;
    const int fd = memfd_create("fuzz-arena", 0);
    std::string error;
    if (fd < 0 || ftruncate(fd, kArenaBytes) != 0 || !mapped->Map(fd, kArenaBytes, &error)) {
      std::abort();
    }
    close(fd);
    for (uint64_t i = 0; i < kArenaBytes; ++i) mapped->data()[i] = static_cast<uint8_t>(i * 7);
    return mapped;
  }();
  return *arena;
}

// What the front end does with a result for `model`: the reply built (or refused) within
// `max_reply_bytes`; a reply built must parse and hold one output per one asked for.
inline void EncodeAndCheck(const ModelState& model, const std::vector<uint32_t>& requested,
                           const wire::Result& result, bool for_stream) {
  grpc::ByteBuffer reply;
  std::string problem;
  const grpc::Status status = EncodeResponse(model, "fuzz", requested, result, TheArena(),
                                             for_stream, 1 << 20, &reply, &problem);
  if (!status.ok()) return;
  std::vector<grpc::Slice> slices;
  if (!reply.Dump(&slices).ok()) std::abort();
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  if (bytes.size() > (1 << 20)) std::abort();  // sized before it was built, within the bound
  inference::ModelInferResponse response;
  if (for_stream) {
    inference::ModelStreamInferResponse streamed;
    if (!streamed.ParseFromString(bytes)) std::abort();
    response = streamed.infer_response();
  } else if (!response.ParseFromString(bytes)) {
    std::abort();
  }
  const size_t wanted = requested.empty() ? model.outputs.size() : requested.size();
  if (static_cast<size_t>(response.outputs_size()) != wanted ||
      static_cast<size_t>(response.raw_output_contents_size()) != wanted) {
    std::abort();
  }
}

}  // namespace batchgate::fuzz
