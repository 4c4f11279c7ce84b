#include "codec.h"

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/slice.h>

#include <cstring>
#include <limits>

#include "input_region.h"
#include "text.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tensors travel little-endian; this code copies them as the host lays them out");

namespace batchgate {

const char* const kSharedMemoryOffMessage =
    "shared-memory tensors are off on this server (start it with --shared-memory to turn them "
    "on); send tensor data in raw_input_contents";

namespace {

using google::protobuf::io::CodedOutputStream;
using inference::InferTensorContents;
using inference::ModelInferRequest;
using Shape = google::protobuf::RepeatedField<int64_t>;

const char* const kInternalMessage = "internal server error; the server log has the details";
const char* const kSharedMemoryKeys[] = {"shared_memory_region", "shared_memory_offset",
                                         "shared_memory_byte_size"};

// Field numbers and wire types, for the parts of the reply written by hand.
constexpr uint8_t kRawOutputContentsTag = (6 << 3) | 2;  // ModelInferResponse.raw_output_contents
constexpr uint8_t kInferResponseTag = (2 << 3) | 2;      // ModelStreamInferResponse.infer_response

grpc::Status Invalid(std::string message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message));
}

std::string ModelPrefix(const std::string& model) { return "model '" + model + "': "; }

// decode_request()'s _int_parameter().
grpc::Status IntParameter(const google::protobuf::Map<std::string, inference::InferParameter>& parameters,
                          const std::string& key, uint64_t* value) {
  const inference::InferParameter& param = parameters.at(key);
  switch (param.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (param.int64_param() < 0) {
        return Invalid("request parameter '" + key + "' must be >= 0, got " +
                       std::to_string(param.int64_param()));
      }
      *value = static_cast<uint64_t>(param.int64_param());
      return grpc::Status::OK;
    case inference::InferParameter::kUint64Param:
      *value = param.uint64_param();
      return grpc::Status::OK;
    case inference::InferParameter::kBoolParam:
      return Invalid("request parameter '" + key + "' must be an integer, got bool_param");
    case inference::InferParameter::kStringParam:
      return Invalid("request parameter '" + key + "' must be an integer, got string_param");
    case inference::InferParameter::kDoubleParam:
      return Invalid("request parameter '" + key + "' must be an integer, got double_param");
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return Invalid("request parameter '" + key + "' must be an integer, got None");
}

std::string ShapeMismatch(const std::string& model, const TensorInfo& spec, bool batching,
                          const Shape& shape) {
  std::string expected = batching ? "batch" : "";
  for (const int64_t d : spec.dims) {
    if (!expected.empty()) expected += ", ";
    expected += std::to_string(d);
  }
  return ModelPrefix(model) + "input '" + spec.name + "' must have shape [" + expected +
         "] (-1: any), got " + ShapeText(shape);
}

// _check_shape(): the batch rows and element count of an input whose shape fits the model and
// the limits. Never forms the product of a shape that passes the limit.
grpc::Status CheckShape(const std::string& model, const TensorInfo& spec, const Shape& shape,
                        bool batching, int32_t max_batch, const RequestLimits& limits,
                        int64_t* rows, uint64_t* count) {
  if (static_cast<size_t>(shape.size()) != spec.dims.size() + (batching ? 1 : 0)) {
    return Invalid(ShapeMismatch(model, spec, batching, shape));
  }
  for (const int64_t d : shape) {
    if (d < 0) {
      return Invalid(ModelPrefix(model) + "input '" + spec.name +
                     "' has a negative dimension, got shape " + ShapeText(shape));
    }
  }
  // A zero dimension counts as one against the limit: [2**62, 0] is no smaller than [2**62].
  uint64_t extent = 1;
  bool empty = false;
  for (const int64_t d : shape) {
    const auto factor = static_cast<unsigned __int128>(d == 0 ? 1 : d);
    const unsigned __int128 product = factor * extent;
    if (product > limits.max_tensor_elements) {
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          ModelPrefix(model) + "input '" + spec.name + "' of shape " + ShapeText(shape) +
              " has more elements than this server allows (--max-tensor-elements " +
              std::to_string(limits.max_tensor_elements) + ")");
    }
    extent = static_cast<uint64_t>(product);
    empty = empty || d == 0;
  }
  *count = empty ? 0 : extent;
  *rows = 1;
  if (batching) {
    *rows = shape[0];
    if (*rows < 1 || *rows > max_batch) {
      return Invalid(ModelPrefix(model) + "batch size must lie in 1.." + std::to_string(max_batch) +
                     " (the model's max_batch_size), got " + std::to_string(*rows) +
                     " for input '" + spec.name + "'");
    }
  }
  const int offset = batching ? 1 : 0;
  for (size_t i = 0; i < spec.dims.size(); ++i) {
    const int64_t d = spec.dims[i];
    if (d != -1 && d != shape[static_cast<int>(i) + offset]) {
      return Invalid(ShapeMismatch(model, spec, batching, shape));
    }
  }
  return grpc::Status::OK;
}

