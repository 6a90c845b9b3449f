"""vLLM /metrics parsing and the polling scraper against a tiny loopback aiohttp server."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.sim.metrics import PodMetrics as SimMetrics
from extproc.endpoints.metrics import MetricsParseError, MetricsScraper, PodMetrics, parse_vllm_metrics
from tests.backends import serve_loopback

# Shaped like a vLLM 0.1x/0.2x v1 engine's /metrics with two engines (DP=2).
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 3000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 400.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 600.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.5
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 123.0
"""  # noqa: E501  (real vLLM lines, kept verbatim)

OLD_TEXT = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
"""


def test_parse_sums_engines_and_averages_usage() -> None:
    m = parse_vllm_metrics(VLLM_TEXT)
    assert m == PodMetrics(
        num_requests_waiting=7.0,
        num_requests_running=4.0,
        kv_cache_usage_perc=0.5,
        block_size=16,
        num_gpu_blocks=54_000,
        prefix_cache_queries=4000.0,
        prefix_cache_hits=1000.0,
        ttft_sum_s=1.5,  # the histogram's sum and count only (its buckets are not read)
        ttft_count=9.0,
    )
    assert m.prefix_cache_hit_rate == 0.25


def test_parse_falls_back_to_old_names_and_tolerates_missing() -> None:
    m = parse_vllm_metrics(OLD_TEXT)
    assert m.kv_cache_usage_perc == 0.5 and m.prefix_cache_queries == 10.0
    assert m.num_requests_waiting is None and m.block_size is None and m.prefix_cache_hit_rate is None
    assert parse_vllm_metrics("") == PodMetrics()


def test_parse_rejects_garbage() -> None:
    for bad in (
        'vllm:num_requests_running{engine="0" 1.0',
        "vllm:num_requests_running{engine=0} 1.0",
        "vllm:num_requests_running",
        "vllm:num_requests_running 1.0 2 3",
        "vllm:num_requests_running one",
    ):
        with pytest.raises(MetricsParseError):
            parse_vllm_metrics(bad + "\n")


def _reference(text: str) -> PodMetrics:
    """The same figures read through prometheus_client's own parser (what kvroute used before)."""
    values: dict[str, float] = {}
    usage: list[float] = []
    info: list[dict[str, str]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if s.name.endswith("_created") or s.name.endswith("_bucket"):
                continue
            if name == "vllm:cache_config_info":
                info.append(s.labels)
            elif not math.isfinite(s.value):
                continue
            elif name == "vllm:kv_cache_usage_perc":
                usage.append(s.value)
            else:
                values[name] = values.get(name, 0.0) + s.value
    return PodMetrics(
        num_requests_waiting=values.get("vllm:num_requests_waiting"),
        num_requests_running=values.get("vllm:num_requests_running"),
        kv_cache_usage_perc=sum(usage) / len(usage) if usage else None,
        block_size=max(int(i["block_size"]) for i in info) if info else None,
        num_gpu_blocks=sum(int(i["num_gpu_blocks"]) for i in info) if info else None,
        prefix_cache_queries=values.get("vllm:prefix_cache_queries"),
        prefix_cache_hits=values.get("vllm:prefix_cache_hits"),
        prompt_tokens=values.get("vllm:prompt_tokens"),
        ttft_sum_s=values.get("vllm:time_to_first_token_seconds_sum"),
        ttft_count=values.get("vllm:time_to_first_token_seconds_count"),
    )


def sim_metrics_text() -> str:
    """bench.sim's /metrics (shaped as vLLM's: every family, histograms observed) after some work."""
    m = SimMetrics("m", block_size=16, num_blocks=500)
    m.running.set(2)
    m.waiting.set(1)
    m.kv_usage.set(0.4)
    m.prefix_queries.inc(300)
    m.prefix_hits.inc(120)
    m.prompt_tokens.inc(300)
    for s in (0.02, 0.3, 1.5):
        m.ttft.observe(s)
        m.itl.observe(s / 10)
    return m.render().decode()


# What the format allows beyond vLLM's usual lines: escaped label values (a brace, a quote, a
# backslash, a newline), a trailing comma, spaces around the labels, a timestamp, Inf/NaN values,
# _created samples, a series whose name extends one read here.
EDGE_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a}b \\"q\\" \\\\ \\n",} 3.0 1700000000000
vllm:num_requests_running{ engine = "1" } 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting 4.0
vllm:num_requests_waiting_by_reason{reason="preempted"} 9.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0"} 100.0
vllm:prompt_tokens_created{engine="0"} 1.7e+09
vllm:prompt_tokens_total{engine="1"} NaN
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} +Inf
vllm:kv_cache_usage_perc{engine="1"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
"""


def test_parse_reads_what_prometheus_clients_parser_reads() -> None:
    edge = parse_vllm_metrics(EDGE_TEXT)
    assert edge.num_requests_running == 5.0 and edge.num_requests_waiting == 4.0 and edge.prompt_tokens == 100.0
    assert edge.kv_cache_usage_perc == 0.5 and edge.num_gpu_blocks == 100  # +Inf and NaN dropped, not summed
    for text in (VLLM_TEXT, OLD_TEXT, EDGE_TEXT, sim_metrics_text()):
        ours, ref = parse_vllm_metrics(text), _reference(text)
        if text is OLD_TEXT:  # the reference reads the current names only
            ref = PodMetrics(kv_cache_usage_perc=0.5, prefix_cache_queries=10.0)
        assert ours == ref


def test_parse_takes_lines_ending_in_cr_lf() -> None:
    assert parse_vllm_metrics(EDGE_TEXT.replace("\n", "\r\n")) == parse_vllm_metrics(EDGE_TEXT)
    assert parse_vllm_metrics(VLLM_TEXT.replace("\n", "\r\n")) == parse_vllm_metrics(VLLM_TEXT)


class FakePod:
    def __init__(self) -> None:
        self.text = VLLM_TEXT
        self.status = 200
        self.delay_s = 0.0
        self.hits = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.Response(text=self.text, status=self.status, content_type="text/plain")


@pytest.fixture
async def pods() -> AsyncIterator[tuple[list[FakePod], list[str]]]:
    fakes = [FakePod(), FakePod()]
    runners, eps = [], []
    for f in fakes:
        app = web.Application()
        app.router.add_get("/metrics", f.handle)
        runner, port = await serve_loopback(app)
        runners.append(runner)
        eps.append(f"127.0.0.1:{port}")
    yield fakes, eps
    for r in runners:
        await r.cleanup()


async def until(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def test_scraper_polls_and_marks_stale(pods: tuple[list[FakePod], list[str]]) -> None:
    fakes, eps = pods
    scraper = MetricsScraper(eps, interval_s=0.02, timeout_s=0.2, stale_after_misses=2, max_age_s=5.0)
    await scraper.start()
    try:
        await until(lambda: all(scraper.get(ep) is not None for ep in eps))
        m = scraper.get(eps[0])
        assert m is not None and m.num_requests_waiting == 7.0
        fakes[0].text = VLLM_TEXT.replace('engine="1",model_name="Qwen/Qwen3-0.6B"} 5.0', 'engine="1"} 0.0')
        await until(lambda: getattr(scraper.get(eps[0]), "num_requests_waiting", None) == 2.0)
        fakes[1].status = 503
        await until(lambda: scraper.get(eps[1]) is None)
        state = scraper.state(eps[1])
        assert state is not None and state.stale and state.misses >= 2 and state.metrics is not None
        fakes[1].status = 200
        await until(lambda: scraper.get(eps[1]) is not None)
        assert scraper.stats()["failures"] >= 2 and scraper.stats()["stale"] == 0
    finally:
        await scraper.aclose()


async def test_scraper_timeouts_and_age_limit(pods: tuple[list[FakePod], list[str]]) -> None:
    fakes, eps = pods
    now = [0.0]
    scraper = MetricsScraper(
        [eps[0]], interval_s=0.02, timeout_s=0.05, stale_after_misses=100, max_age_s=1.0, clock=lambda: now[0]
    )
    await scraper.start()
    try:
        await until(lambda: scraper.get(eps[0]) is not None)
        fakes[0].delay_s = 0.5  # every scrape now times out
        await until(lambda: getattr(scraper.state(eps[0]), "misses", 0) >= 1)
        assert scraper.get(eps[0]) is not None  # few misses and young: still usable
        now[0] = 2.0  # older than max_age_s
        assert scraper.get(eps[0]) is None
    finally:
        await scraper.aclose()


async def test_set_endpoints_follows_the_pool(pods: tuple[list[FakePod], list[str]]) -> None:
    fakes, eps = pods
    scraper = MetricsScraper([eps[0]], interval_s=0.02)
    await scraper.start()
    try:
        await until(lambda: scraper.get(eps[0]) is not None)
        assert fakes[1].hits == 0
        scraper.set_endpoints([eps[1]])
        await until(lambda: scraper.get(eps[1]) is not None)
        assert scraper.get(eps[0]) is None and scraper.state(eps[0]) is None
        hits = fakes[0].hits
        await asyncio.sleep(0.1)
        assert fakes[0].hits <= hits + 1  # at most one in-flight scrape after removal
        assert scraper.get("127.0.0.1:1") is None
    finally:
        await scraper.aclose()
