# The two commands: `make serve` and `make test`. Each sets everything up on a fresh machine
# (a virtual environment with pinned torch, the package, test tools) and then runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test test-fast test-ready install tools native native-asan native-fuzz protos check-protos lint clean gpu-check gpu-check-wheels

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# constraints.txt pins torch to the CPU build on disk; never let pip resolve another.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[server,test]"
	touch $(STAMP)

install: $(STAMP)

# Ecosystem tools the tests use: Triton's perf_analyzer (see scripts/install-perf-analyzer.sh).
tools: $(STAMP)
	bash scripts/install-perf-analyzer.sh || echo "perf_analyzer not installed: its test will say why it skipped"
	bash scripts/install-nginx.sh || echo "nginx not installed: its tests will say why they skipped"
	PYTHON=$(BIN)/python bash scripts/gpu-check-wheels.sh > /dev/null || echo "the GPU check's wheels not downloaded: the test of scripts/gpu-check.sh will say why it skipped"

# The native front end (server/native, C++ on Debian's / Ubuntu's gRPC): the script installs the
# build packages it needs. When it cannot build, this says so once and serve falls back to the
# one-process mode, saying why (tests of the native mode say why they skip; CI sets
# BATCHGATE_REQUIRE_NATIVE).
native: $(STAMP)
	@bash scripts/build-native.sh || echo "make: the native front end could not be built (the line above says why); batchgate serve falls back to one Python process (--frontend single)"

# The same under AddressSanitizer and UBSan, for the tests that run it (tests/test_native_parity.py).
native-asan: $(STAMP)
	@bash scripts/build-native.sh --sanitize || echo "make: the sanitizer build of the native front end could not be built (the line above says why); its tests will skip"

# The libFuzzer targets with clang, for tests/test_fuzz_native.py (scripts/fuzz-native.sh runs them).
native-fuzz: $(STAMP)
	@bash scripts/build-native.sh --fuzz || echo "make: the fuzz targets could not be built (the line above says why); their test will skip"

serve: $(STAMP) native
	$(BIN)/batchgate serve $(ARGS)

# What the whole suite needs, made side by side: the downloads wait on the network while the
# three native builds share the cores (each script is safe to run beside the others).
test-ready: $(STAMP)
	$(MAKE) --no-print-directory -j4 tools native native-asan native-fuzz

# The whole suite, on every core (pytest-xdist; a module's tests stay on one worker, so a
# module's servers start once).
test: test-ready
	$(BIN)/python -m pytest -n auto --dist loadscope $(PYTEST_ARGS)

# The inner loop: the unit tests and one server mode (native, or single where the native front
# end is not built); tests/conftest.py's --fast says what it leaves out. `make test` runs everything.
test-fast: $(STAMP) native
	$(BIN)/python -m pytest -n auto --dist loadscope --fast $(PYTEST_ARGS)

# The GPU check on a GPU machine, with its own torch and no .venv (scripts/gpu-check.sh):
# `make gpu-check OUT=DIR`, `make gpu-check CPU=1` for the same recipe on the CPU. Its wheels
# come from .whl/, which `make gpu-check-wheels` fills where PyPI is reachable.
OUT ?= bench/out/gpu-check
gpu-check:
	bash scripts/gpu-check.sh $(if $(CPU),--cpu) $(OUT)

gpu-check-wheels:
	bash scripts/gpu-check-wheels.sh

protos: $(STAMP)
	$(BIN)/python -m batchgate.protos.generate

check-protos: $(STAMP)
	$(BIN)/python -m batchgate.protos.generate --check

clean:
	rm -rf $(VENV) .tools .pytest_cache .hypothesis build
