"""Approximate prefix index: what kvroute itself routed where (no help from the pods).

Per endpoint an LRU of block keys bounded like the pod's own cache: ``capacity_of(endpoint)``
blocks when known (kvroute derives it from the pod's reported KV size), else ``capacity_blocks``.
Remembering more than the pod holds would credit prefixes the pod has already evicted. A reverse
map key → holders makes ``match`` cost one intersection per block while many pods share a prefix,
independent of how many pods hold nothing; once few are left, each one's run is bisected in its own
LRU (a pod holds a chain's blocks as a leading run), ~2·log2(run) lookups rather than one per block.
Keys are chains (route keys: a block's key names every block before it); a list that is no chain is
recorded all the same, but its matches are only exact for chains. The holders are a bitmask (an int,
a bit per pod), not a set: Python's cyclic garbage collector walks every set at each full collection,
and a set per block made a collection over a full index (125k blocks) stall the event loop for
80-130 ms; ints are not tracked.

The reverse map is split in ``SHARDS`` dicts by a key's top bits. Once the pods' LRUs are full every
record adds keys and deletes as many; a dict marks a deleted slot rather than freeing it, and when an
insert finds none free it rebuilds its whole table in one go: one map over a 64-pod pool's 2M blocks
held the event loop for 115-119 ms at each rebuild (`python -m bench.index_churn`). A shard rebuilds 1/64
of it. Keys are 64-bit hashes: the top bits pick the shard and leave the low bits, which each dict
places by, as spread as they were.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

from extproc.index.base import EndpointId
from extproc.index.ends import PromptEnds

DEFAULT_CAPACITY_BLOCKS = 31_250  # per endpoint; GIE's approximate scorer uses the same default
# Below this many candidates, ``match`` bisects each one's run in its own LRU rather than intersect
# the holders of every block for all of them.
_PER_POD_BELOW = 4
SHARD_BITS = 6
SHARDS = 1 << SHARD_BITS
_SHIFT, _MASK = 64 - SHARD_BITS, SHARDS - 1  # a key's shard: (key >> _SHIFT) & _MASK (any int is a key)


def _leading_run(held: Callable[[int], bool], keys: Sequence[int], start: int) -> int:
    """How many of ``keys`` lead held, ``keys[:start]`` known held: found by galloping then bisecting,
    ~2·log2(run) lookups instead of one per block. Exact because a pod holds a chain's blocks as a
    leading run: every record touches a block's predecessor after it, so the predecessor is the more
    recent and the later evicted (``record``)."""
    n = len(keys)
    lo, hi, step = start, start, 1
    while hi < n and held(keys[hi]):  # keys[:hi + 1] held
        lo = hi + 1
        hi = lo + step
        step <<= 1
    if hi > n:
        hi = n
    while lo < hi:  # keys[:lo] held; keys[hi] not (or hi == n)
        mid = (lo + hi) >> 1
        if held(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


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
        # key -> bitmask of the pods holding it, in the shard of its top bits
        self._holders: list[dict[int, int]] = [{} for _ in range(SHARDS)]
        self._lru: dict[EndpointId, OrderedDict[int, None]] = {}
        self._bit: dict[EndpointId, int] = {}  # a pod's bit (1 << n), from its first record to its removal
        self._name: dict[int, EndpointId] = {}  # n -> the pod
        self._free: list[int] = []  # bit numbers given back by removed pods, reused first
        self._ends = PromptEnds()

    def match(self, keys: Sequence[int], endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        bit = self._bit
        cands = 0
        for e in endpoints:
            cands |= bit.get(e, 0)  # a pod never recorded holds nothing
        out: dict[EndpointId, int] = {}
        matched = 0
        shards = self._holders
        for k in keys:
            if cands.bit_count() < _PER_POD_BELOW:
                # Few candidates left (the usual case past a shared system prompt): each one's leading
                # run, bisected in its own LRU (which holds exactly the keys it is a holder of).
                for e in self._names(cands):
                    run = _leading_run(self._lru[e].__contains__, keys, matched)
                    if run:
                        out[e] = run
                return out
            kept = cands & shards[k >> _SHIFT & _MASK].get(k, 0)
            if not kept:
                break
            if kept != cands:
                if matched:
                    for e in self._names(cands & ~kept):
                        out[e] = matched
                cands = kept
            matched += 1
        if matched:
            for e in self._names(cands):
                out[e] = matched
        return out

    def _names(self, mask: int) -> Iterable[EndpointId]:
        name = self._name
        while mask:
            low = mask & -mask
            yield name[low.bit_length() - 1]
            mask ^= low

    def continues(self, keys: Sequence[int], held: int) -> bool:
        return self._ends.continues(keys, held)

    def record(self, keys: Sequence[int], endpoint: EndpointId, ended: bool = True) -> None:
        if ended:
            self._ends.note(keys)
        lru = self._lru.get(endpoint)
        if lru is None:
            lru = self._lru[endpoint] = OrderedDict()
            n = self._free.pop() if self._free else len(self._bit)
            self._bit[endpoint] = 1 << n
            self._name[n] = endpoint
        # Newest-last LRU, touched tail-first: a prefix's first block is the most recent and evicted
        # last, so what survives eviction is always a leading run (like vLLM freeing tail blocks first).
        if keys and keys[0] in lru:
            # A prefix it holds (a follow-up): the new tail blocks first, one by one, then the leading
            # run at C speed (touching a block again in the same order leaves the same order).
            cut = len(keys)  # keys[cut:]: the tail, new here
            while keys[cut - 1] not in lru:  # stops at keys[0] at the latest
                cut -= 1
            self._touch(reversed(keys[cut:]), lru, endpoint)
            rest = keys[cut - 1 :: -1]
            try:
                deque(map(lru.move_to_end, rest), maxlen=0)
            except KeyError:  # a gap: a block amid held ones is new
                self._touch(rest, lru, endpoint)
        else:
            self._touch(reversed(keys), lru, endpoint)
        over = len(lru) - self.capacity(endpoint)
        if over > 0:
            pop = lru.popitem
            self._release([pop(last=False)[0] for _ in range(over)], self._bit[endpoint])

    def _touch(self, keys: Iterable[int], lru: OrderedDict[int, None], endpoint: EndpointId) -> None:
        """Touch ``keys`` in order in ``endpoint``'s LRU: each to the end, added if new."""
        shards, shift, mask = self._holders, _SHIFT, _MASK
        bit = self._bit[endpoint]
        for k in keys:
            holders = shards[k >> shift & mask]
            h = holders.get(k, 0)
            if h & bit:  # held already (``lru`` holds exactly the keys ``endpoint`` is a holder of)
                lru.move_to_end(k)
                continue
            holders[k] = h | bit
            lru[k] = None

    def capacity(self, endpoint: EndpointId) -> int:
        """Blocks remembered for ``endpoint`` at most."""
        cap = self._capacity_of(endpoint) if self._capacity_of is not None else None
        return self.capacity_blocks if cap is None else max(1, cap)

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        lru = self._lru.pop(endpoint, None)
        if lru is None:
            return
        bit = self._bit.pop(endpoint)
        self._release(lru, bit)
        n = bit.bit_length() - 1
        del self._name[n]
        self._free.append(n)

    def blocks(self, endpoint: EndpointId) -> int:
        lru = self._lru.get(endpoint)
        return len(lru) if lru else 0

    def block_counts(self) -> dict[EndpointId, int]:
        """Blocks remembered per endpoint (for /metrics: a removed pod's entries must be gone)."""
        return {e: len(lru) for e, lru in self._lru.items() if lru}

    def distinct_keys(self) -> int:
        """Block keys some pod holds."""
        return sum(map(len, self._holders))

    def table_sizes(self) -> list[int]:
        """Entries of each dict the index keeps (the reverse map's shards, each pod's LRU, the prompt
        ends' two generations together): a dict's rebuild copies all of its entries while the event
        loop waits."""
        return [*map(len, self._holders), *map(len, self._lru.values()), len(self._ends)]

    def _release(self, keys: Iterable[int], bit: int) -> None:
        """``keys`` no longer held by the pod of ``bit``."""
        shards, shift, mask, keep = self._holders, _SHIFT, _MASK, ~bit
        for key in keys:
            holders = shards[key >> shift & mask]
            h = holders.get(key, 0) & keep
            if h:
                holders[key] = h
            else:
                holders.pop(key, None)
