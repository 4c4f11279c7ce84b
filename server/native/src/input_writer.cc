// A request's inputs written into the arena, once every check has passed (codec.h WriteInput).
#include <cstring>

#include "codec.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tensors travel little-endian; this code copies them as the host lays them out");

namespace batchgate {
namespace {

using inference::InferTensorContents;
using inference::ModelInferRequest;

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

}  // namespace

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

}  // namespace batchgate
