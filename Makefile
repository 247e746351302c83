# `make demo` and `make test` set themselves up: they create .venv when missing, install torch
# (the CPU wheel pinned below when no torch is installed, so pip never pulls a multi-GB CUDA
# build), then diffserve. `make demo` needs only the runtime; `make test` adds the test extras.
# pip installs with --no-compile: byte-compiling all of the ~19,500 modules it installs costs ~35 s of
# one core, while a run imports a fifth of them; Python compiles those on first import and caches them
# (__pycache__), which is why the demo and the tests run with PYTHONDONTWRITEBYTECODE cleared.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PIP_INSTALL = $(PY) -m pip install -q --no-compile
RUNTIME_STAMP := $(VENV)/.diffserve-runtime
# The CPU wheel pinned above, where no torch is installed yet.
INSTALL_TORCH = $(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) torch==$(TORCH_VERSION)
TEST_STAMP := $(VENV)/.diffserve-test
LINT_PATHS := $(wildcard src tests benchmarks tools integrations)
DEMO_PROMPT ?= a large red circle in the center on a black background

.PHONY: demo test lint install clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUNTIME_STAMP): pyproject.toml | $(PY)
	@$(INSTALL_TORCH)
	$(PIP_INSTALL) -e .
	@touch $(RUNTIME_STAMP)

# The test extras include the runtime: one pip run installs both (a second would resolve everything again).
# Meanwhile torch's modules are byte-compiled on the other core (about 6 s of it, which pip leaves idle): the
# two test workers import torch first thing, and each would otherwise compile the same modules (about 9 s).
TORCH_DIR = $$($(PY) -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')
$(TEST_STAMP): pyproject.toml | $(PY)
	@$(INSTALL_TORCH)
	@$(PY) -m compileall -q -j 1 "$(TORCH_DIR)" >/dev/null 2>&1 & compiling=$$!; \
	$(PIP_INSTALL) -e ".[test]"; built=$$?; wait $$compiling; exit $$built
	@touch $(RUNTIME_STAMP) $(TEST_STAMP)

install: $(RUNTIME_STAMP)

demo: $(RUNTIME_STAMP)
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/diffserve generate --prompt "$(DEMO_PROMPT)" --seed 0 --output-path outputs

# The tests cache byte code (git-ignored __pycache__/) even where PYTHONDONTWRITEBYTECODE is set: the suite
# starts hundreds of Python processes, and tests/conftest.py re-enables it for them; the empty value here also
# covers pytest's own start-up (its plugins' rewritten modules). Two workers, one per core: a third one was
# slower (warm tree, 2026-12-05: 705 s against 643 s with two) and made the timing-bound tests flakier.
# tests/conftest.py orders the files so that the longest start first; --durations=30 lists where the time went.
# tests/browser drives the web UI in a headless Chromium: as root with apt-get, Debian's is installed when
# missing (quietly), in the background while pip sets up .venv (pip keeps one core busy, apt-get mostly waits
# on the network and the disk); otherwise those tests skip, saying why.
CHROMIUM_INSTALL = command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	! command -v apt-get >/dev/null 2>&1 || (export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -qq chromium >/dev/null 2>&1 || \
	(apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1))

test:
	@($(CHROMIUM_INSTALL)) & chromium=$$!; \
	$(MAKE) --no-print-directory $(TEST_STAMP); built=$$?; \
	wait $$chromium || echo "make test: could not install chromium with apt-get; tests/browser will be skipped"; \
	exit $$built
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --durations=30 tests

lint: $(TEST_STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

clean-venv:
	rm -rf $(VENV)
