"""Autoscaling signals: per pool and pod role, the demand kvroute routes against the capacity of one
pod, and a desired replica count, exported to Prometheus (an HPA on external metrics or a KEDA
ScaledObject scales the vLLM Deployments on it: deploy/autoscaling/).

Demand, from what the router already knows at each decision:

* ``prefill_tokens_per_s``: the uncached prompt tokens it sent to pods of the role (the pod that
  prefills: the prefill pod of a split, else the pod itself), per second over ``window_s``; while
  that rate climbs, the rate now on the window's linear trend (``_prefill_rate``): a mean lags a
  ramp by half its window, as much as the headroom of ``target_utilization`` buys on a steep one,
  so the count rose only as TTFT broke (bench/ramp.py). The trend counts only when its slope is
  ``trend_z`` standard errors above zero: at a steady rate the estimate is the mean, and a falling
  rate is never extrapolated down (scale-down waits anyway);
* ``streams``: this replica's requests in flight on the role's pods (decode streams);
* ``queue_s``: how long a new prefill would wait there, the mean over the role's ready pods of the
  prefill-queue estimate, or the scraped waiting requests × ``routing.cost.per_waiting_s`` if longer.

Capacity of one pod, prefill tokens per second, from the first of:

* ``capacity.prefill_tokens_per_s``, when pinned;
* measured (``capacity.measured``, on when the pods are scraped): uncached prompt tokens the role's pods
  computed per second they were busy prefilling, over the window, once they reported at least
  ``capacity.measured_min_prefills`` first tokens in it. Busy, not elapsed: at low load a pod idles
  most of the time, so its throughput is not what it could do. Each scrape (``on_scrape``) gives the
  first tokens since the last one (``vllm:time_to_first_token_seconds`` count), their summed time to
  first token (its sum) and their prompt tokens (``vllm:prompt_tokens_total`` less the new
  ``vllm:prefix_cache_hits_total``): those requests waited or prefilled over about [t − mean TTFT, t],
  t the middle between the two scrapes, and the pod prefilled while any request did, so its busy time
  is the union of these spans (``_union``). Not the sum: vLLM batches prefills (chunked prefill
  shares one token budget), and a sum of per-request prefill times (``vllm:request_prefill_time_seconds``,
  recorded only at a request's end besides) counts a step shared by two prompts twice; tokens over
  that sum read 0.68 of the capacity at 70 % load on the simulator. The union, at 0.1 s scrapes,
  read within 1-8 % of the simulated pod's busy-time rate at 10 to 110 % load, fixed or mixed prompt
  lengths (the spans include queueing, which only happens while the pod is busy), and 1.07-1.09x
  the rate bench/ramp.py counts a simulated pod to sustain at 30 and 70 % load
  (tests/unit/test_capacity_measured.py: that rate charges each request its API time, which the
  simulator spends beside the engine's steps). It stays per pool and role, whole pods (every
  kvroute replica reads the same), and needs nothing of kvroute's own decisions;
* else routing.cost's estimate at the prompt mix seen in the window (tokens / the estimated prefill
  seconds of those tokens, so long prompts' attention counts). On the simulator it read 1.17x what a
  pod sustains (bench/ramp.py: the cost model has no per-step or per-request cost).

``kvroute_capacity_prefill_source`` says which is in use, ``kvroute_capacity_measured_prefills`` how
many first tokens the measured figure rests on. Once measured, ``kvroute_cost_model_fit`` is the measured
rate over the cost model's at the same prompt mix: how well routing.cost's seconds fit the pods (1: they
do; 0.5: the pods prefill at half the speed it assumes). Cost scoring only compares pods, but P/D splits
(against ttft_target_s), routing.hold and the queue estimates read those seconds as seconds: outside
``FIT_WARN`` kvroute logs a warning with the factor to scale per_token_s and per_token_context_s by.
Short prompts read lower than long ones: a first token also waits for the step in progress, which the
cost model does not price (on the simulated h100-llama8b pods, whose steps match it within 10 %: 0.73 on
multi-turn's ~1k-token turns, 0.92 on shared-prefix's 8k-token documents; ``bench run`` rows' ``cost_fit``).

Streams per pod come from ``capacity.max_streams_per_pod``, configured, not measured: the stream count a
pod can carry is set by the ITL objective (its decode step grows with the batch), not by what vLLM
reports running, which at saturation is only ``max_num_seqs`` or the KV limit. ``kvroute plan``
derives it from a pod profile and an ITL target.

Desired replicas = max(prefill demand / prefill capacity, streams / stream capacity) /
target_utilization, at least one more than the ready pods while the queue wait exceeds
``queue_target_s``. Up at once; down only to the highest value wanted over the last
``scale_down_delay_s`` (as the HPA's stabilisation window), so a lull does not flap it.

Several kvroute replicas each route a share of the traffic: every figure counts this replica's own
share (its own decisions and in-flight requests, not the peers' that shared state adds), so the
fleet's demand and desired count are the ``sum`` over replicas, and ``kvroute_desired_replicas`` is
left fractional for that sum: the HPA (target AverageValue 1) or KEDA (threshold 1) rounds it up and
applies minReplicas. The queue term adds this replica's share of the streams (its own in flight over
all in flight there, known with shared state; without it each replica asks for the one more pod).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config import CapacityConfig, CostConfig, Role
from extproc.endpoints.metrics import PodMetrics
from extproc.endpoints.pool import EndpointState, Registry
from extproc.index.base import EndpointId

log = logging.getLogger("kvroute")

SAMPLE_INTERVAL_S = 0.1  # streams and queue time are sampled at most this often per pool and role
MIN_SPAN_S = 1.0  # a window younger than this (just started) still divides by this much
# Fewer prefills than this in the window: no trend (a slope from a handful of requests is noise).
TREND_MIN_PREFILLS = 8

DEMAND_KINDS = ("prefill_tokens_per_s", "streams", "queue_s")
CAPACITY_KINDS = ("prefill_tokens_per_s", "streams")
PREFILL_SOURCES = ("pinned", "measured", "cost_model")
# kvroute_cost_model_fit outside this range logs a warning, at most once per FIT_WARN_EVERY_S a pool and role:
# the measured figure is within 1-8 % of a simulated pod's (below), the cost model's errors are what this shows.
FIT_WARN = (2 / 3, 1.5)
FIT_WARN_EVERY_S = 600.0
# routing.hold reads the fit (hold_pace) at most this often per pool and role: it sums the window's spans.
PACE_REFRESH_S = 1.0
# ... and paces its holds only past this fit: under it the fit is within what its measurement errs by (the
# measured rate within 1-8 % of a simulated pod's, above), and the hold's margin covers that much.
PACE_ABOVE_FIT = 1.1
# ... measured on this many of the pool's pods of the role, a sample: the fit is the hardware's and the model's,
# alike on every pod, and reading all of them took 5.6 ms at 64 pods (their spans' unions) where this reads a few.
PACE_PODS = 8
# ... once this many first tokens are in the window (or capacity.measured_min_prefills, if fewer): holds counted at
# routing.cost's seconds before the fit is read reserve the pod that long, and each later hold waits on those
# reservations, so a cost model pricing the pods at twice their time held every long prompt twice too long until
# the 20th first token (the Mooncake synthetic trace: the first 4.5 s, RESULTS' routing.hold notes). A fit read
# early errs, but the pace only ever shortens a hold: at worst a prompt lands in the last step ahead, as unheld.
PACE_MIN_PREFILLS = 8


@dataclass(slots=True)
class _Series:
    """One pool and role's samples within the window."""

    prefills: deque[tuple[float, int, float]] = field(default_factory=deque)  # (t, tokens, est. seconds)
    tokens: int = 0  # prefills' tokens and estimated seconds, summed as they come and go (hold_pace reads
    busy_s: float = 0.0  # them once a second: summing the window's deque was 3.4 ms at 1000 decisions/s)
    loads: deque[tuple[float, int, float, float]] = field(default_factory=deque)  # (t, streams, queue_s, share)
    wanted: deque[tuple[float, float]] = field(default_factory=deque)  # (t, raw desired) for scale-down
    last_load_at: float = -math.inf


