// libFuzzer: a ModelInferRequest's bytes through what the front end does with them: the wire
// scan (whole, and over two slices cut where the first byte says: the same answer), the parse,
// decode_request()'s checks against every model, and the inputs written out as the arena gets
// them. A scan that calls bytes malformed must mean the parser refuses them.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "fuzz_models.h"

namespace {

bool LongVarint(const uint8_t* data, size_t size) {
  size_t run = 0;
  for (size_t i = 0; i < size; ++i) {
    run = data[i] >= 0x80 ? run + 1 : 0;
    if (run >= 4) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace batchgate;
  static const WireLimits limits = fuzz::Limits();
  const ScanResult whole = ScanInferRequest({{data, size}}, limits);
  const size_t cut = size == 0 ? 0 : data[0] % (size + 1);
  const ScanResult split = ScanInferRequest({{data, cut}, {data + cut, size - cut}}, limits);
  if (whole.outcome != split.outcome ||
      (whole.outcome == ScanOutcome::kOverLimit && whole.rule != split.rule)) {
    std::abort();
  }
  inference::ModelInferRequest request;
  const bool parsed = request.ParseFromArray(data, static_cast<int>(size));
  // Where the parsers differ (a tag past 32 bits, a length in more than five bytes, which
  // C++'s takes and upb's refuses), the scan takes the stricter: both need a varint of four
  // bytes or more, so those inputs are not held to it.
  if (whole.outcome == ScanOutcome::kMalformed && parsed && !LongVarint(data, size)) {
    std::abort();
  }
  if (whole.outcome != ScanOutcome::kWithin || !parsed) return 0;
  RequestLimits request_limits;
  request_limits.max_request_bytes = 1 << 16;
  request_limits.max_tensor_elements = 1 << 14;
  for (const auto& model : fuzz::Models()) {
    for (const bool shared_memory : {false, true}) {
      DecodedRequest decoded;
      if (!DecodeRequest(request, *model, request_limits, shared_memory, &decoded).ok()) continue;
      uint64_t total = 0;
      for (size_t i = 0; i < decoded.inputs.size(); ++i) {
        const InputPlan& plan = decoded.inputs[i];
        if (plan.placed) continue;
        total += plan.nbytes;
        // Exactly plan.nbytes: the sanitizer sees a write past it.
        std::vector<uint8_t> destination(plan.nbytes);
        WriteInput(request, plan, model->inputs[i], destination.data());
      }
      if (total > request_limits.max_request_bytes) std::abort();
    }
  }
  return 0;
}
