// A ModelInferRequest's wire bytes counted against the request limits before it is parsed:
// server/frontend/request_scan.py's scan_infer_request(), for the native front end.
//
// Parsed, a repeated field costs far more than on the wire (an empty `outputs` entry: 2 bytes
// sent, a heap object here), so a request is scanned first: the protobuf wire format walked
// over the message's slices as gRPC received them, nothing allocated per field, every count
// given up as soon as it passes its bound. The rules and their refusals' words come
// from server/rules/request_limits.py RULES (rules.h), their bounds from the handover.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "rules.h"

namespace batchgate {

// server/rules/request_limits.py RULES, in their order (rules.h).
using rules::kWireRules;
using rules::WireRule;

struct WireLimits {
  uint64_t most[kWireRules];        // each rule's bound, inclusive
  std::string refusal[kWireRules];  // what a request past it is answered
  uint64_t Most(WireRule rule) const { return most[static_cast<int>(rule)]; }
  const std::string& Refusal(WireRule rule) const { return refusal[static_cast<int>(rule)]; }
};

// Every bound at its most and no refusal texts: the unit tests start from it.
WireLimits UnlimitedWireLimits();

struct WireSpan {
  const uint8_t* data;
  size_t size;
};

enum class ScanOutcome {
  kWithin,     // parse it
  kOverLimit,  // refuse it: `rule` says which
  kMalformed,  // not a protobuf message: the parser would refuse it too (UTF-8 aside)
};

struct ScanResult {
  ScanOutcome outcome = ScanOutcome::kWithin;
  WireRule rule = WireRule::kInputs;
};

// Scans the ModelInferRequest made of `spans`, one after the other. What is malformed is what
// server/frontend/request_scan.py says is: a varint or length cut short, a length past its message's
// end, field number 0, wire types 4 (outside a group), 6 and 7, a group that does not end as
// it began, nesting past 100, a tag or length in more than five bytes.
ScanResult ScanInferRequest(const std::vector<WireSpan>& spans, const WireLimits& limits);

}  // namespace batchgate
