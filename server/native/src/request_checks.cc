// The request checks: server/frontend/codec.py's decode_request(), for the native front end (codec.h).
// Every message is a template of server/rules/messages.py, rendered by rules.h's functions.
#include <cstring>

#include "codec.h"
#include "rules.h"
#include "text.h"

namespace batchgate {
namespace {

using inference::InferTensorContents;
using inference::ModelInferRequest;
using Shape = google::protobuf::RepeatedField<int64_t>;

// A tensor's parameters that place it in a client's shared-memory region: the region, the
// offset into it, the byte size.
const char* const kSharedMemoryKeys[] = {"shared_memory_region", "shared_memory_offset",
                                         "shared_memory_byte_size"};

// The InferParameter field that is set, as Python's WhichOneof() names it.
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

grpc::Status Invalid(std::string message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message));
}

// decode_request()'s _int_parameter().
grpc::Status IntParameter(const google::protobuf::Map<std::string, inference::InferParameter>& parameters,
                          const std::string& key, uint64_t* value) {
  const inference::InferParameter& param = parameters.at(key);
  switch (param.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (param.int64_param() < 0) {
        return Invalid(rules::ParameterNegative(key, std::to_string(param.int64_param())));
      }
      *value = static_cast<uint64_t>(param.int64_param());
      return grpc::Status::OK;
    case inference::InferParameter::kUint64Param:
      *value = param.uint64_param();
      return grpc::Status::OK;
    default:
      return Invalid(rules::ParameterNotInteger(key, ParameterKind(param)));
  }
}

std::string ShapeMismatch(const std::string& model, const TensorInfo& spec, bool batching,
                          const Shape& shape) {
  std::string expected = batching ? "batch" : "";
  for (const int64_t d : spec.dims) {
    if (!expected.empty()) expected += ", ";
    expected += std::to_string(d);
  }
  return rules::ShapeMismatch(model, spec.name, expected, ShapeText(shape));
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
      return Invalid(rules::NegativeDimension(model, spec.name, ShapeText(shape)));
    }
  }
  // A zero dimension counts as one against the limit: [2**62, 0] is no smaller than [2**62].
  uint64_t extent = 1;
  bool empty = false;
  for (const int64_t d : shape) {
    const auto factor = static_cast<unsigned __int128>(d == 0 ? 1 : d);
    const unsigned __int128 product = factor * extent;
    if (product > limits.max_tensor_elements) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          rules::TooManyElements(model, spec.name, ShapeText(shape),
                                                 std::to_string(limits.max_tensor_elements)));
    }
    extent = static_cast<uint64_t>(product);
    empty = empty || d == 0;
  }
  *count = empty ? 0 : extent;
  *rows = 1;
  if (batching) {
    *rows = shape[0];
    if (*rows < 1 || *rows > max_batch) {
      return Invalid(rules::BatchSizeRange(model, std::to_string(max_batch),
                                           std::to_string(*rows), spec.name));
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
                        rules::TooManyBytes(model, std::to_string(limits.max_request_bytes)));
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
      return Invalid(rules::BytesNotEncoded(model, spec.name, std::to_string(count)));
    }
    return grpc::Status::OK;
  }
  const uint64_t size = ElementSize(spec.type);
  if (size == 0) return grpc::Status(grpc::StatusCode::INTERNAL, rules::kInternal);
  const uint64_t expected = count * size;
  if (buffer.size() != expected) {
    return Invalid(rules::RawSize(model, spec.name, ShapeList(shape), spec.datatype,
                                  std::to_string(expected), std::to_string(buffer.size())));
  }
  if (spec.type == DataType::kBool) {
    // Any other byte is not a bool: torch would compute with it (~x of 2 is still true).
    unsigned char high = 0;
    for (const char c : buffer) high |= static_cast<unsigned char>(c) & 0xFE;
    if (high != 0) {
      return Invalid(rules::BoolNot0Or1(model, spec.name));
    }
  }
  return grpc::Status::OK;
}

