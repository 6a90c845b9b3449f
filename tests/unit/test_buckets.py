"""Cache-bucket routing: keys follow their bucket across pod rebuilds, a lost bucket moves only its own
keys, and bounded load spills a hot bucket's keys to their next bucket."""

import random
from collections import Counter

from extproc.config import BucketsConfig, RoutingConfig
from extproc.endpoints.pool import EndpointState
from extproc.hashing import chain_tokens
from extproc.index.approx import ApproxPrefixIndex
from extproc.index.precise import PreciseIndex, precise_seed
from extproc.kvevents import BlockStored
from extproc.request import InferenceRequest
from extproc.scheduling.buckets import BucketRouter, bucket_key, bucket_order
from extproc.scheduling.scheduler import Scheduler

REQ = InferenceRequest(path="/v1/completions", method="POST", request_id="", tenant="t", model="m")
KEYS = [[10_000 + i, 7, 8] for i in range(600)]


def pod(ip: int, bucket: str | None) -> EndpointState:
    return EndpointState(address=f"10.0.0.{ip}:80", role="both", cluster=f"c{ip}", pool="p", cache_bucket=bucket)


def sched(**buckets) -> Scheduler:
    routing = RoutingConfig(buckets=BucketsConfig(enabled=True, **buckets))
    return Scheduler(routing, ApproxPrefixIndex(100_000))


def placement(s: Scheduler, pods: list[EndpointState]) -> dict[int, str]:
    """Each key's pod (its bucket's label), routed at no load."""
    out = {}
    for keys in KEYS:
        d = s.schedule(REQ, keys, "p", pods)
        out[keys[0]] = d.primary.cache_bucket or d.primary.address
    return out


def test_a_pod_rebuilt_in_its_bucket_takes_its_keys_back():
    s = sched()
    pods = [pod(i, f"b{i}") for i in range(4)]
    before = placement(s, pods)
    assert len(set(before.values())) == 4
    # b2's pod is gone while it is rebuilt: its keys spill elsewhere and the index records them there.
    s.forget_endpoint(pods[2].address)
    during = placement(s, [p for p in pods if p.cache_bucket != "b2"])
    assert "b2" not in during.values()
    # The rebuilt pod (new address) in b2 gets exactly b2's keys back, although the index says
    # other pods hold them now.
    rebuilt = [*pods[:2], pod(42, "b2"), pods[3]]
    after = {}
    for keys in KEYS:
        d = s.schedule(REQ, keys, "p", rebuilt)
        after[keys[0]] = d.primary.address
        if before[keys[0]] != "b2":
            assert d.reason == "prefix"  # the others kept their cache
    assert {k for k, a in after.items() if a == "10.0.0.42:80"} == {k for k, b in before.items() if b == "b2"}


def test_precise_mode_a_rebuilt_pod_takes_its_bucket_keys_back():
    """Precise mode: token-exact keys and an index that learns only from the pods' KV events. While
    b2's pod is rebuilt its prompts are stored (events) on other pods; the rebuilt pod at a new address
    gets exactly them back, with an empty cache, and every other prompt stays on its pod as a hit."""
    bs, rng = 16, random.Random(3)
    prompts = [[rng.randrange(50_000) for _ in range(3 * bs)] for _ in range(300)]
    index = PreciseIndex(100_000)
    s = Scheduler(RoutingConfig(buckets=BucketsConfig(enabled=True)), index)
    stored: Counter[str] = Counter()

    def route(pods: list[EndpointState]) -> list[tuple[str, str, int]]:
        """(pod, reason, matched blocks) per prompt; the pod then reports the prompt's blocks stored."""
        out = []
        for tokens in prompts:
            keys = chain_tokens(precise_seed(), tokens, bs, 1024)
            d = s.schedule(REQ, keys, "p", pods, block_tokens=bs)
            addr = d.primary.address
            first = stored[addr]
            stored[addr] += 3
            engine = tuple(hash((addr, first + j)) & (2**63 - 1) for j in range(3))  # the pod's own block ids
            index.apply(addr, BlockStored(engine, None, tuple(tokens), bs, medium="GPU"))
            out.append((addr, d.reason, d.matched_blocks))
        return out

    pods = [pod(i, f"b{i}") for i in range(4)]
    before = route(pods)
    assert {a for a, _, _ in before} == {p.address for p in pods}
    b2 = pods[2].address
    s.forget_endpoint(b2)
    during = route([p for p in pods if p.address != b2])
    assert all(a != b2 for a, _, _ in during)
    rebuilt = [*pods[:2], pod(42, "b2"), pods[3]]
    after = route(rebuilt)
    for (was, _, _), (now, reason, matched) in zip(before, after, strict=True):
        if was == b2:  # the index says another pod holds it, but its bucket's new pod takes it, cold
            assert (now, matched) == ("10.0.0.42:80", 0)
        else:  # the others kept their pod and its cache
            assert (now, reason, matched) == (was, "prefix", 3)
    assert index.stats()["blocks_stored"] > 0


