"""Autoscaling signals under a load ramp (bench/ramp.py, extproc/capacity.py): the ramp's shape and the
figures from scrapes, and one short ramp through real Envoy and kvroute on simulated pods, where
kvroute_desired_replicas rises with the demand and falls back after it, no sooner than the scale-down
delay allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import ramp
from bench.ramp import RampConfig

SHAPE = RampConfig(base_load=0.5, peak_load=1.5, base_s=10, up_s=10, hold_s=10, down_s=10, tail_s=10)

METRICS = """\
# TYPE kvroute_desired_replicas gauge
kvroute_desired_replicas{pool="default",role="prefill"} 2.5
kvroute_desired_replicas{pool="default",role="decode"} 1.0
# TYPE kvroute_capacity_ready_replicas gauge
kvroute_capacity_ready_replicas{pool="default",role="prefill"} 1.0
kvroute_capacity_ready_replicas{pool="default",role="decode"} 2.0
# TYPE kvroute_capacity_demand gauge
kvroute_capacity_demand{kind="prefill_tokens_per_s",pool="default",role="prefill"} 30000.0
kvroute_capacity_demand{kind="streams",pool="default",role="prefill"} 1.0
# TYPE kvroute_capacity_per_pod gauge
kvroute_capacity_per_pod{kind="prefill_tokens_per_s",pool="default",role="prefill"} 20000.0
kvroute_capacity_per_pod{kind="streams",pool="default",role="prefill"} 64.0
"""


def test_the_rate_ramps_up_holds_and_comes_back_down():
    rates = [ramp.rate_at(SHAPE, t, 10.0) for t in (0, 9.9, 15, 20, 29.9, 35, 40, 49)]
    assert rates == pytest.approx([5, 5, 10, 15, 15, 10, 5, 5])
    times = ramp.arrivals(SHAPE, 10.0)
    assert times == ramp.arrivals(SHAPE, 10.0) and times == sorted(times) and times[-1] < SHAPE.span_s
    # The integral of the rate: 5 x 20 s + 10 x 20 s (the two slopes) + 15 x 10 s = 450 requests.
    assert 400 < len(times) < 500
    hold = sum(1 for t in times if 20 <= t < 30)
    assert hold > 2 * sum(1 for t in times if t < 10)


def test_signals_per_role_and_what_the_window_alone_wants():
    roles = ramp.parse_signals(METRICS)
    assert roles["prefill"]["desired"] == 2.5 and roles["prefill"]["ready"] == 1.0
    assert roles["decode"] == {"desired": 1.0, "ready": 2.0, "demand": {}, "per_pod": {}}
    # 30k / 20k tokens/s = 1.5 pods busy, at 75 % target utilisation: 2 pods.
    assert ramp.window_wants(roles["prefill"], 0.75) == pytest.approx(2.0)
    assert ramp.window_wants(roles["decode"], 0.75) == 0.0


def test_ttft_p90_counts_only_first_tokens_seen_by_then():
    rows = [{"at_s": 0.0, "ok": True, "ttft_s": 0.5}, {"at_s": 1.0, "ok": True, "ttft_s": 3.0},
            {"at_s": 1.2, "ok": False, "ttft_s": None}]  # fmt: skip
    assert ramp.trailing_p90(rows, [0.4, 1.0, 3.9, 4.0, 9.0], window=2.0) == [None, 0.5, None, 3.0, None]


def test_rise_break_lead_and_the_delayed_fall():
    def sample(t: float, desired: float, wants_tokens: float, p90: float | None) -> dict:
        sig = {"desired": desired, "ready": 2.0, "demand": {"prefill_tokens_per_s": wants_tokens},
               "per_pod": {"prefill_tokens_per_s": 1000.0, "streams": 64.0}}  # fmt: skip
        return {"t_s": t, "ttft_p90_s": p90, "roles": {"both": sig}}

    cfg = RampConfig(target_utilization=1.0, base_s=2)
    series = [sample(0, 0.5, 500, 0.1), sample(1, 1.0, 1000, 0.1), sample(2, 2.5, 2500, 0.2),
              sample(3, 4.0, 4000, 0.6), sample(4, 4.0, 1500, 0.3), sample(5, 4.0, 1000, 0.1),
              sample(6, 1.5, 1000, 0.1), sample(7, 1.0, 1000, None)]  # fmt: skip
    fig = ramp.role_figures(series, "both", 0.5, cfg)
    assert fig["base_desired"] == 1.0 and fig["peak_desired"] == 4.0 and fig["peak_s"] == 3
    assert (fig["rise_s"], fig["break_s"], fig["lead_s"]) == (2, 3, 1)
    assert (fig["window_fell_s"], fig["fell_s"], fig["fall_delay_s"]) == (3, 6, 3)
    assert ramp.role_figures(series, "prefill", 0.5, cfg) == {"role": "prefill", "samples": 0}


@pytest.mark.integration
def test_desired_replicas_rise_with_a_ramp_and_fall_back_after_the_delay(tmp_path: Path) -> None:
    # 2 fast pods pinned at 10k prefill tokens/s each: 20 requests/s of 1000 tokens is the fleet at
    # 100 %; 0.2 of that ≈ 0.6 pods at 70 % target utilisation, the peak (1.5) ≈ 4.3 pods.
    cfg = RampConfig(pods=2, profile="fast", prompt_tokens=1000, output_tokens=8, prefill_capacity=10_000,
                     base_load=0.2, peak_load=1.5, base_s=3, up_s=1, hold_s=2, down_s=1, tail_s=4,
                     capacity_window_s=1.5, scale_down_delay_s=1.0, scrape_s=0.1, ttft_window_s=1.0,
                     ttft_p90_ms=1000, timeout=30, out=tmp_path, quiet=True)  # fmt: skip
    res = ramp.run(cfg)
    assert res["failed"] == 0, res["errors"]
    [fig] = res["roles"]
    assert fig["role"] == "both" and fig["ready"] == 2
    assert fig["base_desired"] < 2 < fig["peak_desired"] and fig["peak_desired"] > 2 * fig["base_desired"]
    # Above the ready pods only once the rate climbs; back at or below them after the ramp.
    assert fig["rise_s"] is not None and cfg.base_s <= fig["rise_s"] <= cfg.ramp_end_s
    assert fig["fell_s"] is not None and fig["fell_s"] > fig["peak_s"] and fig["end_desired"] <= 2
    # ... and not before the scale-down delay has passed since the window last wanted more.
    assert fig["window_fell_s"] is not None and fig["fall_delay_s"] >= 0.9 * cfg.scale_down_delay_s
    assert (tmp_path / "ramp.png").stat().st_size > 0 and (tmp_path / "ramp.json").exists()
