// Unit tests: a ModelInferRequest's bytes counted against the wire limits before it is parsed.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "auth.h"
#include "codec.h"
#include "executor_link.h"
#include "frame_reader.h"
#include "frontend.h"
#include "handover.h"
#include "protos/handover.pb.h"
#include "input_region.h"
#include "metrics.h"
#include "model_table.h"
#include "text.h"
#include "wire_columns.h"
#include "wire_scan.h"
#include "check.h"

namespace {

using batchgate::DataType;
using batchgate::ModelState;

// -- the wire scan (wire_scan.h) -----------------------------------------------------------------

using batchgate::ScanOutcome;
using batchgate::WireRule;

// `bytes` scanned as gRPC may hand them over: in one slice, or cut at each of `cuts`.
batchgate::ScanResult ScanBytes(const std::string& bytes, const batchgate::WireLimits& limits,
                                const std::vector<size_t>& cuts = {}) {
  std::vector<batchgate::WireSpan> spans;
  size_t from = 0;
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  for (const size_t cut : cuts) {
    spans.push_back({data + from, cut - from});
    from = cut;
  }
  spans.push_back({data + from, bytes.size() - from});
  return batchgate::ScanInferRequest(spans, limits);
}

std::string Outcome(const batchgate::ScanResult& result) {
  switch (result.outcome) {
    case ScanOutcome::kWithin: return "within";
    case ScanOutcome::kMalformed: return "malformed";
    case ScanOutcome::kOverLimit: break;
  }
  return std::string("over ") + batchgate::rules::kWireRuleKeys[static_cast<int>(result.rule)];
}

// A request with something of every kind a rule counts.
inference::ModelInferRequest EveryKind() {
  inference::ModelInferRequest r;
  r.set_model_name("model");
  r.set_model_version("1");
  r.set_id("id");
  (*r.mutable_parameters())["priority"].set_uint64_param(1);
  (*r.mutable_parameters())["key"].set_string_param("value");
  for (int i = 0; i < 2; ++i) {
    auto* t = r.add_inputs();
    t->set_name("IN" + std::to_string(i));
    t->set_datatype("BYTES");
    t->add_shape(1);
    t->add_shape(int64_t{1} << 40);
    (*t->mutable_parameters())["p"].set_double_param(1.5);
    t->mutable_contents()->add_bytes_contents("a");
    t->mutable_contents()->add_int64_contents(-1);
    t->mutable_contents()->add_fp32_contents(1);
    t->mutable_contents()->add_fp64_contents(2);
    r.add_raw_input_contents("raw");
  }
  auto* out = r.add_outputs();
  out->set_name("OUT");
  (*out->mutable_parameters())["shared_memory_region"].set_string_param("r");
  (*out->mutable_parameters())["shared_memory_byte_size"].set_int64_param(8);
  return r;
}

void TestWireScanCounts() {
  const inference::ModelInferRequest request = EveryKind();
  const std::string bytes = request.SerializeAsString();
  const auto unlimited = batchgate::UnlimitedWireLimits();
  CHECK_EQ(Outcome(ScanBytes(bytes, unlimited)), std::string("within"));
  // Cut anywhere, in two or in three: the same.
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    CHECK_EQ(Outcome(ScanBytes(bytes, unlimited, {cut})), std::string("within"));
    CHECK_EQ(Outcome(ScanBytes(bytes, unlimited, {cut / 2, cut})), std::string("within"));
  }
  // Each rule at what the request has is within, one less is over.
  const struct {
    WireRule rule;
    uint64_t has;
  } counts[] = {{WireRule::kInputs, 2}, {WireRule::kRawInputContents, 2}, {WireRule::kOutputs, 1},
                {WireRule::kParameters, 2}, {WireRule::kDimensions, 2},
                {WireRule::kBytesContents, 2}, {WireRule::kNameBytes, 23},
                {WireRule::kUnknownFields, 0}, {WireRule::kContentsBytes, 40}};
  for (const auto& count : counts) {
    auto limits = unlimited;
    limits.most[static_cast<int>(count.rule)] = count.has;
    CHECK_EQ(Outcome(ScanBytes(bytes, limits)), std::string("within"));
    if (count.has == 0) continue;
    limits.most[static_cast<int>(count.rule)] = count.has - 1;
    CHECK_EQ(Outcome(ScanBytes(bytes, limits)),
             std::string("over ") + batchgate::rules::kWireRuleKeys[static_cast<int>(count.rule)]);
  }
  // Each kind of name on its own: the longest is the parameter's string value.
  const auto longest = [&](inference::ModelInferRequest r) {
    auto limits = unlimited;
    limits.most[static_cast<int>(WireRule::kNameBytes)] = 4;
    return Outcome(ScanBytes(r.SerializeAsString(), limits));
  };
  const std::string five = "12345";
  inference::ModelInferRequest named;
  named.set_model_name(five);
  CHECK_EQ(longest(named), std::string("over name_bytes"));
  named.set_model_name("1234");
  CHECK_EQ(longest(named), std::string("within"));
  for (int kind = 0; kind < 7; ++kind) {
    inference::ModelInferRequest r;
    auto* t = r.add_inputs();
    switch (kind) {
      case 0: r.set_model_version(five); break;
      case 1: r.set_id(five); break;
      case 2: t->set_name(five); break;
      case 3: t->set_datatype(five); break;
      case 4: (*t->mutable_parameters())[five].set_bool_param(true); break;
      case 5: (*r.mutable_parameters())["k"].set_string_param(five); break;
      default: r.add_outputs()->set_name(five); break;
    }
    CHECK_EQ(longest(r), std::string("over name_bytes"));
  }
  // Each input's and output's map counts apart; the request's own map across its fields.
  auto two = unlimited;
  two.most[static_cast<int>(WireRule::kParameters)] = 2;
  inference::ModelInferRequest maps;
  for (int i = 0; i < 3; ++i) {
    auto* t = maps.add_inputs();
    (*t->mutable_parameters())["a"].set_bool_param(true);
    (*t->mutable_parameters())["b"].set_bool_param(true);
  }
  CHECK_EQ(Outcome(ScanBytes(maps.SerializeAsString(), two)), std::string("within"));
  (*maps.mutable_outputs()->Add()->mutable_parameters())["c"].set_bool_param(true);
  (*maps.mutable_inputs(1)->mutable_parameters())["c"].set_bool_param(true);
  CHECK_EQ(Outcome(ScanBytes(maps.SerializeAsString(), two)), std::string("over parameters"));
  // A shape packed or not, in several fields of one tensor: the dimensions add up; a packed
  // one long past the bound is given up on early, cut across slices or not.
  auto dims = unlimited;
  dims.most[static_cast<int>(WireRule::kDimensions)] = 3;
  const std::string packed_two = std::string("\x2a\x04\x1a\x02\x01\x05", 6);       // [1, 5]
  const std::string unpacked_one = std::string("\x2a\x02\x18\x07", 4);             // [7]
  const std::string unpacked_two = std::string("\x2a\x04\x18\x07\x18\x80\x01", 7);  // cut varint
  CHECK_EQ(Outcome(ScanBytes(packed_two, dims)), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(std::string("\x2a\x06\x1a\x02\x01\x05\x18\x07", 8), dims)),
           std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(std::string("\x2a\x0a\x1a\x02\x01\x05\x18\x07\x1a\x02\x80\x01", 12),
                             dims)),
           std::string("over dimensions"));
  CHECK_EQ(Outcome(ScanBytes(unpacked_one, dims)), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(unpacked_two, dims)), std::string("malformed"));
  inference::ModelInferRequest wide;
  for (int i = 0; i < 100000; ++i) wide.add_inputs();
  wide.mutable_inputs(0)->mutable_shape()->Resize(1 << 20, 3);
  const std::string wide_bytes = wide.SerializeAsString();
  CHECK_EQ(Outcome(ScanBytes(wide_bytes, dims, {7, 4096, 70000})), std::string("over dimensions"));
  // Typed contents count as parsed (request_scan.py's cases): 1-byte int64 values 8 each.
  const auto contents_limit = [&](uint64_t most) {
    auto limits = unlimited;
    limits.most[static_cast<int>(WireRule::kContentsBytes)] = most;
    return limits;
  };
  const auto in_contents = [](const std::string& contents) {
    const auto wrap = [](char tag, const std::string& payload) {
      std::string out(1, tag);
      uint64_t n = payload.size();
      while (n >= 0x80) {
        out += static_cast<char>(0x80 | (n & 0x7f));
        n >>= 7;
      }
      out += static_cast<char>(n);
      return out + payload;
    };
    return wrap('\x2a', wrap('\x2a', contents));
  };
  inference::InferTensorContents zeros;
  for (int i = 0; i < 1000000; ++i) zeros.add_int64_contents(0);
  const std::string million = in_contents(zeros.SerializeAsString());
  CHECK_EQ(Outcome(ScanBytes(million, contents_limit(8000000), {4096, 70000})),
           std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(million, contents_limit(7999999), {4096, 70000})),
           std::string("over contents_bytes"));
  const std::string unpacked = std::string("\x18\x01", 2) + std::string("\x18\x01", 2) +
                               std::string("\x18\x01", 2) + std::string("\x18\x01", 2) +
                               std::string("\x18\x01", 2) + std::string("\x18\xff\x01", 3) +
                               std::string("\x18\xff\x01", 3);  // 7 int64 values
  const std::string two_inputs = in_contents(unpacked) + in_contents(unpacked);
  CHECK_EQ(Outcome(ScanBytes(two_inputs, contents_limit(112))), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(two_inputs, contents_limit(111))), std::string("over contents_bytes"));
  const std::string fixed = std::string("\x35" "abcd" "\x35" "abcd" "\x35" "abcd" "\x39" "xxxxxxxx", 24);
  CHECK_EQ(Outcome(ScanBytes(in_contents(fixed.substr(0, 15)), contents_limit(12))),
           std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(fixed), contents_limit(96))), std::string("within"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(fixed), contents_limit(95))),
           std::string("over contents_bytes"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(unpacked + "\x18"), contents_limit(55))),
           std::string("over contents_bytes"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(unpacked + "\x18"), contents_limit(56))),
           std::string("malformed"));
  CHECK_EQ(Outcome(ScanBytes(in_contents(std::string("\x98\x00\x01", 3)), contents_limit(7))),
           std::string("over contents_bytes"));
  // Many empty outputs: refused at the first past the bound, whatever follows.
  auto few = unlimited;
  few.most[static_cast<int>(WireRule::kOutputs)] = 1024;
  std::string empty_outputs;
  for (int i = 0; i < 2000; ++i) empty_outputs += std::string("\x32\x00", 2);
  CHECK_EQ(Outcome(ScanBytes(empty_outputs + "\xff", few)), std::string("over outputs"));
  CHECK_EQ(Outcome(ScanBytes(empty_outputs.substr(0, 2048) + "\xff", few)),
           std::string("malformed"));
}