// Adds an input's `bytes` to the request's; refused past --max-request-bytes, where a
// client-given size (a shared-memory BYTES input's) may be anything up to 2**64 - 1.
grpc::Status AddRequestBytes(const std::string& model, uint64_t bytes, uint64_t* request_bytes,
                             const RequestLimits& limits) {
  if (bytes > limits.max_request_bytes - *request_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        ModelPrefix(model) +
                            "the request's inputs take more bytes than this server allows "
                            "(--max-request-bytes " +
                            std::to_string(limits.max_request_bytes) + ")");
  }
  *request_bytes += bytes;
  return grpc::Status::OK;
}

// _bytes_from_raw(): `count` elements, each a 4-byte little-endian length and that many bytes,
// filling the buffer exactly.
bool ValidBytesTensor(const std::string& buffer, uint64_t count) {
  const uint64_t size = buffer.size();
  uint64_t offset = 0;
  uint64_t items = 0;
  while (offset < size && items < count) {
    if (offset + 4 > size) break;
    uint32_t length;
    std::memcpy(&length, buffer.data() + offset, 4);
    offset += 4;
    if (offset + length > size) break;
    offset += length;
    ++items;
  }
  return items == count && offset == size;
}

// _from_raw()'s checks.
grpc::Status CheckRaw(const std::string& model, const TensorInfo& spec, const Shape& shape,
                      uint64_t count, const std::string& buffer) {
  if (spec.type == DataType::kBytes) {
    if (!ValidBytesTensor(buffer, count)) {
      return Invalid(ModelPrefix(model) + "BYTES input '" + spec.name + "' must hold " +
                     std::to_string(count) +
                     " elements, each a 4-byte little-endian length followed by that many bytes");
    }
    return grpc::Status::OK;
  }
  const uint64_t size = ElementSize(spec.type);
  if (size == 0) return grpc::Status(grpc::StatusCode::INTERNAL, kInternalMessage);
  const uint64_t expected = count * size;
  if (buffer.size() != expected) {
    return Invalid(ModelPrefix(model) + "input '" + spec.name + "' of shape " + ShapeList(shape) +
                   " and datatype " + spec.datatype + " needs " + std::to_string(expected) +
                   " bytes, got " + std::to_string(buffer.size()));
  }
  if (spec.type == DataType::kBool) {
    // Any other byte is not a bool: torch would compute with it (~x of 2 is still true).
    unsigned char high = 0;
    for (const char c : buffer) high |= static_cast<unsigned char>(c) & 0xFE;
    if (high != 0) {
      return Invalid(ModelPrefix(model) + "BOOL input '" + spec.name +
                     "' must hold bytes 0 and 1 only");
    }
  }
  return grpc::Status::OK;
}

