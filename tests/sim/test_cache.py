"""Prefix cache semantics (vLLM block pool rules) and its memory bound."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from bench.sim.cache import PrefixCache, _HashIndex, block_hashes


def fill(cache: PrefixCache, tokens: list[int], salt: str | None = None) -> list[int]:
    """Run one request's prompt into the cache like the engine does; returns its slots (pinned)."""
    hashes = block_hashes(tokens, cache.block_size, salt)
    hit = cache.longest_hit(hashes, len(tokens))
    slots = cache.acquire(hashes[:hit])
    need = -(-len(tokens) // cache.block_size) - hit
    new = cache.allocate(need, [])
    assert new is not None
    slots += new
    for b in range(hit, len(hashes)):
        cache.commit(slots[b], hashes[b])
    return slots


def test_only_full_blocks_are_hashed_and_chained() -> None:
    toks = list(range(40))
    hs = block_hashes(toks, 16)
    assert len(hs) == 2
    # Chained: the second block's hash depends on the first block's tokens.
    other = block_hashes([99, *toks[1:]], 16)
    assert other[1] != hs[1]
    # Incremental hashing from a parent equals hashing from scratch.
    assert block_hashes(toks, 16, start=1, parent=hs[0]) == hs[1:]


def test_hit_never_covers_the_last_prompt_token() -> None:
    c = PrefixCache(64, 16)
    c.release(fill(c, list(range(48))))
    hs = block_hashes(list(range(48)), 16)
    # Whole 48-token prompt cached, but the last token must be recomputed: only 2 blocks hit.
    assert c.longest_hit(hs, 48) == 2
    # One more token and all three blocks count.
    assert c.longest_hit(block_hashes(list(range(49)), 16), 49) == 3
    # A different suffix still hits the shared prefix.
    assert c.longest_hit(block_hashes([*range(32), *range(100, 120)], 16), 52) == 2


def test_cache_salt_isolates_tenants() -> None:
    c = PrefixCache(64, 16)
    toks = list(range(64))
    c.release(fill(c, toks, salt="tenant-a"))
    assert c.longest_hit(block_hashes(toks, 16, "tenant-a"), 65) == 4
    assert c.longest_hit(block_hashes(toks, 16, "tenant-b"), 65) == 0
    assert c.longest_hit(block_hashes(toks, 16), 65) == 0


def test_lru_eviction_frees_oldest_and_tail_first() -> None:
    c = PrefixCache(4, 4)
    a = fill(c, [1] * 8)  # 2 blocks
    b = fill(c, [2] * 8)
    ha, hb = block_hashes([1] * 8, 4), block_hashes([2] * 8, 4)
    c.release(a)
    c.release(b)
    assert c.num_free == 4 and c.usage == 0.0
    evicted: list[int] = []
    assert c.allocate(1, evicted) is not None
    # a was freed first; within a, its tail block goes first.
    assert evicted == [ha[1]]
    assert c.allocate(2, evicted) is not None
    assert evicted == [ha[1], ha[0], hb[1]]
    assert c.contains(hb[0]) and not c.contains(ha[0])


def test_reuse_refreshes_lru_position() -> None:
    c = PrefixCache(5, 4)
    a, b = fill(c, [1] * 8), fill(c, [2] * 8)
    c.release(a)
    c.release(b)
    c.release(fill(c, [1] * 9))  # touches a's blocks: now most recently freed
    evicted: list[int] = []
    c.allocate(3, evicted)  # the unused partial block first, then b's two
    assert set(evicted) == set(block_hashes([2] * 8, 4))


def test_pinned_blocks_are_never_evicted() -> None:
    c = PrefixCache(4, 4)
    a = fill(c, [1] * 8)
    b = fill(c, [2] * 8)
    assert c.usage == 1.0
    assert c.allocate(1, []) is None  # all pinned
    c.release(b)
    assert c.allocate(3, []) is None  # only 2 free
    evicted: list[int] = []
    assert c.allocate(2, evicted) is not None
    assert set(evicted) == set(block_hashes([2] * 8, 4))
    assert all(c.contains(h) for h in block_hashes([1] * 8, 4))
    c.release(a)


def test_shared_blocks_are_ref_counted() -> None:
    c = PrefixCache(8, 4)
    a = fill(c, [1] * 9)
    b = fill(c, [1] * 9)  # shares a's two full blocks
    assert a[:2] == b[:2] and c.pinned == 4
    c.release(a)
    assert c.pinned == 3  # shared blocks still held by b
    c.release(b)
    assert c.pinned == 0 and c.num_cached == 2


def test_duplicate_commit_is_not_indexed() -> None:
    c = PrefixCache(8, 4)
    s1, s2 = c.allocate(1, []), c.allocate(1, [])
    assert s1 and s2
    assert c.commit(s1[0], 42)
    assert not c.commit(s2[0], 42)
    c.release(s2)
    assert c.num_free == 7  # the duplicate went back to the unused pool


def test_clear_forgets_everything() -> None:
    c = PrefixCache(8, 4)
    fill(c, [1] * 8)
    c.clear()
    assert c.num_cached == 0 and c.num_free == 8 and c.pinned == 0


def test_hash_index_matches_a_dict() -> None:
    rng = random.Random(1)
    idx = _HashIndex(300)
    model: dict[int, int] = {}
    keys = [rng.getrandbits(64) for _ in range(400)]
    for step in range(6000):
        k = rng.choice(keys)
        if rng.random() < 0.5 and len(model) < 300:
            idx.put(k, step)
            model[k] = step
        else:
            idx.delete(k)
            model.pop(k, None)
        if step % 500 == 0:
            assert all(idx.get(x) == model.get(x, -1) for x in keys)
    assert idx.size == len(model)
    assert all(idx.get(x) == model.get(x, -1) for x in keys)


def test_bookkeeping_fits_64_bytes_per_block() -> None:
    n = 100_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        c = PrefixCache(n, 16)
        slots = c.allocate(n, [])
        assert slots is not None
        for i, s in enumerate(slots):
            c.commit(s, (i * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        c.release(slots)
        del slots
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert c.num_cached == n
    assert used / n <= 64, f"{used / n:.1f} bytes per block"


@pytest.mark.parametrize("bad", [(0, 16), (16, 0)])
def test_rejects_bad_sizes(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        PrefixCache(*bad)
