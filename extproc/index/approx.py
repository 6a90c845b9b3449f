"""Approximate prefix index: what kvroute itself routed where (no help from the pods).

Per endpoint an LRU of block keys bounded like the pod's own cache: ``capacity_of(endpoint)``
blocks when known (kvroute derives it from the pod's reported KV size), else ``capacity_blocks``.
Remembering more than the pod holds would credit prefixes the pod has already evicted. A reverse
map key → holders makes ``match`` cost one set intersection per block, independent of how many
pods hold nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from extproc.index.base import EndpointId

DEFAULT_CAPACITY_BLOCKS = 31_250  # per endpoint; GIE's approximate scorer uses the same default


class ApproxPrefixIndex:
    def __init__(
        self,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        capacity_of: Callable[[EndpointId], int | None] | None = None,
    ) -> None:
        """``capacity_of(endpoint)``: that pod's capacity in blocks, or None (unknown: ``capacity_blocks``);
        asked at every ``record``, so a capacity learnt or changed later applies from the next one."""
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._capacity_of = capacity_of
        self._holders: dict[int, set[EndpointId]] = {}
        self._lru: dict[EndpointId, OrderedDict[int, None]] = {}

    def match(self, keys: Sequence[int], endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        cands = set(endpoints)
        out: dict[EndpointId, int] = {}
        matched = 0
        get = self._holders.get
        for k in keys:
            holders = get(k)
            if not holders:
                break
            if not cands <= holders:  # the common case (every candidate still matching) allocates nothing
                kept = cands & holders
                if not kept:
                    break
                if matched:
                    for e in cands - kept:
                        out[e] = matched
                cands = kept
            matched += 1
        if matched:
            for e in cands:
                out[e] = matched
        return out

    def record(self, keys: Sequence[int], endpoint: EndpointId) -> None:
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
        holders = self._holders
        # Newest-last LRU, touched tail-first: a prefix's first block is the most recent and evicted
        # last, so what survives eviction is always a leading run (like vLLM freeing tail blocks first).
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                h = holders.get(k)
                if h is None:
                    holders[k] = {endpoint}
                else:
                    h.add(endpoint)
        cap = self.capacity(endpoint)
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop(old, endpoint)

    def capacity(self, endpoint: EndpointId) -> int:
        """Blocks remembered for ``endpoint`` at most."""
        cap = self._capacity_of(endpoint) if self._capacity_of is not None else None
        return self.capacity_blocks if cap is None else max(1, cap)

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        lru = self._lru.pop(endpoint, None)
        if lru:
            for k in lru:
                self._drop(k, endpoint)

    def blocks(self, endpoint: EndpointId) -> int:
        lru = self._lru.get(endpoint)
        return len(lru) if lru else 0

    def block_counts(self) -> dict[EndpointId, int]:
        """Blocks remembered per endpoint (for /metrics: a removed pod's entries must be gone)."""
        return {e: len(lru) for e, lru in self._lru.items() if lru}

    def _drop(self, key: int, endpoint: EndpointId) -> None:
        h = self._holders.get(key)
        if h is not None:
            h.discard(endpoint)
            if not h:
                del self._holders[key]
