"""kvroute's /metrics parser and scraper read real vLLM pods sensibly."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import BLOCK_SIZE, MAX_MODEL_LEN, MODEL_NAME, VLLMPod, chat
from extproc.endpoints.metrics import MetricsScraper, PodMetrics, parse_vllm_metrics
from tests.vllm.harness import send_chat

SEE_LOAD_TIMEOUT_S = 120.0  # generations go on back to back until the scraper has seen one running

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _metrics(client: httpx.AsyncClient, pod: VLLMPod) -> PodMetrics:
    r = await client.get(f"{pod.url}/metrics")
    r.raise_for_status()
    return parse_vllm_metrics(r.text)


async def test_parse_real_metrics(pods: list[VLLMPod], tok: HFTokenizer, aclient: httpx.AsyncClient) -> None:
    pod = pods[1]
    before = await _metrics(aclient, pod)
    assert before.block_size == BLOCK_SIZE
    assert before.num_gpu_blocks == pod.kv_cache_blocks
    assert before.num_requests_running == 0 and before.num_requests_waiting == 0
    assert before.kv_cache_usage_perc is not None and 0.0 <= before.kv_cache_usage_perc <= 1.0
    assert before.prefix_cache_queries is not None and before.prefix_cache_hits is not None

    msgs = chat(300, 200)
    first = await send_chat(aclient, pod.url, tok, pod.address, msgs)
    second = await send_chat(aclient, pod.url, tok, pod.address, msgs)
    after = await _metrics(aclient, pod)
    assert after.prefix_cache_queries == before.prefix_cache_queries + first.prompt_tokens + second.prompt_tokens
    assert after.prefix_cache_hits == before.prefix_cache_hits + first.cached_tokens + second.cached_tokens
    assert second.cached_tokens > 0


async def test_scraper_sees_load(pods: list[VLLMPod], aclient: httpx.AsyncClient) -> None:
    """While long generations run, the scraper reports one running and the KV usage above zero.

    Two generations, each as long as the model allows, are kept going back to back (a new one starts
    as soon as one ends), so the pod is never idle until the scraper has seen it busy, and every
    scrape is recorded as it lands (``subscribe``), none sampled away. Not streamed: a loaded host
    left vLLM's API server so far behind sending a stream's tokens that /metrics went unanswered
    until the generation had ended (seen: 84 s and 28 generations before one scrape showed one
    running); unstreamed, it answers within seconds. Cancelling the request aborts the generation."""
    pod = pods[1]
    scraper = MetricsScraper([p.address for p in pods], interval_s=0.05, timeout_s=10.0, max_age_s=30.0)
    scrapes: list[PodMetrics] = []
    busy_seen = asyncio.Event()

    def on_scrape(endpoint: str, m: PodMetrics, _at: float) -> None:
        if endpoint == pod.address:
            scrapes.append(m)
            if m.num_requests_running >= 1:
                busy_seen.set()

    scraper.subscribe(on_scrape)
    await scraper.start()
    body = {"model": MODEL_NAME, "prompt": "load " * 200, "max_tokens": MAX_MODEL_LEN - 512,
            "ignore_eos": True, "stream": False}  # fmt: skip
    generations = 0

    async def keep_busy() -> None:
        nonlocal generations
        while not busy_seen.is_set():
            generations += 1
            r = await aclient.post(f"{pod.url}/v1/completions", json=body, timeout=None)
            r.raise_for_status()

    try:
        async with asyncio.timeout(10):
            while any(scraper.get(p.address) is None for p in pods):
                await asyncio.sleep(0.05)
        workers = [asyncio.create_task(keep_busy()) for _ in range(2)]
        try:
            async with asyncio.timeout(SEE_LOAD_TIMEOUT_S):
                waiter = asyncio.create_task(busy_seen.wait())
                done, _ = await asyncio.wait([waiter, *workers], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # a failed generation fails the test with its own error
                await waiter
        except TimeoutError:
            pytest.fail(f"never saw a request running in {len(scrapes)} scrapes over {generations} generations"
                        f" in {SEE_LOAD_TIMEOUT_S:.0f} s; scraper {scraper.stats()}")  # fmt: skip
        finally:
            busy_seen.set()
            for t in workers:
                t.cancel()
            for t in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            async with asyncio.timeout(30):  # the pod aborted them: later tests start from an idle pod
                while (await _metrics(aclient, pod)).num_requests_running:
                    await asyncio.sleep(0.05)
        busy = [m for m in scrapes if m.num_requests_running >= 1]
        assert busy and max(m.kv_cache_usage_perc or 0.0 for m in busy) > 0.0
        idle = pods[0]
        assert scraper.get(idle.address) is not None
        assert scraper.stats()["parse_errors"] == 0
    finally:
        await scraper.aclose()
