import time
from collections import Counter

import pytest

from extproc.config import RoutingConfig
from extproc.endpoints.pool import EndpointState
from extproc.errors import NoEndpoint
from extproc.index.approx import ApproxPrefixIndex
from extproc.request import InferenceRequest
from extproc.scheduling.filters import BoundedLoadFilter, RoutedShares
from extproc.scheduling.scheduler import Scheduler

REQ = InferenceRequest(path="/v1/completions", method="POST", request_id="", tenant="t", model="m")


def eps(n):
    return [EndpointState(address=f"10.0.0.{i}:80", role="both", cluster=f"c{i}", pool="p") for i in range(n)]


def sched(**kw):
    return Scheduler(RoutingConfig(**kw), ApproxPrefixIndex(1000))


def test_same_prefix_sticks_and_new_prefixes_spread():
    s, pods = sched(), eps(4)
    first = s.schedule(REQ, [11, 12, 13], "p", pods)
    assert first.reason == "hash"
    again = s.schedule(REQ, [11, 12, 13, 14], "p", pods)
    assert again.primary is first.primary and again.reason == "prefix" and again.matched_blocks == 3
    picks = Counter(s.schedule(REQ, [1000 + i, 5], "p", pods).primary.address for i in range(400))
    assert len(picks) == 4 and min(picks.values()) > 60  # rendezvous hashing spreads cold prefixes


def test_bounded_load_moves_hot_prefix():
    s, pods = sched(load_epsilon=0.0, load_slack=0), eps(2)
    d = s.schedule(REQ, [1, 2], "p", pods)
    d.primary.inflight = 5  # the pod holding the prefix is swamped
    d2 = s.schedule(REQ, [1, 2], "p", pods)
    assert d2.primary is not d.primary
    assert d2.endpoints[-1] is d.primary  # the overloaded one stays a last-resort fallback


def test_cost_scoring_keeps_a_conversation_on_a_pod_past_its_share_unless_bounded_explicitly():
    # 8 pods, one holding a conversation's history with twice the fleet's mean in flight: weighted
    # scoring's bound (epsilon 0.5 by default) moves the turn to a pod that must recompute the
    # history; cost scoring prices that load (5 ms a request in flight) against the recompute and
    # keeps the turn, unless a bound is set explicitly.
    keys = list(range(200, 232))
    for kw, stays in (({}, True), ({"scoring": "weighted"}, False), ({"load_epsilon": 0.5}, False)):
        s, pods = sched(**kw), eps(8)
        home = s.schedule(REQ, keys, "p", pods, block_tokens=64).primary
        for p in pods:
            p.inflight = 3
        home.inflight = 8  # cap with epsilon 0.5: ceil(1.5 * (29 + 1) / 8) + 2 = 8, so 8 + 1 is over
        turn = s.schedule(REQ, [*keys, 300, 301], "p", pods, block_tokens=64)
        assert (turn.primary is home) is stays, kw
        assert (turn.matched_blocks == len(keys)) is stays


def test_bounded_load_epsilon_default_follows_scoring():
    assert RoutingConfig().bounded_load_epsilon is None  # cost scoring: no bound
    assert RoutingConfig(scoring="weighted").bounded_load_epsilon == 0.5
    assert RoutingConfig(load_epsilon=1.5).bounded_load_epsilon == 1.5
    assert BoundedLoadFilter(None, 2).capacity(eps(3)) is None


def test_bounded_capacity_formula():
    f = BoundedLoadFilter(epsilon=0.5, slack=1)
    pods = eps(4)
    for p, n in zip(pods, [0, 2, 4, 6], strict=True):
        p.inflight = n
    cap = f.capacity(pods)  # ceil(1.5 * 13 / 4) + 1 = 6
    assert cap == 6
    assert [p.inflight for p in f.filter(None, pods)] == [0, 2, 4]  # type: ignore[arg-type]


