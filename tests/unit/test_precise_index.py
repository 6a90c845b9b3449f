"""PreciseIndex: keys identical to the request side, event semantics, speculation, bounds."""

from __future__ import annotations

import random

import pytest

from extproc import hashing
from extproc.index.base import PrefixIndex
from extproc.index.precise import MAX_ENDPOINTS, PreciseIndex, precise_seed
from extproc.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

BS = 16
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def request_keys(tokens: list[int], salt: str | None = None, max_blocks: int = 1024) -> list[int]:
    """Exactly what the request side computes."""
    return hashing.chain_tokens(hashing.seed_key(salt or ""), tokens, BS, max_blocks)


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium="GPU", **kw)  # type: ignore[arg-type]


def test_is_a_prefix_index() -> None:
    idx: PrefixIndex = PreciseIndex(1000)
    assert idx.match([1, 2], [A]) == {}


def test_event_keys_equal_request_side_keys_across_split_events() -> None:
    """A prompt stored in two events (the second chained through the engine parent hash) matches
    the request side's chain_tokens keys block for block, with and without a cache_salt."""
    rng = random.Random(7)
    tokens = [rng.randrange(150_000) for _ in range(BS * 6 + 5)]  # partial last block never cached
    for salt in (None, "tenant-42"):
        idx = PreciseIndex(10_000)
        extra = ((salt,), None, None) if salt else None
        idx.apply(A, stored([901, 902, 903], None, tokens[: 3 * BS], extra_keys=extra))
        idx.apply(A, stored([904, 905, 906], 903, tokens[3 * BS : 6 * BS]))
        keys = request_keys(tokens, salt)
        assert precise_seed(salt) == hashing.seed_key(salt or "")
        assert len(keys) == 6
        assert idx.match(keys, [A, B]) == {A: 6}
        assert idx.match(keys[:4], [A]) == {A: 4}
        other_salt = request_keys(tokens, "someone-else")
        assert idx.match(other_salt, [A]) == {}
        # a prompt diverging in block 3 matches 2 blocks
        forked = tokens[: 2 * BS] + [t + 1 for t in tokens[2 * BS :]]
        assert idx.match(request_keys(forked, salt), [A]) == {A: 2}


def test_match_counts_leading_blocks_per_endpoint_and_ignores_non_candidates() -> None:
    idx = PreciseIndex(10_000)
    tokens = list(range(BS * 8))
    keys = request_keys(tokens)
    idx.apply(A, stored(list(range(1, 9)), None, tokens))  # all 8
    idx.apply(B, stored([21, 22, 23], None, tokens[: 3 * BS]))  # 3
    idx.apply(C, stored([31, 32, 33, 34, 35], None, tokens[: 5 * BS]))
    idx.apply(C, BlockRemoved((32,), "GPU"))  # a hole at block 1: only block 0 leads
    assert idx.match(keys, [A, B, C]) == {A: 8, B: 3, C: 1}
    assert idx.match(keys, [B]) == {B: 3}
    assert idx.match(keys, ["10.9.9.9:1"]) == {}
    assert idx.match([12345, *keys], [A]) == {}  # the first block missing: nothing leads
    # long prefixes cross match chunks
    long_tokens = list(range(5, 5 + BS * 700))
    idx.apply(B, stored(list(range(1000, 1700)), None, long_tokens))
    assert idx.match(request_keys(long_tokens), [A, B]) == {B: 700}


def test_unknown_parent_is_skipped_and_counted() -> None:
    idx = PreciseIndex(1000)
    idx.apply(A, stored([5, 6], 999, list(range(2 * BS))))
    assert idx.counters["unknown_parent"] == 1 and idx.counters["blocks_stored"] == 0


