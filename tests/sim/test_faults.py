"""Faults on demand: errors, restarts, stalls and slowdowns."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.sim import Fleet

PROMPT = list(range(1, 70))


async def test_error_rate_and_clear(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url
    r = await client.post(url + "/sim/fault", json={"error_rate": 1.0})
    assert r.status_code == 200 and r.json()["faults"]["error_rate"] == 1.0
    r = await client.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    await client.post(url + "/sim/fault", json={"clear": True})
    assert (await client.post(url + "/v1/completions", json={"prompt": "x"})).status_code == 200
    assert (await client.post(url + "/sim/fault", json={"bogus": 1})).status_code == 400


async def test_restart_fails_inflight_and_clears_cache(fleet: Fleet, client: httpx.AsyncClient) -> None:
    pod = fleet.pods[0]
    await client.post(pod.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert pod.cache.num_cached > 0
    pod.fault(slowdown=200.0)  # keep the next requests in flight for a while

    async def stream() -> str:
        async with client.stream(
            "POST", pod.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 500, "stream": True}
        ) as r:
            body = ""
            async for chunk in r.aiter_text():
                body += chunk
            return body

    s_task = asyncio.create_task(stream())
    n_task = asyncio.create_task(client.post(pod.url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 500}))
    for _ in range(200):
        if len(pod.engine.running) == 2:
            break
        await asyncio.sleep(0.01)
    r = await client.post(pod.url + "/sim/fault", json={"restart": True, "down_s": 0.3})
    assert r.status_code == 200
    resp = await n_task
    assert resp.status_code == 500
    try:
        body = await s_task
        assert "[DONE]" not in body
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass
    assert (await client.get(pod.url + "/health")).status_code == 503
    await asyncio.sleep(0.35)
    assert (await client.get(pod.url + "/health")).status_code == 200
    pod.fault(slowdown=1.0)
    r = await client.post(pod.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert pod.stats()["failed"] == 2 and pod.cache.pinned == 0


async def test_stall_delays_requests(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[1].url
    await client.post(url + "/sim/fault", json={"stall_s": 0.3})
    t0 = time.monotonic()
    r = await client.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and time.monotonic() - t0 >= 0.25


@pytest.mark.parametrize("factor", [25.0])
async def test_slowdown_scales_step_time(fleet: Fleet, client: httpx.AsyncClient, factor: float) -> None:
    pod = fleet.pods[1]
    await client.post(pod.url + "/v1/completions", json={"prompt": [9] * 64, "max_tokens": 4})
    base = pod.stats()["busy_s"]
    await client.post(pod.url + "/sim/fault", json={"slowdown": factor})
    await client.post(pod.url + "/v1/completions", json={"prompt": [8] * 64, "max_tokens": 4})
    slow = pod.stats()["busy_s"] - base
    assert slow == pytest.approx(base * factor, rel=1e-6)
