"""Scorers: each rates every candidate 0..1; the scheduler sums them with configured weights."""

from __future__ import annotations

from collections.abc import Callable

from extproc.config import CostConfig
from extproc.endpoints.pool import EndpointState
from extproc.index.base import EndpointId
from extproc.scheduling.base import Estimate, SchedulingContext

_estimate = tuple.__new__  # Estimate(*terms) without NamedTuple's Python-level __new__ (per pod per request)


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
    in-flight requests as load, the larger of the pod's queue (from /metrics) and the prefill work
    kvroute sent there that has not finished yet (its estimated prefill queue), plus the prompt tokens the pod
    does not hold as prefill work. Unlike min-max load scores, one extra request in flight cannot
    outweigh a cached document: both are priced in seconds; and a pod that was just handed a long
    document is not also handed the next one as if it were idle (/metrics lags).

    Recompute: a pod that lacks tokens another candidate holds would prefill them a second time.
    This request's TTFT may still be lower there, but the fleet does that work twice and the
    requests queued behind it there wait for it (and the cache holds the prefix twice): that prefill
    is added once more, times ``cost.recompute_weight``. So a conversation leaves its pod only for a
    queue longer than (1 + weight) × the prefill its history saves, and new prefixes (held nowhere)
    are placed by load alone.

    Decode stall (``cost.decode_stall_weight``, off by default): the prefill also stalls the pod's
    decoding requests, each about that long between two tokens; it is added times the requests in
    flight there, times the weight. A long new prompt then goes where fewer streams decode."""

    name = "cost"

    def __init__(self, cost: CostConfig) -> None:
        self.cost = cost

    def terms(self, ctx: SchedulingContext, e: EndpointState, held: float = 0.0) -> Estimate:
        """``e``'s terms for this request; ``held``: the most prompt tokens any candidate holds."""
        out: dict[EndpointId, Estimate] = {}
        self._price(ctx, [e], [ctx.matches.get(e.address, 0)], held, out)
        return out[e.address]

    def _price(
        self, ctx: SchedulingContext, endpoints: list[EndpointState], blocks: list[int], held: float,
        out: dict[EndpointId, Estimate],
    ) -> float:  # fmt: skip
        """Each pod's terms with its matched ``blocks`` into ``out``; the highest cost. One loop with the
        config and the request's figures read once (this runs per pod per request). Prefill estimates
        (own, recompute) are memoized by cached tokens: most pods hold the same (often nothing)."""
        c, prompt, now, block_tokens = self.cost, ctx.prompt_tokens, ctx.now, ctx.block_tokens
        per_waiting, per_inflight, weight = c.per_waiting_s, c.per_inflight_s, c.recompute_weight
        stall = c.decode_stall_weight
        prefill_s = c.prefill_s
        memo: dict[float, tuple[float, float]] = {}
        hi = 0.0
        for e, b in zip(endpoints, blocks, strict=True):
            cached = b * block_tokens
            if cached > prompt:
                cached = prompt
            # The pod's waiting requests (scraped, lagging) are mostly the prefills kvroute queued there
            # (estimated, current): the larger of the two, not their sum, which counted them twice.
            scraped = (e.queue or 0.0) * per_waiting
            sent = e.prefills.wait(now)
            wait = e.inflight * per_inflight + (sent if sent > scraped else scraped)
            prefill = memo.get(cached)
            if prefill is None:
                recompute = prefill_s(held - cached, cached) if held > cached else 0.0
                prefill = memo[cached] = (prefill_s(prompt - cached, cached), recompute)
            own, recompute = prefill
            # P/D: prefilling here also holds back the KV hand-offs already headed here, as long each.
            work = own * (1 + e.handoffs.pending(now))
            cost = wait + work + weight * recompute
            if stall:  # the requests decoding there wait about this prefill between two of their tokens
                cost += stall * work * e.inflight
            out[e.address] = _estimate(Estimate, (wait, work, recompute, cost))
            if cost > hi:
                hi = cost
        return hi

    def estimates(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, Estimate]:
        """Every candidate's terms, kept in ``ctx.estimates`` (the decision's record)."""
        self._estimates(ctx, endpoints)
        return ctx.estimates

    def _estimates(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> float:
        """``estimates``, returning the highest cost."""
        get = ctx.matches.get
        blocks = [get(e.address, 0) for e in endpoints]
        held = (max(blocks) if blocks else 0) * ctx.block_tokens
        return self._price(ctx, endpoints, blocks, held if held < ctx.prompt_tokens else ctx.prompt_tokens,
                           ctx.estimates)  # fmt: skip

    def estimate(self, ctx: SchedulingContext, e: EndpointState) -> float:
        """``e``'s estimated time to first token (s)."""
        return self.terms(ctx, e).ttft_s

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]:
        hi = self._estimates(ctx, endpoints)
        if hi <= 0:
            return {}
        return {a: 1.0 - v.cost_s / hi for a, v in ctx.estimates.items()}
