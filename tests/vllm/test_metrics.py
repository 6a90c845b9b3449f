"""kvroute's /metrics parser and scraper read real vLLM pods sensibly."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from bench.sim.tokenizer import HFTokenizer
from extproc.endpoints.metrics import MetricsScraper, PodMetrics, parse_vllm_metrics
from tests.vllm.harness import chat, send_chat
from tests.vllm.pods import BLOCK_SIZE, MAX_MODEL_LEN, MODEL_NAME, VLLMPod

ATTEMPTS = 5  # generations, each as long as the model allows, for the scraper to see one running

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
    """While a long generation runs, the scraper reports it as running and the KV usage above zero.

    The request is streamed and as long as the model allows; it is cut off as soon as the scraper has
    seen it (vLLM aborts it), so the check does not race a generation that ends first."""
    pod = pods[1]
    scraper = MetricsScraper([p.address for p in pods], interval_s=0.05, timeout_s=2.0, max_age_s=5.0)
    await scraper.start()
    try:
        async with asyncio.timeout(10):
            while any(scraper.get(p.address) is None for p in pods):
                await asyncio.sleep(0.05)
        body = {"model": MODEL_NAME, "prompt": "load " * 200, "max_tokens": MAX_MODEL_LEN - 512,
                "ignore_eos": True, "stream": True}  # fmt: skip
        seen: list[PodMetrics] = []
        busy: list[PodMetrics] = []
        # A loaded host can starve the scraper for as long as one generation lasts (the tiny model
        # writes its longest answer in a second or two): generate again until it has seen one run.
        for _attempt in range(ATTEMPTS):
            done = asyncio.Event()

            async def generate(done: asyncio.Event = done) -> None:
                async with aclient.stream("POST", f"{pod.url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_lines():
                        pass
                done.set()

            task = asyncio.create_task(generate())
            try:
                async with asyncio.timeout(60):
                    while not (busy := [m for m in seen if m.num_requests_running == 1]) and not done.is_set():
                        if (m := scraper.get(pod.address)) is not None:
                            seen.append(m)
                        await asyncio.sleep(0.05)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                async with asyncio.timeout(30):  # the pod aborted it: later tests start from an idle pod
                    while (await _metrics(aclient, pod)).num_requests_running:
                        await asyncio.sleep(0.05)
            if busy:
                break
        assert busy, f"never saw a request running in {len(seen)} scrapes over {ATTEMPTS} generations"
        assert max(m.kv_cache_usage_perc or 0.0 for m in busy) > 0.0
        idle = pods[0]
        assert scraper.get(idle.address) is not None
        assert scraper.stats()["parse_errors"] == 0
    finally:
        await scraper.aclose()
