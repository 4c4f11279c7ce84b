// wire.proto's columns as the front end makes and takes them: the Infers of one frame that
// share a model and shapes go out as an InferGroup, and a Batch that comes back stands for one
// Result per request.
#pragma once

#include <memory>
#include <vector>

#include "protos/wire.pb.h"

namespace batchgate {

// The Results a Batch stands for (wire.proto), one per request, appended to `results` in its
// order; false (nothing appended) when its lists do not line up.
bool AppendBatchResults(const wire::Batch& batch, std::vector<std::unique_ptr<wire::Result>>* results);

// Moves into InferGroups the Infers of `frame` that may go in one (`groupable`, one entry per
// Infer: SubmitInfer's) wherever at least two would share it; the others stay Infers, in their
// order. A lone request costs the executor less as an Infer than as a group.
void GroupInfers(wire::ToExecutor& frame, const std::vector<bool>& groupable);

}  // namespace batchgate