// How many values a datatype's typed contents field (ContentsField()) holds; -1: it has none.
int TypedValues(DataType type, const InferTensorContents& contents) {
  switch (type) {
    case DataType::kBool: return contents.bool_contents_size();
    case DataType::kInt8:
    case DataType::kInt16:
    case DataType::kInt32: return contents.int_contents_size();
    case DataType::kInt64: return contents.int64_contents_size();
    case DataType::kUint8:
    case DataType::kUint16:
    case DataType::kUint32: return contents.uint_contents_size();
    case DataType::kUint64: return contents.uint64_contents_size();
    case DataType::kFp32: return contents.fp32_contents_size();
    case DataType::kFp64: return contents.fp64_contents_size();
    default: return -1;
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
      return Invalid(rules::BytesContentsCount(model, spec.name, ShapeList(shape),
                                               std::to_string(count),
                                               std::to_string(values.size())));
    }
    uint64_t total = 0;
    for (const std::string& v : values) total += 4 + v.size();
    *nbytes = total;
    return grpc::Status::OK;
  }
  const int values = TypedValues(spec.type, contents);
  if (values < 0) return Invalid(rules::NoTypedContents(model, spec.name, spec.datatype));
  if (static_cast<uint64_t>(values) != count) {
    return Invalid(rules::ContentsCount(model, spec.name, ShapeList(shape), std::to_string(count),
                                        ContentsField(spec.type), std::to_string(values)));
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
    return Invalid(rules::ContentsOutOfRange(model, spec.name, spec.datatype));
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

// The `shared_memory_*` parameters of input or output `tensor` (`kind`) as a Placement
// (codec.py _placement()): shared_memory_region a string, shared_memory_byte_size and
// shared_memory_offset (0 when left out, as tritonclient leaves it for 0) integers >= 0. The
// region itself is the executor's to check: it holds the registrations.
grpc::Status SharedMemoryPlacement(const std::string& model, const char* kind,
                                   const std::string& tensor, const Parameters& parameters,
                                   wire::Placement* placement) {
  const std::string name = Quoted(tensor);
  const auto region = parameters.find(kSharedMemoryKeys[0]);
  if (region == parameters.end() || !parameters.count(kSharedMemoryKeys[2])) {
    return Invalid(rules::PlacementIncomplete(model, kind, name));
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam) {
    return Invalid(rules::PlacementRegionNotString(model, kind, name, ParameterKind(region->second)));
  }
  uint64_t values[2] = {0, 0};
  const char* const keys[2] = {kSharedMemoryKeys[1], kSharedMemoryKeys[2]};
  for (int i = 0; i < 2; ++i) {
    const auto found = parameters.find(keys[i]);
    if (found == parameters.end()) continue;
    const inference::InferParameter& param = found->second;
    if (param.parameter_choice_case() == inference::InferParameter::kInt64Param) {
      if (param.int64_param() < 0) {
        return Invalid(rules::PlacementNegative(model, kind, name, keys[i],
                                                std::to_string(param.int64_param())));
      }
      values[i] = static_cast<uint64_t>(param.int64_param());
    } else if (param.parameter_choice_case() == inference::InferParameter::kUint64Param) {
      values[i] = param.uint64_param();
    } else {
      return Invalid(rules::PlacementNotInteger(model, kind, name, keys[i], ParameterKind(param)));
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
    return Invalid(rules::PlacedSize(model, Quoted(spec.name), ShapeText(shape), spec.datatype,
                                     std::to_string(expected), std::to_string(nbytes)));
  }
  return grpc::Status::OK;
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
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, rules::kSharedMemoryOff);
  }
  // Raw buffers come for the inputs that are not in shared memory, in their order.
  const int n_raw = request.raw_input_contents_size();
  if (n_raw != 0 && n_raw != n_inputs - n_placed) {
    return Invalid(rules::RawCount(
        name, std::to_string(n_raw), std::to_string(n_inputs - n_placed),
        n_placed > 0 ? rules::kRawCountAdvicePlaced : rules::kRawCountAdvice));
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
      return Invalid(rules::NoSuchInput(name, tensor.name(), QuotedList(model.input_names)));
    }
    const TensorInfo& spec = model.inputs[found->second];
    InputPlan& plan = decoded->inputs[found->second];
    if (plan.tensor >= 0) {
      return Invalid(rules::InputTwice(name, tensor.name()));
    }
    if (tensor.datatype() != spec.datatype) {
      if (tensor.datatype() == "BYTES") {
        return Invalid(rules::BytesNotDeclared(name, tensor.name(), spec.datatype));
      }
      return Invalid(rules::WrongDatatype(name, tensor.name(), spec.datatype,
                                          Quoted(tensor.datatype())));
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
        return Invalid(rules::BatchDisagrees(name, std::to_string(batch_size),
                                             std::to_string(rows), tensor.name()));
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
        return Invalid(rules::PlacedWithContents(name, Quoted(tensor.name())));
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
        return Invalid(rules::RawWithContents(name, tensor.name()));
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
    return Invalid(rules::MissingInputs(name, QuotedList(missing)));
  }
  bool any_placed = false;
  std::vector<bool> requested(request.outputs_size() > 0 ? model.outputs.size() : 0);
  for (const auto& output : request.outputs()) {
    const auto found = model.output_index.find(output.name());
    if (found == model.output_index.end()) {
      return Invalid(rules::NoSuchOutput(name, output.name(), QuotedList(model.output_names)));
    }
    // Triton refuses it too; each repeat would cost the reply the output's bytes again.
    if (requested[found->second]) {
      return Invalid(rules::OutputTwice(name, output.name()));
    }
    requested[found->second] = true;
    decoded->outputs.push_back(found->second);
    if (HasSharedMemoryParameters(output.parameters())) {
      if (!shared_memory) {
        return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, rules::kSharedMemoryOff);
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

}  // namespace batchgate
