# kvroute — the two commands: `make demo` and `make test`. Both bootstrap themselves.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv test test-unit test-integration lint demo bench-overhead clean

help:
	@echo "make demo   - simulated vLLM fleet + real Envoy + kvroute vs round robin (sets itself up)"
	@echo "make test   - the whole test suite (sets itself up)"
	@echo "make lint   - ruff + mypy"
	@echo "make bench-overhead - Envoy alone vs Envoy + kvroute added latency (bench/RESULTS.md)"

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the project's dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: venv
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

test-unit: venv
	$(PY) -m pytest -q tests/unit tests/sim

test-integration: venv
	$(PY) -m pytest -q tests/integration

lint: venv
	$(VENV)/bin/ruff check extproc bench tests
	$(VENV)/bin/mypy

demo: venv
	$(PY) -m bench.demo

bench-overhead: venv
	$(PY) -m bench.overhead

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache bench/out