// The typed contents field of a datatype (CONTENTS_FIELDS in protos/datatypes.py), and how many values it holds.
const char* TypedField(DataType type, const InferTensorContents& contents, int* values) {
  switch (type) {
    case DataType::kBool: *values = contents.bool_contents_size(); return "bool_contents";
    case DataType::kInt8:
    case DataType::kInt16:
    case DataType::kInt32: *values = contents.int_contents_size(); return "int_contents";
    case DataType::kInt64: *values = contents.int64_contents_size(); return "int64_contents";
    case DataType::kUint8:
    case DataType::kUint16:
    case DataType::kUint32: *values = contents.uint_contents_size(); return "uint_contents";
    case DataType::kUint64: *values = contents.uint64_contents_size(); return "uint64_contents";
    case DataType::kFp32: *values = contents.fp32_contents_size(); return "fp32_contents";
    case DataType::kFp64: *values = contents.fp64_contents_size(); return "fp64_contents";
    default: return nullptr;
  }
}

template <typename Values>
bool AllWithin(const Values& values, int64_t low, int64_t high) {
  for (const auto v : values) {
    if (static_cast<int64_t>(v) < low || static_cast<int64_t>(v) > high) return false;
  }
  return true;
}

// _from_contents()'s checks; `nbytes` the size of the raw bytes they become.
grpc::Status CheckContents(const std::string& model, const TensorInfo& spec, const Shape& shape,
                           uint64_t count, const InferTensorContents& contents, uint64_t* nbytes) {
  if (spec.type == DataType::kBytes) {
    const auto& values = contents.bytes_contents();
    if (static_cast<uint64_t>(values.size()) != count) {
      return Invalid(ModelPrefix(model) + "input '" + spec.name + "' of shape " + ShapeList(shape) +
                     " needs " + std::to_string(count) + " bytes_contents, got " +
                     std::to_string(values.size()));
    }
    uint64_t total = 0;
    for (const std::string& v : values) total += 4 + v.size();
    *nbytes = total;
    return grpc::Status::OK;
  }
  int values = 0;
  const char* field = TypedField(spec.type, contents, &values);
  if (field == nullptr) {
    return Invalid(ModelPrefix(model) + "input '" + spec.name + "' is " + spec.datatype +
                   ", which has no typed contents field; send it in raw_input_contents");
  }
  if (static_cast<uint64_t>(values) != count) {
    return Invalid(ModelPrefix(model) + "input '" + spec.name + "' of shape " + ShapeList(shape) +
                   " needs " + std::to_string(count) + " values in contents." + field + ", got " +
                   std::to_string(values));
  }
  bool within = true;
  switch (spec.type) {
    case DataType::kInt8: within = AllWithin(contents.int_contents(), -128, 127); break;
    case DataType::kInt16: within = AllWithin(contents.int_contents(), -32768, 32767); break;
    case DataType::kUint8: within = AllWithin(contents.uint_contents(), 0, 255); break;
    case DataType::kUint16: within = AllWithin(contents.uint_contents(), 0, 65535); break;
    default: break;  // the field's type is the datatype's own
  }
  if (!within) {
    return Invalid(ModelPrefix(model) + "input '" + spec.name +
                   "' has values outside the range of " + spec.datatype);
  }
  *nbytes = count * ElementSize(spec.type);
  return grpc::Status::OK;
}

using Parameters = google::protobuf::Map<std::string, inference::InferParameter>;

bool HasSharedMemoryParameters(const Parameters& parameters) {
  if (parameters.empty()) return false;
  for (const char* key : kSharedMemoryKeys) {
    if (parameters.count(key)) return true;
  }
  return false;
}

const char* ParameterKind(const inference::InferParameter& param) {
  switch (param.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam: return "bool_param";
    case inference::InferParameter::kInt64Param: return "int64_param";
    case inference::InferParameter::kStringParam: return "string_param";
    case inference::InferParameter::kDoubleParam: return "double_param";
    case inference::InferParameter::kUint64Param: return "uint64_param";
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET: break;
  }
  return "None";
}