def test_load_scorer_breaks_prefix_ties():
    s, pods = sched(), eps(3)
    for p in pods:
        s.index.record([1, 2], p.address)
    pods[0].inflight, pods[1].inflight, pods[2].inflight = 2, 0, 1
    assert s.schedule(REQ, [1, 2], "p", pods).primary is pods[1]


def test_route_id_pins_and_subset_and_unhealthy():
    s, pods = sched(), eps(3)
    d = s.schedule(REQ, [], "p", pods, route_key=42)
    assert s.schedule(REQ, [], "p", pods, route_key=42).primary is d.primary
    assert s.schedule(REQ, [], "p", pods, route_key=42).reason == "route-id"
    other = next(p for p in pods if p is not d.primary)
    assert s.schedule(REQ, [], "p", pods, subset={other.address}).primary is other
    with pytest.raises(NoEndpoint):
        s.schedule(REQ, [], "p", pods, subset={"10.9.9.9:1"})
    # Every pod's metrics stale: stale is not dead, the request still goes to one of them...
    for p in pods:
        p.healthy = False
    assert s.schedule(REQ, [1], "p", pods).primary in pods
    # ...but never to a pod known down (scrapes refused) or draining, even then.
    pods[0].down, pods[1].draining = True, True
    assert s.schedule(REQ, [1], "p", pods).primary not in pods[:2]
    for p in pods:
        p.down = True
    with pytest.raises(NoEndpoint):
        s.schedule(REQ, [1], "p", pods)


def test_fallback_list_length_and_forget():
    s, pods = sched(fallback_endpoints=2), eps(4)
    d = s.schedule(REQ, [5, 6], "p", pods, route_key=9)
    assert len(d.endpoints) == 2 and len({e.address for e in d.endpoints}) == 2
    s.forget_endpoint(d.primary.address)
    assert s.index.match([5, 6], [d.primary.address]) == {}


def test_a_deferred_record_waits_for_settle_or_the_next_decision():
    """The server answers before the index learns the pick (defer_record): until then the index is as
    before, and the next decision settles it first, so it decides as if the record had been made."""
    s, pods = sched(), eps(4)
    first = s.schedule(REQ, [21, 22, 23], "p", pods, defer_record=True)
    assert s.index.match([21, 22, 23], [e.address for e in pods]) == {}
    again = s.schedule(REQ, [21, 22, 23, 24], "p", pods, defer_record=True)
    assert again.primary is first.primary and again.reason == "prefix" and again.matched_blocks == 3
    assert s.index.match([21, 22, 23, 24], [first.primary.address]) == {first.primary.address: 3}
    s.settle()
    assert s.index.match([21, 22, 23, 24], [first.primary.address]) == {first.primary.address: 4}
    s.settle()  # nothing pending: nothing changes
    assert s.index.blocks(first.primary.address) == 4


def test_a_pod_forgotten_with_a_record_pending_stays_forgotten():
    s, pods = sched(), eps(4)
    d = s.schedule(REQ, [31, 32], "p", pods, defer_record=True)
    s.forget_endpoint(d.primary.address)
    s.settle()
    assert s.index.blocks(d.primary.address) == 0 and s.index.block_counts() == {}


def test_hot_prefix_gets_a_second_home_and_keeps_both():
    s, pods = sched(load_epsilon=0.0, load_slack=0), eps(4)
    home = s.schedule(REQ, [7, 8, 9], "p", pods).primary
    home.inflight = 6  # the prefix is hot: its pod is full
    second = s.schedule(REQ, [7, 8, 9], "p", pods).primary
    assert second is not home
    assert s.index.match([7, 8, 9], [p.address for p in pods]) == {home.address: 3, second.address: 3}
    # Once the first home drains, the prefix is served from whichever of the two is less loaded,
    # never from a third pod that would have to recompute it.
    home.inflight, second.inflight = 0, 3
    assert s.schedule(REQ, [7, 8, 9], "p", pods).primary is home
    home.inflight, second.inflight = 3, 0
    assert s.schedule(REQ, [7, 8, 9], "p", pods).primary is second


