"""The native front end's sanitizer build (``make native-asan``) as the tests run it."""

from __future__ import annotations

from batchgate.server.supervisor import native_binary as native

SANITIZED = native.ROOT / "build" / "native-asan" / "batchgate-frontend"
# A report stops the process (the supervisor would restart it: the test sees the report in the
# log either way); LeakSanitizer reports at the drained process's exit.
SANITIZER_ENV = {"ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1:abort_on_error=0",
                 "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
SANITIZER_REPORTS = (b"ERROR: AddressSanitizer", b"ERROR: LeakSanitizer", b"runtime error:",
                     b"SUMMARY: UndefinedBehavior")
