"""bench.fidelity_load's ITL calibration against a simulated pod: every batch's prompts are cached
before the timed run, so each stream prefills only its last block and the batch decodes together
from its first step (a prefill step among the gaps would read as a per-context decode cost)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import bench.fidelity_load as fl
from bench.vllm_model import build as build_model
from bench.vllm_pods import BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]


async def test_itl_batches_are_cached_before_they_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model(ROOT / ".cache" / "tiny-llama")
    runs: list[tuple[list[fl.LoadItem], Any]] = []
    real_run_load = fl.run_load

    async def spy(urls: Any, items: Any, at: Any, *args: Any, **kwargs: Any) -> Any:
        result = await real_run_load(urls, items, at, *args, **kwargs)
        runs.append((list(items), result))
        return result

    monkeypatch.setattr(fl, "run_load", spy)
    with fl.sim_fleet(1, str(model), 159, {}) as (urls, _):
        samples = await fl.measure_itl(urls, repeats=1)

    configs = [(words, b) for words, batches in fl.ITL_BATCHES for b in batches]
    assert [b for b, _, _ in samples] == [b for _, b in configs]
    assert [items[0].tag for items, _ in runs] == ["warm", "itl"] * len(configs)
    for (warm, _), (timed, result) in zip(runs[::2], runs[1::2], strict=True):
        assert [w.messages for w in warm] == [t.messages for t in timed]  # the same prompts, warmed first
        assert {w.max_tokens for w in warm} == {1} and {t.max_tokens for t in timed} == {fl.ITL_OUTPUT}
        for q in result.requests:
            assert q["ok"] and q["prompt"] - q["cached"] <= BLOCK_SIZE, q  # only the last block prefilled
    # The largest batch of long prompts holds several thousand tokens of context (the fit's range).
    assert max(ctx for _, ctx, _ in samples) > 3000


async def test_the_speed_probe_reads_the_pods_single_stream_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``probe`` (taken after calibrating and before each real run) reads a pod's one-stream decode step:
    on a simulated pod, the step its profile gives one sequence at that context; the median of
    ``PROBE_REPEATS`` decodes after a warm-up one it does not count."""
    from bench.results import fidelity_load_rows
    from bench.sim.profiles import CPU_TINY

    timed: list[float] = []
    real_decode = fl.decode_together

    async def spy(urls: Any, items: Any) -> Any:
        result = await real_decode(urls, items)
        timed.append(result.engine_mean("itl"))
        return result

    monkeypatch.setattr(fl, "decode_together", spy)
    model = build_model(ROOT / ".cache" / "tiny-llama")
    slow = {"base_ms": 40.0}  # steps well above the simulator's own Python cost
    with fl.sim_fleet(1, str(model), 159, slow) as (urls, _):
        speed = await fl.probe(urls)
    expected = (slow["base_ms"] + CPU_TINY.decode_ms_per_seq) / 1e3
    assert expected <= speed < expected * 1.5  # late wake-ups on a busy host only add
    assert len(timed) == fl.PROBE_REPEATS + 1 and speed == sorted(timed[1:])[len(timed[1:]) // 2]
    row = {"workload": "w", "rate": 1.0, "same_cached_sim": 1, "probe_calibrated_s": speed}
    figures = {k: 0.01 for k in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "engine_itl_mean")}
    run = {**figures, "hit_requests": 1, "requests": 1, "preemptions": 0, "waiting_peak": 0}
    row |= {"real": {**run, "probe_s": speed * 1.3}, "real2": {**run, "probe_s": speed}, "sim": run}
    row |= {"sim_vs_real": dict.fromkeys(figures, 1.0)}
    assert fidelity_load_rows([row])[0][-2] == "1.30 / 1.00"
    assert fidelity_load_rows([{**row, "recalibrated": True}])[0][-2] == "1.30 / 1.00 (calibrated again)"


def test_drift_beyond_the_fraction_either_way_calls_for_a_calibration() -> None:
    assert not fl.drifted(0.0114, 0.010, 0.15)
    assert fl.drifted(0.0116, 0.010, 0.15)  # the pods' step 16 % slower than at calibration
    assert fl.drifted(0.0084, 0.010, 0.15)  # ... or 16 % faster (this host ran 0.52x its calibration's)
    assert not fl.drifted(0.0086, 0.010, 0.15)