def test_cost_scoring_prices_cache_against_load():
    s, pods = sched(scoring="cost"), eps(3)
    keys = list(range(100, 132))  # 32 blocks x 64 tokens = 2048 prompt tokens
    home = s.schedule(REQ, keys, "p", pods, block_tokens=64).primary
    # Two more requests in flight on the home pod cost 10 ms; recomputing 2048 tokens costs 41 ms.
    home.inflight = 2
    assert s.schedule(REQ, keys, "p", pods, block_tokens=64).primary is home
    # A queue of waiting requests at the pod (from /metrics) costs a prefill each (50 ms). Up to a point
    # it still costs less than recomputing the prefix elsewhere (41 ms for this request, weighted
    # recompute_weight more times for the fleet's work: 6 × 41 ms more by default); one more: go elsewhere.
    c = RoutingConfig().cost
    elsewhere = c.prefill_s(2048) * (1 + c.recompute_weight)
    most = int((elsewhere - 2 * c.per_inflight_s) / c.per_waiting_s)  # 5 waiting by default
    assert most >= 2
    home.queue = most
    assert s.schedule(REQ, keys, "p", pods, block_tokens=64).primary is home
    home.queue = most + 1
    assert s.schedule(REQ, keys, "p", pods, block_tokens=64).primary is not home


def test_new_prefix_goes_to_the_least_loaded_pod():
    s, pods = sched(), eps(4)
    pods[0].inflight, pods[1].inflight, pods[2].inflight, pods[3].inflight = 2, 1, 0, 1
    for i in range(5):
        assert s.schedule(REQ, [5000 + i], "p", pods).primary is pods[2]


def test_cost_scoring_sees_prefill_work_already_sent_to_a_pod():
    """/metrics lags: a pod just handed a long document shows no queue yet, and by in-flight count
    it looks less loaded than a pod streaming a few chats. The estimated prefill queue tells them apart."""
    s, pods = sched(scoring="cost"), eps(2)
    doc_pod, chat_pod = pods
    doc_pod.inflight, chat_pod.inflight = 1, 4  # 5 ms vs 20 ms by in-flight count alone
    assert s.schedule(REQ, [9000], "p", pods).primary is doc_pod
    doc_pod.prefills.add(0.2, time.monotonic())  # 10k tokens of prefill still to run there
    # A new prefix (the hashing path) and a prefix both pods hold (the scored path) both go elsewhere.
    assert s.schedule(REQ, [9001], "p", pods).primary is chat_pod
    keys = [9100, 9101]
    s.index.record(keys, doc_pod.address)
    s.index.record(keys, chat_pod.address)
    assert s.schedule(REQ, keys, "p", pods, block_tokens=64).primary is chat_pod
    # Weighted scoring keeps its in-flight + waiting order for new prefixes.
    w = sched(scoring="weighted")
    assert w.schedule(REQ, [9002], "p", pods).primary is doc_pod


def test_follow_up_stays_while_its_history_is_worth_more_than_the_queue_there():
    """10k tokens of history save ~0.27 s of prefill at the home pod. The other pods are 0.4 s less
    busy, which wins this one request's TTFT, but recomputing the history there is work the fleet does
    twice: with recompute priced (the default) the follow-up stays; priced at 0 (this request's TTFT
    alone) it moves. A queue far longer than the saving still moves it (the tail)."""
    history = list(range(20_000, 20_160))  # 160 blocks x 64 tokens
    follow_up = [*history, 30_000, 30_001]
    for weight, stays in ((0.0, False), (RoutingConfig().cost.recompute_weight, True)):
        s, pods = sched(scoring="cost", cost={"recompute_weight": weight}), eps(3)
        home = s.schedule(REQ, history, "p", pods, block_tokens=64).primary
        other = next(p for p in pods if p is not home)
        home.prefills.add(0.4, time.monotonic())
        d = s.schedule(REQ, follow_up, "p", pods, block_tokens=64)
        assert (d.primary is home) == stays, weight
        at_home, elsewhere = d.estimates[home.address], d.estimates[other.address]
        assert at_home.ttft_s > elsewhere.ttft_s  # the move is what this request alone would pick
        assert at_home.recompute_s == 0 and elsewhere.recompute_s > 0.25
    home.prefills.add(2.0, time.monotonic())
    assert s.schedule(REQ, follow_up, "p", pods, block_tokens=64).primary is not home


