#include "text.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "rules.h"

namespace batchgate {
namespace {

constexpr std::string_view kCut = rules::kMessageCut;

// The code point starting at text[*at], advancing *at; U+FFFD (advancing one byte) for a byte
// that does not start a valid sequence.
char32_t DecodeUtf8(std::string_view text, size_t* at) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const size_t i = *at;
  const unsigned char lead = byte(i);
  if (lead < 0x80) {
    *at = i + 1;
    return lead;
  }
  int length = 0;
  char32_t code = 0;
  char32_t minimum = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2, code = lead & 0x1F, minimum = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3, code = lead & 0x0F, minimum = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4, code = lead & 0x07, minimum = 0x10000;
  } else {
    *at = i + 1;
    return 0xFFFD;
  }
  if (i + length > text.size()) {
    *at = i + 1;
    return 0xFFFD;
  }
  for (int k = 1; k < length; ++k) {
    const unsigned char next = byte(i + k);
    if ((next & 0xC0) != 0x80) {
      *at = i + 1;
      return 0xFFFD;
    }
    code = (code << 6) | (next & 0x3F);
  }
  if (code < minimum || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) {
    *at = i + 1;
    return 0xFFFD;
  }
  *at = i + length;
  return code;
}

void AppendHex4(std::string& out, unsigned value) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "\\u%04x", value & 0xFFFFu);
  out += buf;
}

}  // namespace

void AppendQuoted(std::string& out, std::string_view text) {
  out.reserve(out.size() + text.size() + 2);
  out += '\'';
  // Bytes below 0x20 and 0x7F never occur inside a multi-byte UTF-8 sequence, so escaping
  // byte by byte escapes exactly the characters Python's loop escapes.
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += c;
    } else if (byte < 0x20 || byte == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", byte);
      out += buf;
    } else {
      out += c;
    }
  }
  out += '\'';
}

std::string Quoted(std::string_view text) {
  std::string out;
  AppendQuoted(out, text);
  return out;
}

bool IsValidUtf8(std::string_view text) {
  size_t at = 0;
  while (at < text.size()) {
    const size_t start = at;
    if (DecodeUtf8(text, &at) == 0xFFFD && !(at - start == 3 && text.compare(start, 3, "\xEF\xBF\xBD") == 0)) {
      return false;
    }
  }
  return true;
}

size_t Utf8PrefixLength(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text.size();
  size_t end = max_bytes;
  // Back up over continuation bytes to the start of the character that straddles the cut.
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return end;
}

std::string Bounded(std::string message) {
  if (message.size() <= kMaxMessageBytes) return message;
  message.resize(Utf8PrefixLength(message, kMaxMessageBytes - kCut.size()));
  message += kCut;
  return message;
}

std::string ShapeList(const google::protobuf::RepeatedField<int64_t>& shape) {
  std::string out = "[";
  for (int i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

std::string ShapeText(const google::protobuf::RepeatedField<int64_t>& shape) {
  if (shape.size() <= rules::kShownDimensions) return ShapeList(shape);
  std::string shown;
  for (int i = 0; i < rules::kShownDimensions; ++i) {
    if (i) shown += ", ";
    shown += std::to_string(shape[i]);
  }
  return rules::ShapeCut(shown, std::to_string(shape.size()));
}

std::string PythonFloat(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  if (value == 0) return std::signbit(value) ? "-0.0" : "0.0";
  // The shortest digits that read back as `value` (what Python's repr picks too), as
  // d.ddde±XX; then laid out as Python lays them out.
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::scientific);
  std::string_view text(buf, static_cast<size_t>(result.ptr - buf));
  std::string out;
  if (text.front() == '-') {
    out += '-';
    text.remove_prefix(1);
  }
  const size_t e = text.find('e');
  std::string digits(1, text[0]);
  if (e > 1) digits.append(text.substr(2, e - 2));
  int exponent = 0;
  std::string_view exponent_text = text.substr(e + 1);
  if (exponent_text.front() == '+') exponent_text.remove_prefix(1);
  std::from_chars(exponent_text.data(), exponent_text.data() + exponent_text.size(), exponent);
  const int ndigits = static_cast<int>(digits.size());
  if (exponent >= -4 && exponent < 16) {
    if (exponent >= 0) {
      const int whole = exponent + 1;
      if (ndigits <= whole) {
        out += digits;
        out.append(static_cast<size_t>(whole - ndigits), '0');
        out += ".0";
      } else {
        out.append(digits, 0, static_cast<size_t>(whole));
        out += '.';
        out.append(digits, static_cast<size_t>(whole), std::string::npos);
      }
    } else {
      out += "0.";
      out.append(static_cast<size_t>(-exponent - 1), '0');
      out += digits;
    }
  } else {
    out += digits[0];
    if (ndigits > 1) {
      out += '.';
      out.append(digits, 1, std::string::npos);
    }
    out += exponent < 0 ? "e-" : "e+";
    const int magnitude = std::abs(exponent);
    if (magnitude < 10) out += '0';
    out += std::to_string(magnitude);
  }
  return out;
}

std::string PrometheusFloat(double value) {
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (std::isnan(value)) return "NaN";
  std::string text = PythonFloat(value);
  const size_t dot = text.find('.');
  if (value > 0 && dot != std::string::npos && dot > 6) {
    std::string mantissa(1, text[0]);
    mantissa += '.';
    mantissa.append(text, 1, dot - 1);
    mantissa.append(text, dot + 1, std::string::npos);
    while (!mantissa.empty() && (mantissa.back() == '0' || mantissa.back() == '.')) {
      mantissa.pop_back();
    }
    char exponent[16];
    std::snprintf(exponent, sizeof exponent, "e+%02d", static_cast<int>(dot - 1));
    return mantissa + exponent;
  }
  return text;
}

void AppendJsonString(std::string& out, std::string_view text) {
  out += '"';
  size_t at = 0;
  while (at < text.size()) {
    const auto c = static_cast<unsigned char>(text[at]);
    if (c >= 0x20 && c < 0x7F) {
      if (c == '"' || c == '\\') out += '\\';
      out += static_cast<char>(c);
      ++at;
      continue;
    }
    const char32_t code = DecodeUtf8(text, &at);
    switch (code) {
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (code >= 0x10000) {
          const char32_t v = code - 0x10000;
          AppendHex4(out, 0xD800 | static_cast<unsigned>(v >> 10));
          AppendHex4(out, 0xDC00 | static_cast<unsigned>(v & 0x3FF));
        } else {
          AppendHex4(out, static_cast<unsigned>(code));
        }
    }
  }
  out += '"';
}

void AppendLabelValue(std::string& out, std::string_view value) {
  for (const char c : value) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
}

}  // namespace batchgate