async def test_an_anchored_rate_runs_the_fit_beside_the_anchored_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Setup.anchor``: the simulated run's decode terms follow real run 1's probe, and the fit as is
    runs beside it. Here a simulated pod with 40 ms steps stands in for the real one and the fit says
    30 ms: the anchored run decodes at the real pod's pace, the fit's a quarter faster."""
    model = str(build_model(ROOT / ".cache" / "tiny-llama"))
    real_terms, fitted = {"base_ms": 40.0}, {"base_ms": 30.0}
    items = fl.mixed(6, 1, seed=2)

    async def fresh(urls: Any) -> None:  # the stand-in pod starts empty (the simulator has no dev reset)
        return None

    monkeypatch.setattr(fl, "reset_real", fresh)
    with fl.sim_fleet(1, model, 159, fitted) as (urls, _):
        sim_probe = await fl.probe(urls)
    with fl.sim_fleet(1, model, 159, real_terms) as (urls, _):
        setup = fl.Setup(urls, (), model, 159, fitted, probe_s=sim_probe, sim_probe_s=sim_probe, probe_context=130,
                         quiet_wait_s=0.0, anchor=True)  # fmt: skip
        c = await fl.compare_at(setup, "mixed", items, 20.0, repeats=1)
    row = c.row()
    assert 1.15 < row["decode_anchor"] < 1.8  # ~ 1 + (40 - 30) / 30.4; late wake-ups on a busy host only add
    assert row["sim_overrides"]["base_ms"] == pytest.approx(30.0 * row["decode_anchor"])
    real, anchored, fit = (row[k]["engine_itl_mean"] for k in ("real", "sim", "sim_fit"))
    assert abs(anchored - real) < abs(fit - real) / 2
    assert set(row["sim_fit_vs_real"]) == set(row["sim_vs_real"])


def test_paired_compares_each_request_with_itself() -> None:
    """``paired``: request k's figure in one run over its figure in the other, failed requests left out;
    the run's percentiles can differ while every request matches (and the reverse)."""

    def run(ttfts: list[float | None], itl: float = 0.01) -> fl.RunResult:
        reqs = [{"k": k, "ok": t is not None, "ttft": t, "itl": [itl, 2 * itl]} for k, t in enumerate(ttfts)]
        return fl.RunResult(reqs, [], [], 1.0, 0.0)

    real = run([0.10, 0.20, 0.30, 0.40, 0.50, None])
    sim = run([0.11, 0.22, 0.33, 0.44, 0.55, 0.60], itl=0.008)
    p = fl.paired(real, sim, "ttft")
    assert p["requests"] == 5 and p["p10"] == pytest.approx(1.1) and p["p90"] == pytest.approx(1.1)
    assert fl.paired(real, sim, "itl")["p50"] == pytest.approx(0.8)  # the mean gap, 12 ms over 15 ms
    # The same TTFTs handed to other requests: the run's percentiles equal, each request off.
    shuffled = fl.paired(real, run([0.50, 0.40, 0.30, 0.20, 0.10, None]), "ttft")
    assert shuffled["p50"] == pytest.approx(1.0) and shuffled["p10"] < 0.5 and shuffled["p90"] > 2.0


async def test_the_drift_check_also_probes_a_batch_of_long_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """``host_moved``: the host is calibrated again when the one-stream step or, where the calibration
    took it, the step of ``PROBE_BATCH`` long streams has moved more than the fraction; the batch probe
    decodes that many ~900-token chats per pod together (the context term the one-stream probe misses)."""
    sent: list[list[Any]] = []

    class Run:
        def engine_mean(self, key: str) -> float:
            return 0.010 if len(sent[-1]) == 1 else 0.020  # one stream 10 ms, the batch 20 ms

    async def fake(urls: Any, items: Any) -> Any:
        sent.append(list(items))
        return Run()

    monkeypatch.setattr(fl, "decode_together", fake)
    assert await fl.probe(["http://pod"], batch=fl.PROBE_BATCH) == pytest.approx(0.020)
    streams = fl.PROBE_BATCH[0]
    assert len(sent) == fl.PROBE_REPEATS + 1 and all(len(items) == streams for items in sent)
    assert len({str(item.messages) for items in sent for item in items}) == streams * len(sent)  # all distinct
    base = fl.Setup(["http://pod"], (), "m", 159, {}, probe_s=0.010, quiet_wait_s=0.0)
    assert not await fl.host_moved(base, 0.15)  # no batch probe at calibration: the one-stream step only
    assert not await fl.host_moved(replace(base, probe_batch_s=0.019), 0.15)
    assert await fl.host_moved(replace(base, probe_batch_s=0.016), 0.15)  # the batch 25 % slower now
    assert await fl.host_moved(replace(base, probe_s=0.0085, probe_batch_s=0.020), 0.15)