@dataclass(slots=True)
class _Scraped:
    """One pod's prefills as its scrapes place them."""

    # The last scrape's counters: (scraped at, prompt tokens, prefix-cache hits, TTFT sum, TTFT count).
    last: tuple[float, float, float, float, float] | None = None
    # Per scrape that saw first tokens or prompt tokens: (t, span start, first tokens, uncached tokens).
    spans: deque[tuple[float, float, float, float]] = field(default_factory=deque)

    def prune(self, horizon: float) -> None:
        """Forget the spans placed before ``horizon``."""
        while self.spans and self.spans[0][0] < horizon:
            self.spans.popleft()


@dataclass(frozen=True, slots=True)
class Measured:
    """The role's pods' prefills in the window, as their scrapes report them."""

    prefills: float  # first tokens
    tokens: float  # uncached prompt tokens
    busy_s: float  # summed over the pods: each pod's union of its requests' spans

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.busy_s if self.busy_s > 0 and self.tokens > 0 else None


@dataclass(frozen=True, slots=True)
class Signal:
    """What one pool and role needs now (one row of the exported gauges)."""

    pool: str
    role: Role
    ready: int
    demand: dict[str, float]
    per_pod: dict[str, float]
    utilization: float  # demand over the ready pods' capacity, the busier resource
    raw: float  # desired replicas from this window alone (this replica's share: fractional)
    desired: float  # after the scale-down delay
    prefill_source: str = "cost_model"  # where per_pod's prefill figure came from: PREFILL_SOURCES
    measured_prefills: float = 0.0  # first tokens behind the measured figure (whether it is used or not)
    cost_fit: float | None = None  # the measured rate over the cost model's (None: not measured enough)


