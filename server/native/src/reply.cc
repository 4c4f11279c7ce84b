// The reply to an inference request, sized before it is built (codec.h EncodeResponse), and the
// serialization helpers the calls share.
#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/slice.h>

#include <cstring>

#include "codec.h"
#include "input_region.h"
#include "rules.h"

namespace batchgate {
namespace {

using google::protobuf::io::CodedOutputStream;

// Field numbers and wire types, for the parts of the reply written by hand.
constexpr uint8_t kRawOutputContentsTag = (6 << 3) | 2;  // ModelInferResponse.raw_output_contents
constexpr uint8_t kInferResponseTag = (2 << 3) | 2;      // ModelStreamInferResponse.infer_response

uint8_t* WriteVarint(uint64_t value, uint8_t* at) {
  return CodedOutputStream::WriteVarint64ToArray(value, at);
}

}  // namespace

grpc::Status EncodeResponse(const ModelState& model, const std::string& id,
                            const std::vector<uint32_t>& requested, const wire::Result& result,
                            const Arena& arena, bool for_stream, uint64_t max_reply_bytes,
                            grpc::ByteBuffer* reply, std::string* problem) {
  const grpc::Status internal(grpc::StatusCode::INTERNAL, rules::kInternal);
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
                        rules::ReplyTooLarge(model.spec_name, std::to_string(total),
                                             std::to_string(max_reply_bytes)));
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