def test_decode_stall_weight_sends_a_long_new_prompt_where_fewer_requests_decode():
    """A new 8k-token prompt (~0.2 s of prefill on every pod): one pod has 0.1 s of prefill queued but one
    request in flight, another no queue but four requests in flight (decoding: each would wait about
    the prefill between two tokens). This request's TTFT alone picks the busy pod; with the decode
    stall priced (0.3 x 0.2 s x in flight) the prefill goes where one stream decodes. A follow-up
    whose history one pod holds still stays there: the stall of its short prefill is small."""
    keys = list(range(40_000, 40_128))  # 128 blocks x 64 tokens
    now = time.monotonic()
    for weight, to_quiet in ((0.0, False), (0.3, True)):
        s, pods = sched(scoring="cost", cost={"decode_stall_weight": weight}), eps(2)
        quiet, busy = pods
        quiet.inflight, busy.inflight = 1, 4
        quiet.prefills.add(0.1, now)
        d = s.schedule(REQ, keys, "p", pods, block_tokens=64)
        assert (d.primary is quiet) is to_quiet, weight
        est = d.estimates
        assert est[busy.address].ttft_s < est[quiet.address].ttft_s  # the TTFT-cheapest is the busy pod
        busy_est = est[busy.address]  # (no pod holds the prompt: no recompute term)
        assert busy_est.cost_s - busy_est.ttft_s == pytest.approx(weight * busy_est.work_s * 4)
        busy.inflight += 2  # its next turn: the pod holding the history has more decoding now
        turn = s.schedule(REQ, [*keys, 50_000], "p", pods, block_tokens=64)
        assert turn.primary is d.primary and turn.matched_blocks == len(keys)


def test_a_new_conversation_copies_a_shared_prefix_to_an_idle_pod_but_a_next_turn_stays():
    """Sessions on one shared prefix (a coding agent's tools and system prompt): the pod that took the
    first ones would take every later one too, its history priced against any other pod. A new conversation
    branches off the shared prefix (its held run ends where the recorded prompts branch apart): while the
    prefix's pods have taken more than branch_copy_factor times their fair part of the recent requests and
    another pod has taken almost none, it goes there when the holder has more in flight than that pod (idle,
    the holder serves it from its cache at once), which then holds the prefix too. A conversation's next turn
    continues its own recorded prompt and stays. Without the spread (null) the new one stays."""
    system = list(range(40_000, 40_016))  # 16 blocks x 64 tokens
    for factor, busy, copies in ((1.0, 1, True), (1.0, 0, False), (3.0, 4, False), (None, 4, False)):
        s, pods = sched(scoring="cost", cost={"branch_copy_factor": factor}), eps(4)
        first = [*system, 50_000, 50_001, 50_002]  # the first conversation's first turn
        home = s.schedule(REQ, first, "p", pods, block_tokens=64).primary
        s.schedule(REQ, [*first, 50_003], "p", pods, block_tokens=64)  # its next turn: home again
        other = s.schedule(REQ, [70_000, 70_001], "p", [p for p in pods if p is not home], block_tokens=64).primary
        idle = [p for p in pods if p is not home and p is not other]  # home took 2 of 3, other 1, these none
        home.inflight = busy  # its conversations' replies decoding
        new_conversation = [*system, 60_000, 60_001, 60_002]
        if factor is not None:
            explained = s.schedule(REQ, new_conversation, "p", pods, block_tokens=64, dry_run=True)
            assert ("branch-spread", not copies) in explained.trace.verdicts[home.address]
        new = s.schedule(REQ, new_conversation, "p", pods, block_tokens=64)
        assert new.matches == {home.address: len(system)}
        assert new.continues is (False if factor is not None else None)
        assert (new.primary in idle) is copies, (factor, busy)
        assert (new.primary is home) is not copies, (factor, busy)
        if copies:
            assert s.index.match(system, [new.primary.address]) == {new.primary.address: len(system)}
        turn = s.schedule(REQ, [*first, 50_003, 50_004], "p", pods, block_tokens=64)
        assert turn.primary is home and turn.continues is (True if factor is not None else None)