void TestWireScanMalformed() {
  const auto unlimited = batchgate::UnlimitedWireLimits();
  const auto scan = [&](const std::string& bytes) { return Outcome(ScanBytes(bytes, unlimited)); };
  const auto parses = [](const std::string& bytes) {
    inference::ModelInferRequest r;
    return r.ParseFromString(bytes);
  };
  const std::string ten_byte_varint = std::string("\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 10);
  // What the parser accepts, which the scan passes: unknown fields of every wire type, a
  // group holding a group, a varint of ten bytes, a known field of the wrong wire type.
  const std::string fine[] = {
      std::string("\x40\x01", 2),                       // field 8 varint
      std::string("\x41") + std::string(8, '\0'),       // fixed64
      std::string("\x45") + std::string(4, '\0'),       // fixed32
      std::string("\x42\x02xy"),                        // length-delimited
      std::string("\x43\x0b\x08\x01\x0c\x44", 6),       // group 8 { group 1 { 1: 1 } }
      "\x40" + ten_byte_varint,
      std::string("\x08\x01", 2),                       // model_name as a varint: unknown
      std::string("\x2a\x04\x1b\x08\x01\x1c", 6),       // inputs { group 3 { 1: 1 } }
      std::string("\x22\x07\x12\x05\x2d\x00\x00\x00\x00", 9),  // map { value { 5: fixed32 } }
      std::string("\xaa\x00\x00", 3),                   // inputs, its tag in two bytes
  };
  for (const std::string& bytes : fine) {
    CHECK_EQ(scan(bytes), std::string("within"));
    CHECK(parses(bytes));
  }
  const std::string bad[] = {
      std::string("\x28", 1),                           // a tag and no value
      std::string("\x28\x80", 2),                       // a varint cut short
      "\x28" + ten_byte_varint.substr(0, 9) + "\x80\x01",  // eleven bytes
      std::string("\x0a\x05" "abc"),                    // a length past the end
      std::string("\x2a\x03\x0a\x05" "a", 5),           // ... past its message's end
      std::string("\x02\x00", 2),                       // field number 0
      std::string("\x00", 1),
      std::string("\x46\x00", 2),                       // wire type 6
      std::string("\x47\x00", 2),                       // wire type 7
      std::string("\x44", 1),                           // a group's end, none began
      std::string("\x43\x4c", 2),                       // group 8 ended as 9
      std::string("\x43\x08\x01", 3),                   // group 8 never ended
      std::string("\x2a\x02\x43\x44\x44", 5),           // its end outside its message
      std::string("\x80\x80\x80\x80\x80\x08", 6),       // a tag in six bytes
  };
  for (const std::string& bytes : bad) {
    CHECK_EQ(scan(bytes), std::string("malformed"));
    CHECK(!parses(bytes));
  }
  // Where the two parsers differ, the scans take the stricter: a length in six bytes (this
  // parser refuses it, upb does not), a tag past 32 bits (upb refuses it, this parser wraps it
  // round to field 1).
  const std::string long_length = std::string("\x0a\x80\x80\x80\x80\x80\x00", 7);
  CHECK_EQ(scan(long_length), std::string("malformed"));
  CHECK(!parses(long_length));
  const std::string wide_tag = std::string("\x8a\x80\x80\x80\x10\x00", 6);
  CHECK_EQ(scan(wide_tag), std::string("malformed"));
  CHECK(parses(wide_tag));
  // Groups nested 100 deep parse; 101 do not.
  const auto nested = [](int depth) {
    std::string bytes;
    for (int i = 0; i < depth; ++i) bytes += "\x43";
    for (int i = 0; i < depth; ++i) bytes += "\x44";
    return bytes;
  };
  CHECK_EQ(scan(nested(99)), std::string("within"));
  CHECK(parses(nested(99)));
  CHECK_EQ(scan(nested(101)), std::string("malformed"));
  CHECK(!parses(nested(101)));
  // Every cut of a valid request that the parser refuses, the scan calls malformed (or, cut
  // inside a string, passes on for the parser to refuse); none that parses is refused.
  const std::string whole = EveryKind().SerializeAsString();
  for (size_t size = 0; size < whole.size(); ++size) {
    const std::string cut = whole.substr(0, size);
    if (scan(cut) == "malformed") CHECK(!parses(cut));
  }
}

}  // namespace

void RunWireScanTests() {
  TestWireScanCounts();
  TestWireScanMalformed();
}