def test_removed_and_all_cleared_and_remove_endpoint() -> None:
    idx = PreciseIndex(1000)
    tokens = list(range(BS * 3))
    keys = request_keys(tokens)
    for ep in (A, B):
        idx.apply(ep, stored([1, 2, 3], None, tokens))  # same engine hashes on both pods
    idx.apply(A, BlockRemoved((3,), "GPU"))
    assert idx.match(keys, [A, B]) == {A: 2, B: 3}
    idx.apply_batch(B, EventBatch(0.0, (AllBlocksCleared(),)))
    assert idx.match(keys, [A, B]) == {A: 2}
    # B's engine map is gone too: a child of B's old block cannot be keyed
    idx.apply(B, stored([4], 3, list(range(BS))))
    assert idx.counters["unknown_parent"] == 1
    idx.remove_endpoint(A)
    assert idx.match(keys, [A, B]) == {}
    assert idx.stats()["blocks"] == 0 and idx.stats()["engine_entries"] == 0


def test_other_media_and_mm_extra_keys_are_not_indexed() -> None:
    idx = PreciseIndex(1000)
    tokens = list(range(BS * 2))
    idx.apply(A, BlockStored((1, 2), None, tuple(tokens), BS, medium="CPU"))
    assert idx.counters["other_media"] == 1
    mm = ((("img-hash", 3),), (("img-hash", -13),))
    idx.apply(A, stored([1, 2], None, tokens, extra_keys=mm))
    assert idx.match(request_keys(tokens), [A]) == {}
    assert idx.counters["skipped_extra_keys"] == 2


def test_an_event_is_keyed_up_to_its_first_block_with_keys_the_tokens_do_not_carry() -> None:
    """A multimodal block inside an event: the blocks before it are indexed (keys chained as the request
    side chains them, the root salted), it and the rest are skipped, and its children cannot be keyed."""
    idx = PreciseIndex(1000)
    tokens = list(range(100, 100 + BS * 4))
    extra = (("tenant-a",), None, (("img-hash", 0),), None)
    idx.apply(A, stored([11, 12, 13, 14], None, tokens, extra_keys=extra))
    assert idx.counters["skipped_extra_keys"] == 2 and idx.counters["blocks_stored"] == 2
    assert idx.match(request_keys(tokens, salt="tenant-a"), [A]) == {A: 2}
    assert idx.match(request_keys(tokens), [A]) == {}  # unsalted: another chain
    idx.apply(A, stored([15], 14, list(range(BS))))
    assert idx.counters["unknown_parent"] == 1


def test_lora_blocks_are_scoped_by_adapter() -> None:
    idx = PreciseIndex(1000)
    tokens = list(range(BS * 2))
    idx.apply(A, stored([1, 2], None, tokens, lora_name="sql", extra_keys=(("sql",), ("sql",))))
    assert idx.match(request_keys(tokens), [A]) == {}
    lora_keys = hashing.chain_tokens(precise_seed(None, "sql"), tokens, BS, 10)
    assert idx.match(lora_keys, [A]) == {A: 2}


def test_speculative_record_counts_until_ttl_or_confirmation() -> None:
    clock = FakeClock()
    idx = PreciseIndex(1000, speculative_ttl_s=2.0, clock=clock)
    tokens = list(range(BS * 4))
    keys = request_keys(tokens)
    idx.record(keys, B)
    assert idx.match(keys, [A, B]) == {B: 4}
    clock.t += 1.0
    idx.apply(B, stored([1, 2], None, tokens[: 2 * BS]))  # confirms two blocks
    clock.t += 1.5  # past the TTL: the unconfirmed blocks no longer count
    assert idx.match(keys, [B]) == {B: 2}
    idx.record(keys, A)
    clock.t += 0.5
    assert idx.match(keys, [A, B]) == {A: 4, B: 2}


