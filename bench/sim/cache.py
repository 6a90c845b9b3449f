"""A vLLM-style prefix cache of fixed-size KV blocks with compact bookkeeping.

Mirrors vllm/v1/core/block_pool.py + kv_cache_manager.py where a router can see it:
- only full blocks are hashed and cached; a block's hash chains its parent's hash (cache_salt is
  mixed into the first block), so equal hashes mean equal prefixes;
- blocks held by running requests are pinned (ref counted); freed hashed blocks stay cached and
  are evicted least-recently-freed first; a request frees its blocks tail-first, so a prompt's last
  blocks go before its first ones;
- a lookup never counts the last prompt token as a hit (vLLM recomputes it to get logits), so the
  hit is at most ``(num_tokens - 1) // block_size`` blocks.

One deliberate difference: free blocks that never held a full block (partial tails) are reused
before any cached block is evicted; vLLM keeps them in the same LRU queue. This only makes the
simulated cache slightly luckier when it is full of partial blocks.

Memory: everything lives in ``array`` objects (no per-block Python objects): a slot table
(hash u64, ref count i32, LRU prev/next i32) and an open-addressing hash index (linear probing,
backward-shift deletion, load <= 2/3). That is ~21 B per slot plus ~18 B of index per slot.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import xxhash

_xxh = xxhash.xxh3_64_intdigest
_ROOT = _xxh(b"bench.sim/none-hash")
_NIL = -1


def first_parent(cache_salt: str | None) -> int:
    """The chain's root: vLLM mixes cache_salt into the first block's extra keys."""
    if not cache_salt:
        return _ROOT
    return _xxh(cache_salt.encode("utf-8", "surrogatepass"), seed=_ROOT)


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, start: int = 0, parent: int | None = None
) -> list[int]:
    """Chained uint64 hashes of the full blocks of ``token_ids`` from block index ``start``.

    ``parent`` must be the hash of block ``start - 1`` when ``start > 0``.
    """
    out: list[int] = []
    h = first_parent(cache_salt) if parent is None else parent
    for i in range(start, len(token_ids) // block_size):
        h = _xxh(array("I", token_ids[i * block_size : (i + 1) * block_size]).tobytes(), seed=h)
        out.append(h)
    return out


class _HashIndex:
    """uint64 -> slot map in two flat arrays (open addressing, linear probing)."""

    __slots__ = ("_keys", "_n", "_vals", "size")

    def __init__(self, capacity: int) -> None:
        # Load factor <= 2/3 keeps linear-probe chains short at 12 B per table entry.
        n = max(8, capacity * 3 // 2 + 1)
        self._n = n
        self._keys = array("Q", bytes(8 * n))
        self._vals = array("i", [_NIL]) * n
        self.size = 0

    def _home(self, key: int) -> int:
        # The key is already a good hash; fold the high bits in for small tables.
        return (key ^ (key >> 32)) % self._n

    def get(self, key: int) -> int:
        keys, vals, n = self._keys, self._vals, self._n
        i = self._home(key)
        while True:
            v = vals[i]
            if v == _NIL:
                return _NIL
            if keys[i] == key:
                return v
            i = i + 1 if i + 1 < n else 0

    def put(self, key: int, val: int) -> None:
        keys, vals, n = self._keys, self._vals, self._n
        i = self._home(key)
        while vals[i] != _NIL:
            if keys[i] == key:
                vals[i] = val
                return
            i = i + 1 if i + 1 < n else 0
        keys[i] = key
        vals[i] = val
        self.size += 1

    def delete(self, key: int) -> None:
        keys, vals, n = self._keys, self._vals, self._n
        i = self._home(key)
        while True:
            if vals[i] == _NIL:
                return
            if keys[i] == key:
                break
            i = i + 1 if i + 1 < n else 0
        # Backward-shift deletion keeps probe chains intact without tombstones.
        j = i
        while True:
            j = j + 1 if j + 1 < n else 0
            if vals[j] == _NIL:
                break
            home = self._home(keys[j])
            # Move entry j into hole i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
                keys[i] = keys[j]
                vals[i] = vals[j]
                i = j
        vals[i] = _NIL
        self.size -= 1

    def clear(self) -> None:
        self._vals = array("i", [_NIL]) * self._n
        self.size = 0


class PrefixCache:
    """Block pool + prefix index for one pod. Slots are the block ids reported to P/D peers."""

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks <= 0 or block_size <= 0:
            raise ValueError("capacity_blocks and block_size must be positive")
        self.capacity = capacity_blocks
        self.block_size = block_size
        n = capacity_blocks
        self._hash = array("Q", bytes(8 * n))
        self._hashed = bytearray(n)  # 1 if the slot holds a cached (full, indexed) block
        self._ref = array("i", bytes(4 * n))
        # LRU of evictable (ref 0, hashed) slots as a doubly linked list; head is evicted first.
        self._prev = array("i", [_NIL]) * n
        self._next = array("i", [_NIL]) * n
        self._head = _NIL
        self._tail = _NIL
        self._evictable = 0
        # Never-used or unhashed free slots, reused before evicting anything.
        self._unused = array("i", range(n - 1, -1, -1))
        self._index = _HashIndex(n)
        self.pinned = 0  # slots with ref > 0

    # -- introspection -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._unused) + self._evictable

    @property
    def num_cached(self) -> int:
        return self._index.size

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: share of blocks held by requests (cached free ones count free)."""
        return self.pinned / self.capacity

    def contains(self, h: int) -> bool:
        return self._index.get(h) != _NIL

    # -- lookups -------------------------------------------------------------------------------
    def longest_hit(self, hashes: Sequence[int], num_tokens: int) -> int:
        """Number of leading blocks of a ``num_tokens``-token prompt that are cached."""
        limit = min(len(hashes), max(num_tokens - 1, 0) // self.block_size)
        get = self._index.get
        n = 0
        while n < limit and get(hashes[n]) != _NIL:
            n += 1
        return n

    def acquire(self, hashes: Sequence[int]) -> list[int]:
        """Pin the cached blocks with these hashes (all must be present) and return their slots."""
        slots = []
        for h in hashes:
            s = self._index.get(h)
            if s == _NIL:
                raise KeyError(h)
            self._pin(s)
            slots.append(s)
        return slots

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int, evicted: list[int]) -> list[int] | None:
        """``n`` fresh pinned slots, evicting LRU cached blocks (their hashes go to ``evicted``).

        Returns None, changing nothing, when fewer than ``n`` blocks are free.
        """
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._unused:
                s = self._unused.pop()
            else:
                s = self._head
                self._unlink(s)
                h = self._hash[s]
                self._index.delete(h)
                self._hashed[s] = 0
                evicted.append(h)
            self._ref[s] = 1
            self.pinned += 1
            out.append(s)
        return out

    def commit(self, slot: int, h: int) -> bool:
        """Index a pinned, now full block under hash ``h``.

        False when another block already holds ``h`` (two requests computed the same block at
        once); like vLLM the duplicate stays uncached and is simply freed later.
        """
        if self._hashed[slot] or self._index.get(h) != _NIL:
            return False
        self._hash[slot] = h
        self._hashed[slot] = 1
        self._index.put(h, slot)
        return True

    def release(self, slots: Iterable[int]) -> None:
        """Drop one reference to each slot; pass a request's blocks in order (freed tail-first)."""
        for s in reversed(list(slots)):
            r = self._ref[s] - 1
            self._ref[s] = r
            if r > 0:
                continue
            self.pinned -= 1
            if self._hashed[s]:
                self._append(s)
            else:
                self._unused.append(s)

    def clear(self) -> None:
        """Forget everything (restart). Pinned slots are dropped too: callers abort their requests."""
        n = self.capacity
        self._hashed = bytearray(n)
        self._ref = array("i", bytes(4 * n))
        self._prev = array("i", [_NIL]) * n
        self._next = array("i", [_NIL]) * n
        self._head = self._tail = _NIL
        self._evictable = 0
        self._unused = array("i", range(n - 1, -1, -1))
        self._index.clear()
        self.pinned = 0

    # -- LRU list ------------------------------------------------------------------------------
    def _pin(self, s: int) -> None:
        if self._ref[s] == 0:
            self._unlink(s)
            self.pinned += 1
        self._ref[s] += 1

    def _append(self, s: int) -> None:
        self._prev[s] = self._tail
        self._next[s] = _NIL
        if self._tail == _NIL:
            self._head = s
        else:
            self._next[self._tail] = s
        self._tail = s
        self._evictable += 1

    def _unlink(self, s: int) -> None:
        p, nx = self._prev[s], self._next[s]
        if p == _NIL:
            self._head = nx
        else:
            self._next[p] = nx
        if nx == _NIL:
            self._tail = p
        else:
            self._prev[nx] = p
        self._prev[s] = self._next[s] = _NIL
        self._evictable -= 1
