#include "auth.h"

#include <algorithm>
#include <iterator>

#include "log.h"
#include "rules.h"

namespace batchgate {
namespace {

// server/rules/rpc_access.py's sets (rules.h).
template <size_t N>
bool IsIn(const std::string_view (&methods)[N], std::string_view method) {
  return std::find(std::begin(methods), std::end(methods), method) != std::end(methods);
}

// Python's str.isspace() characters, as UTF-8: what str.strip() removes from a token's ends.
bool IsPythonSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point that ends at text[end - 1] and its length; 0 length when the bytes there do
// not end a well-formed UTF-8 sequence.
char32_t LastCodePoint(std::string_view text, size_t end, size_t* length) {
  *length = 0;
  size_t start = end;
  while (start > 0 && end - start < 4) {
    --start;
    if ((static_cast<unsigned char>(text[start]) & 0xC0) != 0x80) break;
  }
  if (start == end) return 0;
  const auto lead = static_cast<unsigned char>(text[start]);
  const size_t n = end - start;
  const size_t expected = lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3
                                                                  : (lead & 0xF8) == 0xF0 ? 4 : 0;
  if (expected != n) return 0;
  char32_t code = n == 1 ? lead : n == 2 ? (lead & 0x1F) : n == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (size_t i = start + 1; i < end; ++i) code = (code << 6) | (text[i] & 0x3F);
  *length = n;
  return code;
}

char32_t FirstCodePoint(std::string_view text, size_t* length) {
  *length = 0;
  if (text.empty()) return 0;
  const auto lead = static_cast<unsigned char>(text[0]);
  const size_t n = lead < 0x80 ? 1 : (lead & 0xE0) == 0xC0 ? 2 : (lead & 0xF0) == 0xE0 ? 3
                                   : (lead & 0xF8) == 0xF0 ? 4 : 0;
  if (n == 0 || n > text.size()) return 0;
  char32_t code = n == 1 ? lead : n == 2 ? (lead & 0x1F) : n == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (size_t i = 1; i < n; ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (text[i] & 0x3F);
  }
  *length = n;
  return code;
}

std::string_view StripPythonSpace(std::string_view text) {
  size_t n = 0;
  while (!text.empty()) {
    const char32_t c = FirstCodePoint(text, &n);
    if (n == 0 || !IsPythonSpace(c)) break;
    text.remove_prefix(n);
  }
  while (!text.empty()) {
    const char32_t c = LastCodePoint(text, text.size(), &n);
    if (n == 0 || !IsPythonSpace(c)) break;
    text.remove_suffix(n);
  }
  return text;
}

bool IsAscii(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

bool EqualsIgnoringAsciiCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

}  // namespace

std::optional<std::string_view> BearerToken(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  // A multimap keeps entries of one key in the order they came: find() is the first one.
  const auto it = metadata.find(rules::kTokenMetadataKey);
  if (it == metadata.end()) return std::nullopt;
  const std::string_view value(it->second.data(), it->second.size());
  const size_t space = value.find(' ');
  const std::string_view scheme = value.substr(0, space);
  if (space == std::string_view::npos || !EqualsIgnoringAsciiCase(scheme, "bearer")) {
    // "Bearer" alone names the scheme but no token: the same "" as a wrong scheme.
    return std::string_view();
  }
  return StripPythonSpace(value.substr(space + 1));
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Compare over the longer length, so that the time does not tell where they differ.
  const size_t n = std::max(a.size(), b.size());
  unsigned char difference = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    difference |= static_cast<unsigned char>(x ^ y);
  }
  return difference == 0;
}

TokenAuth::TokenAuth(const std::optional<std::string>& admin_token,
                     const std::optional<std::string>& infer_token,
                     const std::vector<std::string>& methods) {
  enabled_ = admin_token.has_value() || infer_token.has_value();
  for (const std::string& method : methods) {
    Rule rule;
    rule.path = "/inference.GRPCInferenceService/" + method;
    const bool admin_method = IsIn(rules::kAdminMethods, method);
    if (IsIn(rules::kOpenMethods, method)) {
      // open
    } else if (admin_method) {
      if (admin_token) rule.accepted.push_back(*admin_token);
      else if (infer_token) rule.accepted.push_back(*infer_token);
    } else if (infer_token) {
      rule.accepted.push_back(*infer_token);
      if (admin_token) rule.accepted.push_back(*admin_token);
    }
    const bool admin = admin_method && admin_token.has_value();
    rule.missing = grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        rules::TokenMissing(method, admin ? rules::kTokenMissingWhichAdmin
                                          : rules::kTokenMissingWhich));
    rule.wrong = grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                              rules::TokenWrong(method, admin ? rules::kTokenWrongAdmin : ""));
    rules_.push_back(std::move(rule));
  }
}

grpc::Status TokenAuth::Check(int method, const grpc::ServerContext& context) const {
  if (!enabled_) return grpc::Status::OK;
  const Rule& rule = rules_.at(static_cast<size_t>(method));
  if (rule.accepted.empty()) return grpc::Status::OK;
  const std::optional<std::string_view> token = BearerToken(context.client_metadata());
  if (!token || token->empty()) {
    Log(LogLevel::kDebug, "rpc_refused",
        {LogField("method", rule.path), LogField("code", "UNAUTHENTICATED")});
    return rule.missing;
  }
  bool accepted = false;
  if (IsAscii(*token)) {
    for (const std::string& expected : rule.accepted) {
      accepted |= ConstantTimeEquals(*token, expected);  // no early exit: every token compared
    }
  }
  if (!accepted) {
    Log(LogLevel::kDebug, "rpc_refused",
        {LogField("method", rule.path), LogField("code", "PERMISSION_DENIED")});
    return rule.wrong;
  }
  return grpc::Status::OK;
}

}  // namespace batchgate