def test_a_record_the_last_match_found_all_held_adds_nothing() -> None:
    """A decision records the keys it matched on its pick: where that pod holds every block (a
    conversation's next turn on its history), the record is skipped; its expectations keep their
    deadlines. Held in part, or not matched just before (another key list, or the table changed since),
    the record is made as ever."""
    clock = FakeClock()
    idx = PreciseIndex(1000, speculative_ttl_s=2.0, clock=clock)
    tokens = list(range(BS * 4))
    keys = request_keys(tokens)
    idx.record(keys, B)
    clock.t += 1.5
    assert idx.match(keys, [A, B]) == {B: 4}
    before = (idx._spec.copy(), idx._spec_until.copy(), idx._blocks.version)
    idx.record(keys, B)  # B holds all four (expected): nothing to add
    assert (idx._spec == before[0]).all() and (idx._spec_until == before[1]).all()
    assert idx._blocks.version == before[2]
    clock.t += 1.0  # past the first record's deadline, which the skipped one did not move
    assert idx.match(keys, [A, B]) == {}
    idx.record(keys, B)  # not held now: recorded
    assert idx.match(keys, [A, B]) == {B: 4}
    longer = request_keys(list(range(BS * 6)))
    assert idx.match(longer, [A, B]) == {B: 4}
    idx.record(longer, B)  # held in part: the two new blocks recorded
    assert idx.match(longer, [A, B]) == {B: 6}
    idx.match(keys, [A, B])
    idx.apply(A, stored([1], None, tokens[:BS]))  # the table changes between the match and the record
    idx.record(keys, A)
    assert idx.match(keys, [A]) == {A: 4}


def test_capacity_is_bounded_with_lru_eviction() -> None:
    idx = PreciseIndex(256)
    hot_tokens = list(range(BS * 4))
    hot = request_keys(hot_tokens)
    idx.apply(A, stored([1, 2, 3, 4], None, hot_tokens))
    rng = random.Random(3)
    for i in range(200):
        tokens = [rng.randrange(1 << 20) for _ in range(BS * 4)]
        idx.apply(A, stored([10_000 + 4 * i + j for j in range(4)], None, tokens))
        assert idx.match(hot, [A]) == {A: 4}  # touched by every match: stays
    stats = idx.stats()
    assert stats["blocks"] <= 256 and stats["block_evictions"] > 0


def test_endpoint_slots_are_bounded_and_reused() -> None:
    idx = PreciseIndex(1000)
    eps = [f"10.1.0.{i}:8000" for i in range(MAX_ENDPOINTS + 1)]
    for ep in eps:
        idx.record([1], ep)
    assert idx.counters["endpoint_overflow"] == 1
    idx.remove_endpoint(eps[0])
    idx.record([1], eps[-1])
    assert set(idx.match([1], eps)) == set(eps[1:])


