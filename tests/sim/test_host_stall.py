"""Host CPU shared by the engine and the API side (issue 19): the profile's host terms, the engine's
step stretch and their fit."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx
import pytest

from bench.sim import Fleet, FleetConfig
from bench.sim.calibrate import StallSample, fit_host
from bench.sim.engine import Engine, Finished, SimRequest
from bench.sim.profiles import CPU_TINY, FAST, H100_LLAMA8B, TUNABLE, LatencyProfile, with_overrides
from tests.sim.test_engine import make_engine

# Decode steps of exactly 5 ms (no per-sequence or context term), 1 ms per prefill token.
FLAT = replace(CPU_TINY, base_ms=5.0, decode_ms_per_seq=0.0, decode_ms_per_kctx=0.0, prefill_ms_per_token=0.0)


async def stream(eng: Engine, tokens: int, host: tuple[float, float] | None = None) -> float:
    """How long one request decoding ``tokens`` tokens takes; ``host``: (stall, window) of host work
    that starts once it decodes (another request being taken in)."""
    req = SimRequest("probe", [5] * 40, tokens)
    eng.submit(req)
    await req.out.get()
    if host is not None:
        eng.host_work(*host)
    while not isinstance(await req.out.get(), Finished):
        pass
    return req.last_token_at - req.arrival


def test_only_opted_in_profiles_have_host_terms() -> None:
    for p in (H100_LLAMA8B, FAST, CPU_TINY):
        assert p.host_ms_per_request == p.host_ms_per_prompt_token == 0.0
        assert p.host_stall_seconds(1000) == 0.0
    assert {"host_ms_per_request", "host_ms_per_prompt_token"} <= set(TUNABLE)  # --set accepts them
    tuned = with_overrides(CPU_TINY, {"host_ms_per_request": 12.0, "host_ms_per_prompt_token": 0.01})
    assert tuned.host_stall_seconds(1000) == pytest.approx(0.022)
    assert tuned.scaled(2.0).host_stall_seconds(1000) == pytest.approx(0.044)


async def test_zero_stall_changes_nothing(vclock: Any) -> None:
    base = await stream(make_engine(vclock, FLAT)[0], 30)
    assert await stream(make_engine(vclock, FLAT)[0], 30, host=(0.0, 0.05)) == pytest.approx(base, abs=1e-12)


@pytest.mark.parametrize(("stall", "window"), [(0.02, 0.05), (0.03, 0.0), (0.012, 0.1), (0.03, 0.01)])
async def test_steps_overlapping_host_work_lose_its_stall(vclock: Any, stall: float, window: float) -> None:
    """The stream's steps together last ``stall`` longer (the window ends before the stream does);
    nothing else changes."""
    base = await stream(make_engine(vclock, FLAT)[0], 60)
    eng, _ = make_engine(vclock, FLAT)
    assert await stream(eng, 60, host=(stall, window)) == pytest.approx(base + stall, abs=1e-9)
    assert eng.stats.busy_s == pytest.approx(base + stall, abs=1e-9)
    assert eng.stats.steps == 60


async def test_stall_is_spread_over_the_window(vclock: Any) -> None:
    """Host work ending mid-stream is charged in full; work still going on when the stream ends is
    charged only for the part that overlapped it."""
    base = await stream(make_engine(vclock, FLAT)[0], 11)  # 55 ms
    eng, _ = make_engine(vclock, FLAT)
    # 0.5 s window, 10 ms lost in all: the stream overlaps ~10% of it, so it loses ~1 ms.
    got = await stream(eng, 11, host=(0.01, 0.5))
    assert 0.0005 < got - base < 0.0015


async def test_host_work_while_idle_delays_nothing(vclock: Any) -> None:
    eng, _ = make_engine(vclock, FLAT)
    base = await stream(eng, 20)
    await asyncio.sleep(0)  # the engine goes idle
    eng.host_work(0.05, 0.05)  # a request tokenized and refused meanwhile
    eng.host_work(0.05, 0.0)
    vclock.t += 1.0
    assert await stream(eng, 20) == pytest.approx(base, abs=1e-12)


def sample(n: int, host: LatencyProfile, own_ms: float, quiet: float = 0.005) -> StallSample:
    """A probe of 799 gaps while 30 requests of ``n`` tokens came in: the real pod lost the host terms'
    stall per request plus ``own_ms`` (their own prefill, which the simulator charges too)."""
    requests, gaps = 30, 799
    real_extra = requests * (host.host_stall_seconds(n) + own_ms / 1e3) / gaps
    sim_extra = requests * (own_ms / 1e3) / gaps
    return StallSample(n, requests, gaps, quiet, quiet + real_extra, quiet * 1.1, quiet * 1.1 + sim_extra)


@pytest.mark.parametrize(("per_req", "per_tok"), [(14.0, 0.004), (25.0, 0.0), (0.0, 0.02)])
def test_fit_host_recovers_the_terms(per_req: float, per_tok: float) -> None:
    host = replace(CPU_TINY, host_ms_per_request=per_req, host_ms_per_prompt_token=per_tok)
    samples = [sample(n, host, own_ms=0.5 + n / 1000) for n in (120, 1400)]
    assert samples[0].stall_ms() == pytest.approx(per_req + per_tok * 120)
    got = fit_host(samples)
    assert got == pytest.approx({"host_ms_per_request": per_req, "host_ms_per_prompt_token": per_tok}, abs=1e-9)


def test_fit_host_without_a_stall_is_zero_and_needs_samples() -> None:
    samples = [sample(n, CPU_TINY, own_ms=2.0) for n in (120, 1400)]  # the simulator already explains it
    assert fit_host(samples) == pytest.approx({"host_ms_per_request": 0.0, "host_ms_per_prompt_token": 0.0})
    faster = [replace(s, real_busy=s.real_quiet) for s in samples]  # the real pod did not slow at all
    assert fit_host(faster) == {"host_ms_per_request": 0.0, "host_ms_per_prompt_token": 0.0}
    with pytest.raises(ValueError, match="need stall samples"):
        fit_host([])
    with pytest.raises(ValueError, match="need stall samples"):
        fit_host([replace(samples[0], requests=0)])


async def test_pod_charges_each_request_to_its_engine(client: httpx.AsyncClient) -> None:
    """Each request a pod takes in, refused or not, is host work for its engine: the profile's stall
    over the request's API time."""
    over = {"host_ms_per_request": 30.0, "host_ms_per_prompt_token": 0.01, "api_overhead_ms": 2.0}
    async with Fleet(FleetConfig(pods=1, profile="cpu-tiny", zmq_base_port=None, profile_overrides=over)) as fleet:
        pod = fleet.pods[0]
        calls: list[tuple[float, float]] = []
        pod.engine.host_work = lambda stall, window: calls.append((stall, window))  # type: ignore[method-assign]
        url = pod.url + "/v1/completions"
        ok = await client.post(url, json={"prompt": [5] * 100, "max_tokens": 1})
        refused = await client.post(url, json={"prompt": [6] * 40, "max_tokens": 5000})
        assert (ok.status_code, refused.status_code) == (200, 400)
        api = pod.profile.api_seconds
    assert calls == [pytest.approx((0.031, api(100))), pytest.approx((0.0304, api(40)))]