// The `shared_memory_*` parameters of input or output `tensor` (`kind`) as a Placement
// (codec.py _placement()): shared_memory_region a string, shared_memory_byte_size and
// shared_memory_offset (0 when left out, as tritonclient leaves it for 0) integers >= 0. The
// region itself is the executor's to check: it holds the registrations.
grpc::Status SharedMemoryPlacement(const std::string& model, const char* kind,
                                   const std::string& tensor, const Parameters& parameters,
                                   wire::Placement* placement) {
  const std::string what = ModelPrefix(model) + kind + " " + Quoted(tensor) + ": ";
  const auto region = parameters.find("shared_memory_region");
  if (region == parameters.end() || !parameters.count("shared_memory_byte_size")) {
    return Invalid(what +
                   "the parameters 'shared_memory_region' and 'shared_memory_byte_size' go "
                   "together ('shared_memory_offset' is optional)");
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam) {
    return Invalid(what + "parameter 'shared_memory_region' must be a string, got " +
                   ParameterKind(region->second));
  }
  uint64_t values[2] = {0, 0};
  const char* const keys[2] = {"shared_memory_offset", "shared_memory_byte_size"};
  for (int i = 0; i < 2; ++i) {
    const auto found = parameters.find(keys[i]);
    if (found == parameters.end()) continue;
    const inference::InferParameter& param = found->second;
    if (param.parameter_choice_case() == inference::InferParameter::kInt64Param) {
      if (param.int64_param() < 0) {
        return Invalid(what + "parameter '" + keys[i] + "' must be >= 0, got " +
                       std::to_string(param.int64_param()));
      }
      values[i] = static_cast<uint64_t>(param.int64_param());
    } else if (param.parameter_choice_case() == inference::InferParameter::kUint64Param) {
      values[i] = param.uint64_param();
    } else {
      return Invalid(what + "parameter '" + keys[i] + "' must be an integer, got " +
                     ParameterKind(param));
    }
  }
  placement->set_region(region->second.string_param());
  placement->set_offset(values[0]);
  placement->set_nbytes(values[1]);
  return grpc::Status::OK;
}

// A shared-memory input's byte size against its shape, for datatypes of a fixed size (a BYTES
// tensor's size is known only from its bytes, which the executor reads).
grpc::Status CheckPlacedBytes(const std::string& model, const TensorInfo& spec, const Shape& shape,
                              uint64_t count, uint64_t nbytes) {
  const uint64_t size = ElementSize(spec.type);
  if (size == 0) return grpc::Status::OK;
  const uint64_t expected = count * size;
  if (nbytes != expected) {
    return Invalid(ModelPrefix(model) + "input " + Quoted(spec.name) + " of shape " +
                   ShapeText(shape) + " and datatype " + spec.datatype + " needs " +
                   std::to_string(expected) + " bytes, shared_memory_byte_size is " +
                   std::to_string(nbytes));
  }
  return grpc::Status::OK;
}

template <typename Narrow, typename Values>
void WriteNarrowed(const Values& values, uint8_t* destination) {
  for (const auto v : values) {
    const auto narrow = static_cast<Narrow>(v);
    std::memcpy(destination, &narrow, sizeof narrow);
    destination += sizeof narrow;
  }
}

template <typename Values>
void WriteSame(const Values& values, uint8_t* destination) {
  if (!values.empty()) std::memcpy(destination, values.data(), values.size() * sizeof(values[0]));
}

uint8_t* WriteVarint(uint64_t value, uint8_t* at) {
  return CodedOutputStream::WriteVarint64ToArray(value, at);
}

}  // namespace

