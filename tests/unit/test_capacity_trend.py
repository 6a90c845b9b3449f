"""Prefill demand that follows a ramp (extproc/capacity.py, capacity.trend_z): while the rate climbs
clearly, demand is the rate now on the window's linear trend, not the window's mean, which lags a
ramp by half the window; a steady, falling or barely climbing rate stays the mean."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from extproc.capacity import CapacityTracker
from extproc.config import build_config
from extproc.endpoints.pool import Registry
from extproc.errors import ConfigError
from tests.unit.test_capacity import Clock, setup, signal

TOKENS = 1000  # uncached tokens per request
POD_RATE = 10_000.0  # prefill tokens/s one pod sustains (pinned): 10 requests/s


def ramp_arrivals(rate: Callable[[float], float], until: float, step: float = 1e-3) -> list[float]:
    """Deterministic arrivals whose count follows ``rate`` (req/s from t = 0): the k-th request
    arrives when the rate's integral reaches k."""
    out, t, area, due = [], 0.0, 0.0, 1.0
    while t < until:
        area += rate(t) * step
        t += step
        if area >= due:
            out.append(t)
            due += 1.0
    return out


def drive(
    capacity: dict[str, Any], arrivals: list[float], scrape_every: float, until: float
) -> list[tuple[float, Any]]:
    """Routes ``arrivals`` (offsets from the clock's start) to one pod and scrapes every
    ``scrape_every`` s up to ``until``: the signal at each scrape."""
    tracker, reg, clock = setup({"prefill_tokens_per_s": POD_RATE, "scale_down_delay_s": 0, **capacity})
    pod, t0 = reg.pools["p"].endpoints[0], clock.t
    out, i = [], 0
    for k in range(1, int(until / scrape_every) + 1):
        at = k * scrape_every
        while i < len(arrivals) and arrivals[i] <= at:
            clock.t = t0 + arrivals[i]
            tracker.observe("p", pod, TOKENS, TOKENS)
            i += 1
        clock.t = t0 + at
        out.append((at, signal(tracker)))
    return out


def first_above(series: list[tuple[float, Any]], pods: float) -> float | None:
    return next((t for t, sig in series if sig.desired > pods), None)


def test_a_climbing_rate_counts_at_its_trend_now_not_the_window_mean() -> None:
    """20 s at 5 req/s, then +2 req/s every second: 20 s into the climb the rate is 45 req/s, the
    mean of the last 20 s 25 req/s."""

    def rate(t: float) -> float:
        return 5.0 + 2.0 * max(0.0, t - 20.0)

    arrivals = ramp_arrivals(rate, 40.0)
    (_, trend), (_, mean) = (drive({"window_s": 20, "trend_z": z}, arrivals, 40.0, 40.0)[-1] for z in (2.0, None))
    assert mean.demand["prefill_tokens_per_s"] == pytest.approx(25 * TOKENS, rel=0.02)
    assert trend.demand["prefill_tokens_per_s"] == pytest.approx(45 * TOKENS, rel=0.05)
    # The count follows: 45k tokens/s over 10k per pod at 70 % is 6.4 pods, not the mean's 3.6.
    assert trend.raw == pytest.approx(45 * TOKENS / POD_RATE / 0.7, rel=0.05)


def test_on_a_ramp_the_count_rises_when_the_rate_crosses_the_target_not_half_a_window_later() -> None:
    """Two pods at 70 % target utilisation carry 14 req/s: the rate, climbing 1 req/s per second from
    6 req/s, crosses it 8 s into the climb. The trend's count passes the two ready pods within a
    scrape of that; the mean's, about half the 10 s window later."""

    def rate(t: float) -> float:
        return 6.0 + max(0.0, t - 20.0)

    crossing = 28.0
    arrivals = ramp_arrivals(rate, 45.0)
    trend_rise = first_above(drive({"window_s": 10, "trend_z": 2.0}, arrivals, 0.5, 45.0), 2)
    mean_rise = first_above(drive({"window_s": 10, "trend_z": None}, arrivals, 0.5, 45.0), 2)
    assert trend_rise is not None and mean_rise is not None
    assert crossing - 0.5 <= trend_rise <= crossing + 1.5  # not before the demand is there either
    assert mean_rise >= crossing + 4.0 and mean_rise - trend_rise >= 3.0


