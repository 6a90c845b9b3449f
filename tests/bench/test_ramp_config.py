"""bench/ramp.py's kvroute config (the run's capacity settings, capacity.trend_z from --trend-z, its
times scaled with the pods; the pods scraped as the shipped config does) and the figures that say
why a rise came late: the offered load at the rise and the break, kvroute's capacity against the pods'."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml

from bench import harness, ramp
from bench.ramp import RampConfig
from extproc.config import CapacityConfig, build_config

ADDRESSES = ["127.0.0.1:18001", "127.0.0.1:18002"]


def kvroute_config(cfg: RampConfig) -> dict[str, Any]:
    fleet = cast(harness.SimFleet, SimpleNamespace(addresses=ADDRESSES))
    return ramp.kvroute_config(cfg, fleet, chars_per_token=2.5)


def test_the_capacity_section_carries_the_run_s_settings_scaled_and_valid() -> None:
    cfg = RampConfig(time_scale=2.0, capacity_window_s=5, scale_down_delay_s=10, trend_z=1.5)
    data = kvroute_config(cfg)
    capacity = build_config(data).capacity  # kvroute accepts it
    assert (capacity.window_s, capacity.scale_down_delay_s, capacity.trend_z) == (10, 20, 1.5)
    assert capacity.queue_target_s == pytest.approx(2 * (CapacityConfig().queue_target_s or 0))
    assert RampConfig().trend_z == CapacityConfig().trend_z  # by default the product's own
    assert build_config(kvroute_config(RampConfig(trend_z=None))).capacity.trend_z is None


def test_the_pods_are_scraped_as_shipped_unless_the_user_says_otherwise(tmp_path: Path) -> None:
    scrape = build_config(kvroute_config(RampConfig(time_scale=3.0))).scrape
    assert scrape.enabled and scrape.interval_s == pytest.approx(3 * harness.production_scrape()["interval_s"])
    user = tmp_path / "kvroute.yaml"
    user.write_text(yaml.safe_dump({"scrape": {"enabled": False}}))
    assert not build_config(kvroute_config(RampConfig(kvroute_config=str(user)))).scrape.enabled


@pytest.mark.parametrize(("arg", "want"), [("off", None), ("0", 0.0), ("2.5", 2.5)])
def test_trend_z_flag(arg: str, want: float | None) -> None:
    assert ramp._z(arg) == want


@pytest.mark.parametrize("arg", ["-1", "nan", "two"])
def test_a_bad_trend_z_is_refused_by_name(arg: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ramp.main(["--trend-z", arg])
    assert "--trend-z" in capsys.readouterr().err


def test_the_load_at_the_rise_and_break_and_kvroute_s_capacity_against_the_pods() -> None:
    """Pinned at 10k tokens/s a pod, 1000-token prompts, 2 pods: the fleet takes 20 req/s. kvroute
    (time scale 2: it prices wall seconds) reporting 6k tokens/s a pod counts on 1.2 x the pods."""
    cfg = RampConfig(prefill_capacity=10_000, prompt_tokens=1000, time_scale=2.0, base_load=0.2, peak_load=1.2,
                     base_s=10, up_s=10, target_utilization=1.0)  # fmt: skip

    def sample(t: float, desired: float, p90: float) -> dict[str, Any]:
        sig = {"desired": desired, "ready": 2.0, "demand": {"prefill_tokens_per_s": 1.0},
               "per_pod": {"prefill_tokens_per_s": 6000.0, "streams": 64.0}}  # fmt: skip
        return {"t_s": t, "ttft_p90_s": p90, "roles": {"both": sig}}

    series = [sample(10, 1.0, 0.1), sample(15, 2.5, 0.1), sample(18, 3.0, 0.9)]
    fig = ramp.role_figures(series, "both", 0.5, cfg)
    assert (fig["rise_s"], fig["break_s"]) == (15, 18)
    assert fig["load_at_rise"] == pytest.approx(0.7) and fig["load_at_break"] == pytest.approx(1.0)
    assert fig["prefill_capacity_ratio"] == pytest.approx(1.2)
    meta = {"requests": 1, "base_rps": 4, "peak_rps": 24, "capacity_rps": 20, "ramp_end_s": 40, "ttft_target_s": 0.5}
    assert "offered load at the rise 0.70" in ramp.summary({"meta": meta, "failed": 0, "roles": [fig]})