grpc::Status DecodeRequest(const ModelInferRequest& request, const ModelState& model,
                           const RequestLimits& limits, bool shared_memory,
                           DecodedRequest* decoded) {
  const std::string& name = model.spec_name;
  if (!request.parameters().empty()) {
    if (request.parameters().count("priority")) {
      auto status = IntParameter(request.parameters(), "priority", &decoded->priority);
      if (!status.ok()) return status;
    }
    if (request.parameters().count("timeout")) {
      auto status = IntParameter(request.parameters(), "timeout", &decoded->timeout_us);
      if (!status.ok()) return status;
    }
  }
  const int n_inputs = request.inputs_size();
  int n_placed = 0;
  for (const auto& tensor : request.inputs()) {
    if (HasSharedMemoryParameters(tensor.parameters())) ++n_placed;
  }
  if (n_placed > 0 && !shared_memory) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, kSharedMemoryOffMessage);
  }
  // Raw buffers come for the inputs that are not in shared memory, in their order.
  const int n_raw = request.raw_input_contents_size();
  if (n_raw != 0 && n_raw != n_inputs - n_placed) {
    return Invalid("model '" + name + "': " + std::to_string(n_raw) + " raw_input_contents for " +
                   std::to_string(n_inputs - n_placed) + " inputs; " +
                   (n_placed > 0 ? "send one raw buffer per input that is not in shared memory, "
                                   "in the order of 'inputs'"
                                 : "send one raw buffer per input, in the order of 'inputs'"));
  }
  const bool raw = n_raw != 0;
  const bool batching = model.batching();
  decoded->inputs.assign(model.inputs.size(), InputPlan{});
  size_t given = 0;
  int next_raw = 0;
  int64_t batch_size = -1;
  uint64_t request_bytes = 0;
  for (int index = 0; index < n_inputs; ++index) {
    const auto& tensor = request.inputs(index);
    const auto found = model.input_index.find(tensor.name());
    if (found == model.input_index.end()) {
      return Invalid("model '" + name + "' has no input '" + tensor.name() + "'; its inputs are " +
                     QuotedList(model.input_names));
    }
    const TensorInfo& spec = model.inputs[found->second];
    InputPlan& plan = decoded->inputs[found->second];
    if (plan.tensor >= 0) {
      return Invalid(ModelPrefix(name) + "input '" + tensor.name() + "' is given twice");
    }
    if (tensor.datatype() != spec.datatype) {
      if (tensor.datatype() == "BYTES") {
        return Invalid(ModelPrefix(name) + "input '" + tensor.name() + "' is " + spec.datatype +
                       "; BYTES tensors are accepted only by models that declare them "
                       "(TYPE_STRING)");
      }
      return Invalid(ModelPrefix(name) + "input '" + tensor.name() + "' must be " + spec.datatype +
                     ", got " + Quoted(tensor.datatype()));
    }
    int64_t rows = 1;
    uint64_t count = 0;
    auto status = CheckShape(name, spec, tensor.shape(), batching, model.max_batch_size, limits,
                             &rows, &count);
    if (!status.ok()) return status;
    if (batching) {
      if (batch_size == -1) {
        batch_size = rows;
      } else if (rows != batch_size) {
        return Invalid(ModelPrefix(name) + "inputs disagree on the batch dimension (" +
                       std::to_string(batch_size) + " and " + std::to_string(rows) + " for '" +
                       tensor.name() + "')");
      }
    }
    const uint64_t element_size = ElementSize(spec.type);
    plan.tensor = index;
    ++given;
    if (n_placed > 0 && HasSharedMemoryParameters(tensor.parameters())) {
      status = SharedMemoryPlacement(name, "input", tensor.name(), tensor.parameters(),
                                     &plan.placement);
      if (!status.ok()) return status;
      if (tensor.has_contents()) {
        return Invalid(ModelPrefix(name) + "input " + Quoted(tensor.name()) +
                       " is in shared memory and has contents too; use one or the other");
      }
      status = CheckPlacedBytes(name, spec, tensor.shape(), count, plan.placement.nbytes());
      if (!status.ok()) return status;
      status = AddRequestBytes(
          name, element_size == 0 ? plan.placement.nbytes() : count * element_size,
          &request_bytes, limits);
      if (!status.ok()) return status;
      plan.placed = true;
      plan.nbytes = 0;
    } else if (raw) {
      if (tensor.has_contents()) {
        return Invalid(ModelPrefix(name) + "input '" + tensor.name() +
                       "' has typed contents while the request uses raw_input_contents; use one "
                       "or the other");
      }
      plan.raw = next_raw++;
      const std::string& buffer = request.raw_input_contents(plan.raw);
      status = AddRequestBytes(name, element_size == 0 ? buffer.size() : count * element_size,
                               &request_bytes, limits);
      if (!status.ok()) return status;
      status = CheckRaw(name, spec, tensor.shape(), count, buffer);
      if (!status.ok()) return status;
      plan.nbytes = buffer.size();
    } else {
      // For BYTES, what the contents take on the wire: the decoded size is not known yet.
      status = AddRequestBytes(
          name, element_size == 0 ? tensor.contents().ByteSizeLong() : count * element_size,
          &request_bytes, limits);
      if (!status.ok()) return status;
      status = CheckContents(name, spec, tensor.shape(), count, tensor.contents(), &plan.nbytes);
      if (!status.ok()) return status;
    }
  }
  if (given != model.inputs.size()) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < model.inputs.size(); ++i) {
      if (decoded->inputs[i].tensor < 0) missing.push_back(model.inputs[i].name);
    }
    return Invalid(ModelPrefix(name) + "missing inputs " + QuotedList(missing));
  }
  bool any_placed = false;
  std::vector<bool> requested(request.outputs_size() > 0 ? model.outputs.size() : 0);
  for (const auto& output : request.outputs()) {
    const auto found = model.output_index.find(output.name());
    if (found == model.output_index.end()) {
      return Invalid("model '" + name + "' has no output '" + output.name() +
                     "'; its outputs are " + QuotedList(model.output_names));
    }
    // Triton refuses it too; each repeat would cost the reply the output's bytes again.
    if (requested[found->second]) {
      return Invalid(ModelPrefix(name) + "output '" + output.name() + "' is requested twice");
    }
    requested[found->second] = true;
    decoded->outputs.push_back(found->second);
    if (HasSharedMemoryParameters(output.parameters())) {
      if (!shared_memory) {
        return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, kSharedMemoryOffMessage);
      }
      if (!any_placed) {
        decoded->placements.resize(decoded->outputs.size() - 1);
        any_placed = true;
      }
      wire::Placement& placement = decoded->placements.emplace_back();
      auto status =
          SharedMemoryPlacement(name, "output", output.name(), output.parameters(), &placement);
      if (!status.ok()) return status;
    } else if (any_placed) {
      decoded->placements.emplace_back();
    }
  }
  // A model without inputs has no batch dimension to read; it runs as one row.
  decoded->batch_size = batching && batch_size > 0 ? static_cast<uint32_t>(batch_size) : 1;
  return grpc::Status::OK;
}