def test_no_copy_where_every_pod_has_taken_its_part():
    """Four prompts, each with its home among four pods: every pod has taken its fair part, none has room,
    so a new conversation on a prompt stays at that prompt's home even when another home is lighter (a copy
    there would only move load onto another prompt's home)."""
    s, pods = sched(scoring="cost"), eps(4)
    prompts = [list(range(10_000 * (k + 1), 10_000 * (k + 1) + 16)) for k in range(4)]
    homes = []
    for k, prompt in enumerate(prompts):
        homes.append(s.schedule(REQ, [*prompt, 90_000 + k], "p", [pods[k]], block_tokens=64).primary)
    assert homes == pods
    s.schedule(REQ, [*prompts[0], 90_000, 1], "p", pods, block_tokens=64)  # the first prompt's next turn
    homes[0].inflight = 3  # busier than the other homes, and it took 2 of 5 requests: over its part
    new = s.schedule(REQ, [*prompts[0], 99_999], "p", pods, block_tokens=64)
    assert new.continues is False and new.primary is homes[0]


def test_recompute_only_prices_tokens_another_pod_holds():
    """A prompt no pod holds more of than another (new, or the same shared prefix everywhere) has no
    recompute anywhere: it goes by load alone, as before."""
    s, pods = sched(scoring="cost", cost={"recompute_weight": 5}), eps(3)
    for p in pods:
        s.index.record([1, 2], p.address)
    pods[0].inflight, pods[1].inflight, pods[2].inflight = 3, 1, 2
    d = s.schedule(REQ, [1, 2, 3], "p", pods, block_tokens=64)
    assert d.primary is pods[1] and all(e.recompute_s == 0 for e in d.estimates.values())
    assert d.matches == {p.address: 2 for p in pods}
    cold = s.schedule(REQ, [7, 8], "p", pods, block_tokens=64)
    assert cold.reason == "hash" and cold.primary is pods[1]
    assert set(cold.estimates) == {p.address for p in pods}


def test_peer_replicas_split_near_equal_pods_between_requests_that_race():
    """Two replicas with one view decide two requests at the same moment: alone, each takes the
    cheapest pod and they queue behind each other there; with peers, pods within peer_spread x the
    request's own prefill estimate of the cheapest are picked among by the request's hash, and a pod
    past it is never taken. A short prompt stays greedy."""
    pods = eps(4)
    pods[0].inflight, pods[1].inflight, pods[2].inflight = 0, 1, 2  # 0, 5 and 10 ms dearer
    pods[3].prefills.add(1.0, time.monotonic())  # a long prefill queued: far dearer
    alone = sched()
    with_peers = Scheduler(RoutingConfig(), ApproxPrefixIndex(1000), peers=lambda: 2)

    def pick(s: Scheduler, keys: list[int], tokens: float = 8000) -> EndpointState:
        return s.schedule(REQ, keys, "p", pods, prompt_tokens=tokens, dry_run=True).primary

    # 8k tokens: ~0.24 s of prefill, so pods within ~60 ms of the cheapest are equals.
    races = [([1, 7000 + 2 * i], [1, 7001 + 2 * i]) for i in range(40)]  # two new prompts at once, one system prompt
    deciders = {"alone": alone, "peers": with_peers}
    collide = {name: sum(pick(s, a) is pick(s, b) for a, b in races) for name, s in deciders.items()}
    assert collide["alone"] == 40  # every pair on the cheapest pod
    assert 5 < collide["peers"] < 25  # about a third: three pods near the cheapest
    picks = Counter(pick(with_peers, [1, 9000 + i]).address for i in range(90))
    assert set(picks) == {p.address for p in pods[:3]}  # never the pod with a second queued
    assert all(pick(with_peers, [1, 9000 + i], tokens=100) is pods[0] for i in range(20))  # 2 ms of prefill: greedy
    off = Scheduler(RoutingConfig(cost={"peer_spread": 0}), ApproxPrefixIndex(1000), peers=lambda: 2)
    assert all(pick(off, [1, 9000 + i]) is pods[0] for i in range(20))