def test_a_few_keys_on_python_ints_do_what_the_vector_path_does() -> None:
    """Inserts and finds of up to FEW_KEYS keys (a decode step's one-block events) run on Python ints;
    on the same operations a table driven by the numpy path ends in the same state, with the same
    answers: the same slots, the same victims (empty way first, then the oldest stamp, never a way
    this call found or placed), the same keys left out of a full bucket, the same eviction count."""
    import numpy as np

    from extproc.index.precise import FEW_KEYS, WAYS, _AssocTable, _mix

    rng = random.Random(7)
    few, many = _AssocTable(4 * WAYS), _AssocTable(4 * WAYS)  # 4 buckets: evictions and full buckets
    pool = [rng.getrandbits(64) | 1 for _ in range(60)]
    for step in range(400):
        keys = np.array(rng.sample(pool, rng.randint(1, FEW_KEYS)), dtype=np.uint64)
        if step % 3 == 0:
            (fa, ok_a), (fb, ok_b) = few._find_few(keys), many._find_many(keys)
            assert (ok_a == ok_b).all() and (fa[ok_a] == fb[ok_b]).all(), step
        else:
            (fa, na, pa), (fb, nb, pb) = few._insert_few(keys), many._insert_many(keys)
            assert (na == nb).all() and (pa == pb).all() and (fa[pa] == fb[pb]).all(), step
        assert (few.keys == many.keys).all() and (few.stamp == many.stamp).all(), step
        assert few.evictions == many.evictions, step
    assert few.evictions > 50
    # More new keys than FEW_KEYS in one call: the numpy placement, against the same on Python ints.
    for step in range(200):
        keys = np.array(rng.sample(pool, rng.randint(FEW_KEYS + 1, 3 * FEW_KEYS)), dtype=np.uint64)
        (fa, na, pa), (fb, nb, pb) = few._insert_few(keys), many._insert_many(keys)
        assert (na == nb).all() and (pa == pb).all() and (fa[pa] == fb[pb]).all(), step
        assert (few.keys == many.keys).all() and (few.stamp == many.stamp).all(), step
        assert few.evictions == many.evictions, step
    # Nine new keys for one bucket in one call: the ninth finds every way taken by this same call.
    keys = np.array([rng.getrandbits(64) | 1 for _ in range(WAYS + 1)], dtype=np.uint64)
    for insert in (_AssocTable(WAYS)._insert_few, _AssocTable(WAYS)._insert_many):
        _, new, present = insert(keys)
        assert new[:WAYS].all() and present[:WAYS].all() and not present[WAYS]
    # The splitmix finaliser on Python ints (a few values) and on numpy (more than FEW_KEYS).
    values = np.array([0, 1, 2**64 - 1, *pool[: 2 * FEW_KEYS]], dtype=np.uint64)
    apart = np.concatenate([_mix(values[i : i + 3], 12345) for i in range(0, len(values), 3)])
    assert (_mix(values, 12345) == apart).all() and 0 not in apart


def test_keys_given_twice_take_one_slot_on_both_paths() -> None:
    """insert places a key given twice once and answers the same slot for both (record no longer sorts
    its keys unique first); the Python-int and numpy paths agree on it."""
    import numpy as np

    from extproc.index.precise import FEW_KEYS, WAYS, _AssocTable

    rng = random.Random(11)
    few, many = _AssocTable(4 * WAYS), _AssocTable(4 * WAYS)
    pool = [rng.getrandbits(64) | 1 for _ in range(40)]
    for step in range(300):
        keys = np.array(rng.choices(pool, k=rng.randint(2, 3 * FEW_KEYS)), dtype=np.uint64)
        (fa, na, pa), (fb, nb, pb) = few._insert_few(keys), many._insert_many(keys)
        assert (na == nb).all() and (pa == pb).all() and (fa[pa] == fb[pb]).all(), step
        for flat, present in ((fa, pa), (fb, pb)):
            for k in set(keys[present].tolist()):
                assert len(set(flat[present][keys[present] == k].tolist())) == 1, step  # one slot per key
        for table in (few, many):
            held = table.keys[table.keys != 0]
            assert len(held) == len(np.unique(held)), step  # never two ways with one key
    dup = np.array([7, 9, 7, 7, 11, 9, 13, 15, 7, 17], dtype=np.uint64)  # past FEW_KEYS: the numpy path
    flat, new, present = _AssocTable(64).insert(dup)
    assert present.all() and new.sum() == 6 and flat[0] == flat[2] == flat[3] == flat[8] and flat[1] == flat[5]