void WriteInput(const ModelInferRequest& request, const InputPlan& plan, const TensorInfo& spec,
                uint8_t* destination) {
  if (plan.raw >= 0) {
    const std::string& buffer = request.raw_input_contents(plan.raw);
    if (!buffer.empty()) std::memcpy(destination, buffer.data(), buffer.size());
    return;
  }
  const InferTensorContents& contents = request.inputs(plan.tensor).contents();
  switch (spec.type) {
    case DataType::kBytes:
      for (const std::string& value : contents.bytes_contents()) {
        const auto length = static_cast<uint32_t>(value.size());
        std::memcpy(destination, &length, 4);
        if (length) std::memcpy(destination + 4, value.data(), length);
        destination += 4 + length;
      }
      break;
    case DataType::kBool: WriteSame(contents.bool_contents(), destination); break;
    case DataType::kInt8: WriteNarrowed<int8_t>(contents.int_contents(), destination); break;
    case DataType::kInt16: WriteNarrowed<int16_t>(contents.int_contents(), destination); break;
    case DataType::kInt32: WriteSame(contents.int_contents(), destination); break;
    case DataType::kInt64: WriteSame(contents.int64_contents(), destination); break;
    case DataType::kUint8: WriteNarrowed<uint8_t>(contents.uint_contents(), destination); break;
    case DataType::kUint16: WriteNarrowed<uint16_t>(contents.uint_contents(), destination); break;
    case DataType::kUint32: WriteSame(contents.uint_contents(), destination); break;
    case DataType::kUint64: WriteSame(contents.uint64_contents(), destination); break;
    case DataType::kFp32: WriteSame(contents.fp32_contents(), destination); break;
    case DataType::kFp64: WriteSame(contents.fp64_contents(), destination); break;
    default: break;  // DecodeRequest refused the rest
  }
}

