"""Precise prefix index: what each vLLM pod *reports* it holds, from its KV-cache events.

Keys. The index never reproduces the engine's block hash (sha256/pickle, per-process seeds...).
A BlockStored event carries the blocks' token ids, so each block is keyed by kvroute's own chained
hash, identical to what the request side computes:

    own_key(block 0) = hashing.chain(precise_seed(cache_salt, lora_name), token_block_bytes(tokens_0))
    own_key(block i) = hashing.chain(own_key(block i-1), token_block_bytes(tokens_i))

i.e. ``hashing.chain_tokens(precise_seed(cache_salt, lora_name), token_ids, block_size, n)``.
vLLM puts ``cache_salt`` into the *root* block's ``extra_keys`` (after the LoRA name and multimodal
keys); the LoRA name comes with the event. A per-pod map engine-hash → own key resolves the parent
of a later BlockStored and the blocks of a BlockRemoved. A BlockStored whose parent engine hash is
unknown (events lost, map evicted) cannot be keyed and is skipped (``unknown_parent``). Blocks whose
extra keys hold anything kvroute cannot see in the request tokens (multimodal hashes, prompt
embeddings) are skipped too, with their descendants: keying them by tokens alone would alias
different images behind the same placeholder tokens.

Layout. Two fixed-size set-associative tables (numpy, ``WAYS`` slots per bucket, least-recently
used slot of a bucket is the victim), so memory is bounded and no per-entry Python objects exist:
- blocks: own key → bitmask of pods holding it, bitmask of pods *expected* to hold it
  (speculative, see ``record``), the speculation deadline, an LRU stamp — 32 bytes per slot;
- engine map: mix(engine hash, pod slot) → own key, pod slot, LRU stamp — 21 bytes per slot.
Pods are bits of a uint64, so an index serves at most ``MAX_ENDPOINTS`` pods at once.
``match`` gathers a chunk of keys with a handful of vectorised numpy operations and ANDs the masks
cumulatively, so its cost depends on the prefix length, not on the number of pods.

Speculation. ``record(keys, ep)`` marks blocks as expected on ``ep`` until its events confirm them or
``speculative_ttl_s`` passes; one deadline per block (the latest record), so a block recorded for
two pods keeps both expectations until the later deadline — coarse, but bounded by the TTL. A record
of keys the last ``match`` found all held by that pod adds nothing, and moves no deadline.

Single asyncio loop: every method is synchronous, so no locks are needed.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from extproc import hashing
from extproc.index.base import EndpointId
from extproc.index.ends import PromptEnds
from extproc.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BLOCKS = 1_000_000  # slots of the block table; the engine map gets the same
DEFAULT_SPECULATIVE_TTL_S = 2.0  # how long a routed-but-unconfirmed prefix counts as present
DEFAULT_MEDIA = frozenset({"GPU"})  # event media counted as "in the cache" (None always is)
MAX_ENDPOINTS = 64  # pods are bits of one uint64 mask
WAYS = 8  # slots per bucket: 8 x 8-byte keys, one cache line to compare
TICK_S = 0.01  # resolution of speculation deadlines (uint32 ticks: 497 days before wrap)
MATCH_FIRST_CHUNK = 512  # keys gathered per numpy pass; later passes only if a candidate still matches
MATCH_CHUNK_GROWTH = 8
# Up to this many keys, a table operation runs on Python ints: numpy's per-call cost (a few us per
# operation, ~0.2 ms per insert) outweighs its vector speed on the one-block events of decode steps.
FEW_KEYS = 8
BUSY = 1 << 40  # an insert's victim priority for ways found or placed by the same call: never evicted
STAMP_LIMIT = (1 << 32) - 2  # LRU stamps are uint32 op counters; halve them all when reached

U64 = npt.NDArray[np.uint64]
Intp = npt.NDArray[np.intp]
Bools = npt.NDArray[np.bool_]

_MIX1_INT, _MIX2_INT = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MIX1, _MIX2 = np.uint64(_MIX1_INT), np.uint64(_MIX2_INT)
_U64_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def precise_seed(cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """Root of the chain for a request (and for a pod's root blocks); see the module docstring."""
    if lora_name:
        return hashing.seed_key(cache_salt or "", "lora", lora_name)
    return hashing.seed_key(cache_salt or "")


def _as_keys(keys: Sequence[int] | U64) -> U64:
    """Keys as uint64 with 0 (the empty-slot marker) folded onto 1."""
    if isinstance(keys, np.ndarray):
        arr = keys.astype(np.uint64, copy=False)
    else:  # array('Q') converts a list of Python ints faster than np.asarray does
        arr = np.frombuffer(array("Q", keys), dtype=np.uint64)
    return arr if arr.all() else np.where(arr == 0, np.uint64(1), arr)


def _as_ints(keys: Sequence[int] | U64) -> list[int]:
    """``_as_keys`` on Python ints (the few-key paths): 0 folded onto 1."""
    return [k or 1 for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys)]