def big_pool(n):
    return [EndpointState(address=f"10.1.{i // 200}.{i % 200 + 1}:80", role="both", cluster="c", pool="p")
            for i in range(n)]  # fmt: skip


def test_a_large_pool_scores_a_shortlist_that_keeps_the_holder_and_spreads_new_prefixes(monkeypatch):
    from extproc.scheduling import scheduler as mod

    s, pods = sched(), big_pool(64)
    home = pods[37]
    s.index.record([7, 8, 9], home.address)
    for p in pods:
        p.inflight = 2
    home.inflight = 3  # a little busier than the rest: its history still wins
    assert s.schedule(REQ, [7, 8, 9, 10], "p", pods).primary is home
    # New prefixes on an idle pool land all over it, not on the pool's first pods.
    for p in pods:
        p.inflight = 0
    picks = {s.schedule(REQ, [5000 + i, 1], "p", pods).primary.address for i in range(200)}
    assert len(picks) >= 48
    # Against scoring every pod: the same pick on a busy pool with history spread over it.
    import random

    rng = random.Random(7)
    agree = total = 0
    for trial in range(200):
        s1, s2, pool1, pool2 = sched(), sched(), big_pool(64), big_pool(64)
        for a, b in zip(pool1, pool2, strict=True):
            a.inflight = b.inflight = rng.randrange(6)
            a.queue = b.queue = float(rng.randrange(3))
        for doc in range(6):
            holder = rng.randrange(64)
            for sc, pl in ((s1, pool1), (s2, pool2)):
                sc.index.record([doc, doc + 100], pl[holder].address)
        keys = [trial % 6, trial % 6 + 100, 9000 + trial]
        monkeypatch.setattr(mod, "SHORTLIST_ABOVE", 10_000)
        full = s1.schedule(REQ, keys, "p", pool1).primary.address
        monkeypatch.setattr(mod, "SHORTLIST_ABOVE", 16)
        short = s2.schedule(REQ, keys, "p", pool2).primary.address
        agree += full == short
        total += 1
    assert agree / total >= 0.95, (agree, total)


def test_new_conversations_on_a_shared_system_prompt_spread_over_pods_that_tie():
    # Every pod holds the shared system prompt (blocks 1..16) and none is busier: each new conversation
    # ties on every pod. The tie goes by the first block past the shared part, so the conversations
    # spread; ordered by the first block, all would land on one pod, which would then evict first.
    s, pods = sched(), eps(4)
    system = list(range(1, 17))
    for p in pods:
        s.index.record(system, p.address)
    picks = Counter()
    for i in range(40):
        d = s.schedule(REQ, [*system, 5000 + i, 6000 + i], "p", pods, block_tokens=64)
        assert d.matched_blocks == len(system)
        picks[d.primary.address] += 1
    assert len(picks) == 4 and min(picks.values()) >= 4, picks


PROMPTS = [list(range(40_000 + 100 * p, 40_016 + 100 * p)) for p in range(4)]


def _prompt_homes(n: int, inflight: list[int]) -> tuple[Scheduler, list[EndpointState]]:
    """``n`` pods, the four PROMPTS each recorded on its own home (the first four pods) with 10 requests
    routed there, and each pod's requests in flight."""
    s, pods = sched(scoring="cost"), eps(n)
    for i, (prompt, home) in enumerate(zip(PROMPTS, pods, strict=False)):
        s.index.record([*prompt, 50_000 + i], home.address)
        for _ in range(10):
            s.branch_spread.routed.note(home.address)
    for pod, k in zip(pods, inflight, strict=True):
        pod.inflight = k
    return s, pods


