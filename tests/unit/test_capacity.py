"""Autoscaling signals (extproc/capacity.py): demand against one pod's capacity, the desired replica
count per pool and role, its scale-down delay, and the router feeding it at each decision."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.capacity import CapacityCollector, CapacityTracker, Signal
from extproc.config import CapacityConfig, CostConfig, build_config
from extproc.endpoints.pool import Registry
from extproc.observability import Metrics
from extproc.router import Router

PODS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def setup(
    capacity: dict[str, Any], roles: tuple[str, ...] = ("both", "both")
) -> tuple[CapacityTracker, Registry, Clock]:
    eps = [{"address": a, "role": r} for a, r in zip(PODS, roles, strict=False)]
    cfg = build_config({"pools": {"p": {"endpoints": eps}}, "capacity": capacity})
    reg, clock = Registry(cfg), Clock()
    return CapacityTracker(reg, lambda: cfg.capacity, lambda: cfg.routing.cost, clock), reg, clock


def signal(tracker: CapacityTracker, role: str = "both") -> Signal:
    (sig,) = [s for s in tracker.signals() if s.role == role]
    return sig


def test_prefill_demand_sets_the_desired_count() -> None:
    """30 s of 2000-token misses at 20/s = 40k tokens/s; a pod prefills 25k/s (pinned): 1.6 pods at
    100 %, 1.6 / 0.8 = 2 at 80 % utilisation."""
    tracker, reg, clock = setup({"window_s": 30, "target_utilization": 0.8, "prefill_tokens_per_s": 25_000})
    pod = reg.pools["p"].endpoints[0]
    assert signal(tracker).desired == 0  # nothing routed yet (the autoscaler's minReplicas applies)
    for _ in range(600):
        tracker.observe("p", pod, 2000, 2000)
        clock.t += 0.05
    sig = signal(tracker)
    assert sig.demand["prefill_tokens_per_s"] == pytest.approx(40_000, rel=0.01)
    assert sig.per_pod["prefill_tokens_per_s"] == 25_000
    assert sig.utilization == pytest.approx(0.8, rel=0.01)  # 1.6 pods' work on 2 ready pods
    assert sig.raw == sig.desired == pytest.approx(2.0, rel=0.01)


def test_prefill_capacity_comes_from_the_cost_model_at_the_prompt_mix() -> None:
    """Unpinned: tokens / the cost model's seconds for them. Long prompts cost more per token
    (attention), so a pod sustains fewer of their tokens per second; cached context costs too."""
    cost = CostConfig()
    tracker, reg, _ = setup({})
    pod = reg.pools["p"].endpoints[0]
    assert signal(tracker).per_pod["prefill_tokens_per_s"] == pytest.approx(1 / cost.per_token_s)  # no data yet
    tracker.observe("p", pod, 12_000, 12_000)
    assert signal(tracker).per_pod["prefill_tokens_per_s"] == pytest.approx(12_000 / cost.prefill_s(12_000))
    assert signal(tracker).per_pod["prefill_tokens_per_s"] < 1 / cost.per_token_s


def test_streams_set_the_desired_count_and_it_falls_only_after_the_delay() -> None:
    tracker, reg, clock = setup({"window_s": 10, "max_streams_per_pod": 4, "target_utilization": 0.5,
                                 "scale_down_delay_s": 60})  # fmt: skip
    a, b = reg.pools["p"].endpoints[:2]
    a.inflight, b.inflight = 7, 5  # 12 streams: 12 / (4 x 0.5) = 6 pods
    for _ in range(20):
        clock.t += 0.5
        tracker.signals()
    assert signal(tracker).desired == 6
    a.inflight = b.inflight = 0
    clock.t += 11  # the window has forgotten the streams; the scale-down delay has not
    sig = signal(tracker)
    assert sig.raw == 0 and sig.desired == 6
    clock.t += 50  # 61 s after the last time 6 were wanted
    assert signal(tracker).desired == 0


def test_each_replica_counts_its_own_share() -> None:
    """With shared state a pod's in-flight count includes the peers': this replica's streams are only
    its own (the fleet's demand is the sum over replicas), and the queue term asks for its share of
    the one more pod."""
    tracker, reg, _ = setup({"max_streams_per_pod": 4, "target_utilization": 1.0, "queue_target_s": 0.5})
    a, b = reg.pools["p"].endpoints[:2]
    a.set_peer_load("r2", 6, 0.0, 0.0)
    b.set_peer_load("r2", 2, 0.0, 0.0)
    a.inflight += 2  # its own two
    sig = signal(tracker)
    assert sig.demand["streams"] == 2 and sig.desired == 0.5  # 2 of 10 in flight are this replica's
    a.prefills.add(2.0, tracker.clock())
    b.prefills.add(2.0, tracker.clock())
    assert signal(tracker).desired == pytest.approx(3 * 2 / 10)  # (2 ready + 1) x its share


def test_a_queue_over_its_target_asks_for_one_more_pod_than_are_ready() -> None:
    tracker, reg, clock = setup({"queue_target_s": 0.5, "scale_down_delay_s": 0})
    for e in reg.pools["p"].endpoints:
        e.prefills.add(2.0, clock.t)  # 2 s of prefill queued on each (the estimate kvroute keeps)
    sig = signal(tracker)
    assert sig.demand["queue_s"] == pytest.approx(2.0) and sig.ready == 2 and sig.desired == 3  # one kvroute
    reg.pools["p"].endpoints[0].queue = 100  # scraped waiting requests x per_waiting_s (5 s) count too
    assert signal(tracker).demand["queue_s"] > 2.0


def test_roles_are_separate_and_disabled_exports_nothing() -> None:
    tracker, reg, _ = setup({"prefill_tokens_per_s": 10_000, "target_utilization": 1.0},
                            roles=("prefill", "decode", "decode"))  # fmt: skip
    prefill = reg.pools["p"].endpoints[0]
    for _ in range(30):
        tracker.observe("p", prefill, 1000, 1000)  # 30k tokens in the first second: 3 prefill pods
    assert signal(tracker, "prefill").desired == 3 and signal(tracker, "decode").desired == 0
    off, _, _ = setup({"enabled": False})
    assert off.signals() == [] and list(CapacityCollector(off).collect()) == []


def test_invalid_settings_name_the_field() -> None:
    from extproc.errors import ConfigError

    with pytest.raises(ConfigError, match=r"capacity\.target_utilization"):
        build_config({"capacity": {"target_utilization": 1.5}})
    with pytest.raises(ConfigError, match=r"capacity\.max_streams_per_pod"):
        build_config({"capacity": {"max_streams_per_pod": 0}})
    CapacityConfig(prefill_tokens_per_s=None, queue_target_s=None)  # both may be off


def chat(doc: int, words: int = 2000) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"doc {doc} " + "lorem " * words}]})


def test_the_router_feeds_it_and_prometheus_exports_it() -> None:
    """Each routed request adds what its prefilling pod lacks; a split charges the prefill pod, a
    repeat of a cached prompt charges (almost) nothing; the gauges carry pool and role."""
    eps = [{"address": PODS[0], "role": "prefill"}, {"address": PODS[1], "role": "decode"}]
    m = Metrics()
    router = Router(build_config({"pools": {"p": {"endpoints": eps}}, "pd": {"disaggregation": "always"}}), m)
    first = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(1)))
    assert first.pd is not None and first.pd.split
    uncached = first.pd.prefill_tokens
    assert uncached > 2000
    router.route(router.parse("/v1/chat/completions", "POST", {}, chat(1)))  # cached on the prefill pod now
    sigs = {s.role: s for s in router.capacity.signals()}
    # Both prefills went to the prefill pod (within the first second: per second = in all); the
    # repeat lacked at most its last block.
    assert uncached <= sigs["prefill"].demand["prefill_tokens_per_s"] < uncached * 1.1
    assert sigs["decode"].demand["prefill_tokens_per_s"] == 0
    assert sigs["decode"].demand["streams"] == 2  # both still in flight on the decode pod
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(m.registry).decode())
        for s in f.samples
        if s.name.startswith(("kvroute_desired", "kvroute_capacity"))
    }
    assert got["kvroute_desired_replicas", (("pool", "p"), ("role", "decode"))] == pytest.approx(2 / 64 / 0.7)
    assert got["kvroute_capacity_demand", (("kind", "streams"), ("pool", "p"), ("role", "decode"))] == 2
    assert got["kvroute_capacity_per_pod", (("kind", "streams"), ("pool", "p"), ("role", "decode"))] == 64
    assert got["kvroute_capacity_ready_replicas", (("pool", "p"), ("role", "prefill"))] == 1
    # An explain dry run records nothing.
    before = sigs["prefill"].demand["prefill_tokens_per_s"]
    router.route(router.parse("/v1/chat/completions", "POST", {}, chat(2)), dry_run=True)
    assert {s.role: s for s in router.capacity.signals()}["prefill"].demand["prefill_tokens_per_s"] == before


def test_the_window_stays_bounded_when_nobody_scrapes() -> None:
    """Samples older than the window are dropped as requests come, not only at a scrape: without
    Prometheus the window kept a sample per request forever (found by bench/fuzz.py's memory check)."""
    tracker, reg, clock = setup({"window_s": 10})
    pod = reg.pools["p"].endpoints[0]
    for _ in range(5000):
        tracker.observe("p", pod, 100, 100)
        clock.t += 0.1
    (series,) = tracker._series.values()
    assert len(series.prefills) <= 101 and len(series.loads) <= 101  # 10 s of samples, never 5000
