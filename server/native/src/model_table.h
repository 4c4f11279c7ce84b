// The model states the executor pushes (ToFrontend.models), as the request path reads them.
//
// Requests never ask the executor about a model: they are checked against the state cached
// here, and ModelMetadata / ModelConfig are answered from it. The executor link's reader thread
// is the only writer; every gRPC worker reads. A change publishes a whole new immutable
// snapshot, so a reader takes one reference and then reads without a lock, and a request keeps
// the state it was checked against alive until it is answered.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "protos/wire.pb.h"
#include "rules.h"

namespace batchgate {

// KServe datatypes (protos/datatypes.py, as rules.h has them).
using rules::DataType;
DataType ParseDataType(std::string_view name);
// Bytes per element; 0 for BYTES (variable length) and unknown datatypes.
uint64_t ElementSize(DataType type);
// The datatype's typed contents field (its name in messages); "" for none.
std::string_view ContentsField(DataType type);

struct TensorInfo {
  std::string name;
  std::string datatype;  // as the spec spells it (messages quote it)
  DataType type = DataType::kUnknown;
  std::vector<int64_t> dims;  // without the batch dimension; -1: any
};

// One model's state, immutable once published.
struct ModelState {
  std::string name;    // the name the executor serves it under (the table's key)
  std::string state;   // READY, LOADING, UNLOADING or UNAVAILABLE
  std::string reason;  // why it is not READY
  bool ready = false;  // READY, with a spec
  // The executor connection this state came over (ExecutorLink generations): a handle means
  // nothing to another executor process.
  uint64_t generation = 0;

  // READY only.
  uint32_t handle = 0;
  std::string spec_name;
  std::string version;
  int32_t max_batch_size = 0;
  std::vector<TensorInfo> inputs;
  std::vector<TensorInfo> outputs;
  std::unordered_map<std::string, uint32_t> input_index;   // name -> index in inputs
  std::unordered_map<std::string, uint32_t> output_index;  // name -> index in outputs
  std::vector<std::string> input_names;   // for messages listing them
  std::vector<std::string> output_names;
  std::string metadata_response;  // serialized inference.ModelMetadataResponse
  std::string config_response;    // serialized inference.ModelConfigResponse

  bool batching() const { return max_batch_size > 0; }
};

// What a request looks up: one consistent view of every model and of the connection.
struct ModelSnapshot {
  std::unordered_map<std::string, std::shared_ptr<const ModelState>> models;
  bool connected = false;  // the executor welcomed this front end and is still there
};

class ModelTable {
 public:
  ModelTable();

  std::shared_ptr<const ModelSnapshot> Current() const;

  // The READY model `name` (of `version`, when not empty), or the status ModelRepository.get()
  // raises for it (server/executor/repository.py), message not yet bounded.
  static grpc::Status Lookup(const ModelSnapshot& snapshot, const std::string& name,
                             const std::string& version,
                             std::shared_ptr<const ModelState>* model);

  // -- the executor link's reader thread only ------------------------------------------------

  // A model whose state changed, and whether health should now report it SERVING.
  struct Change {
    std::string name;
    bool serving;
  };
  // The states of `states` (every model the executor knows when `welcome`: the others are
  // dropped); `connected` as the snapshot should say. Returns the models whose state changed.
  std::vector<Change> Apply(const google::protobuf::RepeatedPtrField<wire::ModelState>& states,
                            bool welcome, bool connected, uint64_t generation);
  // The executor went away: every model UNAVAILABLE with `reason`, the snapshot disconnected.
  std::vector<Change> Disconnect(const std::string& reason);

 private:
  void Publish(std::shared_ptr<const ModelSnapshot> snapshot);

  mutable std::mutex mu_;  // guards the pointer only; snapshots are immutable
  std::shared_ptr<const ModelSnapshot> current_;
};

// The state of `wire`, with everything the request path needs computed once.
std::shared_ptr<const ModelState> MakeModelState(const wire::ModelState& wire, uint64_t generation);

}  // namespace batchgate