def test_a_steady_or_falling_rate_is_the_window_mean() -> None:
    def last_demand(z: float | None, arrivals: list[float]) -> float:
        return drive({"window_s": 10, "trend_z": z}, arrivals, 30.0, 30.0)[-1][1].demand["prefill_tokens_per_s"]

    falling = ramp_arrivals(lambda t: 40.0 - t, 30.0)
    assert last_demand(0.0, falling) == last_demand(None, falling) == pytest.approx(15 * TOKENS, rel=0.02)
    steady = ramp_arrivals(lambda t: 20.0, 30.0)
    assert last_demand(2.0, steady) == last_demand(None, steady) == pytest.approx(20 * TOKENS, rel=0.02)


def test_poisson_noise_at_a_steady_rate_rarely_reads_as_a_climb() -> None:
    """At a steady 10 req/s of Poisson arrivals (a fixed seed), scraped every second over 10-s
    windows: the slope clears two standard errors by chance only now and then (one-sided, ~2 %)."""
    rng, t, arrivals = random.Random(7), 0.0, []
    while t < 300:
        t += rng.expovariate(10.0)
        arrivals.append(t)
    series = drive({"window_s": 10, "trend_z": 2.0}, arrivals, 1.0, 300.0)[10:]
    means = drive({"window_s": 10, "trend_z": None}, arrivals, 1.0, 300.0)[10:]
    lifted = [a.demand["prefill_tokens_per_s"] / b.demand["prefill_tokens_per_s"] for (_, a), (_, b) in
              zip(series, means, strict=True)]  # fmt: skip
    assert all(x >= 1.0 for x in lifted)  # never below the mean
    assert sum(x > 1.0 for x in lifted) <= 0.08 * len(lifted)


def test_a_window_younger_than_its_minimum_span_has_no_trend() -> None:
    """Ten requests in the first half second (kvroute just started): no history to fit a slope on."""
    tracker, reg, clock = setup({"window_s": 10, "trend_z": 0.0})
    pod = reg.pools["p"].endpoints[0]
    t0 = clock.t
    for k in range(10):
        clock.t = t0 + 0.5 * math.sqrt(k / 9)  # ever faster over 0.5 s: a climb, if it were believed
        tracker.observe("p", pod, TOKENS, TOKENS)
    assert signal(tracker).demand["prefill_tokens_per_s"] == pytest.approx(10 * TOKENS)  # over the 1 s floor


def test_trend_z_is_validated_and_applies_on_reload() -> None:
    with pytest.raises(ConfigError, match=r"capacity\.trend_z"):
        build_config({"capacity": {"trend_z": -1}})
    # The tracker reads its config at each evaluation: switching the trend off applies at once.
    cfgs = [build_config({"pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}},
                          "capacity": {"window_s": 10, "trend_z": z}}) for z in (2.0, None)]  # fmt: skip
    assert cfgs[1].capacity.trend_z is None
    current = cfgs[0]
    clock = Clock()
    tracker = CapacityTracker(Registry(current), lambda: current.capacity, lambda: current.routing.cost, clock)
    pod = tracker.registry.pools["p"].endpoints[0]
    for k in range(100):  # 1 req/s climbing to 20 req/s over 10 s
        clock.t = 1000.0 + math.sqrt(k)  # k(t) = t²: rate 2t
        tracker.observe("p", pod, TOKENS, TOKENS)
    clock.t = 1010.0
    (rising,) = tracker.signals()
    current = cfgs[1]
    (flat,) = tracker.signals()
    assert flat.demand["prefill_tokens_per_s"] == pytest.approx(100 * TOKENS / 10)
    assert rising.demand["prefill_tokens_per_s"] > 1.5 * flat.demand["prefill_tokens_per_s"]
