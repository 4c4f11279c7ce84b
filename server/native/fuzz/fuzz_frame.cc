// libFuzzer: what the front end does with a ToFrontend frame from the executor, up to the
// replies: the frame parsed, its model states applied to the model table (as the link's
// reader does), its batches split into one Result per request (AppendBatchResults), and each
// result encoded against the models the table now serves. The link's socket and threads are
// left out: they are not what a frame's contents can reach.
#include <cstdint>
#include <memory>
#include <vector>

#include "executor_link.h"
#include "fuzz_models.h"
#include "wire_columns.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace batchgate;
  wire::ToFrontend frame;
  if (!frame.ParseFromArray(data, static_cast<int>(size))) return 0;
  ModelTable table;
  table.Apply(frame.models(), frame.welcome(), true, 1);
  const auto snapshot = table.Current();
  for (const auto& [name, model] : snapshot->models) {
    std::shared_ptr<const ModelState> found;
    ModelTable::Lookup(*snapshot, name, "", &found);
  }
  std::vector<std::unique_ptr<wire::Result>> results;
  for (const wire::Batch& batch : frame.batches()) {
    // The executor's frames are bounded (64 MiB) but a batch's results multiply its requests
    // by its outputs: kept to what a frame of this size could carry.
    if (static_cast<size_t>(batch.rids_size()) * (batch.outputs_size() + 1) > (1u << 16)) {
      continue;
    }
    AppendBatchResults(batch, &results);
  }
  for (const wire::Result& result : frame.results()) {
    results.push_back(std::make_unique<wire::Result>(result));
  }
  std::vector<std::shared_ptr<const ModelState>> models = fuzz::Models();
  for (const auto& [name, model] : snapshot->models) {
    if (model->ready) models.push_back(model);
  }
  for (const auto& result : results) {
    for (const auto& model : models) fuzz::EncodeAndCheck(*model, {}, *result, false);
  }
  return 0;
}
