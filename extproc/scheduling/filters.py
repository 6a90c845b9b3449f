"""Filters: which endpoints may take this request at all."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

from extproc.config import CostConfig
from extproc.endpoints.pool import EndpointState
from extproc.errors import Shed
from extproc.index.base import EndpointId
from extproc.scheduling.base import SchedulingContext

K = TypeVar("K", bound=Hashable)

# The branch spread copies a prefix only to a pod that takes less than this share of its fair part
# (1 / pods) of the last SHARE_WINDOW requests routed: a pod left without a prefix of its own (4
# system prompts on 8 pods), not another prompt's home that is momentarily lighter (4 on 4 pods).
ROOM_SHARE = 0.25
SHARE_WINDOW = 1000
# Requests a pod the window must hold before shares are compared with each other (branch_room_gap): the
# opening's first few requests are a share of 0, 1 or 2 each, and ROOM_SHARE already spreads them.
GAP_MIN_REQUESTS = 4
# How many new conversations back the branch spread counts the shared prefixes they branched off
# (routing.cost.branch_fair_homes: a prefix's fair number of homes is pods / that count).
ROOT_WINDOW = 1000


class BoundedLoadFilter:
    """Consistent-hashing-with-bounded-loads guard: no endpoint above ⌈(1+ε)·mean⌉ + slack in flight.

    The slack keeps a hot prefix on its pod at low load (where spreading only costs cache hits);
    ε keeps it from piling every request on one pod at high load. ε None: no bound (cost scoring's
    default, routing.load_epsilon).
    """

    name = "bounded-load"

    def __init__(self, epsilon: float | None, slack: int) -> None:
        self.epsilon = epsilon
        self.slack = slack

    def capacity(self, endpoints: list[EndpointState]) -> int | None:
        """The most requests in flight a pod may hold to take this one (None: no bound)."""
        if self.epsilon is None or not endpoints:
            return None
        total = sum(e.inflight for e in endpoints)
        return math.ceil((1 + self.epsilon) * (total + 1) / len(endpoints)) + self.slack

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        cap = self.capacity(endpoints)
        if cap is None:
            return endpoints
        # At least the least-loaded endpoint always fits, so this never empties a non-empty list.
        return [e for e in endpoints if e.inflight + 1 <= cap]


class SaturationFilter:
    """Pods past the queue or KV-use threshold (from their /metrics) take no new work while others
    can. When every candidate is saturated, a sheddable request (priority < 0) is refused with 429
    and the rest queue at the pods, as the EPP protocol asks."""

    name = "saturation"

    def __init__(self, queue_threshold: int, kv_threshold: float) -> None:
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold

    def saturated(self, e: EndpointState) -> bool:
        return (e.queue is not None and e.queue >= self.queue_threshold) or (
            e.kv_usage is not None and e.kv_usage >= self.kv_threshold
        )

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        ok = [e for e in endpoints if not self.saturated(e)]
        if ok:
            return ok
        if ctx.request.priority < 0:
            raise Shed("every endpoint is saturated and the request is sheddable")
        return endpoints


class HealthyFilter:
    """Pods with fresh metrics (or none scraped) that are not draining. When none is, stale is not
    dead: a busy pod's /metrics stalls, and one process serving several pods stalls them together,
    so the request goes among the pods not known down (scrapes refused, TLS failing) rather than
    being refused with 503 while the pods still serve."""

    name = "healthy"

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        ok = [e for e in endpoints if e.available]
        return ok or [e for e in endpoints if not e.draining and not e.down]


class _Recent(Generic[K]):
    """How many of the last ``window`` keys noted were each key."""

    def __init__(self, window: int) -> None:
        self._recent: deque[K] = deque()
        self._counts: dict[K, int] = {}
        self.window = window

    def note(self, key: K) -> None:
        counts, recent = self._counts, self._recent
        if len(recent) >= self.window:
            gone = recent.popleft()
            if (left := counts[gone] - 1) > 0:
                counts[gone] = left
            else:
                del counts[gone]
        recent.append(key)
        counts[key] = counts.get(key, 0) + 1


class RoutedShares(_Recent[EndpointId]):
    """Each pod's share of the last ``window`` requests routed."""

    def __init__(self, window: int = SHARE_WINDOW) -> None:
        super().__init__(window)

    def __len__(self) -> int:
        return len(self._recent)

    def taken(self, among: list[EndpointState]) -> tuple[list[float], int]:
        """Each pod's fraction of the noted requests that went to ``among`` (0 before any), and how many did."""
        get = self._counts.get
        counts = [get(e.address, 0) for e in among]
        total = sum(counts)
        return [c / total if total else 0.0 for c in counts], total

    def shares(self, among: list[EndpointState]) -> list[float]:
        """Each pod's fraction of the noted requests that went to ``among`` (0 before any)."""
        return self.taken(among)[0]