def test_a_prompt_is_copied_only_to_a_pod_left_without_a_share_of_the_traffic():
    """Four system prompts, each on its own home, 10 requests routed to each home so far. On four
    pods every pod is a prompt's home: a new conversation stays with its prompt's home though another
    home is 5 requests lighter in flight (a copy would only move load onto it), however many requests
    another pool's pods took meanwhile (a share is of the pool's own). On eight pods four pods took
    nothing: the conversation copies its prompt to one of them once its home is as far ahead."""
    for n, inflight, other_pool, copies in (
        (4, [8, 3, 8, 9], 0, False), (4, [8, 3, 8, 9], 300, False), (8, [8, 8, 8, 8, 3, 3, 3, 3], 0, True)
    ):  # fmt: skip
        s, pods = _prompt_homes(n, inflight)
        for _ in range(other_pool):
            s.branch_spread.routed.note("10.9.9.9:80")
        d = s.schedule(REQ, [*PROMPTS[0], 60_000, 60_001], "p", pods, block_tokens=64)
        assert d.continues is False and d.matches == {pods[0].address: 16}
        assert (d.primary is not pods[0]) is copies, (n, other_pool, d.primary.address)
        if copies:
            assert d.primary.address in {p.address for p in pods[4:]}
    # A pod's share counts the last SHARE_WINDOW requests: one left idle that long is room again.
    shares = RoutedShares(window=4)
    a, b, c = (EndpointState(address=x, role="both", cluster="c", pool="p") for x in ("a", "b", "c"))
    assert shares.shares([a, b]) == [0, 0]
    for x in ("a", "a", "b", "b", "b", "b"):
        shares.note(x)
    assert shares.shares([a, b]) == [0, 1] and len(shares) == 4
    shares.note("c")
    assert shares.shares([a, b, c]) == [0, 0.75, 0.25] and shares.shares([c]) == [1] and shares.shares([a]) == [0]


def test_a_prompt_whose_home_took_a_copys_worth_more_than_another_pod_gets_a_copy_there():
    """Eight pods that have all taken requests (none under a quarter of its fair part): the prompt that opened
    last has its one home, which took 30 of the window's 99 requests where every other pod took 6-12. Its
    share is more than half a fair part (routing.cost.branch_room_gap) above theirs and it has 6 more requests in
    flight (30 ms at per_inflight_s) than the least busy of them, more than a copy of the 1k-token prompt costs:
    a new conversation on it copies the prompt there, which then holds it. Where the shares are level (12 each),
    or the window holds fewer than GAP_MIN_REQUESTS a pod, or the gap is off (null), or the prefix is a document
    whose copy costs more than those requests, it stays at the home."""
    from extproc.scheduling.filters import GAP_MIN_REQUESTS

    skewed = [12, 12, 12, 30, 9, 9, 9, 6]  # the late prompt's home is pods[3]; every share over a quarter of 1/8
    few = [1, 1, 1, 3, 1, 1, 1, 1]  # as skewed, early: 3 of 10
    assert sum(few) < GAP_MIN_REQUESTS * 8 <= sum(skewed)
    for taken, gap, block, copies in (
        (skewed, 0.5, 64, True), ([12] * 8, 0.5, 64, False), (few, 0.5, 64, False), (skewed, None, 64, False),
        (skewed, 0.5, 512, False),  # an 8k-token document: its copy (~0.2 s) outweighs 6 more in flight (30 ms)
    ):  # fmt: skip
        s, pods = sched(scoring="cost", cost={"branch_room_gap": gap}), eps(8)
        for prompt, home in zip(PROMPTS, pods, strict=False):
            s.index.record([*prompt, 50_000], home.address)
        for pod, n in zip(pods, taken, strict=True):
            for _ in range(n):
                s.branch_spread.routed.note(pod.address)
            pod.inflight = 3
        pods[3].inflight = 8
        pods[5].inflight = 2  # the least busy pod with room
        d = s.schedule(REQ, [*PROMPTS[3], 60_000, 60_001], "p", pods, block_tokens=block)
        assert d.continues is False and d.matches == {pods[3].address: 16}
        assert (d.primary is pods[5]) is copies and (d.primary is pods[3]) is not copies, (taken, gap, block)
        if copies:
            assert s.index.match(PROMPTS[3], [pods[5].address]) == {pods[5].address: 16}


