// ModelInferRequest checked against a model's state, and ModelInferResponse built from a Result:
// server/frontend/codec.py's decode_request() and encode_outputs(), for the native front end. The checks
// are request_checks.cc, writing the inputs into the arena input_writer.cc, the reply reply.cc.
//
// The checks, their order and their messages are decode_request()'s, so that the same mistake
// gets the same status from either front end. Shapes are checked before anything is sized from
// them (rank, then negative dimensions, then --max-tensor-elements with the product given up as
// soon as it passes the limit, then the model's dimensions); --max-request-bytes is checked as
// each input adds to the total. Decoding validates everything and allocates nothing; writing
// the inputs into the arena comes after, once every check has passed, and cannot fail.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "model_table.h"
#include "protos/inference.pb.h"
#include "protos/wire.pb.h"

namespace batchgate {

class Arena;

// --max-request-bytes and --max-tensor-elements, as the handover gives them (their defaults are
// the settings'; none here).
struct RequestLimits {
  uint64_t max_request_bytes = std::numeric_limits<uint64_t>::max();
  uint64_t max_tensor_elements = std::numeric_limits<uint64_t>::max();
};

// Where one model input comes from in the request, and what it takes in the arena.
struct InputPlan {
  int tensor = -1;      // index into request.inputs
  int raw = -1;         // index into raw_input_contents; -1: typed contents, or `placed`
  uint64_t nbytes = 0;  // bytes in the arena: raw little-endian, BYTES length-prefixed
  // In a client's shared-memory region (its `shared_memory_*` parameters): nothing goes into
  // the arena, the executor reads the bytes where `placement` names them.
  bool placed = false;
  wire::Placement placement;
};

struct DecodedRequest {
  uint64_t priority = 0;
  uint64_t timeout_us = 0;
  uint32_t batch_size = 1;
  std::vector<InputPlan> inputs;  // one per model input, in the model's order
  std::vector<uint32_t> outputs;  // requested outputs, as indexes into the model's; empty: all
  // Infer.placements: one per entry of `outputs` when any of them asks to be written into a
  // shared-memory region (region "" for the others), else none.
  std::vector<wire::Placement> placements;
};

// OK, or INVALID_ARGUMENT / RESOURCE_EXHAUSTED / UNIMPLEMENTED with decode_request()'s message
// (not yet cut to length). `shared_memory`: the server serves shared-memory tensors (else a
// tensor with `shared_memory_*` parameters is refused).
grpc::Status DecodeRequest(const inference::ModelInferRequest& request, const ModelState& model,
                           const RequestLimits& limits, bool shared_memory,
                           DecodedRequest* decoded);

// Writes input `plan` (not `placed`) of `request` (model input `spec`) into `destination`,
// plan.nbytes long: raw bytes as they are, typed contents converted to little-endian raw bytes,
// BYTES contents as 4-byte little-endian lengths each followed by its bytes.
void WriteInput(const inference::ModelInferRequest& request, const InputPlan& plan,
                const TensorInfo& spec, uint8_t* destination);

// The serialized reply to a request answered with `result`: a ModelInferResponse (a
// ModelStreamInferResponse holding it, with `for_stream`), each output's bytes copied once,
// from the arena into the reply; an output the executor wrote into the client's region
// (Output.placed) has its metadata in the reply and an empty raw_output_contents entry.
// RESOURCE_EXHAUSTED, before anything is allocated, when the reply would pass
// `max_reply_bytes` (--max-message-bytes); INTERNAL, with `problem` for the log, when the
// result does not fit the request (an executor bug).
grpc::Status EncodeResponse(const ModelState& model, const std::string& id,
                            const std::vector<uint32_t>& requested, const wire::Result& result,
                            const Arena& arena, bool for_stream, uint64_t max_reply_bytes,
                            grpc::ByteBuffer* reply, std::string* problem);

// A serialized ModelStreamInferResponse carrying `error_message`.
grpc::ByteBuffer StreamError(const std::string& error_message);

// `message` serialized into a ByteBuffer.
grpc::ByteBuffer Serialize(const google::protobuf::MessageLite& message);
grpc::ByteBuffer BytesOf(const std::string& serialized);

}  // namespace batchgate
