"""The scheduler: candidates → filters → (route-id pin | cold-prefix hashing | scores) → Decision.

One request, in order:
1. candidates: the pool's healthy endpoints, narrowed to the proxy's subset hint if it sent one;
2. saturation: pods past their queue/KV thresholds sit out while others can serve (429 for
   sheddable requests when all are saturated);
3. bounded load (weighted scoring, or ``routing.load_epsilon`` set): drop endpoints above
   ⌈(1+ε)·mean⌉ + slack in flight — a hot prefix whose pod is full gets a second home instead of a
   queue, and keeps both (the index records the new one); cost scoring prices that load instead;
   cache buckets (``routing.buckets``, pods labelled with one): only the pods of the key's bucket
   compete from here on (scheduling/buckets.py), the other buckets' pods are fallbacks;
4. an explicit route/session id whose pod is still eligible wins outright;
5. no eligible endpoint holds any block → the least-loaded pods (cost scoring: the lowest estimated
   time to first token, which counts the prefill work kvroute just sent each pod), consistent
   (rendezvous) hashing of the first block among equals, so new prefixes fill idle pods first and
   spread evenly;
6. otherwise scorers rank them: the weighted sum (prefix share, in-flight, queue, KV use), or the
   estimated time to first token plus, weighted, the prefill of tokens another eligible pod holds
   (``routing.scoring: cost``; a conversation stays with its history unless the queue there outweighs
   the work a move makes the fleet repeat; a new conversation on a shared prefix weighs that copy
   lightly, as it is made once). The decision keeps what was weighed (matches, estimates).
The chosen endpoint is recorded in the index so the next same-prefix request finds it: behind the
server once the answer is sent (``defer_record``; the next decision settles what is pending first, so
every decision sees every one before it), the bookkeeping off the request's path.

In a pool larger than ``SHORTLIST_ABOVE`` eligible pods, steps 5-6 score a shortlist: the pods holding
the longest runs of the prompt and the least loaded by in-flight count and scraped queue (cheap to
read for every pod, unlike the cost estimate): what still grows with the pool is one cheap pass per pod.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence

from extproc.config import RoutingConfig
from extproc.endpoints.pool import EndpointState
from extproc.errors import NoEndpoint
from extproc.index.base import EndpointId, PrefixIndex
from extproc.request import InferenceRequest
from extproc.scheduling.base import Decision, Filter, SchedulingContext, SchedulingTrace, Scorer, WholePromptNeeded
from extproc.scheduling.buckets import BucketRouter
from extproc.scheduling.filters import BoundedLoadFilter, BranchSpreadFilter, HealthyFilter, SaturationFilter
from extproc.scheduling.pickers import rank_by_score, rendezvous_order, spread_near_cheapest, tie_key
from extproc.scheduling.scorers import CostScorer, InflightScorer, KVUsageScorer, PrefixScorer, QueueScorer
from extproc.state.base import LocalRouteTable, RouteTable

# Large pools: only a shortlist is scored (module docstring). A pod outside it holds a shorter run of the
# prompt than SHORTLIST_HOLDERS others and is busier than SHORTLIST_LEAST_LOADED others: it would not win.
SHORTLIST_ABOVE = 16
SHORTLIST_HOLDERS = 8
SHORTLIST_LEAST_LOADED = 8

SCORERS: dict[str, type] = {
    "prefix": PrefixScorer,
    "load": InflightScorer,
    "queue": QueueScorer,
    "kv_usage": KVUsageScorer,
}


class Scheduler:
    def __init__(
        self,
        routing: RoutingConfig,
        index: PrefixIndex,
        routes: RouteTable | None = None,
        peers: Callable[[], int] = lambda: 0,
    ) -> None:
        """``routes``: the route-id pins (shared state's; default this process's own); ``peers``: how
        many other replicas decide beside this one now (shared state's)."""
        self.peers = peers
        self.index = index
        self.routes = routes if routes is not None else LocalRouteTable(routing.route_table_size)
        # Records of decisions whose answers go out first (``schedule``'s ``defer_record``): applied by
        # ``settle``, which every decision calls before it reads the index.
        self._pending: list[tuple[PrefixIndex, Sequence[int], EndpointId, bool]] = []
        self.reconfigure(routing)

    def settle(self) -> None:
        """Record the deferred decisions' prefixes, in their order (a no-op with none pending)."""
        pending, self._pending = self._pending, []
        for index, keys, address, whole in pending:
            index.record(keys, address, whole)

    def reconfigure(self, routing: RoutingConfig) -> None:
        """Filters, scorers and fallbacks from ``routing`` (at start, and on a config reload); the
        index and the route pins stay."""
        self.routing = routing
        self.fallbacks = routing.fallback_endpoints
        self.bounded = BoundedLoadFilter(routing.bounded_load_epsilon, routing.load_slack)
        self.branch_spread = BranchSpreadFilter(routing.cost)
        sat = routing.saturation
        self.saturation = SaturationFilter(sat.queue_threshold, sat.kv_threshold)
        self.buckets = BucketRouter(routing.buckets) if routing.buckets.enabled else None
        self.filters: list[Filter] = [HealthyFilter(), self.saturation]
        weights = routing.weights.model_dump()
        self.cost = CostScorer(routing.cost)
        # Whether a request holding a prefix is asked if it continues it (for the branch spread).
        self._weigh_branches = routing.scoring == "cost" and routing.cost.branch_copy_factor is not None
        self.scorers: list[tuple[Scorer, float]] = (
            [(self.cost, 1.0)]
            if routing.scoring == "cost"
            else [(cls(), float(weights[name])) for name, cls in SCORERS.items() if weights.get(name, 0) > 0]
        )

    def schedule(
        self,
        req: InferenceRequest,
        keys: Sequence[int],
        pool: str,
        endpoints: list[EndpointState],
        route_key: int | None = None,
        subset: set[str] | None = None,
        index: PrefixIndex | None = None,
        block_tokens: float = 64.0,
        prompt_tokens: float | None = None,
        dry_run: bool = False,
        whole: bool = True,
        head_holders: int | None = None,
        defer_record: bool = False,
    ) -> Decision:
        """``prompt_tokens``: the whole prompt (default: what its keys cover). ``dry_run``: record
        nothing (index, pins) and trace every verdict and score (the explain API). ``whole``: the keys
        run to the prompt's end (False: a head's; the index notes no prompt end). ``head_holders``: the
        keys are a prompt's head, and a pod holding all of them may hold more: at most this many such
        pods (0 or 1), and with one, a decision by the prompt's blocks stands only if it picks that pod
        (its longer match could change it); else ``WholePromptNeeded``, before anything is recorded.
        ``defer_record``: the pick's record waits for ``settle`` (or the next decision)."""
        if self._pending:
            self.settle()
        index = index or self.index
        prompt = len(keys) * block_tokens if prompt_tokens is None else prompt_tokens
        ctx = SchedulingContext(request=req, keys=keys, block_tokens=block_tokens, prompt_tokens=prompt)
        candidates = list(endpoints) if subset is None else [e for e in endpoints if e.address in subset]
        if not candidates:
            where = "in the proxy's subset hint" if subset is not None else f"in pool {pool!r}"
            raise NoEndpoint(f"no endpoint {where}")
        trace = SchedulingTrace(considered=candidates) if dry_run else None
        for f in self.filters:
            before, candidates = candidates, f.filter(ctx, candidates)
            if trace is not None:
                trace.judge(f.name, before, candidates)
            if not candidates:
                raise NoEndpoint(f"no ready endpoint in pool {pool!r} (all failed the {f.name} check)")
        eligible = self.bounded.filter(ctx, candidates)
        overloaded = _dropped(candidates, eligible)
        if trace is not None:
            if self.bounded.epsilon is not None:  # no bound (cost scoring's default): no verdict to show
                trace.judge(self.bounded.name, candidates, eligible)
            if keys:  # a pinned request skips the lookup; explain shows what the pods hold anyway
                trace.matches = index.match(keys, [e.address for e in candidates])
        # Cache buckets (pods labelled with one): the key's bucket first, the others only as fallbacks.
        other_buckets: list[EndpointState] = []
        if self.buckets is not None and (split := self.buckets.split(keys, route_key, eligible)) is not None:
            before, (eligible, other_buckets) = eligible, split
            if trace is not None:
                trace.judge(self.buckets.name, before, eligible)

        ranked: list[EndpointState]
        scores: dict[EndpointId, float] = {}
        matched = 0
        holder: EndpointId | None = None  # a head's one pod that may hold more of the prompt
        if route_key is not None and (pinned := self._pinned(route_key, eligible)) is not None:
            ranked, reason = [pinned, *(e for e in eligible if e is not pinned)], "route-id"
        else:
            if keys:
                ctx.matches = index.match(keys, [e.address for e in eligible])
                if head_holders is not None:
                    whole_head = [a for a, n in ctx.matches.items() if n >= len(keys)]
                    if len(whole_head) > head_holders:
                        raise WholePromptNeeded
                    holder = whole_head[0] if whole_head else None
                if ctx.matches and self._weigh_branches:
                    eligible = self._spread_branch(ctx, index, eligible, overloaded, trace)
            tie = tie_key(keys, ctx.matches) if keys else route_key if route_key is not None else random.getrandbits(63)
            if len(eligible) > SHORTLIST_ABOVE:
                before, eligible = eligible, shortlist(eligible, ctx.matches, tie)
                if trace is not None:
                    trace.judge("shortlist", before, eligible)
            if not ctx.matches and keys:
                # A new prefix: the least-loaded pods first (so a few cold prefixes cannot leave a pod
                # idle), consistent hashing among equals (so equal load keeps placement stable).
                ranked = sorted(rendezvous_order(eligible, tie), key=self._load_key(ctx, eligible))
                reason = "hash"
            else:
                if trace is None and len(self.scorers) == 1 and self.scorers[0][1] == 1.0:
                    scores = self.scorers[0][0].score(ctx, eligible)  # (cost scoring) the sum as it is
                else:
                    for scorer, weight in self.scorers:
                        for addr, s in scorer.score(ctx, eligible).items():
                            scores[addr] = scores.get(addr, 0.0) + weight * s
                            if trace is not None:
                                trace.scores.setdefault(addr, {})[scorer.name] = weight * s
                ranked = rank_by_score(eligible, scores, tie)
                reason = "prefix" if ctx.matches else "load"
            if self.routing.scoring == "cost" and (spread := self.routing.cost.peer_spread) > 0 and self.peers():
                est = ctx.estimates  # (filled by the cost scorer or _load_key above)
                within = spread * est[ranked[0].address].work_s
                ranked = spread_near_cheapest(ranked, lambda e: est[e.address].cost_s, within,
                                              keys[-1] if keys else tie)  # fmt: skip
            matched = ctx.matches.get(ranked[0].address, 0)
        # Other buckets' pods, then overloaded endpoints (least loaded first) are the fallbacks.
        if other_buckets:
            ranked.extend(other_buckets)
        if overloaded:
            ranked.extend(sorted(overloaded, key=lambda e: e.inflight))
        chosen = ranked[0]
        if holder is not None and chosen.address != holder:
            raise WholePromptNeeded
        if trace is not None:
            trace.ranked = ranked
            if self.routing.scoring == "cost":
                trace.estimates = {e.address: self.cost.estimate(ctx, e) for e in candidates}
        else:
            if keys and defer_record:
                self._pending.append((index, keys, chosen.address, whole))
            elif keys:
                index.record(keys, chosen.address, whole)
            if self._weigh_branches:
                self.branch_spread.routed.note(chosen.address)
                if ctx.continues is False and self.routing.cost.branch_fair_homes:
                    self.branch_spread.roots.note(ctx.keys[max(ctx.matches.values()) - 1])
        if route_key is not None and not dry_run:
            self.routes.put(route_key, chosen.address)
        return Decision(
            endpoints=tuple(ranked[: self.fallbacks]),
            pool=pool,
            reason=reason,
            matched_blocks=matched,
            total_blocks=len(keys),
            scores=scores,
            trace=trace,
            matches=ctx.matches,
            estimates=ctx.estimates,
            continues=ctx.continues,
        )

    def _spread_branch(
        self, ctx: SchedulingContext, index: PrefixIndex, eligible: list[EndpointState],
        overloaded: list[EndpointState], trace: SchedulingTrace | None,
    ) -> list[EndpointState]:  # fmt: skip
        """Whether the request continues the prefix it holds (``ctx.continues``); if it branches off a
        shared one instead, the eligible pods less the busy holders, which join the fallbacks."""
        ctx.continues = index.continues(ctx.keys, max(ctx.matches.values()))
        if ctx.continues:
            return eligible
        kept = self.branch_spread.filter(ctx, eligible)
        overloaded.extend(_dropped(eligible, kept))
        if trace is not None:
            trace.judge(self.branch_spread.name, eligible, kept)
        return kept

    def _load_key(self, ctx: SchedulingContext, eligible: list[EndpointState]) -> Callable[[EndpointState], float]:
        """How loaded a pod is for a prompt none holds: the cost estimate (which also sees the
        prefill work already sent there), or in weighted mode in-flight plus waiting requests."""
        if self.routing.scoring == "cost":
            est = self.cost.estimates(ctx, eligible)
            return lambda e: est[e.address].cost_s
        return _light_load

    def _pinned(self, route_key: int, eligible: list[EndpointState]) -> EndpointState | None:
        addr = self.routes.get(route_key)
        if addr is None:
            return None
        return next((e for e in eligible if e.address == addr), None)

    def forget_endpoint(self, address: EndpointId) -> None:
        self.settle()
        self.index.remove_endpoint(address)
        self.routes.forget_endpoint(address)


def _dropped(before: list[EndpointState], after: list[EndpointState]) -> list[EndpointState]:
    """The endpoints of ``before`` a filter left out of ``after``, in order (by identity:
    EndpointState's generated __eq__ compares every field)."""
    if len(after) == len(before):
        return []
    kept = {id(e) for e in after}
    return [e for e in before if id(e) not in kept]


def _light_load(e: EndpointState) -> float:
    """In flight plus waiting: the weighted mode's load, and the shortlist's cheap one."""
    return e.inflight + (e.queue or 0.0)


def shortlist(eligible: list[EndpointState], matches: dict[EndpointId, int], tie: int) -> list[EndpointState]:
    """The pods of a large pool worth scoring: the ``SHORTLIST_HOLDERS`` holding the longest runs of the
    prompt, and the ``SHORTLIST_LEAST_LOADED`` with the fewest requests in flight or waiting. Among
    equally loaded pods the scan starts at a place set by ``tie`` (the prompt's first block past
    what the pool holds), so new prefixes spread over the pool rather than filling its first pods."""
    start = tie % len(eligible)
    least = heapq.nsmallest(SHORTLIST_LEAST_LOADED, eligible[start:] + eligible[:start], key=_light_load)
    keep = {id(e) for e in least}
    if matches:
        holders = set(heapq.nlargest(SHORTLIST_HOLDERS, matches, key=matches.__getitem__))
        keep.update(id(e) for e in eligible if e.address in holders)
    return [e for e in eligible if id(e) in keep]  # the pool's order: rankings break ties the same way
