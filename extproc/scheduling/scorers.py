"""Scorers: each rates every candidate 0..1; the scheduler sums them with configured weights."""

from __future__ import annotations

from collections.abc import Callable

from extproc.config import CostConfig
from extproc.endpoints.pool import EndpointState
from extproc.index.base import EndpointId
from extproc.scheduling.base import SchedulingContext


class PrefixScorer:
    """Share of the request's blocks the endpoint already holds (leading blocks only)."""

    name = "prefix"

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]:
        total = len(ctx.keys)
        if not total:
            return {}
        return {e.address: ctx.matches.get(e.address, 0) / total for e in endpoints}


def _min_max_inverted(
    endpoints: list[EndpointState], value: Callable[[EndpointState], float | None]
) -> dict[EndpointId, float]:
    """1 for the least-loaded, 0 for the most-loaded; nothing when the signal is unknown or flat."""
    vals = {e.address: value(e) for e in endpoints}
    known = [v for v in vals.values() if v is not None]
    if len(known) < 2:
        return {}
    lo, hi = min(known), max(known)
    if hi <= lo:
        return {}
    return {a: (hi - v) / (hi - lo) for a, v in vals.items() if v is not None}


class InflightScorer:
    """kvroute's own in-flight count per endpoint: instant, and exact for traffic through this replica."""

    name = "load"

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]:
        return _min_max_inverted(endpoints, lambda e: e.inflight)


class QueueScorer:
    """The pod's own ``vllm:num_requests_waiting`` (from /metrics)."""

    name = "queue"

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]:
        return _min_max_inverted(endpoints, lambda e: e.queue)


class KVUsageScorer:
    """The pod's ``vllm:kv_cache_usage_perc``: a full cache evicts, and admits new requests slowly."""

    name = "kv_usage"

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]:
        return {e.address: 1.0 - e.kv_usage for e in endpoints if e.kv_usage is not None}


class CostScorer:
    """Estimated time to first token on each pod, inverted to 0..1 (cheapest = 1): kvroute's
    in-flight requests and the pod's queue (from /metrics) as load, the prefill work kvroute sent
    there that has not finished yet (its estimated prefill queue), plus the prompt tokens the pod
    does not hold as prefill work. Unlike min-max load scores, one extra request in flight cannot
    outweigh a cached document: both are priced in seconds; and a pod that was just handed a long
    document is not also handed the next one as if it were idle (/metrics lags)."""

    name = "cost"

    def __init__(self, cost: CostConfig) -> None:
        self.cost = cost

    def estimate(self, ctx: SchedulingContext, e: EndpointState) -> float:
        prompt = ctx.prompt_tokens
        cached = min(prompt, ctx.matches.get(e.address, 0) * ctx.block_tokens)
        c = self.cost
        work = c.prefill_s(prompt - cached, cached)
        # P/D: prefilling here also holds back the KV hand-offs already headed here, as long each.
        return (
            e.inflight * c.per_inflight_s
            + (e.queue or 0.0) * c.per_waiting_s
            + e.prefills.wait(ctx.now)
            + work * (1 + e.handoffs.pending(ctx.now))
        )

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]:
        est = {e.address: self.estimate(ctx, e) for e in endpoints}
        hi = max(est.values(), default=0.0)
        if hi <= 0:
            return {}
        return {a: 1.0 - v / hi for a, v in est.items()}