class CapacityTracker:
    """Fed by the router at each decision (``observe``); ``signals`` evaluates (Prometheus scrapes).
    ``config`` and ``cost`` are read at each use, so a reloaded config applies at once."""

    def __init__(
        self,
        registry: Registry,
        config: Callable[[], CapacityConfig],
        cost: Callable[[], CostConfig],
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.cost = cost
        # The router's clock by default (time.monotonic, looked up when read: a test may stand it still).
        self.clock = clock if clock is not None else lambda: time.monotonic()
        self._series: dict[tuple[str, Role], _Series] = {}
        self._scraped: dict[EndpointId, _Scraped] = {}
        self._lock = threading.Lock()  # decisions on the event loop, scrapes on the metrics thread
        self._fit_warned: dict[tuple[str, Role], float] = {}  # when each pool and role was last warned of
        self._paces: dict[tuple[str, Role], tuple[float, float]] = {}  # hold_pace: (read at, pace)

    def observe(self, pool: str, pod: EndpointState, uncached_tokens: int, prompt_tokens: int) -> None:
        """A decision sent ``uncached_tokens`` of a ``prompt_tokens`` prompt to ``pod`` to prefill."""
        cfg = self.config()
        if not cfg.enabled:
            return
        now = self.clock()
        seconds = self.cost().prefill_s(uncached_tokens, prompt_tokens - uncached_tokens)
        with self._lock:
            # get first: setdefault would build a _Series (three deques) at every decision.
            s = self._series.get((pool, pod.role)) or self._series.setdefault((pool, pod.role), _Series())
            # Pruned here too, not only when scraped: unscraped, the window grew by a sample per request.
            _prune(s, now - cfg.window_s)
            s.prefills.append((now, uncached_tokens, seconds))
            s.tokens += uncached_tokens
            s.busy_s += seconds
            if now - s.last_load_at >= SAMPLE_INTERVAL_S:
                self._sample(s, pool, pod.role, now)

    def on_scrape(self, endpoint: EndpointId, m: PodMetrics, at: float) -> None:
        """A ``MetricsScraper`` listener: ``endpoint``'s figures scraped at ``at`` (this tracker's clock)."""
        cfg = self.config()
        if not cfg.enabled or cfg.measured is False:
            return
        if m.prompt_tokens is None or m.ttft_sum_s is None or m.ttft_count is None:
            return  # a vLLM that does not report them: the cost model stays
        now = (at, m.prompt_tokens, m.prefix_cache_hits or 0.0, m.ttft_sum_s, m.ttft_count)
        with self._lock:
            p = self._scraped.get(endpoint) or self._scraped.setdefault(endpoint, _Scraped())
            last, p.last = p.last, now
            p.prune(at - cfg.window_s)
            if last is None or at <= last[0]:
                return
            d_tokens, d_hits, d_ttft, d_count = (b - a for a, b in zip(last[1:], now[1:], strict=True))
            if d_tokens < 0 or d_hits < 0 or d_ttft < 0 or d_count < 0:
                return  # counters went back: the pod restarted, and this scrape is the new baseline
            if d_count or d_tokens or d_hits:
                # The first tokens came at some point between the scrapes: the middle errs by at most half
                # an interval either way (both ways alike, so the spans' union comes out about right).
                t = (last[0] + at) / 2
                p.spans.append((t, t - (d_ttft / d_count if d_count else 0.0), d_count, d_tokens - d_hits))

    def measured(self, pool: str, role: Role) -> Measured:
        """What the pool's pods of ``role`` prefilled in the window, per their scrapes."""
        horizon = self.clock() - self.config().window_s
        with self._lock:
            return self._measured(self._pods(pool, role), horizon)

    def _measured(self, pods: list[EndpointState], horizon: float) -> Measured:
        prefills = tokens = busy = 0.0
        for e in pods:
            p = self._scraped.get(e.address)
            if p is None:
                continue
            p.prune(horizon)
            prefills += sum(s[2] for s in p.spans)
            tokens += sum(s[3] for s in p.spans)
            busy += _union((start, t) for t, start, n, _ in p.spans if n)
        return Measured(prefills, max(0.0, tokens), busy)

    def _pods(self, pool: str, role: Role) -> list[EndpointState]:
        p = self.registry.pools.get(pool)
        return [] if p is None else [e for e in p.endpoints if e.role == role]

    def _sample(self, s: _Series, pool: str, role: Role, now: float) -> None:
        pods = self._pods(pool, role)
        ready = [e for e in pods if e.available] or pods
        per_waiting = self.cost().per_waiting_s
        waits = [max(e.prefills.wait(now), (e.queue or 0.0) * per_waiting) for e in ready]
        own, everyone = sum(e.inflight - e.peer_inflight for e in pods), sum(e.inflight for e in pods)
        share = own / everyone if everyone else 1.0
        s.loads.append((now, own, sum(waits) / len(waits) if waits else 0.0, share))
        s.last_load_at = now

    def signals(self) -> list[Signal]:
        """Every pool and role with pods, evaluated now (this also advances the scale-down history)."""
        cfg = self.config()
        if not cfg.enabled:
            return []
        now = self.clock()
        out = []
        with self._lock:
            for pool in list(self.registry.pools.values()):
                for role in sorted({e.role for e in pool.endpoints}):
                    s = self._series.setdefault((pool.name, role), _Series())
                    self._sample(s, pool.name, role, now)
                    out.append(sig := self._evaluate(s, pool.name, role, now, cfg))
                    self._warn_fit(sig, now)
            live = {(sig.pool, sig.role) for sig in out}
            for key in [k for k in self._series if k not in live]:  # pools and roles that are gone
                del self._series[key]
            for key in [k for k in self._paces if k not in live]:
                del self._paces[key]
            known = {e.address for p in self.registry.pools.values() for e in p.endpoints}
            for ep in [ep for ep in self._scraped if ep not in known]:
                del self._scraped[ep]
        return out

    def _evaluate(self, s: _Series, pool: str, role: Role, now: float, cfg: CapacityConfig) -> Signal:
        _prune(s, now - cfg.window_s)
        oldest = min((q[0][0] for q in (s.prefills, s.loads) if q), default=now)
        span = max(MIN_SPAN_S, min(cfg.window_s, now - oldest))
        tokens, busy_s = s.tokens, s.busy_s
        # A window padded to MIN_SPAN_S has no history before its first sample: no trend from it.
        trend_z = cfg.trend_z if now - oldest >= MIN_SPAN_S else None
        demand = {
            "prefill_tokens_per_s": _prefill_rate(s.prefills, tokens, now - span, now, trend_z),
            "streams": sum(x[1] for x in s.loads) / len(s.loads),
            "queue_s": sum(x[2] for x in s.loads) / len(s.loads),
        }
        pods = self._pods(pool, role)
        measured = self._measured(pods, now - cfg.window_s)
        rate, modelled = self._rates(measured, tokens, busy_s, cfg)
        if cfg.prefill_tokens_per_s is not None:
            prefill_cap, source = cfg.prefill_tokens_per_s, "pinned"
        elif rate is not None:
            prefill_cap, source = rate, "measured"
        else:
            prefill_cap, source = modelled, "cost_model"
        per_pod = {"prefill_tokens_per_s": prefill_cap, "streams": float(cfg.max_streams_per_pod)}
        need = max(demand[k] / per_pod[k] for k in CAPACITY_KINDS)  # pods at 100 % utilisation
        ready = sum(e.available for e in pods)
        raw = need / cfg.target_utilization
        if cfg.queue_target_s is not None and demand["queue_s"] > cfg.queue_target_s:
            raw = max(raw, (ready + 1) * s.loads[-1][3])
        s.wanted.append((now, raw))
        while s.wanted and s.wanted[0][0] < now - cfg.scale_down_delay_s:
            s.wanted.popleft()
        desired = max(w for _, w in s.wanted)
        utilization = need / ready if ready else (math.inf if need else 0.0)
        fit = rate / modelled if rate is not None else None
        return Signal(pool, role, ready, demand, per_pod, utilization, raw, desired, source, measured.prefills, fit)

    def _rates(
        self, measured: Measured, tokens: float, busy_s: float, cfg: CapacityConfig, min_prefills: int | None = None
    ) -> tuple[float | None, float]:
        """The pods' measured prefill rate (None until ``measured_min_prefills``, or ``min_prefills`` if fewer), and
        the cost model's at the prompt mix kvroute sent in the window (``tokens`` it priced at ``busy_s``: long
        prompts' attention counted), or with nothing sent, its linear rate."""
        least = cfg.measured_min_prefills if min_prefills is None else min(min_prefills, cfg.measured_min_prefills)
        enough = cfg.measured is not False and measured.prefills >= least
        modelled = tokens / busy_s if tokens and busy_s > 0 else 1.0 / self.cost().per_token_s
        return (measured.tokens_per_s if enough else None), modelled

    def cost_fit(
        self, pool: str, role: Role, pods: int | None = None, min_prefills: int | None = None
    ) -> tuple[float, float] | None:
        """(kvroute_cost_model_fit, the first tokens it rests on) for ``pool``'s pods of ``role`` now, None
        until measured (``signals`` gives it too, but also advances the scale-down history; this does not).
        ``pods``: measured on at most this many of them (their first ones with scrapes), as a sample;
        ``min_prefills``: measured from this many first tokens (at most capacity.measured_min_prefills)."""
        cfg = self.config()
        horizon = self.clock() - cfg.window_s
        with self._lock:
            members = self._pods(pool, role)
            if pods is not None:
                members = [e for e in members if e.address in self._scraped][:pods]
            measured = self._measured(members, horizon)
            s = self._series.get((pool, role))
            if s is not None:
                _prune(s, horizon)
            tokens, busy_s = (s.tokens, s.busy_s) if s is not None else (0, 0.0)
        rate, modelled = self._rates(measured, tokens, busy_s, cfg, min_prefills)
        return None if rate is None else (rate / modelled, measured.prefills)

    def hold_pace(self, pool: str, role: Role) -> float:
        """The share of routing.cost's seconds ``pool``'s pods of ``role`` take to prefill, for routing.hold:
        1 / kvroute_cost_model_fit where they are measured faster than it prices them (past PACE_ABOVE_FIT),
        else 1 (and until measured, from PACE_MIN_PREFILLS first tokens). Never over 1: short prompts read the
        fit low (a first token also waits for the step in progress), so a fit under 1 may be the prompt mix
        rather than slow pods; and a hold too long idles the pod, where one too short lands the prompt in the
        last step ahead, as without holding."""
        now = self.clock()
        last = self._paces.get((pool, role))
        if last is not None and now - last[0] < PACE_REFRESH_S:
            return last[1]
        fit = self.cost_fit(pool, role, PACE_PODS, PACE_MIN_PREFILLS)
        pace = 1.0 / fit[0] if fit is not None and fit[0] > PACE_ABOVE_FIT else 1.0
        with self._lock:  # signals (the metrics thread) prunes this dict
            self._paces[(pool, role)] = (now, pace)
        return pace

    def _warn_fit(self, sig: Signal, now: float) -> None:
        if sig.cost_fit is None or FIT_WARN[0] <= sig.cost_fit <= FIT_WARN[1]:
            return
        key = (sig.pool, sig.role)
        if now - self._fit_warned.get(key, -math.inf) < FIT_WARN_EVERY_S:
            return
        self._fit_warned[key] = now
        log.warning(
            "routing.cost does not fit the pods: they prefill %.2fx the rate it assumes; scale "
            "routing.cost.per_token_s and per_token_context_s by %.2f (P/D splits, routing.hold and queue "
            "estimates read its seconds as seconds)", sig.cost_fit, 1.0 / sig.cost_fit,
            extra={"fields": {"pool": sig.pool, "role": sig.role, "cost_fit": round(sig.cost_fit, 3),
                              "measured_prefills": sig.measured_prefills}},
        )  # fmt: skip


class CapacityCollector(Collector):
    """The tracker's signals as gauges, evaluated at scrape time."""

    def __init__(self, tracker: CapacityTracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sigs = self.tracker.signals()
        if not sigs:
            return
        labels = ["pool", "role"]
        demand = GaugeMetricFamily(
            "kvroute_capacity_demand",
            "Demand per pool and pod role over capacity.window_s: uncached prefill tokens/s, streams in flight, "
            "mean prefill queue wait (s)",
            labels=[*labels, "kind"],
        )
        per_pod = GaugeMetricFamily(
            "kvroute_capacity_per_pod", "What one pod sustains: prefill tokens/s, streams", labels=[*labels, "kind"]
        )
        util = GaugeMetricFamily(
            "kvroute_capacity_utilization", "Demand over the ready pods' capacity (the busier resource)", labels=labels
        )
        ready = GaugeMetricFamily("kvroute_capacity_ready_replicas", "Ready pods per pool and role", labels=labels)
        desired = GaugeMetricFamily(
            "kvroute_desired_replicas",
            "Pods this replica's traffic needs per pool and role at capacity.target_utilization (scale-down "
            "delayed by capacity.scale_down_delay_s); fractional: sum over kvroute replicas, then round up",
            labels=labels,
        )
        source = GaugeMetricFamily(
            "kvroute_capacity_prefill_source",
            "Where kvroute_capacity_per_pod's prefill figure comes from: 1 for the source in use (pinned by "
            "capacity.prefill_tokens_per_s, measured from the pods' /metrics, or the cost model's estimate)",
            labels=[*labels, "source"],
        )
        fit = GaugeMetricFamily(
            "kvroute_cost_model_fit",
            "The pods' measured prefill rate over routing.cost's at the same prompt mix (1: routing.cost fits "
            "the pods; 0.5: they prefill at half its speed, scale per_token_s and per_token_context_s by 2); "
            "absent until capacity.measured_min_prefills first tokens are measured",
            labels=labels,
        )
        measured = GaugeMetricFamily(
            "kvroute_capacity_measured_prefills",
            "First tokens the pods reported within capacity.window_s (the measured capacity needs "
            "capacity.measured_min_prefills)",
            labels=labels,
        )
        for sig in sigs:
            for s in PREFILL_SOURCES:
                source.add_metric([sig.pool, sig.role, s], float(s == sig.prefill_source))
            measured.add_metric([sig.pool, sig.role], sig.measured_prefills)
            if sig.cost_fit is not None:
                fit.add_metric([sig.pool, sig.role], sig.cost_fit)
            for k in DEMAND_KINDS:
                demand.add_metric([sig.pool, sig.role, k], sig.demand[k])
            for k in CAPACITY_KINDS:
                per_pod.add_metric([sig.pool, sig.role, k], sig.per_pod[k])
            util.add_metric([sig.pool, sig.role], sig.utilization)
            ready.add_metric([sig.pool, sig.role], sig.ready)
            desired.add_metric([sig.pool, sig.role], sig.desired)
        yield from (demand, per_pod, util, ready, desired, source, measured, fit)


def _prefill_rate(
    prefills: deque[tuple[float, int, float]], tokens: int, start: float, now: float, z: float | None
) -> float:
    """Uncached tokens per second at ``now`` of the ``prefills`` (t, tokens, _) since ``start``, ``tokens``
    in all: their mean rate, or, when it climbs by more than ``z`` standard errors, its linear trend
    at ``now``.

    Least squares for a rate a + b·(t − mid) over the span L (mid its middle) from arrivals of n
    tokens at t: a = Σn / L, b = 12·Σn·(t − mid) / L³ (the least-squares slope of whatever the rate
    does, exact for a linear one), with variance 144·Σ(n·(t − mid))² / L⁶ for Poisson arrivals. The
    rate at ``now`` is a + b·L/2."""
    span = now - start
    mean = tokens / span
    if z is None or len(prefills) < TREND_MIN_PREFILLS:
        return mean
    mid = start + span / 2
    moment = sum(n * (t - mid) for t, n, _ in prefills)
    spread = math.sqrt(sum((n * (t - mid)) ** 2 for t, n, _ in prefills))
    if moment <= z * spread:  # b <= z standard errors (the 12 / L³ cancels): steady, falling or unclear
        return mean
    return mean + 6 * moment / span**2  # b·L/2


def _union(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans."""
    total, start, end = 0.0, -math.inf, -math.inf
    for a, b in sorted(spans):
        if a > end:
            total += end - start if end > start else 0.0
            start, end = a, b
        else:
            end = max(end, b)
    return total + (end - start if end > start else 0.0)


def _prune(s: _Series, horizon: float) -> None:
    """Drop the samples older than ``horizon`` (the window's start)."""
    q = s.prefills
    while q and q[0][0] < horizon:
        _, tokens, seconds = q.popleft()
        s.tokens -= tokens
        s.busy_s -= seconds
    if not q:
        s.tokens, s.busy_s = 0, 0.0  # (no drift from the running sums past an empty window)
    while s.loads and s.loads[0][0] < horizon:
        s.loads.popleft()