def test_a_prefix_with_its_fair_number_of_homes_leaves_the_pods_without_a_share_to_the_others():
    """Eight pods, three system prompts on two homes each (busy), two pods that took nothing. New conversations
    have branched off the three prompts, so each prompt's fair number of homes is 8 // 3 = 2: a new conversation
    on the first stays with its homes, leaving the empty pods to prompts that have fewer (without
    routing.cost.branch_fair_homes it copies the prompt there, as when it is the only prefix in use: an agent's
    prompt gets every pod). A fourth prompt, on one of them since, gets its second home on the other."""
    for fair_homes, others, copies in ((True, 2, False), (False, 2, True), (True, 0, True)):
        s, pods = sched(scoring="cost", cost={"branch_fair_homes": fair_homes}), eps(8)
        for k in range(3):
            for home in pods[2 * k : 2 * k + 2]:
                s.index.record([*PROMPTS[k], 50_000 + k], home.address)
                for _ in range(10):
                    s.branch_spread.routed.note(home.address)
                home.inflight = 8
        for k in range(1, 1 + others):
            s.branch_spread.roots.note(PROMPTS[k][-1])  # new conversations branched off the other prompts
        explained = s.schedule(REQ, [*PROMPTS[0], 60_000, 60_001], "p", pods, block_tokens=64, dry_run=True)
        assert (explained.primary in pods[6:]) is copies and len(s.branch_spread.roots) == others  # noted nothing
        d = s.schedule(REQ, [*PROMPTS[0], 60_000, 60_001], "p", pods, block_tokens=64)
        assert d.continues is False and d.matches == {pods[0].address: 16, pods[1].address: 16}
        assert len(s.branch_spread.roots) == others + fair_homes  # the routed one's prompt, where counted
        assert (d.primary in pods[6:]) is copies and (d.primary in pods[:2]) is not copies, (fair_homes, others)
        if not copies:
            s.index.record([*PROMPTS[3], 50_003], pods[6].address)  # a fourth prompt's first conversations
            for _ in range(10):
                s.branch_spread.routed.note(pods[6].address)
            pods[6].inflight = 8
            d = s.schedule(REQ, [*PROMPTS[3], 60_000, 60_001], "p", pods, block_tokens=64)
            assert d.continues is False and d.matches == {pods[6].address: 16} and d.primary is pods[7]


def test_recent_roots_counts_the_prefixes_the_window_of_new_conversations_branched_off():
    from extproc.scheduling.filters import RecentRoots

    roots = RecentRoots(window=3)
    counts = []
    for r in (1, 2, 1, 3):
        counts.append(roots.count(r))
        roots.note(r)
    assert counts == [1, 2, 2, 3] and len(roots) == 3
    roots.note(1)
    assert roots.count(3) == 2 and len(roots) == 2  # 2 was last noted 3 conversations ago: out of the window


def test_a_prompt_is_copied_to_any_pod_left_without_a_share_while_a_new_home_is_as_idle():
    """Eight pods: four prompts' homes, a fifth pod that took a copy of a prompt (its share of the traffic
    is a home's) and three pods that took nothing, the copy's pod and the empty ones all idle. A new
    conversation on a busy home copies its prompt to an empty pod: the copy's pod, idle as it is, is
    another prompt's home and no reason to stay."""
    s, pods = _prompt_homes(8, [8, 8, 8, 8, 0, 0, 0, 0])
    s.index.record([*PROMPTS[1], 50_100], pods[4].address)
    for _ in range(10):
        s.branch_spread.routed.note(pods[4].address)
    d = s.schedule(REQ, [*PROMPTS[0], 60_000, 60_001], "p", pods, block_tokens=64)
    assert d.continues is False and d.matches == {pods[0].address: 16}
    assert d.primary.address in {p.address for p in pods[5:]}, d.primary.address