def _mix_one(value: int, salt: int) -> int:
    """``_mix`` of one value, on Python ints masked to 64 bits."""
    z = value ^ salt
    z = ((z ^ (z >> 30)) * _MIX1_INT) & _U64_MASK
    z = ((z ^ (z >> 27)) * _MIX2_INT) & _U64_MASK
    return (z ^ (z >> 31)) or 1


def _mix(values: U64, salt: int) -> U64:
    """splitmix64 finaliser of ``values ^ salt``: spreads engine hashes (maybe non-uniform) over buckets."""
    if len(values) <= FEW_KEYS:  # the same on Python ints: cheaper for a few
        return np.array([_mix_one(v, salt) for v in values.tolist()], dtype=np.uint64)
    z = values ^ np.uint64(salt)
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return _as_keys(z ^ (z >> np.uint64(31)))


def _table(shape: int | tuple[int, int], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A zeroed table with every page already written. ``np.zeros`` maps fresh pages that the kernel
    supplies at first write, each a page fault: a new prefix's record writes ~5 tables at ~100 random
    slots, so the first requests after a start paid the faults (a record 1-3 ms; 64 ms in a VM whose
    host also backs each new page lazily, the event loop stopped meanwhile). Written here, at startup,
    before kvroute serves; the index's memory is resident from the start, as it will be once full."""
    table = np.empty(shape, dtype=dtype)
    table.fill(0)
    return table


def _pod_salt(slot: int) -> int:
    return ((slot + 1) * _GOLDEN) & ((1 << 64) - 1)


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _AssocTable:
    """uint64 key → slot, ``WAYS`` slots per bucket; key 0 marks an empty slot.

    Slots are addressed by a flat index ``bucket * WAYS + way``; payload arrays of the owner are
    flat arrays of ``size`` entries indexed the same way.
    """

    def __init__(self, capacity: int) -> None:
        self.buckets = max(1, -(-capacity // WAYS))
        self.size = self.buckets * WAYS
        self.rows = _table((self.buckets, WAYS), np.uint64)
        self.keys = self.rows.reshape(-1)  # flat view
        self.stamp = _table(self.size, np.uint32)
        self.evictions = 0
        self.version = 0  # bumped whenever a key is placed or cleared: a find taken before is stale
        self._op = 0

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.stamp.nbytes)

    def next_stamp(self) -> np.uint32:
        self._op += 1
        if self._op >= STAMP_LIMIT:
            self.stamp //= np.uint32(2)
            self._op //= 2
        return np.uint32(self._op)

    def bucket(self, keys: U64) -> Intp:
        # "fastrange" on the high 32 bits: uniform for hash-like keys, no modulo.
        return ((keys >> np.uint64(32)) * np.uint64(self.buckets) >> np.uint64(32)).astype(np.intp)

    def find(self, keys: U64) -> tuple[Intp, Bools]:
        """(flat slot, found) per key; the slot is meaningless where not found (its bucket's first)."""
        return self._find_few(keys) if len(keys) <= FEW_KEYS else self._find_many(keys)

    def insert(self, keys: U64, located: tuple[Intp, Bools] | None = None) -> tuple[Intp, Bools, Bools]:
        """Find or place each key: (flat slot, newly placed, present at all). A key given twice gets
        the same slot (placed once). ``located``: ``find(keys)`` taken since the last ``version`` change
        (``PreciseIndex.match``'s, reused by ``record``), so it is not done again.

        A new key takes an empty way of its bucket, else evicts the least recently used one. Ways
        found or placed in this same call are never victims; a key that finds no way left (more
        than ``WAYS`` new keys in one bucket in one call) is reported as not present.
        """
        self.version += 1
        return self._insert_few(keys) if len(keys) <= FEW_KEYS else self._insert_many(keys, located)

    def _find_many(self, keys: U64) -> tuple[Intp, Bools]:
        b = self.bucket(keys)
        flat = b * WAYS + (self.rows[b] == keys[:, None]).argmax(axis=1)
        return flat, self.keys.take(flat) == keys

    def _find_few(self, keys: U64) -> tuple[Intp, Bools]:
        """``find`` one key at a time on Python ints: what a decode step's one-block event costs."""
        flat, found = self._locate(keys.tolist())
        return np.array(flat, dtype=np.intp), np.array(found, dtype=bool)

    def _locate(self, keys: list[int]) -> tuple[list[int], list[bool]]:
        """``_find_few``'s slots and hits as lists (``bucket`` on each Python int)."""
        flat: list[int] = []
        found: list[bool] = []
        for k in keys:
            base = ((k >> 32) * self.buckets >> 32) * WAYS
            row = self.keys[base : base + WAYS].tolist()
            hit = k in row
            flat.append(base + row.index(k) if hit else base)
            found.append(hit)
        return flat, found

    def _insert_few(self, keys: U64) -> tuple[Intp, Bools, Bools]:
        """``insert`` one key at a time on Python ints, choosing the victims ``_insert_many`` chooses:
        the first empty way, else the first way with the oldest stamp not taken in this call."""
        places, new, present = self.insert_list(keys.tolist(), bump=False)
        return np.array(places, dtype=np.intp), np.array(new, dtype=bool), np.array(present, dtype=bool)

    def insert_list(self, keys: list[int], bump: bool = True) -> tuple[list[int], list[bool], list[bool]]:
        """``insert`` of a few keys (nonzero Python ints) answered as lists: no array made on either side
        (a decode step's one-block event). ``bump``: count the change (``insert`` has already)."""
        if bump:
            self.version += 1
        now = self.next_stamp()
        places, present = self._locate(keys)
        for i, hit in enumerate(present):
            if hit:
                self.stamp[places[i]] = now
        new = self._place(keys, places, present, now)
        return places, new, present

    def _place(self, keys: list[int], places: list[int], present: list[bool], now: np.uint32) -> list[bool]:
        """Place each key not ``present`` in its bucket (``places``: the bucket's first slot), one at a
        time on Python ints; ``places`` and ``present`` updated in place, what was placed returned."""
        stamp_now = int(now)
        new = [False] * len(places)
        placed: dict[int, int] = {}  # a key given twice is placed once
        for i, k in enumerate(keys):
            if present[i]:
                continue
            if k in placed:
                places[i] = placed[k]
                present[i] = True
                continue
            base = places[i]
            row = self.keys[base : base + WAYS].tolist()
            stamps = self.stamp[base : base + WAYS].tolist()
            prio = [-1 if key == 0 else BUSY if st == stamp_now else st for key, st in zip(row, stamps, strict=True)]
            way = prio.index(min(prio))
            if prio[way] >= BUSY:
                continue
            self.evictions += row[way] != 0
            self.keys[base + way] = k
            self.stamp[base + way] = now
            places[i] = placed[k] = base + way
            new[i] = present[i] = True
        return new

    def _insert_many(self, keys: U64, located: tuple[Intp, Bools] | None = None) -> tuple[Intp, Bools, Bools]:
        now = self.next_stamp()
        flat, found = self._find_many(keys) if located is None else (located[0].copy(), located[1])
        self.stamp[flat[found]] = now
        new = np.zeros(len(keys), dtype=bool)
        present = found.copy()
        pending = np.flatnonzero(~found)
        if pending.size <= FEW_KEYS:  # the usual record: a prompt's new tail, placed on Python ints
            if pending.size:
                sub_places, sub_present = (flat[pending] // WAYS * WAYS).tolist(), [False] * pending.size
                sub_new = self._place(keys[pending].tolist(), sub_places, sub_present, now)
                flat[pending], present[pending], new[pending] = sub_places, sub_present, sub_new
            return flat, new, present
        # A key given twice is placed once: only the first of equal new keys is placed, the others take
        # its slot afterwards (chained block keys never repeat; only the rest of the prompt is new).
        twins: tuple[Intp, Intp] | None = None
        _, firsts, inverse = np.unique(keys[pending], return_index=True, return_inverse=True)
        if firsts.size < pending.size:
            twins = (pending, pending[firsts][inverse])
            pending = pending[np.sort(firsts)]
        busy = np.int64(BUSY)
        ways = np.arange(WAYS)
        # One key per bucket per pass (the rest wait for the next pass, seeing this one's writes);
        # several new keys rarely share a bucket, so this is one or two passes.
        while pending.size:
            buckets, firsts = np.unique(flat[pending] // WAYS, return_index=True)
            cols = buckets[:, None] * WAYS + ways
            occupied = self.keys[cols] != 0
            stamps = self.stamp[cols].astype(np.int64)
            prio = np.where(occupied, np.where(stamps == int(now), busy, stamps), -1)
            victims = prio.argmin(axis=1)
            rows = np.arange(len(buckets))
            usable = prio[rows, victims] < busy
            keys_idx = pending[firsts[usable]]
            slots = cols[rows[usable], victims[usable]]
            self.evictions += int(occupied[rows[usable], victims[usable]].sum())
            self.keys[slots] = keys[keys_idx]
            self.stamp[slots] = now
            flat[keys_idx] = slots
            new[keys_idx] = True
            present[keys_idx] = True
            rest = np.ones(pending.size, dtype=bool)
            rest[firsts] = False
            pending = pending[rest]
        if twins is not None:
            every, first = twins
            flat[every] = flat[first]
            present[every] = present[first]
        return flat, new, present


class PreciseIndex:
    """PrefixIndex fed by vLLM KV events (``apply_batch``) plus speculative ``record`` entries."""

    def __init__(
        self,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        *,
        engine_map_capacity: int | None = None,
        speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
        media: frozenset[str] = DEFAULT_MEDIA,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self.media = media
        self._clock = clock
        self._t0 = clock()
        self._blocks = _AssocTable(capacity_blocks)
        n = self._blocks.size
        self._mask = _table(n, np.uint64)  # pods holding the block (confirmed)
        self._spec = _table(n, np.uint64)  # pods expected to hold it
        self._spec_until = _table(n, np.uint32)  # ticks
        self._spec_horizon = 0  # latest deadline ever set: past it, no speculation is live
        self._engine = _AssocTable(engine_map_capacity or capacity_blocks)
        self._engine_own = _table(self._engine.size, np.uint64)
        self._engine_pod = _table(self._engine.size, np.uint8)
        self._slot_of: dict[EndpointId, int] = {}
        self._names: dict[int, EndpointId] = {}
        self._free_slots = list(range(MAX_ENDPOINTS - 1, -1, -1))
        self.block_size_of: dict[EndpointId, int] = {}  # as the pod reports it in BlockStored
        self._ends = PromptEnds()
        # match's finds, for record: (keys, table version, finds, the pods holding every key)
        self._seen: tuple[object, int, list[tuple[U64, Intp, Bools]], int] | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "blocks_stored",
                "blocks_removed",
                "removed_unknown",
                "unknown_parent",
                "skipped_extra_keys",
                "malformed",
                "other_media",
                "clears",
                "endpoint_overflow",
                "block_size_changes",
            ),
            0,
        )

    # -- PrefixIndex -------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        """Leading blocks per endpoint. ``keys`` may also be a uint64 numpy array (saves the
        list conversion, ~40 ns a key)."""
        cand = 0
        for ep in endpoints:
            slot = self._slot_of.get(ep)
            if slot is not None:
                cand |= 1 << slot
        n = len(keys)
        if not cand or not n:
            return {}
        if n <= FEW_KEYS:
            return self._match_few(keys, cand)
        now = self._now()
        spec_live = now < self._spec_horizon
        stamp = self._blocks.next_stamp()
        counts: dict[int, int] = {}
        running = cand
        start, chunk = 0, MATCH_FIRST_CHUNK
        seen: list[tuple[U64, Intp, Bools]] = []
        while start < n and running:
            arr = _as_keys(keys[start : start + chunk])
            flat, found = self._blocks.find(arr)
            seen.append((arr, flat, found))
            held = self._mask.take(flat)
            if spec_live:
                live = self._spec_until.take(flat) > now
                held |= np.where(live, self._spec.take(flat), np.uint64(0))
            held[~found] = 0
            held[0] &= np.uint64(running)
            acc = np.bitwise_and.accumulate(held)
            self._blocks.stamp[flat[acc != 0]] = stamp
            ends = np.flatnonzero(acc[:-1] != acc[1:]).tolist()
            prev = running
            for i in [-1, *ends]:  # -1: what the chunk's first key already lost
                cur = int(acc[i + 1])
                for slot in _bits(prev & ~cur):
                    counts[slot] = start + i + 1
                prev = cur
            running = int(acc[-1])
            start += len(arr)
            chunk *= MATCH_CHUNK_GROWTH
        self._seen = (keys, self._blocks.version, seen, running)
        for slot in _bits(running):
            counts[slot] = n
        return {self._names[s]: c for s, c in counts.items() if c > 0}

    def _match_few(self, keys: Sequence[int] | U64, cand: int) -> dict[EndpointId, int]:
        """``match`` of up to ``FEW_KEYS`` keys on Python ints (a new prompt's probe, a short prompt): the
        same counts, stamps and ``_seen`` as the numpy path, without its per-call cost."""
        now = self._now()
        spec_live = now < self._spec_horizon
        stamp = self._blocks.next_stamp()
        ks = _as_ints(keys)
        flat, found = self._blocks._locate(ks)
        mask, spec, until, stamps = self._mask, self._spec, self._spec_until, self._blocks.stamp
        counts: dict[int, int] = {}
        running = cand
        for i, (f, hit) in enumerate(zip(flat, found, strict=True)):
            held = 0
            if hit:
                held = int(mask[f])
                if spec_live and int(until[f]) > now:
                    held |= int(spec[f])
            cur = running & held
            for slot in _bits(running & ~cur):
                counts[slot] = i
            running = cur
            if not running:
                break
            stamps[f] = stamp
        self._seen = (keys, self._blocks.version, [], running)
        for slot in _bits(running):
            counts[slot] = len(ks)
        return {self._names[s]: c for s, c in counts.items() if c > 0}

    def continues(self, keys: Sequence[int], held: int) -> bool:
        return self._ends.continues(keys, held)

    def record(self, keys: Sequence[int], endpoint: EndpointId, ended: bool = True) -> None:
        if ended:
            self._ends.note(keys)
        slot = self._slot(endpoint)
        if slot is None or not len(keys):
            return
        seen = self._seen
        if seen is not None and seen[0] is keys and seen[1] == self._blocks.version and seen[3] >> slot & 1:
            # The match just made found every block held there (confirmed, or expected until its deadline)
            # and stamped them: nothing to add (a conversation's next turn decided on its history).
            self._seen = None
            return
        now = self._now()
        until = now + max(1, round(self.speculative_ttl_s / TICK_S))
        self._spec_horizon = max(self._spec_horizon, until)
        if len(keys) <= FEW_KEYS:
            self._seen = None
            self._record_few(keys, 1 << slot, now, until)
            return
        bit = np.uint64(1 << slot)
        flat, new, present = self._blocks.insert(*self._located(keys))
        self._reset(flat[new])
        flat = flat[present]
        spec = np.where(self._spec_until[flat] > now, self._spec[flat], np.uint64(0))
        held = (self._mask[flat] & bit) != 0
        self._spec[flat] = np.where(held, spec, spec | bit)
        self._spec_until[flat] = until

    def _record_few(self, keys: Sequence[int] | U64, bit: int, now: int, until: int) -> None:
        """``record``'s expectations for up to ``FEW_KEYS`` keys on Python ints, to the same end state."""
        ks = _as_ints(keys)
        places, new, present = self._blocks.insert_list(ks)
        mask, spec, spec_until = self._mask, self._spec, self._spec_until
        for f, placed, here in zip(places, new, present, strict=True):
            if placed:  # a slot taken over: what it said of the key evicted goes
                mask[f] = spec[f] = spec_until[f] = 0
            if not here:
                continue
            expected = int(spec[f]) if int(spec_until[f]) > now else 0
            spec[f] = expected if int(mask[f]) & bit else expected | bit
            spec_until[f] = until

    def _located(self, keys: Sequence[int] | U64) -> tuple[U64, tuple[Intp, Bools] | None]:
        """``keys`` as uint64, with the table's slots for them when the last ``match`` looked them up
        (the same object) and nothing was placed or cleared since: a decision records the keys it has
        just matched, and that find was a fifth of a precise decision. The keys past where the match
        stopped are looked up here."""
        seen = self._seen
        self._seen = None
        if seen is None or seen[0] is not keys or seen[1] != self._blocks.version or len(keys) <= FEW_KEYS:
            return _as_keys(keys), None
        arrs, flats, founds = (list(x) for x in zip(*seen[2], strict=True)) if seen[2] else ([], [], [])
        done = sum(map(len, arrs))
        if done < len(keys):
            tail = _as_keys(keys[done:])
            flat, found = self._blocks.find(tail)
            arrs.append(tail)
            flats.append(flat)
            founds.append(found)
        if len(arrs) == 1:
            return arrs[0], (flats[0], founds[0])
        return np.concatenate(arrs), (np.concatenate(flats), np.concatenate(founds))

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        self.clear_endpoint(endpoint)
        slot = self._slot_of.pop(endpoint, None)
        if slot is not None:
            del self._names[slot]
            self._free_slots.append(slot)
        self.block_size_of.pop(endpoint, None)

    # -- KVEventSink -------------------------------------------------------------------------------
    def apply_batch(self, endpoint: EndpointId, batch: EventBatch) -> None:
        for ev in batch.events:
            self.apply(endpoint, ev)

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        """Forget every block of ``endpoint`` (restart, resync, AllBlocksCleared); keep its slot.

        Scans the whole table (tens of ms at 10M blocks): for rare events only."""
        slot = self._slot_of.get(endpoint)
        if slot is None:
            return
        self.counters["clears"] += 1
        keep = ~np.uint64(1 << slot)
        np.bitwise_and(self._mask, keep, out=self._mask)
        np.bitwise_and(self._spec, keep, out=self._spec)
        self._blocks.keys[(self._mask == 0) & (self._spec == 0)] = 0
        self._blocks.version += 1
        self._engine.keys[self._engine_pod == slot] = 0

    def apply(self, endpoint: EndpointId, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._stored(endpoint, event)
        elif isinstance(event, BlockRemoved):
            self._removed(endpoint, event)
        elif isinstance(event, AllBlocksCleared):
            self.clear_endpoint(endpoint)

    def bulk_load(self, endpoint: EndpointId, own_keys: U64, engine_hashes: U64) -> None:
        """Mark blocks as held by ``endpoint`` from precomputed own keys and their engine hashes
        (a snapshot restore, or a benchmark fill); the same effect as BlockStored events."""
        slot = self._slot(endpoint)
        if slot is not None and len(own_keys):
            self._confirm(slot, _as_keys(own_keys), np.asarray(engine_hashes, dtype=np.uint64))

    # -- observability -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters plus occupancy (occupancy scans the tables: call it at scrape rate, not per request)."""
        return {
            **self.counters,
            "endpoints": len(self._slot_of),
            "blocks": int(np.count_nonzero(self._blocks.keys)),
            "engine_entries": int(np.count_nonzero(self._engine.keys)),
            "block_evictions": self._blocks.evictions,
            "engine_evictions": self._engine.evictions,
            "memory_bytes": self.memory_bytes(),
        }

    def block_counts(self) -> dict[EndpointId, int]:
        """Confirmed blocks per endpoint (scans the table: for admin calls, not per request)."""
        return {ep: int(np.count_nonzero(self._mask & np.uint64(1 << slot))) for ep, slot in self._slot_of.items()}

    def memory_bytes(self) -> int:
        arrays = (self._mask, self._spec, self._spec_until, self._engine_own, self._engine_pod)
        return self._blocks.nbytes + self._engine.nbytes + sum(int(a.nbytes) for a in arrays)

    # -- internals ---------------------------------------------------------------------------------
    def _now(self) -> int:
        return int((self._clock() - self._t0) / TICK_S) + 1

    def _slot(self, endpoint: EndpointId) -> int | None:
        slot = self._slot_of.get(endpoint)
        if slot is None:
            if not self._free_slots:
                self.counters["endpoint_overflow"] += 1
                return None
            slot = self._slot_of[endpoint] = self._free_slots.pop()
            self._names[slot] = endpoint
        return slot

    def _reset(self, flat: Intp) -> None:
        self._mask[flat] = 0
        self._spec[flat] = 0
        self._spec_until[flat] = 0

    def _stored(self, endpoint: EndpointId, ev: BlockStored) -> None:
        if ev.medium is not None and ev.medium not in self.media:
            self.counters["other_media"] += 1
            return
        n, bs = len(ev.block_hashes), ev.block_size
        if not n or len(ev.token_ids) != n * bs or (ev.extra_keys is not None and len(ev.extra_keys) != n):
            self.counters["malformed"] += 1
            return
        slot = self._slot(endpoint)
        if slot is None:
            return
        if self.block_size_of.setdefault(endpoint, bs) != bs:
            self.counters["block_size_changes"] += 1
            self.block_size_of[endpoint] = bs
        if ev.parent_block_hash is None:
            salt = _root_salt(ev.extra_keys[0] if ev.extra_keys else None, ev.lora_name)
            if salt is None:
                self.counters["skipped_extra_keys"] += n
                return
            parent = precise_seed(salt, ev.lora_name)
        else:
            parent_own = self._engine_lookup(slot, ev.parent_block_hash)
            if parent_own is None:
                self.counters["unknown_parent"] += 1
                return
            parent = parent_own
        tokens = ev.token_ids
        keyable = n  # blocks keyable by their tokens: up to the first with extra keys beyond the LoRA name
        if ev.extra_keys is not None:
            keyable = next((i for i in range(1, n) if not _plain_extra(ev.extra_keys[i], ev.lora_name)), n)
            self.counters["skipped_extra_keys"] += n - keyable
        # The request side's chain over the same tokens (one conversion, memoised groups of blocks).
        owns = hashing.chain_tokens(parent, tokens, bs, keyable)
        if len(owns) <= FEW_KEYS:
            self._confirm_few(slot, owns, ev.block_hashes)
        else:
            self._confirm(slot, _as_keys(owns), np.asarray(ev.block_hashes[: len(owns)], dtype=np.uint64))

    def _confirm(self, slot: int, own_keys: U64, engine_hashes: U64) -> None:
        self.counters["blocks_stored"] += len(own_keys)
        bit = np.uint64(1 << slot)
        uniq, first = np.unique(own_keys, return_index=True)
        flat, new, present = self._blocks.insert(uniq)
        self._reset(flat[new])
        flat = flat[present]
        self._mask[flat] |= bit
        self._spec[flat] &= ~bit  # confirmed: no longer merely expected
        flat, _, present = self._engine.insert(_mix(engine_hashes[first], _pod_salt(slot)))
        self._engine_own[flat[present]] = uniq[present]
        self._engine_pod[flat[present]] = slot

    def _confirm_few(self, slot: int, owns: list[int], engine_hashes: Sequence[int]) -> None:
        """``_confirm`` of a few blocks (``FEW_KEYS``: a decode step's one-block event, the most frequent
        batch a serving pod publishes) on Python ints, to the same end state: keys in sorted order as
        ``np.unique`` gives them, each block's first engine hash."""
        if not owns:
            return
        self.counters["blocks_stored"] += len(owns)
        first: dict[int, int] = {}
        for i, k in enumerate(owns):
            first.setdefault(k or 1, i)  # (0 is the empty-slot marker: folded onto 1, as _as_keys does)
        uniq = sorted(first)
        places, new, present = self._blocks.insert_list(uniq)
        bit = 1 << slot
        keep = _U64_MASK ^ bit
        mask, spec, until = self._mask, self._spec, self._spec_until
        for place, fresh, ok in zip(places, new, present, strict=True):
            if not ok:
                continue
            if fresh:
                mask[place] = bit
                spec[place] = 0
                until[place] = 0
            else:
                mask[place] = int(mask[place]) | bit
                spec[place] = int(spec[place]) & keep  # confirmed: no longer merely expected
        salt = _pod_salt(slot)
        mixed = [_mix_one(int(engine_hashes[first[k]]), salt) for k in uniq]
        places, _, present = self._engine.insert_list(mixed)
        for place, ok, k in zip(places, present, uniq, strict=True):
            if ok:
                self._engine_own[place] = k
                self._engine_pod[place] = slot

    def _engine_find(self, slot: int, hashes: Sequence[int]) -> tuple[Intp, Bools]:
        flat, found = self._engine.find(_mix(np.asarray(hashes, dtype=np.uint64), _pod_salt(slot)))
        return flat, found & (self._engine_pod.take(flat) == slot)

    def _engine_lookup(self, slot: int, engine_hash: int) -> int | None:
        """The own key of one of ``slot``'s engine hashes (a stored event's parent), on Python ints."""
        (place,), (found,) = self._engine._locate([_mix_one(engine_hash & _U64_MASK, _pod_salt(slot))])
        return int(self._engine_own[place]) if found and self._engine_pod[place] == slot else None

    def _removed(self, endpoint: EndpointId, ev: BlockRemoved) -> None:
        if ev.medium is not None and ev.medium not in self.media:
            self.counters["other_media"] += 1
            return
        slot = self._slot_of.get(endpoint)
        if slot is None or not ev.block_hashes:
            return
        eflat, efound = self._engine_find(slot, ev.block_hashes)
        eflat = eflat[efound]
        owns = self._engine_own[eflat]
        self._engine.keys[eflat] = 0
        self.counters["blocks_removed"] += len(owns)
        self.counters["removed_unknown"] += len(ev.block_hashes) - len(owns)
        if not len(owns):
            return
        flat, found = self._blocks.find(owns)
        flat = flat[found]
        self._mask[flat] &= ~np.uint64(1 << slot)
        self._blocks.keys[flat[(self._mask[flat] == 0) & (self._spec[flat] == 0)]] = 0
        self._blocks.version += 1


def _root_salt(extra: tuple[object, ...] | None, lora_name: str | None) -> str | None:
    """cache_salt of a root block ("" if none); None if the block has keys we cannot reproduce.

    vLLM builds a block's extra keys as lora_name?, multimodal (hash, offset)*, cache_salt (root
    block only), prompt-embedding digest?.
    """
    items = list(extra or ())
    if lora_name and items and items[0] == lora_name:
        items.pop(0)
    if not items:
        return ""
    if len(items) == 1 and isinstance(items[0], str):
        return items[0]
    return None


def _plain_extra(extra: tuple[object, ...] | None, lora_name: str | None) -> bool:
    """A non-root block is keyable by tokens if its extra keys are at most the LoRA name."""
    return not extra or (len(extra) == 1 and lora_name is not None and extra[0] == lora_name)
