# `make test` and `make demo` set themselves up: they create .venv when missing, install torch
# (the CPU wheel pinned below, so pip never pulls a multi-GB CUDA build), then the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.diffserve-installed

.PHONY: test lint install clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

clean-venv:
	rm -rf $(VENV)
