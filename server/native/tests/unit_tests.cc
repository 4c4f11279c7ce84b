// Unit tests of the native front end's pure parts; run by ctest (no framework: a failed check
// prints where and what, and the exit code counts the failures).
#include <cstdio>
#include <string>

#include "text.h"

namespace {

int g_failures = 0;

#define CHECK_EQ(actual, expected)                                                        \
  do {                                                                                    \
    const auto& a_ = (actual);                                                            \
    const auto& e_ = (expected);                                                          \
    if (!(a_ == e_)) {                                                                    \
      ++g_failures;                                                                       \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, #actual " == " #expected); \
    }                                                                                     \
  } while (0)

void TestText() {
  using batchgate::PythonFloat;
  CHECK_EQ(PythonFloat(0.0001), std::string("0.0001"));
  CHECK_EQ(PythonFloat(30.0), std::string("30.0"));
}

}  // namespace

int main() {
  TestText();
  if (g_failures) std::fprintf(stderr, "%d checks failed\n", g_failures);
  else std::fprintf(stderr, "all checks passed\n");
  return g_failures ? 1 : 0;
}
