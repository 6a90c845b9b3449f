import random
from collections import OrderedDict

import pytest

from extproc.lru import PARTS, ShardedLRU


def test_a_small_table_is_one_exact_lru():
    """Under min_part entries a part, one part: the same keys as an OrderedDict LRU after every step."""
    lru: ShardedLRU[int, int] = ShardedLRU(100)
    ref: OrderedDict[int, int] = OrderedDict()
    rng = random.Random(0)
    assert lru.parts == 1
    for step in range(5000):
        k = rng.randrange(300)
        if rng.random() < 0.5:
            got = lru.get(k)
            assert got == ref.get(k)
            if k in ref:
                ref.move_to_end(k)
        else:
            lru.put(k, step)
            ref[k] = step
            ref.move_to_end(k)
            if len(ref) > 100:
                ref.popitem(last=False)
        assert list(lru.items()) == list(ref.items())


def test_a_large_table_holds_its_capacity_in_parts_no_larger_than_their_share():
    cap = 100_000
    lru: ShardedLRU[int, int] = ShardedLRU(cap)
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(3 * cap)]  # route keys: hashes
    for i, k in enumerate(keys):
        lru.put(k, i)
    assert lru.parts == PARTS
    assert len(lru) == cap  # every part full, none over
    # What one rebuild copies: a part, not the table (an OrderedDict of 100,000 held the loop ~7 ms).
    assert max(len(p) for p in lru._parts) <= -(-cap // PARTS)
    assert all(k in lru for k in keys[-cap // 2 :])  # the newest half, whatever part each fell in
    assert sum(k in lru for k in keys[:cap]) == 0  # the oldest third, all gone


def test_a_used_key_outlives_the_churn_around_it():
    lru: ShardedLRU[int, str] = ShardedLRU(10_000)
    lru.put(-1, "pinned")
    rng = random.Random(2)
    for i in range(50_000):
        lru.put(rng.getrandbits(64), "x")
        if i % 50 == 0:
            assert lru.get(-1) == "pinned"
    assert lru.get(-1) == "pinned" and lru.pop(-1) == "pinned" and -1 not in lru


def test_weights_bound_the_sum_and_follow_replacements_and_pops():
    def weigh(k: str, v: bytes) -> int:
        return len(k) + len(v)

    lru: ShardedLRU[str, bytes] = ShardedLRU(64 * 1024, weigh, min_part=4096)
    assert lru.parts == 16
    rng = random.Random(3)
    for i in range(5000):
        lru.put(f"text {i}", bytes(rng.randrange(1, 200)))
        assert lru.weight <= 64 * 1024
    assert lru.weight == sum(weigh(k, v) for k, v in lru.items()) > 0.9 * 64 * 1024
    k = next(iter(lru))
    lru.put(k, b"")  # the same key again, lighter
    assert lru.weight == sum(weigh(k, v) for k, v in lru.items())
    lru.pop(k)
    assert k not in lru and lru.weight == sum(weigh(k, v) for k, v in lru.items())
    held, weight = len(lru), lru.weight
    lru.put("heavy", bytes(8192))  # past its part's 4 KiB share: not kept, nothing else lost for it
    assert "heavy" not in lru and (len(lru), lru.weight) == (held, weight)
    lru.clear()
    assert len(lru) == 0 and lru.weight == 0


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        ShardedLRU(0)
