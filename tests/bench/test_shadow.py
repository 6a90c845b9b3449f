"""bench.shadow: the figures (histogram quantiles, usage hit rates, predicted vs realised gain) and tiny
real runs of both commands on simulated fleets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from bench import harness, shadow
from extproc.observability import Metrics


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    cum = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert shadow.histogram_quantile(0.25, cum) == pytest.approx(0.1)  # the 10th of 40: the first bucket's top
    assert shadow.histogram_quantile(0.5, cum) == pytest.approx(0.3)  # the 20th: halfway through (0.1, 0.5]
    assert shadow.histogram_quantile(0.9, cum) == pytest.approx(0.8)
    assert shadow.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_histogram_deltas_sum_pods_and_subtract_before() -> None:
    def pod(n_fast: int, n_all: int) -> str:
        return (
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            f'vllm:time_to_first_token_seconds_bucket{{le="0.1"}} {n_fast}\n'
            f'vllm:time_to_first_token_seconds_bucket{{le="+Inf"}} {n_all}\n'
            f"vllm:time_to_first_token_seconds_count {n_all}\n"
            f"vllm:time_to_first_token_seconds_sum 1.0\n"
        )

    before, after = pod(1, 2), pod(3, 5) + pod(2, 2)
    assert shadow.histogram_deltas(before, after, shadow.TTFT) == [(0.1, 4.0), (float("inf"), 5.0)]


def test_compare_summary_gains(tmp_path: Path) -> None:
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text('{"prompt_tokens": 100, "cached_tokens": 50}\n{"prompt_tokens": 100, "cached_tokens": null}\n'
                     '{"prompt_tokens": null, "cached_tokens": null}\n')  # fmt: skip
    assert shadow.usage_hit_rate(jsonl) == pytest.approx(0.25)
    m = Metrics()  # kvroute's own exposition of the rollout counters
    for kind, n in (("prompt", 1000), ("predicted_cached", 600), ("reported_cached", 250)):
        m.rollout_tokens.labels("shadow", kind).inc(n)
    text = generate_latest(m.registry).decode()
    rows = {shadow.SHADOW: {"rollout_tokens": harness.rollout_tokens(text), "ttft_p50_s": 0.2}, shadow.ENFORCED: {}}
    s = shadow.compare_summary(rows, {shadow.SHADOW: 0.25, shadow.ENFORCED: 0.55})
    assert s["shadow_predicted_hit_rate"] == pytest.approx(0.6)
    assert (s["predicted_gain"], s["realised_gain"]) == (pytest.approx(0.35), pytest.approx(0.30))
    assert s["gain_gap_points"] == pytest.approx(5.0)
    assert "+5.0 points" in shadow.compare_table(s)


def test_tiny_compare_run(tmp_path: Path) -> None:
    """Shadow mode predicts a gain over round robin, and enforcing realises one, on the same workload."""
    out = tmp_path / "compare"
    argv = ["compare", "--scenario", "multi-turn", "--max-requests", "40", "--pods", "2", "--rate", "4", "--quiet",
            "--out", str(out)]  # fmt: skip
    assert shadow.main(argv) == 0
    s = json.loads((out / "shadow.json").read_text())["summary"]
    assert s[f"{shadow.SHADOW}/errors"] == 0 and s[f"{shadow.ENFORCED}/errors"] == 0
    assert s["shadow_predicted_hit_rate"] > s["shadow_real_hit_rate"]
    assert s["enforced_hit_rate"] > s["shadow_real_hit_rate"]
    # The usage clients saw is the pods' own count (no cached tokens invented on the way).
    assert s["shadow_real_hit_rate"] == pytest.approx(s[f"{shadow.SHADOW}/hit_rate"], abs=0.02)
    assert (out / "shadow.png").stat().st_size > 0 and "gain predicted" in (out / "shadow.md").read_text()


def test_tiny_mirror_run(tmp_path: Path) -> None:
    """Every request reaches the live pool and, mirrored, the kvroute pool; both pools are measured."""
    out = tmp_path / "mirror"
    argv = ["mirror", "--scenario", "multi-turn", "--max-requests", "40", "--pods", "2", "--rate", "4", "--quiet",
            "--out", str(out)]  # fmt: skip
    assert shadow.main(argv) == 0
    pools = json.loads((out / "shadow.json").read_text())["pools"]
    assert pools["live"]["requests"] == pools["mirror"]["requests"] == 40
    for p in pools.values():
        assert p["ttft_p50_s"] is not None and 0 < p["ttft_p50_s"] <= p["ttft_p90_s"]
        assert p["tpot_p50_s"] is not None
    assert pools["mirror"]["hit_rate"] > pools["live"]["hit_rate"]
    assert (out / "shadow.png").stat().st_size > 0