class RecentRoots(_Recent[int]):
    """The distinct shared prefixes (each by the key of the block it ends at) that the last ``window`` new
    conversations branched off (``note``: one was routed)."""

    def __init__(self, window: int = ROOT_WINDOW) -> None:
        super().__init__(window)

    def count(self, root: int) -> int:
        """How many distinct roots the window holds with ``root`` among them."""
        return len(self._counts) + (root not in self._counts)

    def __len__(self) -> int:
        return len(self._counts)


class BranchSpreadFilter:
    """A new conversation on a shared cached prefix (``ctx.continues`` False) leaves the pods holding the
    prefix that have taken more than ``branch_copy_factor`` times their fair part (1 / pods) of their pool's
    recent requests (``routed``) while some pod has room (has taken less than ``ROOM_SHARE`` of its fair part,
    or ``branch_room_gap`` fair parts less than the busiest holder, which then must be busier by a copy's
    prefill) and fewer requests in flight (a holder with nothing more running serves the prefix from its cache
    at once). The prefix gets another home (config.py, ``CostConfig.branch_copy_factor``): a coding agent's tools
    and system prompt, sent by every session, get a copy on each idle pod rather than every session piling
    onto the pod that served the first (its replies then decode in one batch: agentic in bench/RESULTS.md);
    4 system prompts on 8 pods get homes on the pods left without one; while on 4 pods, each a prompt's home,
    none has room and a copy would only move load onto another prompt's home. A pod with room under a quarter
    of its fair part takes a copy only of a prefix with fewer homes than pods / the distinct prefixes recent
    new conversations branched off (``branch_fair_homes``). Pods holding nothing of it and
    pods with room always stay, so this never empties a non-empty list."""

    name = "branch-spread"

    def __init__(self, cost: CostConfig) -> None:
        self.cost = cost
        self.routed = RoutedShares()
        self.roots = RecentRoots()

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        factor = self.cost.branch_copy_factor
        if factor is None or ctx.continues is not False or len(endpoints) < 2:
            return endpoints
        fair, get, gap = 1.0 / len(endpoints), ctx.matches.get, self.cost.branch_room_gap
        shares, total = self.routed.taken(endpoints)
        matched = [get(e.address, 0) for e in endpoints]
        room = ROOM_SHARE * fair
        roomy = [e.inflight for e, share in zip(endpoints, shares, strict=True) if share < room]
        if self.cost.branch_fair_homes and (top := max(matched)):
            # The pods left without a share are for every prefix in use, not the first few to branch
            # (routing.cost.branch_fair_homes): a prefix with its fair number of homes keeps to them.
            homes = sum(1 for blocks in matched if blocks >= top)
            if homes >= max(1, len(endpoints) // self.roots.count(ctx.keys[top - 1])):
                roomy = []
        least = min(roomy) if roomy else math.inf
        if gap is not None and total >= GAP_MIN_REQUESTS * len(endpoints):
            # Or a copy's worth below the busiest holder (CostConfig.branch_room_gap), once the shares are more
            # than the opening's first few requests, where the holder has more requests in flight than that
            # pod by at least the copy's prefill, at per_inflight_s each: a system prompt's copy is a few
            # requests' worth, a long document's is not made for this.
            held = [share for share, blocks in zip(shares, matched, strict=True) if blocks]
            gap_room = max(held, default=0.0) - gap * fair
            busy = [e.inflight for e, share in zip(endpoints, shares, strict=True) if room <= share < gap_room]
            if busy and self.cost.per_inflight_s > 0:
                tokens = min(max(matched) * ctx.block_tokens, ctx.prompt_tokens or math.inf)
                least = min(least, min(busy) + self.cost.prefill_s(tokens) / self.cost.per_inflight_s)
                room = gap_room
        if least == math.inf:
            return endpoints
        most = factor * fair
        return [e for e, share, blocks in zip(endpoints, shares, matched, strict=True)
                if share <= most or share < room or e.inflight <= least or not blocks]  # fmt: skip
