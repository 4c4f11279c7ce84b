// The unit tests' checks (no framework): a failed check prints where and what, and the exit
// status counts the failures. Each file of tests/ runs its area's tests from one Run...() call.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "protos/wire.pb.h"

inline int g_failures = 0;
inline int g_checks = 0;



#define CHECK(condition)                                                     \
  do {                                                                       \
    ++g_checks;                                                              \
    if (!(condition)) {                                                      \
      ++g_failures;                                                          \
      std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #condition); \
    }                                                                        \
  } while (0)

#define CHECK_EQ(actual, expected)                                                         \
  do {                                                                                     \
    ++g_checks;                                                                            \
    const auto a_ = (actual);                                                              \
    const auto e_ = (expected);                                                            \
    if (!(a_ == e_)) {                                                                     \
      ++g_failures;                                                                        \
      std::fprintf(stderr, "%s:%d: %s == %s\n  got:      %s\n  expected: %s\n", __FILE__, \
                   __LINE__, #actual, #expected, Show(a_).c_str(), Show(e_).c_str());      \
    }                                                                                      \
  } while (0)

inline std::string Show(const std::string& s) { return "\"" + s + "\""; }
template <typename T>
inline std::string Show(const T& v) { return std::to_string(v); }

// An Infer of `model` with one tensor per shape in `shapes`, each in the arena at `offset`
// (wire_tests.cc).
batchgate::wire::Infer MakeInfer(uint64_t rid, uint32_t model,
                                 const std::vector<std::vector<int64_t>>& shapes, uint64_t offset);

// Each area's tests.
void RunBasicsTests();     // basics_tests.cc: text, the input region, tokens, handover, metrics
void RunRequestTests();    // request_tests.cc: decode_request()'s checks, replies, deadlines
void RunWireScanTests();   // wire_scan_tests.cc: a request's bytes against the wire limits
void RunWireTests();       // wire_tests.cc: the wire's columns, frames read off a socket
void RunLinkTests();       // link_tests.cc: the executor link over a real socket