def test_record_after_match_reuses_its_lookup_and_ends_as_a_record_alone() -> None:
    """A decision's record reuses the lookup its match just made (when the index has not changed since,
    and for keys past where the match stopped it looks them up): the table ends exactly as a record
    without the match leaves it, for prompts shorter and longer than a match's first chunk; and an
    event that changed the table in between is seen (the stale lookup is not used)."""
    import numpy as np

    from extproc.index.precise import MATCH_FIRST_CHUNK

    rng = random.Random(5)
    for n_blocks in (12, MATCH_FIRST_CHUNK + 40):
        shared = [rng.randrange(1 << 20) for _ in range(BS * n_blocks)]
        reused, alone = PreciseIndex(4096, clock=FakeClock()), PreciseIndex(4096, clock=FakeClock())
        for idx in (reused, alone):
            idx.apply(A, stored(list(range(1, n_blocks // 2 + 1)), None, shared[: BS * (n_blocks // 2)]))
        for q in range(3):
            keys = request_keys(shared + [rng.randrange(1 << 20) for _ in range(BS * 3)])
            assert reused.match(keys, [A, B]) == alone.match(keys, [A, B]), q
            reused.record(keys, B)
            alone._seen = None  # forgets the lookup: the record looks everything up again
            alone.record(keys, B)
            for a, b in ((reused._blocks.keys, alone._blocks.keys), (reused._mask, alone._mask),
                         (reused._spec, alone._spec), (reused._spec_until, alone._spec_until)):  # fmt: skip
                assert np.array_equal(a, b), (n_blocks, q)
            assert reused.match(keys, [B]) == {B: len(keys)}
    idx = PreciseIndex(4096, clock=FakeClock())
    tokens = [rng.randrange(1 << 20) for _ in range(BS * 20)]
    keys = request_keys(tokens)
    idx.apply(A, stored(list(range(1, 21)), None, tokens))
    assert idx.match(keys, [A]) == {A: 20}
    idx.apply(A, BlockRemoved(tuple(range(1, 21)), medium="GPU"))  # every block gone between match and record
    idx.record(keys, B)
    assert idx.match(keys, [A, B]) == {B: 20}


def test_few_block_events_on_python_ints_end_as_the_vector_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored events of up to FEW_KEYS blocks (a decode step's) are confirmed on Python ints
    (``_confirm_few``, parents looked up likewise): fed the same events, speculative records and
    removals, an index that takes every event through numpy (FEW_KEYS 0) ends with the same tables,
    counters and matches, evictions included (a small table)."""
    from extproc.index import precise

    rng, few = random.Random(5), precise.FEW_KEYS
    eps = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    fast, vector = PreciseIndex(256, clock=lambda: 0.0), PreciseIndex(256, clock=lambda: 0.0)
    chains: list[tuple[str, int | None, list[int]]] = [(ep, None, []) for ep in eps]  # (pod, last hash, tokens)
    next_hash = 1
    for step in range(600):
        i = rng.randrange(len(chains))
        ep, parent, tokens = chains[i]
        if step % 7 == 0 and tokens:
            keys = hashing.chain_tokens(precise_seed(), tokens, BS, 1000)[: rng.randint(1, len(tokens) // BS)]
            to = eps[rng.randrange(3)]
            for idx in (fast, vector):
                idx.record(keys, to)
            continue
        n = rng.choice([1, 1, 1, 2, 3, few, few + 1])
        new = [rng.randrange(32000) for _ in range(n * BS)]
        shared = [t for _, _, t in chains if len(t) >= n * BS]
        if parent is None and shared and rng.random() < 0.5:  # a prefix another pod holds too
            new = rng.choice(shared)[: n * BS]
        if rng.random() < 0.4:  # routed there first: the event confirms what a record expects
            ahead = hashing.chain_tokens(precise_seed(), tokens + new, BS, 1000)
            to = ep if rng.random() < 0.7 else eps[rng.randrange(3)]
            for idx in (fast, vector):
                idx.record(ahead, to)
        hashes = tuple(range(next_hash, next_hash + n))
        next_hash += n
        events: list[BlockStored | BlockRemoved] = [BlockStored(hashes, parent, tuple(new), BS, medium="GPU")]
        if step % 11 == 0:
            events.append(BlockRemoved((rng.randrange(1, next_hash),), medium="GPU"))
        batch = EventBatch(0.0, tuple(events))
        fast.apply_batch(ep, batch)
        monkeypatch.setattr(precise, "FEW_KEYS", 0)
        vector.apply_batch(ep, batch)
        monkeypatch.setattr(precise, "FEW_KEYS", few)
        chains[i] = (ep, hashes[-1], tokens + new) if rng.random() < 0.9 else (eps[rng.randrange(3)], None, [])
    assert fast.counters == vector.counters and fast.counters["blocks_stored"] > 500
    assert fast._blocks.evictions == vector._blocks.evictions > 0
    _same_tables(fast, vector, engine=True)
    for _, _, tokens in chains:
        keys = hashing.chain_tokens(precise_seed(), tokens, BS, 1000)
        assert fast.match(keys, eps) == vector.match(keys, eps)


def test_few_key_matches_and_records_on_python_ints_end_as_the_vector_path_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Matches and records of up to FEW_KEYS keys (a new prompt's probe) run on Python ints: fed the same
    calls, with speculative expectations expiring as the clock moves, confirmed blocks and evictions (a
    small table), an index taking every call through numpy (FEW_KEYS 0) answers the same and ends with
    the same tables, the records a match saw complete skipped alike."""
    import numpy as np

    from extproc.index import precise

    rng, few, now = random.Random(11), precise.FEW_KEYS, [0.0]
    eps = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    fast = PreciseIndex(128, clock=lambda: now[0], speculative_ttl_s=2.0)
    vector = PreciseIndex(128, clock=lambda: now[0], speculative_ttl_s=2.0)
    prompts = [hashing.chain_tokens(precise_seed(), [rng.randrange(32000) for _ in range(12 * BS)], BS, 100)
               for _ in range(12)]  # fmt: skip
    answers = 0
    for step in range(1500):
        keys = rng.choice(prompts)[: rng.randint(1, few + 2)]
        pod = rng.choice(eps)
        op = rng.random()
        if op < 0.1:
            now[0] += rng.choice([0.5, 1.5, 3.0])
        if op < 0.15:  # the first pod's event confirms those of them in the table (as _confirm sets it)
            for idx in (fast, vector):
                flat, found = idx._blocks.find(np.asarray(keys, dtype=np.uint64))
                idx._mask[flat[found]] |= np.uint64(1)
        for idx, f in ((fast, few), (vector, 0)):
            monkeypatch.setattr(precise, "FEW_KEYS", f)
            got = idx.match(keys, eps)
            if op < 0.6:
                idx.record(keys, pod)  # right after its match, as a decision records: maybe skipped
            elif op < 0.8:
                idx.record(list(keys), pod)  # another list: recorded in full
            if idx is fast:
                want = got
            else:
                assert got == want, step
        monkeypatch.setattr(precise, "FEW_KEYS", few)
        answers += bool(want)
    assert answers > 300 and fast._blocks.evictions == vector._blocks.evictions > 0
    _same_tables(fast, vector, engine=False)
    assert fast._spec_horizon == vector._spec_horizon


def _same_tables(a: PreciseIndex, b: PreciseIndex, engine: bool) -> None:
    """Two indexes' block tables (and with ``engine``, their engine-hash maps) hold the same."""
    import numpy as np

    names = ["_mask", "_spec", "_spec_until"] + (["_engine_own", "_engine_pod"] if engine else [])
    pairs = [(a._blocks.keys, b._blocks.keys), (a._blocks.stamp, b._blocks.stamp)]
    pairs += [(getattr(a, n), getattr(b, n)) for n in names]
    if engine:
        pairs.append((a._engine.keys, b._engine.keys))
    for x, y in pairs:
        assert np.array_equal(x, y)


def test_the_tables_are_resident_from_construction():
    """Every page of the index's tables is written when it is made (at startup, before kvroute serves):
    the first requests' records then take no page faults. Lazily zeroed pages cost a fault at each new
    page a record writes, ~100 per record of 94 new blocks at this capacity (over 2,000 for these 20)."""
    import resource

    idx = PreciseIndex(1_000_000)
    rng = random.Random(0)
    prompts = [[rng.getrandbits(63) for _ in range(94)] for _ in range(20)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for keys in prompts:
        idx.record(keys, A)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 200, faults
    assert idx.match(prompts[-1], [A]) == {A: 94}