grpc::Status EncodeResponse(const ModelState& model, const std::string& id,
                            const std::vector<uint32_t>& requested, const wire::Result& result,
                            const Arena& arena, bool for_stream, uint64_t max_reply_bytes,
                            grpc::ByteBuffer* reply, std::string* problem) {
  const grpc::Status internal(grpc::StatusCode::INTERNAL, kInternalMessage);
  const size_t expected = requested.empty() ? model.outputs.size() : requested.size();
  if (static_cast<size_t>(result.outputs_size()) != expected) {
    *problem = "the executor answered " + std::to_string(result.outputs_size()) +
               " outputs for " + std::to_string(expected) + " asked";
    return internal;
  }
  inference::ModelInferResponse header;
  header.set_model_name(model.spec_name);
  header.set_model_version(model.version);
  header.set_id(id);
  uint64_t raw_bytes = 0;
  for (size_t i = 0; i < expected; ++i) {
    const wire::Output& output = result.outputs(static_cast<int>(i));
    if (!output.placed() && !arena.Contains(output.offset(), output.nbytes())) {
      *problem = "output " + std::to_string(i) + " lies outside the arena";
      return internal;
    }
    const TensorInfo& spec = model.outputs[requested.empty() ? i : requested[i]];
    auto* tensor = header.add_outputs();
    tensor->set_name(spec.name);
    tensor->set_datatype(spec.datatype);
    *tensor->mutable_shape() = output.shape();
    // One written into the client's region has an empty entry, which keeps
    // raw_output_contents aligned with outputs (clients index them together).
    const uint64_t nbytes = output.placed() ? 0 : output.nbytes();
    raw_bytes += 1 + CodedOutputStream::VarintSize64(nbytes) + nbytes;
  }
  const uint64_t header_bytes = header.ByteSizeLong();
  const uint64_t inner = header_bytes + raw_bytes;
  const uint64_t total = for_stream ? 1 + CodedOutputStream::VarintSize64(inner) + inner : inner;
  if (total > max_reply_bytes) {
    // gRPC would refuse to send it, once built: that request fails, no buffer made.
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        ModelPrefix(model.spec_name) + "the reply would take " +
                            std::to_string(total) + " bytes, more than this server sends (" +
                            "--max-message-bytes " + std::to_string(max_reply_bytes) + ")");
  }
  // One buffer for the whole reply: the outputs' bytes go from the arena straight into it, the
  // only copy they make in this process. raw_output_contents is the response's last field, so
  // appending it after the rest is the order protobuf itself would write.
  grpc::Slice slice(static_cast<size_t>(total));
  uint8_t* at = const_cast<uint8_t*>(slice.begin());
  if (for_stream) {
    *at++ = kInferResponseTag;
    at = WriteVarint(inner, at);
  }
  at = header.SerializeWithCachedSizesToArray(at);
  for (const wire::Output& output : result.outputs()) {
    const uint64_t nbytes = output.placed() ? 0 : output.nbytes();
    *at++ = kRawOutputContentsTag;
    at = WriteVarint(nbytes, at);
    if (nbytes) std::memcpy(at, arena.data() + output.offset(), nbytes);
    at += nbytes;
  }
  *reply = grpc::ByteBuffer(&slice, 1);
  return grpc::Status::OK;
}

grpc::ByteBuffer Serialize(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.ByteSizeLong());
  message.SerializeWithCachedSizesToArray(const_cast<uint8_t*>(slice.begin()));
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer BytesOf(const std::string& serialized) {
  grpc::Slice slice(serialized);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer StreamError(const std::string& error_message) {
  inference::ModelStreamInferResponse response;
  response.set_error_message(error_message);
  return Serialize(response);
}

}  // namespace batchgate
