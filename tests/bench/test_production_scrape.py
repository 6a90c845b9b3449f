"""The bench runs kvroute-approx and kvroute-precise as deploy/base/kvroute.yaml runs kvroute in a
cluster: scraping each pod's /metrics at the shipped interval (scaled with --time-scale), unless the
user's --kvroute-config says otherwise."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import harness, loadgen, workloads
from extproc.config import ScrapeConfig, load_config
from tests.polling import wait_for


def test_production_scrape_is_the_shipped_section_time_scaled() -> None:
    shipped = yaml.safe_load(harness.PRODUCTION_CONFIG.read_text())["scrape"]
    assert shipped["enabled"] is True  # what the bench now copies: production scrapes
    real = harness.production_scrape()
    assert real == ScrapeConfig(**shipped).model_dump()
    slow = harness.production_scrape(3.0)
    for k in ("interval_s", "timeout_s", "max_age_s"):
        assert slow[k] == pytest.approx(3 * real[k])
    assert slow["stale_after_misses"] == real["stale_after_misses"] and slow["enabled"]


def test_defaults_sit_under_the_users_file_and_the_runs_own_settings(tmp_path: Path) -> None:
    defaults = {"scrape": harness.production_scrape(2.0)}
    path = tmp_path / "k.yaml"
    pods = {"pools": {"default": {"endpoints": [{"address": "127.0.0.1:9"}]}}}
    harness._write_config(pods, path, None, defaults=defaults)
    loaded = load_config(path)
    assert loaded.scrape.enabled and loaded.scrape.interval_s == pytest.approx(2 * ScrapeConfig().interval_s)

    user = tmp_path / "user.yaml"
    user.write_text("scrape: {enabled: false}\nmode: shadow\n")
    harness._write_config({**pods, "mode": "epp"}, path, str(user), defaults=defaults)
    loaded = load_config(path)
    assert not loaded.scrape.enabled  # the user's scrape section wins over production's
    assert loaded.mode == "epp"  # the run's own settings win over the user's


def _scrape_stats(text: str) -> dict[str, float]:
    return {
        s.labels["stat"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvroute_scrape"
        for s in f.samples
    }


@pytest.mark.integration
def test_bench_kvroute_scrapes_the_pods(open_policy: Any) -> None:
    """A bench kvroute-approx (Envoy + kvroute over two simulated pods) polls both pods' /metrics and
    routes a request with them fresh."""
    _, router = open_policy("kvroute-approx")
    assert router.metrics is not None
    item = workloads.build("multi-turn", None, 1).items[0]
    recs = asyncio.run(loadgen.run(router.url, workloads.specs([item], [0.0]), timeout=30))
    assert recs[0].ok, recs[0].error
    metrics = router.metrics
    wait_for(lambda: _scrape_stats(metrics()).get("scrapes", 0) >= 4, 20, "kvroute's scrapes")
    stats = _scrape_stats(metrics())
    assert stats["endpoints"] == 2 and stats["scrapes"] >= 4
    assert stats["stale"] == 0 and stats["failures"] == 0