def test_losing_a_bucket_moves_only_its_keys():
    s = sched()
    pods = [pod(i, f"b{i}") for i in range(5)]
    before = placement(s, pods)
    after = placement(sched(), pods[:4])  # a fresh scheduler: no index, pure placement
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "b4" for k in moved)
    assert len(moved) == sum(1 for b in before.values() if b == "b4")
    # And adding it back moves only keys to it (the minimal share, ~1/5).
    again = placement(sched(), pods)
    assert again == before


def test_a_bucket_with_replicas_keeps_prefix_scoring_inside_it():
    s = sched()
    pods = [pod(0, "a"), pod(1, "a"), pod(2, "b"), pod(3, "b")]
    keys = KEYS[0]
    first = s.schedule(REQ, keys, "p", pods).primary
    home = first.cache_bucket
    assert [e.cache_bucket for e in s.schedule(REQ, keys, "p", pods).endpoints[:2]] == [home, home]
    d = s.schedule(REQ, [*keys, 99], "p", pods)
    assert d.primary is first and d.reason == "prefix" and d.matched_blocks == 3


def test_bounded_load_spills_to_the_next_bucket_and_comes_back():
    s = sched(load_factor=0.0, slack=0)
    pods = [pod(i, f"b{i}") for i in range(4)]
    keys = KEYS[0]
    order = bucket_order([f"b{i}" for i in range(4)], keys[0])
    home = s.schedule(REQ, keys, "p", pods).primary
    assert home.cache_bucket == order[0]
    home.inflight = 3  # past ⌈(1 + 0) · 4/4 · 1⌉ = 1 for its one pod
    spilled = s.schedule(REQ, keys, "p", pods)
    assert spilled.primary.cache_bucket == order[1]
    home.inflight = 0
    assert s.schedule(REQ, keys, "p", pods).primary is home


def test_hot_keys_spread_over_buckets_under_load():
    router = BucketRouter(BucketsConfig(enabled=True, load_factor=0.25, slack=1))
    pods = [pod(i, f"b{i}") for i in range(4)]
    counts: Counter[str] = Counter()
    for _ in range(40):  # one hot key, requests that stay in flight
        chosen, _rest = router.split([5, 6], None, pods)
        chosen[0].inflight += 1
        counts[chosen[0].cache_bucket or ""] += 1
    # No bucket past ⌈1.25 · 40/4⌉ + 1 = 14; the key's own buckets fill first, in its order.
    order = bucket_order([p.cache_bucket for p in pods], 5)  # type: ignore[misc]
    assert max(counts.values()) <= 14 and len(counts) >= 3
    assert [counts[b] for b in order] == sorted(counts[b] for b in order)[::-1]


def test_route_id_names_the_bucket_and_pins_stay_inside_it():
    s = sched()
    pods = [pod(i, f"b{i}") for i in range(4)]
    d1 = s.schedule(REQ, [1, 2], "p", pods, route_key=77)
    d2 = s.schedule(REQ, [3, 4], "p", pods, route_key=77)  # another prompt, same conversation
    assert d1.primary is d2.primary
    assert d1.primary.cache_bucket == bucket_order([p.cache_bucket for p in pods], 77)[0]  # type: ignore[misc]
    assert bucket_key([1, 2, 3], None, 2) == 2 and bucket_key([1], None, 4) == 1 and bucket_key([], None, 1) is None


def test_unlabelled_pods_and_disabled_buckets_route_as_before():
    plain = Scheduler(RoutingConfig(), ApproxPrefixIndex(1000))
    labelled = [pod(i, f"b{i}") for i in range(4)]
    assert plain.buckets is None
    unlabelled = [pod(i, None) for i in range(4)]
    s = sched()
    assert BucketRouter(BucketsConfig()).split([1], None, unlabelled) is None
    d = s.schedule(REQ, [1, 2], "p", unlabelled)
    assert d.reason == "hash" and len(d.endpoints) == 3
    # With buckets, the fallbacks are the other buckets' pods.
    d = s.schedule(REQ, [1, 2], "p", labelled)
    assert len({e.cache_bucket for e in d.endpoints}) == 3


def test_explain_shows_the_bucket_verdict():
    s = sched()
    pods = [pod(i, f"b{i}") for i in range(3)]
    d = s.schedule(REQ, [1, 2], "p", pods, dry_run=True)
    assert d.trace is not None
    verdicts = {a: dict(v)["bucket"] for a, v in d.trace.verdicts.items()}
    assert [a for a, ok in verdicts.items() if ok] == [d.primary.address]
