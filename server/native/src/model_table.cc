#include "model_table.h"

#include "protos/inference.pb.h"
#include "rules.h"
#include "text.h"

namespace batchgate {
namespace {

TensorInfo MakeTensorInfo(const wire::TensorSpec& spec) {
  TensorInfo info;
  info.name = spec.name();
  info.datatype = spec.datatype();
  info.type = ParseDataType(spec.datatype());
  info.dims.assign(spec.dims().begin(), spec.dims().end());
  return info;
}

void AddMetadata(google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* out,
                 const std::vector<TensorInfo>& tensors, bool batching) {
  for (const TensorInfo& t : tensors) {
    auto* m = out->Add();
    m->set_name(t.name);
    m->set_datatype(t.datatype);
    if (batching) m->add_shape(-1);
    for (const int64_t d : t.dims) m->add_shape(d);
  }
}

}  // namespace

DataType ParseDataType(std::string_view name) {
  for (const auto& entry : rules::kDataTypes) {
    if (entry.name == name) return entry.type;
  }
  return DataType::kUnknown;
}

uint64_t ElementSize(DataType type) {
  for (const auto& entry : rules::kDataTypes) {
    if (entry.type == type) return entry.size;
  }
  return 0;
}

std::string_view ContentsField(DataType type) {
  for (const auto& entry : rules::kDataTypes) {
    if (entry.type == type) return entry.contents_field;
  }
  return {};
}

std::shared_ptr<const ModelState> MakeModelState(const wire::ModelState& wire, uint64_t generation) {
  auto state = std::make_shared<ModelState>();
  state->name = wire.name();
  state->state = wire.state();
  state->reason = wire.reason();
  state->generation = generation;
  state->ready = wire.state() == "READY" && wire.has_spec();
  if (!state->ready) return state;
  const wire::ModelSpec& spec = wire.spec();
  state->handle = wire.handle();
  state->spec_name = spec.name();
  state->version = spec.version();
  state->max_batch_size = spec.max_batch_size();
  for (const auto& t : spec.inputs()) {
    state->input_index.emplace(t.name(), static_cast<uint32_t>(state->inputs.size()));
    state->inputs.push_back(MakeTensorInfo(t));
    state->input_names.push_back(t.name());
  }
  for (const auto& t : spec.outputs()) {
    state->output_index.emplace(t.name(), static_cast<uint32_t>(state->outputs.size()));
    state->outputs.push_back(MakeTensorInfo(t));
    state->output_names.push_back(t.name());
  }
  // As service.py builds them, once per state instead of once per request.
  inference::ModelMetadataResponse metadata;
  metadata.set_name(spec.name());
  metadata.add_versions(spec.version());
  metadata.set_platform(spec.platform());
  AddMetadata(metadata.mutable_inputs(), state->inputs, state->batching());
  AddMetadata(metadata.mutable_outputs(), state->outputs, state->batching());
  metadata.SerializeToString(&state->metadata_response);
  inference::ModelConfigResponse config;
  *config.mutable_config() = wire.config();
  config.SerializeToString(&state->config_response);
  return state;
}

ModelTable::ModelTable() : current_(std::make_shared<ModelSnapshot>()) {}

std::shared_ptr<const ModelSnapshot> ModelTable::Current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

void ModelTable::Publish(std::shared_ptr<const ModelSnapshot> snapshot) {
  std::lock_guard<std::mutex> lock(mu_);
  current_.swap(snapshot);
  // The old snapshot is released here, outside the lock, when this was its last reference.
}

grpc::Status ModelTable::Lookup(const ModelSnapshot& snapshot, const std::string& name,
                                const std::string& version,
                                std::shared_ptr<const ModelState>* model) {
  const auto it = snapshot.models.find(name);
  if (it == snapshot.models.end()) {
    if (!snapshot.connected) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the executor process is not connected; retry");
    }
    return grpc::Status(grpc::StatusCode::NOT_FOUND, rules::ModelUnknown(Quoted(name)));
  }
  const ModelState& state = *it->second;
  if (!state.ready) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        rules::ModelNotAvailable(Quoted(name),
                                                 state.reason.empty() ? state.state : state.reason));
  }
  if (!version.empty() && version != state.version) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        rules::ModelNoVersion(Quoted(name), Quoted(version), state.version));
  }
  *model = it->second;
  return grpc::Status::OK;
}

std::vector<ModelTable::Change> ModelTable::Apply(
    const google::protobuf::RepeatedPtrField<wire::ModelState>& states, bool welcome,
    bool connected, uint64_t generation) {
  const std::shared_ptr<const ModelSnapshot> old = Current();
  auto next = std::make_shared<ModelSnapshot>();
  if (!welcome) next->models = old->models;
  next->connected = connected;
  std::vector<Change> changes;
  for (const wire::ModelState& wire : states) {
    auto state = MakeModelState(wire, generation);
    const auto before = old->models.find(wire.name());
    if (before == old->models.end() || before->second->state != state->state) {
      changes.push_back({wire.name(), state->ready});
    }
    next->models[wire.name()] = std::move(state);
  }
  if (welcome) {
    // The welcome lists every model the executor knows; one it no longer lists is gone.
    for (const auto& [name, state] : old->models) {
      if (!next->models.count(name)) changes.push_back({name, false});
    }
  }
  Publish(std::move(next));
  return changes;
}

std::vector<ModelTable::Change> ModelTable::Disconnect(const std::string& reason) {
  const std::shared_ptr<const ModelSnapshot> old = Current();
  auto next = std::make_shared<ModelSnapshot>();
  std::vector<Change> changes;
  for (const auto& [name, state] : old->models) {
    auto gone = std::make_shared<ModelState>();
    gone->name = name;
    gone->state = "UNAVAILABLE";
    gone->reason = reason;
    gone->generation = state->generation;
    if (state->state != gone->state) changes.push_back({name, false});
    next->models.emplace(name, std::move(gone));
  }
  Publish(std::move(next));
  return changes;
}

}  // namespace batchgate
