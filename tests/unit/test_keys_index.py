import random

import pytest

from extproc.hashing import chain_tokens, seed_key
from extproc.index.approx import SHARDS, ApproxPrefixIndex
from extproc.keys import char_block_keys, route_id_key, route_keys
from extproc.request import InferenceRequest


def req(text="", ids=None, tenant="t", model="m", salt=None, route_id=None):
    return InferenceRequest(
        path="/v1/completions",
        method="POST",
        request_id="",
        tenant=tenant,
        model=model,
        prompt_text=text,
        prompt_token_ids=ids,
        cache_salt=salt,
        route_id=route_id,
    )


def test_keys_are_chained_prefix_keys():
    a = route_keys(req("x" * 64 * 3 + "tail"), 64, 100)
    b = route_keys(req("x" * 64 * 3 + "other suffix that is long enough to fill a block" * 2), 64, 100)
    assert len(a) == 3  # partial last block has no key
    assert b[:3] == a
    # Same block content at a different position gets a different key (chaining).
    assert len(set(a)) == 3


def test_keys_scoped_by_model_tenant_salt():
    text = "y" * 640
    base = route_keys(req(text), 64, 100)
    assert route_keys(req(text, tenant="other"), 64, 100)[0] != base[0]
    assert route_keys(req(text, model="m2"), 64, 100)[0] != base[0]
    assert route_keys(req(text, salt="s"), 64, 100)[0] != base[0]
    assert route_keys(req(text), 64, 100) == base


def test_max_blocks_and_token_ids():
    assert len(route_keys(req("z" * 6400), 64, 10)) == 10
    ids = tuple(range(100))
    k = route_keys(req(ids=ids), 64, 100)
    assert k == chain_tokens(seed_key("m", "t", ""), ids, 16, 100) and len(k) == 6
    # With 2 characters per token a 64-character block spans 32 token ids.
    assert route_keys(req(ids=ids), 64, 100, chars_per_token=2) == chain_tokens(seed_key("m", "t", ""), ids, 32, 100)


def test_chars_per_token_sizes_the_prefill_estimate():
    """Text of 8 characters per token (or CJK at ~1.5) is mis-sized by the English default: the
    prompt-token estimate, and the prefill seconds and P/D decisions built on it, follow the setting."""
    from extproc.keys import estimated_tokens

    text = "x" * 8000
    assert estimated_tokens(req(text)) == 2000
    assert estimated_tokens(req(text), chars_per_token=8) == 1000
    assert estimated_tokens(req(ids=tuple(range(10))), chars_per_token=8) == 10  # token ids are counted


def test_unicode_blocks_hash_by_characters():
    k = char_block_keys("é" * 128, 7, 64, 10)
    assert len(k) == 2 and k[0] != k[1]


def test_route_id_key_scoped():
    assert route_id_key(req(route_id=None)) is None
    assert route_id_key(req(route_id="a")) != route_id_key(req(route_id="a", tenant="x"))
    assert route_id_key(req(route_id="a")) == route_id_key(req(route_id="a"))


def test_approx_match_leading_blocks_only():
    idx = ApproxPrefixIndex(100)
    idx.record([1, 2, 3, 4], "a")
    idx.record([1, 2], "b")
    idx.record([2, 3, 4], "c")  # holds later blocks but not the first: no leading match
    assert idx.match([1, 2, 3, 4, 5], ["a", "b", "c", "d"]) == {"a": 4, "b": 2}
    assert idx.match([9], ["a"]) == {}
    assert idx.match([], ["a"]) == {}
    assert idx.match([1, 2], ["b"]) == {"b": 2}


def test_approx_lru_eviction_and_remove():
    idx = ApproxPrefixIndex(3)
    idx.record([1, 2, 3], "a")
    idx.record([7], "a")
    assert idx.blocks("a") == 3
    # The tail block goes first, so what is left is still a leading run of the prefix.
    assert idx.match([1, 2, 3], ["a"]) == {"a": 2}
    assert idx.match([7], ["a"]) == {"a": 1}
    idx.remove_endpoint("a")
    assert idx.match([1], ["a"]) == {} and idx.blocks("a") == 0


def test_approx_no_dict_holds_a_full_pools_blocks_whole():
    """Once the pods' LRUs are full every record deletes as many keys as it adds, and a dict rebuilds
    its whole table when deleted slots use up its free ones: one map of a 64-pod pool's 2M blocks held
    the event loop for 115-119 ms at each rebuild (bench.index_churn). The map is split by the keys' top
    bits, each part near its share, and a pod removed leaves no key behind in any part."""
    idx = ApproxPrefixIndex(2000)
    rng = random.Random(1)
    pods = [f"10.0.0.{i}:8000" for i in range(16)]
    for _ in range(1200):
        idx.record([rng.getrandbits(64) for _ in range(50)], rng.choice(pods))
    assert idx.distinct_keys() == 16 * 2000  # every pod full, no key shared
    parts = idx.table_sizes()[:SHARDS]
    assert sum(parts) == 16 * 2000 and max(parts) < 2 * 16 * 2000 / SHARDS, parts
    for pod in pods:
        idx.remove_endpoint(pod)
    assert idx.distinct_keys() == 0


def test_approx_capacity_validation():
    with pytest.raises(ValueError):
        ApproxPrefixIndex(0)


def test_chain_tokens_equals_block_by_block_chaining():
    from extproc.hashing import chain, token_block_bytes

    ids = list(range(1000, 1000 + 16 * 5 + 7))
    expected, parent = [], 99
    for i in range(5):
        parent = chain(parent, token_block_bytes(ids[i * 16 : (i + 1) * 16]))
        expected.append(parent)
    assert chain_tokens(99, ids, 16, 100) == expected
    assert chain_tokens(99, ids, 16, 3) == expected[:3]
    assert chain_tokens(99, ids[:15], 16, 100) == []


@pytest.mark.parametrize("text", ["ab c" * 70, "ab é" * 70, "x" * 63, "\ud800" + "a" * 200])
def test_char_block_keys_equal_block_by_block_chaining(text):
    """ASCII prompts are hashed from one encoding (zero-copy slices): the keys stay those of the
    per-block UTF-8 chain that every other prompt (and every earlier kvroute) uses."""
    from extproc.hashing import chain

    expected, parent = [], 5
    for i in range(min(len(text) // 64, 3)):
        parent = chain(parent, text[i * 64 : (i + 1) * 64].encode("utf-8", "surrogatepass"))
        expected.append(parent)
    assert char_block_keys(text, 5, 64, 3) == expected
