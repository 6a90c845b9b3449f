"""The simulated pod's /metrics text against prometheus_client's, for the same updates.

The reference below declares vLLM's series as vLLM does (prometheus_client objects on a registry);
bench.sim.metrics writes the text from plain floats, and must write the same bytes (but the
``_created`` timestamps, taken at different instants) so that every scraper sees vLLM's format.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bench.sim.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, PodMetrics
from extproc.endpoints.metrics import parse_vllm_metrics

MODEL = "sim-model"
CREATED = re.compile(r"^(\S+_created\{[^}]*\}) \S+$", re.M)


class Reference:
    """vLLM's registry, declared with prometheus_client as vllm/v1/metrics/loggers.py does."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        names, lv = ["model_name", "engine"], (MODEL, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     [*names, "block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=r)  # fmt: skip
        info.labels(*lv, str(block_size), str(num_blocks), "True").set(1)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "External (KV connector) prefix cache queries, in tokens."
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "External (KV connector) prefix cache hits, in tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*names, "finished_reason"], registry=r)  # fmt: skip

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*lv)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", E2E_BUCKETS)

    def success(self, reason: str) -> None:
        self._success.labels(MODEL, "0", reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _text(raw: bytes) -> str:
    return CREATED.sub(r"\1 T", raw.decode())


def _drive(targets: list[Any], rng: random.Random, steps: int) -> None:
    """The same random updates, as the engine makes them, on every target."""
    for _ in range(steps):
        op = rng.randrange(9)
        v = rng.choice([0.0, 0.001, 0.005, 0.01, 0.0123, 0.5, 1.0, 2.5, 99.9, 3000.0, rng.random() * 10])
        n = rng.choice([1, 16, 100, 4096])
        for t in targets:
            if op == 0:
                t.running.set(n % 7)
                t.waiting.set(n % 3)
                t.kv_usage.set(v / 3000.0)
            elif op == 1:
                t.prefix_queries.inc(n)
                t.prefix_hits.inc(n // 2)
            elif op == 2:
                t.ttft.observe(v)  # values on a bucket edge included: le counts them in that bucket
            elif op == 3:
                t.itl.observe(v)
            elif op == 4:
                t.e2e.observe(v)
            elif op == 5:
                t.prompt_tokens.inc(n)
                t.generation_tokens.inc(n // 16)
            elif op == 6:
                t.success(["stop", "length", "abort"][n % 3])
            elif op == 7:
                t.preemptions.inc()
            else:
                t.external_queries.inc(n)
                t.external_hits.inc(n // 4)


def test_a_fresh_pod_writes_what_prometheus_client_writes() -> None:
    assert _text(PodMetrics(MODEL, 16, 28000).render()) == _text(Reference(16, 28000).render())


@pytest.mark.parametrize("seed", range(5))
def test_the_same_updates_write_the_same_text(seed: int) -> None:
    ours, ref = PodMetrics(MODEL, 32, 2048), Reference(32, 2048)
    rng = random.Random(seed)
    for _ in range(4):
        _drive([ours, ref], rng, 60)
        assert _text(ours.render()) == _text(ref.render())


def test_created_timestamps_are_wall_clock_seconds_and_kvroute_reads_the_text() -> None:
    import time

    before = time.time()
    m = PodMetrics(MODEL, 16, 100)
    m.running.set(3)
    m.prompt_tokens.inc(500)
    m.ttft.observe(0.2)
    text = m.render().decode()
    stamps = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if "_created{" in line]
    assert stamps and all(before <= s <= time.time() for s in stamps)
    got = parse_vllm_metrics(text)
    assert (got.num_requests_running, got.prompt_tokens, got.ttft_count, got.ttft_sum_s) == (3.0, 500.0, 1.0, 0.2)
    assert got.kv_capacity_tokens == 1600


def test_counters_refuse_to_go_down() -> None:
    with pytest.raises(ValueError):
        PodMetrics(MODEL, 16, 100).prompt_tokens.inc(-1)
