// Text the front end writes for people: status messages, log lines, metric samples.
//
// Every function here reproduces, byte for byte, what the one-process server writes, so that a
// client (or a test comparing the two front ends) cannot tell them apart. Strings are UTF-8:
// protobuf refuses a proto3 string field that is not, so everything a client sends is.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <google/protobuf/repeated_field.h>

#include "rules.h"

namespace batchgate {

// `text` in single quotes, with a backslash, a quote and the ASCII control characters escaped
// (batcher/errors.py quoted()).
std::string Quoted(std::string_view text);

// Appends Quoted(text) to `out`.
void AppendQuoted(std::string& out, std::string_view text);

// `['a', 'b']`, each name Quoted (batcher/errors.py quoted_list()). `Names` is any range of
// things convertible to std::string_view.
template <typename Names>
std::string QuotedList(const Names& names) {
  std::string out = "[";
  bool first = true;
  for (const auto& name : names) {
    if (!first) out += ", ";
    first = false;
    AppendQuoted(out, std::string_view(name));
  }
  out += "]";
  return out;
}

// A status message cut to at most 1024 bytes of UTF-8, at a character boundary, with
// " ... (message cut)" appended when cut (server/frontend/errors.py bounded()).
std::string Bounded(std::string message);
inline constexpr size_t kMaxMessageBytes = rules::kMaxMessageBytes;

// Python's str(list(shape)) of a shape: "[1, 512]".
std::string ShapeList(const google::protobuf::RepeatedField<int64_t>& shape);

// A shape quoted in a message: the list for up to 8 dimensions, else the first 8 and a count
// (server/frontend/codec.py _shape_text()).
std::string ShapeText(const google::protobuf::RepeatedField<int64_t>& shape);

// Python's repr() of a float: the shortest text that reads back as `value`, in Python's choice
// of fixed or exponent notation ("0.0001", "30.0", "1e-05", "1e+16").
std::string PythonFloat(double value);

// prometheus_client's floatToGoString(): PythonFloat, but "+Inf"/"-Inf"/"NaN", and exponent
// notation from 1e7 on, as Go writes it.
std::string PrometheusFloat(double value);

// `text` as a JSON string, quotes included, as Python's json.dumps writes it (ensure_ascii:
// everything outside printable ASCII as \uXXXX; invalid UTF-8 becomes U+FFFD).
void AppendJsonString(std::string& out, std::string_view text);

// A Prometheus label value, escaped per the text exposition format (backslash, quote, newline).
void AppendLabelValue(std::string& out, std::string_view value);

// Whether `text` is well-formed UTF-8 (what protobuf requires of a proto3 string).
bool IsValidUtf8(std::string_view text);

// The length of the longest prefix of `text` of at most `max_bytes` bytes that ends on a
// UTF-8 character boundary.
size_t Utf8PrefixLength(std::string_view text, size_t max_bytes);

}  // namespace batchgate
