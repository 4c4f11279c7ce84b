// libFuzzer: the reply encoder. A wire::Result as the executor could send it (any outputs,
// offsets, sizes, shapes, placements) and requested outputs from the first bytes, against each
// model and an arena: EncodeResponse must refuse what does not fit (the arena, the request,
// the reply's bound) and build what does, never reading outside the arena.
#include <cstdint>
#include <vector>

#include "fuzz_models.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace batchgate;
  if (size < 2) return 0;
  const bool for_stream = data[0] & 1;
  const size_t asked = data[1] % 4;  // 0: every output
  if (size < 2 + asked) return 0;
  wire::Result result;
  if (!result.ParseFromArray(data + 2 + asked, static_cast<int>(size - 2 - asked))) return 0;
  for (const auto& model : fuzz::Models()) {
    std::vector<uint32_t> requested;
    for (size_t i = 0; i < asked; ++i) {
      requested.push_back(static_cast<uint32_t>(data[2 + i] % model->outputs.size()));
    }
    fuzz::EncodeAndCheck(*model, requested, result, for_stream);
  }
  return 0;
}
