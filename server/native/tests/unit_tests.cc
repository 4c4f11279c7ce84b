// Unit tests of the native front end, run by ctest: each area's file of tests/ (check.h lists
// them). No framework: a failed check prints where and what, and the exit status counts the
// failures.
#include <cstdio>

#include "check.h"

int main() {
  RunBasicsTests();
  RunRequestTests();
  RunWireScanTests();
  RunWireTests();
  RunLinkTests();
  std::fprintf(stderr, "%d of %d checks failed\n", g_failures, g_checks);
  return g_failures ? 1 : 0;
}
