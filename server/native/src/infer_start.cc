// The inference path up to the executor, shared by ModelInfer and ModelStreamInfer: the model,
// decode_request()'s checks, the inputs into the arena, the Infer queued on the link; and the
// deadline a call carries to the executor.
#include <grpc/support/time.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "codec.h"
#include "frontend.h"
#include "input_region.h"
#include "rules.h"
#include "text.h"

namespace batchgate {
namespace {

// The id a request carries to the executor, for its log lines; the reply echoes the whole one.
constexpr size_t kMaxForwardedIdBytes = 1024;

}  // namespace

int64_t DeadlineNs(const grpc::ServerContext& context) {
  const gpr_timespec deadline = context.raw_deadline();
  if (deadline.tv_sec == gpr_inf_future(deadline.clock_type).tv_sec) return 0;
  // gRPC's monotonic clock and CLOCK_MONOTONIC may differ by an offset: carry the time left,
  // not the instant.
  const gpr_timespec left =
      gpr_time_sub(gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC), gpr_now(GPR_CLOCK_MONOTONIC));
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  return DeadlineAfter(now_ns, left.tv_sec, left.tv_nsec);
}

int64_t DeadlineAfter(int64_t now_ns, int64_t left_s, int64_t left_ns) {
  constexpr int64_t kLast = std::numeric_limits<int64_t>::max();
  int64_t left = 0;
  int64_t deadline = 0;
  if (__builtin_mul_overflow(left_s, int64_t{1000000000}, &left) ||
      __builtin_add_overflow(left, left_ns, &left) ||
      __builtin_add_overflow(now_ns, left, &deadline)) {
    return left_s < 0 ? 1 : kLast;
  }
  return std::max<int64_t>(1, deadline);
}
grpc::Status Frontend::StartInfer(const inference::ModelInferRequest& request, int64_t deadline_ns,
                                  AnswerTarget* target, InferTicket* ticket) {
  if (draining()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, rules::kShuttingDown);
  std::shared_ptr<const ModelState> model;
  grpc::Status status =
      ModelTable::Lookup(*models_.Current(), request.model_name(), request.model_version(), &model);
  if (!status.ok()) return grpc::Status(status.error_code(), Bounded(status.error_message()));
  DecodedRequest decoded;
  status = DecodeRequest(request, *model, limits_, handover_.shared_memory, &decoded);
  if (!status.ok()) return grpc::Status(status.error_code(), Bounded(status.error_message()));

  auto infer = std::make_unique<wire::Infer>();
  std::vector<uint64_t> blocks;
  blocks.reserve(decoded.inputs.size());
  const auto free_blocks = [&] {
    for (const uint64_t offset : blocks) region_->Free(offset);
  };
  for (size_t i = 0; i < decoded.inputs.size(); ++i) {
    InputPlan& plan = decoded.inputs[i];
    auto* tensor = infer->add_inputs();
    *tensor->mutable_shape() = request.inputs(plan.tensor).shape();
    if (plan.placed) {
      // The executor reads it in the client's region: nothing goes into the arena.
      tensor->mutable_placement()->Swap(&plan.placement);
      continue;
    }
    const std::optional<uint64_t> offset = region_->Allocate(plan.nbytes);
    if (!offset) {
      const std::string message = "this front end's shared-memory region is full (" +
                                  std::to_string(region_->bytes_in_use()) +
                                  " bytes in flight); retry later";
      free_blocks();
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, message);
    }
    blocks.push_back(*offset);
    WriteInput(request, plan, model->inputs[i], arena_.data() + *offset);
    tensor->set_offset(*offset);
    tensor->set_nbytes(plan.nbytes);
  }
  infer->set_model(model->handle);
  infer->set_batch_size(decoded.batch_size);
  infer->set_priority(decoded.priority);
  infer->set_deadline_ns(deadline_ns);
  infer->set_timeout_us(decoded.timeout_us);
  // Frames are bounded (64 MiB); an id is for log lines there, and the reply echoes it whole.
  infer->set_id(request.id().substr(0, Utf8PrefixLength(request.id(), kMaxForwardedIdBytes)));
  for (const uint32_t output : decoded.outputs) infer->add_outputs(output);
  for (wire::Placement& placement : decoded.placements) infer->add_placements()->Swap(&placement);
  // Such requests may share an InferGroup (wire.proto) with others of their frame, which the
  // executor takes without a message per request.
  bool groupable = model->batching() && decoded.placements.empty();
  for (size_t i = 0; groupable && i < decoded.inputs.size(); ++i) {
    groupable = !decoded.inputs[i].placed && model->inputs[i].type != DataType::kBytes;
  }
  for (size_t k = 0; groupable && k < decoded.outputs.size(); ++k) {
    groupable = decoded.outputs.size() == model->outputs.size() && decoded.outputs[k] == k;
  }
  uint64_t rid = 0;
  if (!link_->SubmitInfer(std::move(infer), blocks, model->generation, target, &rid, &status,
                          groupable)) {
    free_blocks();
    return status;
  }
  ticket->model = std::move(model);
  ticket->outputs = std::move(decoded.outputs);
  ticket->rid = rid;
  return grpc::Status::OK;
}

bool Frontend::KnowsModel(const std::string& name) const {
  return models_.Current()->models.count(name) != 0;
}

}  // namespace batchgate
