"""A bounded least-recently-used map whose evictions never hold the event loop for long: ``ShardedLRU``.

An OrderedDict kept at its bound (each new key in, the oldest out) marks a deleted slot per eviction,
and when an insert finds no free slot left it rebuilds its whole table at once, with the event loop
held, every stream's decision waiting behind it: 8-10 ms for kvroute's 100,000 route pins, 11-13 ms for
precise mode's ~128,000 cached chunks (``python -m bench.index_churn --lru``). ``ShardedLRU`` keeps
the entries in up to ``PARTS`` OrderedDicts picked by the key's hash, each bounded to its share of the
capacity: a rebuild copies one part. Least recently used goes first within a part; across parts, as
far as the keys spread evenly (for a cache of hashed keys or texts, the same to within a part's few
entries).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

PARTS = 64  # the most parts (a power of two): 100,000 pins a rebuild of ~1,600


class ShardedLRU(Generic[K, V]):
    """At most ``capacity`` entries, or with ``weigh`` at most ``capacity`` of their summed weights (an
    entry heavier than its part's share is not kept). A table too small to give each part ``min_part``
    (entries or weight) has fewer parts; under ``min_part`` in all, one: an exact LRU."""

    __slots__ = ("_budget", "_mask", "_parts", "_weigh", "_weights")

    def __init__(self, capacity: int, weigh: Callable[[K, V], int] | None = None, min_part: int = 256) -> None:
        if capacity < 1 or min_part < 1:
            raise ValueError(f"capacity and min_part must be positive (got {capacity}, {min_part})")
        n = 1
        while n < PARTS and capacity // (2 * n) >= min_part:
            n *= 2
        self._mask = n - 1
        self._parts: list[OrderedDict[K, V]] = [OrderedDict() for _ in range(n)]
        # The remainder of capacity / n goes one each to the first parts: the parts sum to capacity.
        self._budget = [capacity // n + (i < capacity % n) for i in range(n)]
        self._weigh = weigh
        self._weights = [0] * n

    def get(self, key: K) -> V | None:
        """The value (marked used), or None."""
        part = self._parts[hash(key) & self._mask]
        value = part.get(key)
        if value is not None:
            part.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Holds ``value`` as the most recently used, evicting its part's least recently used past the bound."""
        i = hash(key) & self._mask
        part, weigh = self._parts[i], self._weigh
        if weigh is None:
            part[key] = value
            part.move_to_end(key)
            if len(part) > self._budget[i]:
                part.popitem(last=False)
            return
        old = part.pop(key, None)
        weight = self._weights[i] - (0 if old is None else weigh(key, old))
        budget, w = self._budget[i], weigh(key, value)
        if w <= budget:  # (heavier: not kept, and nothing else evicted for it)
            part[key] = value
            weight += w
            while weight > budget:
                weight -= weigh(*part.popitem(last=False))
        self._weights[i] = weight

    def pop(self, key: K) -> V | None:
        i = hash(key) & self._mask
        value = self._parts[i].pop(key, None)
        if value is not None and self._weigh is not None:
            self._weights[i] -= self._weigh(key, value)
        return value

    def clear(self) -> None:
        for part in self._parts:
            part.clear()
        self._weights = [0] * len(self._parts)

    @property
    def weight(self) -> int:
        """The entries' summed weights (``weigh``), or their count."""
        return sum(self._weights) if self._weigh is not None else len(self)

    @property
    def parts(self) -> int:
        return len(self._parts)

    def items(self) -> Iterator[tuple[K, V]]:
        """Every entry, a part at a time (each part oldest first)."""
        for part in self._parts:
            yield from part.items()

    def __iter__(self) -> Iterator[K]:
        for part in self._parts:
            yield from part

    def __contains__(self, key: object) -> bool:
        return key in self._parts[hash(key) & self._mask]

    def __len__(self) -> int:
        return sum(map(len, self._parts))
