#include "wire_columns.h"

#include <algorithm>

namespace batchgate {
namespace {

// The most requests an InferGroup holds (wire.proto): with ids of kMaxForwardedIdBytes, ~4 MiB.
constexpr int kMaxGroupRequests = 4096;

// Whether `infer` has inputs, all in the arena, each with batch_size rows (what a group says
// of its requests).
bool InArenaWithRows(const wire::Infer& infer) {
  if (infer.inputs_size() == 0) return false;
  for (const wire::Tensor& tensor : infer.inputs()) {
    if (tensor.shape_size() == 0 || tensor.has_placement() ||
        tensor.shape(0) != static_cast<int64_t>(infer.batch_size())) {
      return false;
    }
  }
  return true;
}

using Dims = google::protobuf::RepeatedField<int64_t>;

// Whether `shape` is a batch dimension followed by the dimensions [tail, tail_end).
bool HasTail(const Dims& shape, Dims::const_iterator tail, Dims::const_iterator tail_end) {
  return shape.size() == tail_end - tail + 1 && std::equal(tail, tail_end, shape.begin() + 1);
}

// Whether `a` and `b` (each InArenaWithRows) go in the same group: one model, the same shapes
// past the batch dimension.
bool SameGroup(const wire::Infer& a, const wire::Infer& b) {
  if (a.model() != b.model() || a.inputs_size() != b.inputs_size()) return false;
  for (int k = 0; k < a.inputs_size(); ++k) {
    const auto& shape = b.inputs(k).shape();
    if (!HasTail(a.inputs(k).shape(), shape.begin() + 1, shape.end())) return false;
  }
  return true;
}

// A new InferGroup of `frame` for `infer`'s model and shapes past the batch dimension.
wire::InferGroup* NewGroup(const wire::Infer& infer, wire::ToExecutor& frame) {
  wire::InferGroup* group = frame.add_groups();
  group->set_model(infer.model());
  for (const wire::Tensor& tensor : infer.inputs()) {
    group->add_inputs()->mutable_tail()->Add(tensor.shape().begin() + 1, tensor.shape().end());
  }
  return group;
}

// `infer`'s entry in each of `group`'s columns.
void AppendToGroup(const wire::Infer& infer, wire::InferGroup& group) {
  group.add_rids(infer.rid());
  group.add_batch_sizes(infer.batch_size());
  group.add_priorities(infer.priority());
  group.add_deadlines_ns(infer.deadline_ns());
  group.add_timeouts_us(infer.timeout_us());
  group.add_ids(infer.id());
  for (int k = 0; k < infer.inputs_size(); ++k) {
    group.mutable_inputs(k)->add_offsets(infer.inputs(k).offset());
  }
}

}  // namespace

bool AppendBatchResults(const wire::Batch& batch, std::vector<std::unique_ptr<wire::Result>>* results) {
  const int count = batch.rids_size();
  if (batch.first_rows_size() != count || batch.rows_size() != count) return false;
  results->reserve(results->size() + static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    auto result = std::make_unique<wire::Result>();
    result->set_rid(batch.rids(i));
    result->set_released(batch.released());
    const uint64_t first = batch.first_rows(i);
    const uint64_t rows = batch.rows(i);
    for (const wire::BatchOutput& output : batch.outputs()) {
      wire::Output* out = result->add_outputs();
      out->set_block(output.block());
      out->set_offset(output.block() + first * output.row_bytes());
      out->set_nbytes(rows * output.row_bytes());
      out->mutable_shape()->Reserve(output.tail_size() + 1);
      out->add_shape(static_cast<int64_t>(rows));
      for (const int64_t dim : output.tail()) out->add_shape(dim);
    }
    results->push_back(std::move(result));
  }
  return true;
}

void GroupInfers(wire::ToExecutor& frame, const std::vector<bool>& groupable) {
  const int count = frame.infer_size();
  if (count < 2 || groupable.size() != static_cast<size_t>(count)) return;
  // Per Infer that may go in a group: the first such Infer of its group (itself, or one before
  // it); -1 for the others. Per first Infer: how many share its group.
  std::vector<int> first(static_cast<size_t>(count), -1);
  std::vector<int> members(static_cast<size_t>(count), 0);
  std::vector<int> leaders;  // the first Infer of each group: a frame's requests share a few
  bool any = false;
  for (int i = 0; i < count; ++i) {
    if (!groupable[static_cast<size_t>(i)] || !InArenaWithRows(frame.infer(i))) continue;
    int lead = i;
    for (const int j : leaders) {
      if (SameGroup(frame.infer(i), frame.infer(j))) {
        lead = j;
        break;
      }
    }
    if (lead == i) leaders.push_back(i);
    first[static_cast<size_t>(i)] = lead;
    any = ++members[static_cast<size_t>(lead)] > 1 || any;
  }
  if (!any) return;
  // Per first Infer of a group of two or more: the InferGroup being filled (a full one is
  // followed by a new one). A RepeatedPtrField's elements stay where they are as it grows.
  std::vector<wire::InferGroup*> filling(static_cast<size_t>(count), nullptr);
  auto* infers = frame.mutable_infer();
  int kept = 0;
  for (int i = 0; i < count; ++i) {
    const int lead = first[static_cast<size_t>(i)];
    if (lead >= 0 && members[static_cast<size_t>(lead)] > 1) {
      wire::InferGroup*& group = filling[static_cast<size_t>(lead)];
      if (group == nullptr || group->rids_size() >= kMaxGroupRequests) {
        group = NewGroup(infers->Get(i), frame);
      }
      AppendToGroup(infers->Get(i), *group);
      continue;
    }
    if (kept != i) infers->SwapElements(kept, i);
    ++kept;
  }
  while (infers->size() > kept) infers->RemoveLast();
}

}  // namespace batchgate
