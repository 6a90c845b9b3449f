"""The decision's hot path, made cheaper without changing what it decides: the approximate index
against a one-block-at-a-time reference, the cost scorer against its formula pod by pod, the ranking
against a plain sort, the prefill queue's empty reads, the unlocked per-request metrics against
prometheus_client's methods, the stream's one idle timer, the tokenizer's chunk cache against
whole-text encoding, and a long prompt's encoding off the event loop."""

import asyncio
import itertools
import random
import sysconfig
import threading
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import xxhash
from prometheus_client import generate_latest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from extproc import envoy, hashing, keys
from extproc.config import CostConfig, build_config
from extproc.endpoints.pool import EndpointState, PrefillQueue
from extproc.index.approx import ApproxPrefixIndex
from extproc.observability import Metrics
from extproc.request import InferenceRequest
from extproc.rollout import ROLLOUT_METADATA
from extproc.router import Router
from extproc.scheduling.base import SchedulingContext
from extproc.scheduling.pickers import rank_by_score
from extproc.scheduling.scorers import CostScorer
from extproc.server import OFF_LOOP_CHARS, ExternalProcessor, _route_shadows
from extproc.tokenize import _CUT, CHUNK_CHARS, ModelTokenizer
from tests.unit.test_server_stream import body_msgs, chat, headers_msg, run


class ReferenceIndex:
    """The approximate index's semantics, one block at a time (what ApproxPrefixIndex did before)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def record(self, keys: Sequence[int], endpoint: str) -> None:
        lru = self.lru.setdefault(endpoint, OrderedDict())
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def match(self, keys: Sequence[int], endpoints: Sequence[str]) -> dict[str, int]:
        out = {}
        for e in set(endpoints):
            run = 0
            for k in keys:
                if k not in self.lru.get(e, {}):
                    break
                run += 1
            if run:
                out[e] = run
        return out

    def remove_endpoint(self, endpoint: str) -> None:
        self.lru.pop(endpoint, None)


def _chain(blocks: Sequence[int]) -> list[int]:
    """Chained keys of a prompt's blocks, as route keys are: a key names its block and every one before."""
    out, k = [], 0
    for b in blocks:
        k = xxhash.xxh3_64_intdigest(b"%d:%d" % (k, b))
        out.append(k)
    return out


def _random_prompt(rng: random.Random) -> list[int]:
    """Blocks of a prompt: one of 4 stems, then one of 4 branches, then blocks of its own (shared
    prefixes, follow-ups that add blocks to an earlier prompt)."""
    stem = rng.randint(0, 3)
    return ([stem] * rng.randint(0, 6) + [100 + rng.randint(0, 3)] * rng.randint(0, 4)
            + [1000 + rng.randint(0, 5) + i for i in range(rng.randint(0, 8))])  # fmt: skip


def _check_against_reference(rng: random.Random, prompt: Callable[[random.Random], list[int]],
                             compare_matches: bool) -> None:  # fmt: skip
    cap = rng.randint(1, 40)
    idx, ref = ApproxPrefixIndex(cap), ReferenceIndex(cap)
    eps = [f"10.0.0.{i}:8000" for i in range(7)]
    for _ in range(1500):
        keys = prompt(rng)
        op = rng.random()
        if op < 0.45:
            e = rng.choice(eps)
            idx.record(keys, e)
            ref.record(keys, e)
        elif op < 0.97:
            cands = rng.sample(eps, rng.randint(0, len(eps)))
            if compare_matches:
                assert idx.match(keys, cands) == ref.match(keys, cands), (keys, cands)
            else:
                idx.match(keys, cands)
        else:
            e = rng.choice(eps)
            idx.remove_endpoint(e)
            ref.remove_endpoint(e)
        for e in eps:
            assert list(idx._lru.get(e, ())) == list(ref.lru.get(e, ()))
    held = {(k, e) for e, lru in idx._lru.items() for k in lru}
    assert held == {(k, e) for shard in idx._holders for k, mask in shard.items() for e in idx._names(mask)}


@pytest.mark.parametrize("seed", range(6))
def test_approx_index_equals_the_block_by_block_reference(seed):
    """Chained prompts (shared stems and branches, follow-ups that add blocks), on few and many
    candidates, under eviction and pod removals: the same matches (``match`` bisects a pod's leading
    run, exact for chains), the same LRU order, and holders that agree with the LRUs."""
    _check_against_reference(random.Random(seed), lambda rng: _chain(_random_prompt(rng)), compare_matches=True)


@pytest.mark.parametrize("seed", range(3))
def test_approx_records_of_arbitrary_key_lists_keep_the_reference_order(seed):
    """Key lists that are no chains (gaps, repeats, blocks held without their first): records keep the
    reference's LRU order and holders all the same (matches are only exact on chains)."""
    _check_against_reference(random.Random(seed),
                             lambda rng: [rng.randint(0, 30) for _ in range(rng.randint(0, 10))],
                             compare_matches=False)  # fmt: skip


def test_a_pods_held_blocks_of_a_chain_stay_a_leading_run_under_eviction():
    """What bisecting relies on: after records of chains (conversations' turns of every length, on a
    shared system prompt) and evictions, each chain's blocks a pod holds are a leading run, and
    ``match`` finds its length, for runs of many sizes."""
    rng = random.Random(7)
    idx = ApproxPrefixIndex(1000)
    talks = [_chain([0] * 8 + [c] * 292) for c in range(1, 9)]
    for _ in range(300):
        idx.record(rng.choice(talks)[: rng.randint(1, 300)], "a")
    lru = idx._lru["a"]
    runs = set()
    for talk in talks:
        flags = [k in lru for k in talk]
        run = flags.index(False) if False in flags else len(flags)
        assert not any(flags[run:]), "a block held past the first one missing"
        assert idx.match(talk, ["a"]) == ({"a": run} if run else {})
        for n in (1, 2, 3, run - 1, run, run + 1, 299):
            if 0 < n <= len(talk):
                assert idx.match(talk[:n], ["a"]) == ({"a": min(n, run)} if min(n, run) else {})
        runs.add(run)
    assert len(runs) >= 5 and min(runs) > 0 and max(runs) < 300, runs  # partial runs of many lengths


@pytest.mark.parametrize("step", [256, 64, 4])
def test_chain_spans_memo_gives_the_block_by_block_chain(monkeypatch, step):
    """Groups of blocks met before come from the memo: the keys stay exactly ``chain``'s, whatever
    the parent (the same text under another seed or after other text keys differently), the length
    (partial groups) or the memo's bound."""
    for table, bound in (("_memo", "MEMO_GROUPS"), ("_probation", "PROBATION_GROUPS")):
        monkeypatch.setattr(hashing, table, OrderedDict())
        monkeypatch.setattr(hashing, bound, 5)
    rng = random.Random(step)
    doc = rng.randbytes(step * hashing.GROUP_BLOCKS * 4 + step * 3)

    def expected(seed: int, data: bytes) -> list[int]:
        out, parent = [], seed
        for off in range(0, len(data), step):
            parent = hashing.chain(parent, data[off : off + step])
            out.append(parent)
        return out

    for _ in range(3):  # cold (on probation), met again (into the memo), then from the memo
        for seed in (1, 2):
            for n in (len(doc), step * hashing.GROUP_BLOCKS, step * 5, 0):
                assert hashing.chain_spans(seed, doc[:n], step) == expected(seed, doc[:n])
            shifted = doc[step : step * (hashing.GROUP_BLOCKS * 2 + 1)]  # the same bytes, other parents
            assert hashing.chain_spans(seed, shifted, step) == expected(seed, shifted)
    assert 0 < len(hashing._memo) <= 5 and len(hashing._probation) <= 5  # bounded, and used


@pytest.mark.parametrize("chars", [64, 5])
def test_chain_chars_memo_gives_the_block_by_block_chain(monkeypatch, chars):
    """Text past ASCII in blocks of characters: groups of blocks met before come from the memo (ASCII
    groups under chain_spans' own keys), and the keys stay each block's UTF-8 ``chain``, whatever the
    parent, the length or the memo's bound."""
    for table, bound in (("_memo", "MEMO_GROUPS"), ("_probation", "PROBATION_GROUPS")):
        monkeypatch.setattr(hashing, table, OrderedDict())
        monkeypatch.setattr(hashing, bound, 6)
    rng = random.Random(chars)
    group = chars * hashing.GROUP_BLOCKS
    ascii_part = "".join(rng.choice("ab c.") for _ in range(group * 2))
    mixed = "".join(rng.choice(["a", " ", "é", "“", "数", "\ud800", "😀"]) for _ in range(group * 2 + chars * 3))
    text = ascii_part + mixed

    def expected(seed: int, t: str, n: int) -> list[int]:
        out, parent = [], seed
        for i in range(n):
            parent = hashing.chain(parent, t[i * chars : (i + 1) * chars].encode("utf-8", "surrogatepass"))
            out.append(parent)
        return out

    for _ in range(3):  # cold (on probation), met again (into the memo), then from the memo
        for seed in (1, 2):
            for n in (len(text) // chars, hashing.GROUP_BLOCKS * 3, 5, 0):
                assert hashing.chain_chars(seed, text, chars, n) == expected(seed, text, n)
            shifted = text[chars:]  # the same characters, other parents
            assert hashing.chain_chars(seed, shifted, chars, 40) == expected(seed, shifted, 40)
    assert 0 < len(hashing._memo) <= 6 and len(hashing._probation) <= 6  # bounded, and used
    # An ASCII group is memoized as chain_spans memoizes its bytes: the same keys either way.
    monkeypatch.setattr(hashing, "_memo", OrderedDict())
    monkeypatch.setattr(hashing, "_probation", OrderedDict())
    for _ in range(2):
        hashing.chain_chars(7, ascii_part + "é", chars, 2 * hashing.GROUP_BLOCKS)
    assert len(hashing._memo) == 2
    assert hashing.chain_spans(7, ascii_part.encode(), chars) == expected(7, ascii_part, 2 * hashing.GROUP_BLOCKS)
    assert len(hashing._memo) == 2  # found there, not added again


def test_chain_spans_memo_keeps_recurring_groups_over_one_offs(monkeypatch):
    """Groups seen once (each request's own tail) stay on probation: however many pass, the groups
    of a document met twice stay in the memo."""
    monkeypatch.setattr(hashing, "_memo", OrderedDict())
    monkeypatch.setattr(hashing, "_probation", OrderedDict())
    step = 64
    doc = random.Random(1).randbytes(step * hashing.GROUP_BLOCKS * 3)
    hashing.chain_spans(9, doc, step)
    hashing.chain_spans(9, doc, step)
    held = dict(hashing._memo)
    assert len(held) == 3
    for i in range(hashing.PROBATION_GROUPS + 10):
        hashing.chain_spans(9, i.to_bytes(8) * (step * hashing.GROUP_BLOCKS // 8), step)
    assert dict(hashing._memo) == held and len(hashing._probation) == hashing.PROBATION_GROUPS


def test_cost_estimates_equal_each_pods_own_terms():
    """``estimates`` prices each distinct cached size once for all pods: the same terms as pricing
    every pod on its own."""
    scorer = CostScorer(CostConfig())
    eps = [EndpointState(f"10.0.0.{i}:8000", "both", "c", "p", inflight=i, queue=[None, 2.0][i % 2]) for i in range(5)]
    eps[3].prefills.add(0.2, 0.0)
    eps[4].handoffs.add(1e9)
    req = InferenceRequest(path="/v1/completions", method="POST", request_id="r", tenant="", model="m")
    ctx = SchedulingContext(request=req, keys=list(range(40)), block_tokens=16.0, prompt_tokens=700.0, now=1.0)
    ctx.matches = {eps[0].address: 40, eps[2].address: 12, eps[4].address: 12}
    est = scorer.estimates(ctx, eps)
    assert est == {e.address: scorer.terms(ctx, e, held=640.0) for e in eps}
    assert est[eps[1].address].recompute_s > 0 and est[eps[0].address].recompute_s == 0


def reference_terms(cost: CostConfig, ctx: SchedulingContext, e: EndpointState, held: float) -> tuple[float, ...]:
    """The cost scorer's terms as CostScorer documents them, one pod at a time (what it computed before)."""
    cached = min(ctx.prompt_tokens, ctx.matches.get(e.address, 0) * ctx.block_tokens)
    wait = e.inflight * cost.per_inflight_s + max((e.queue or 0.0) * cost.per_waiting_s, e.prefills.wait(ctx.now))
    recompute = cost.prefill_s(held - cached, cached) if held > cached else 0.0
    work = cost.prefill_s(ctx.prompt_tokens - cached, cached) * (1 + e.handoffs.pending(ctx.now))
    stall = cost.decode_stall_weight * work * e.inflight
    return wait, work, recompute, wait + work + cost.recompute_weight * recompute + stall


@pytest.mark.parametrize("seed", range(3))
def test_cost_scores_equal_the_formula_pod_by_pod(seed):
    """One loop over the pods, config read once and prefills memoized: the same terms, to the bit, as
    the formula per pod, and scores 1 - cost / the highest cost."""
    rng = random.Random(seed)
    cost = CostConfig(recompute_weight=rng.choice([0.0, 0.5, 1.0]), decode_stall_weight=rng.choice([0.0, 0.3]))
    scorer = CostScorer(cost)
    req = InferenceRequest(path="/v1/completions", method="POST", request_id="r", tenant="", model="m")
    for _ in range(50):
        eps = [EndpointState(f"10.0.0.{i}:8000", "both", "c", "p", inflight=rng.randrange(4),
                             queue=rng.choice([None, 0.0, 3.0])) for i in range(rng.randint(1, 6))]  # fmt: skip
        for e in eps:
            if rng.random() < 0.5:
                e.prefills.add(rng.random(), 0.0)
            if rng.random() < 0.3:
                e.handoffs.add(rng.choice([0.5, 1e9]))
        blocks = rng.randint(1, 60)
        prompt = rng.choice([blocks * 16.0, blocks * 16.0 + 9, 100.0])  # all keyed, past the keys, fewer
        ctx = SchedulingContext(request=req, keys=list(range(blocks)), block_tokens=16.0, prompt_tokens=prompt, now=1.0)
        ctx.matches = {e.address: rng.randint(1, blocks) for e in eps if rng.random() < 0.6}
        held = min(ctx.prompt_tokens, max(ctx.matches.values(), default=0) * ctx.block_tokens)
        want = {e.address: reference_terms(cost, ctx, e, held) for e in eps}
        scores = scorer.score(ctx, eps)
        assert {a: tuple(v) for a, v in ctx.estimates.items()} == want
        hi = max(v[3] for v in want.values())
        assert scores == ({a: 1.0 - v[3] / hi for a, v in want.items()} if hi > 0 else {})


def test_rank_by_score_equals_sorting_by_score_then_rendezvous_hash():
    """The decorated sort ranks exactly as sorting the pods by (score, their hash under the key)."""
    rng = random.Random(7)
    for _ in range(500):
        eps = [EndpointState(f"10.0.{rng.randrange(9)}.{i}:8000", "both", "c", "p") for i in range(rng.randint(1, 9))]
        scores = {e.address: rng.choice([0.0, 0.5, 1.0, rng.random()]) for e in eps if rng.random() < 0.8}
        key = rng.getrandbits(64)
        tie = {e.address: xxhash.xxh3_64_intdigest(e.address.encode(), seed=key) for e in eps}
        want = sorted(eps, key=lambda e: (scores.get(e.address, 0.0), tie[e.address]), reverse=True)
        assert rank_by_score(eps, scores, key) == want


class AlwaysAdvancing(PrefillQueue):
    """``wait`` as it was: the queue run forward at every read, empty or not."""

    __slots__ = ()

    def wait(self, now: float) -> float:
        self._advance(now)
        return sum(e.work for e in self._queue) + sum(self._peers.values())


def test_reading_an_empty_prefill_queue_changes_nothing():
    """``wait`` on an empty queue answers 0 without running it forward: read at every step, it holds
    the same figures, to the bit, as a queue run forward at every read."""
    rng = random.Random(3)
    for _ in range(200):
        new, old = PrefillQueue(), AlwaysAdvancing()
        t, tickets = 0.0, []
        for _ in range(12):
            t += rng.choice([0.0, 0.01, 0.3, 2.0])
            op, seconds, within = rng.random(), rng.random(), rng.choice([None, 0.5])
            for q in (new, old):
                if op < 0.4:
                    ticket = q.add(seconds, t, within)
                elif op < 0.55:
                    q.set_peer("peer", seconds * (op < 0.5), t)
                elif op < 0.75 and tickets:
                    q.finished(tickets[0], t)
            if op < 0.4:
                tickets.append(ticket)
            elif op < 0.75 and tickets and op >= 0.55:
                tickets.pop(0)
            assert new.wait(t) == old.wait(t)
        assert (new.own_wait(t), new.served) == (old.own_wait(t), old.served)


def test_hot_path_metrics_export_what_prometheus_methods_export():
    """The per-request updates (unlocked cells, the decision histogram's buckets) give the same
    exposition as prometheus_client's own methods; the metric's methods still reach the same value; a
    pod that leaves takes its series, and one that comes back starts from 0."""
    hot, ref = Metrics(), Metrics()
    pod = "10.0.0.1:8000"
    for i, seconds in enumerate([0.00005, 0.0001, 0.0007, 0.004, 0.3, 2.0, 0.0025]):
        hot.observe_decision(seconds)
        ref.decision_seconds.observe(seconds)
        hot.cell(hot.decisions, "p", pod, "prefix").v += 1
        ref.decisions.labels("p", pod, "prefix").inc()
        hot.cell(hot.predicted_cached, "p").v += 64 * i
        ref.predicted_cached.labels("p").inc(64 * i)
        hot.cell(hot.inflight, pod).v = i % 3
        ref.inflight.labels(pod).set(i % 3)
        hot.open_streams.v += 1
        ref.streams.inc()
    hot.open_streams.v -= 2
    ref.streams.dec(2)
    hot.decisions.labels("p", pod, "prefix").inc(5)  # the metric's own method: the same value as the cell's
    ref.decisions.labels("p", pod, "prefix").inc(5)

    def exposition(m: Metrics) -> list[str]:
        return [x for x in generate_latest(m.registry).decode().splitlines() if "_created" not in x]

    assert exposition(hot) == exposition(ref)

    def decisions(reason: str) -> float | None:
        labels = {"pool": "p", "endpoint": pod, "reason": reason}
        return hot.registry.get_sample_value("kvroute_decisions_total", labels)

    assert decisions("prefix") == 12
    hot.forget_endpoint(pod)
    assert hot.registry.get_sample_value("kvroute_inflight_requests", {"endpoint": pod}) is None
    hot.cell(hot.decisions, "p", pod, "hash").v += 1
    assert decisions("prefix") is None and decisions("hash") == 1


def test_route_shadow_marker_is_read_from_the_streams_metadata():
    """The route's shadow marker: only its exact (key, value) pair on the stream's gRPC metadata, whose
    entries grpc hands over as (key, value) named tuples."""
    pair = namedtuple("pair", "key value")

    class Context:
        def __init__(self, *metadata: tuple[str, str | bytes]) -> None:
            self.metadata = tuple(pair(*m) for m in metadata)

        def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
            return self.metadata

    assert _route_shadows(Context(("user-agent", "envoy"), (ROLLOUT_METADATA, "shadow")))
    assert not _route_shadows(Context((ROLLOUT_METADATA, "enforce"), ("x-shadow-bin", b"shadow")))
    assert not _route_shadows(Context()) and not _route_shadows(None)


def test_request_seed_is_the_scopes_hash_remembered_within_a_bound(monkeypatch):
    """The chain's root per (model, tenant, salt) is remembered, and starts over at its bound."""
    monkeypatch.setattr(keys, "_SEEDS", {})
    monkeypatch.setattr(keys, "_SEEDS_MAX", 2)

    def req(tenant: str, salt: str | None = None) -> InferenceRequest:
        return InferenceRequest(path="/v1/completions", method="POST", request_id="r", tenant=tenant, model="m",
                                cache_salt=salt)  # fmt: skip

    assert keys.request_seed(req("a")) == hashing.seed_key("m", "a", "") == keys.request_seed(req("a"))
    assert keys.request_seed(req("a", "s")) == hashing.seed_key("m", "a", "s") != keys.request_seed(req("a"))
    assert len(keys._SEEDS) == 2
    assert keys.request_seed(req("b")) == hashing.seed_key("m", "b", "") and len(keys._SEEDS) == 1


def test_routing_answers_come_from_the_cache_equal_and_new_each_time(monkeypatch):
    """A routing answer served from the cache equals one filled field by field, is a message of its
    own (changing it changes no later answer), and a full cache starts over."""
    monkeypatch.setattr(envoy, "_ANSWERS", {})
    monkeypatch.setattr(envoy, "_ANSWERS_MAX", 2)
    dest = {"x-gateway-destination-endpoint": "10.0.0.1:8000"}
    meta = {"x-gateway-destination-endpoint": "10.0.0.1:8000,10.0.0.2:8000"}
    fresh = envoy.ProcessingResponse()
    envoy._fill_common(fresh.request_body.response, dest, ["x-kvroute-pd"], True)
    envoy._fill_lb_metadata(fresh.dynamic_metadata, meta)
    first = envoy.request_body_response(set_headers=dest, remove=["x-kvroute-pd"], clear_route_cache=True,
                                        metadata=meta)  # fmt: skip
    first.request_body.response.clear_route_cache = False
    again = envoy.request_body_response(set_headers=dest, remove=["x-kvroute-pd"], clear_route_cache=True,
                                        metadata=meta)  # fmt: skip
    assert again == fresh and again is not first and len(envoy._ANSWERS) == 1
    as_headers = envoy.request_headers_response(set_headers=dest, clear_route_cache=True)
    assert as_headers.WhichOneof("response") == "request_headers" and len(envoy._ANSWERS) == 2
    envoy.request_body_response(set_headers={"x-gateway-destination-endpoint": "10.0.0.2:8000"})
    assert len(envoy._ANSWERS) == 1  # full: started over
    assert envoy.request_body_response(body=b"{}").request_body.response.body_mutation.body == b"{}"  # not cached


def _processor(idle_s: float) -> ExternalProcessor:
    cfg = {"pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}}, "server": {"stream_idle_timeout_s": idle_s}}
    return ExternalProcessor(Router(build_config(cfg), Metrics()))


def _idle_closed(proc: ExternalProcessor) -> float:
    return proc.metrics.streams_limited.labels("idle")._value.get()


async def test_a_silent_stream_is_closed_after_the_idle_timeout():
    proc = _processor(0.2)
    silence = asyncio.Event()

    async def messages():
        yield headers_msg()
        await silence.wait()  # Envoy never sends the body, nor closes the stream

    out = await asyncio.wait_for(_collect(proc, messages()), 10)
    assert [r.WhichOneof("response") for r in out] == ["request_headers"]
    assert _idle_closed(proc) == 1 and proc._open == 0


async def test_a_stream_busy_or_talking_longer_than_the_timeout_stays_open(monkeypatch):
    """Only waiting on Envoy counts: handling each message (e.g. a prefill leg) for longer than the
    timeout, and messages that keep coming well within it, do not close the stream."""
    proc = _processor(0.5)
    on_message = proc._on_message

    async def slow(st, msg):
        await asyncio.sleep(0.7)
        return await on_message(st, msg)

    monkeypatch.setattr(proc, "_on_message", slow)

    async def messages():
        yield headers_msg()
        for m in body_msgs(chat(), cuts=(10,)):
            await asyncio.sleep(0.05)
            yield m

    out = await asyncio.wait_for(_collect(proc, messages()), 20)
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_body"]
    assert _idle_closed(proc) == 0


async def test_a_silent_stream_closes_and_a_talking_one_open_beside_it_stays():
    """Streams open together share one idle sweep: the silent one closes at its timeout; the one that
    keeps talking (resting after it, again and again, for longer than the timeout) stays open."""
    proc = _processor(1.0)
    silence = asyncio.Event()
    chunks = body_msgs(chat(), cuts=tuple(range(20, 620, 20)))

    async def silent():
        yield headers_msg()
        await silence.wait()

    async def talking():
        yield headers_msg()
        for m in chunks:  # 31 chunks 50 ms apart: 1.5 s in all
            await asyncio.sleep(0.05)
            yield m

    quiet, chatty = await asyncio.wait_for(asyncio.gather(_collect(proc, silent()), _collect(proc, talking())), 20)
    assert [r.WhichOneof("response") for r in quiet] == ["request_headers"]
    assert [r.WhichOneof("response") for r in chatty] == ["request_headers"] + ["request_body"] * len(chunks)
    assert _idle_closed(proc) == 1 and proc._open == 0


async def test_a_cancelled_stream_is_not_counted_idle():
    proc = _processor(30)
    started = asyncio.Event()

    async def messages():
        yield headers_msg()
        started.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(_collect(proc, messages()))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _idle_closed(proc) == 0 and proc._open == 0


async def _collect(proc: ExternalProcessor, messages) -> list:
    return [r async for r in proc.Process(messages, None)]


# -- the tokenizer's chunk cache ------------------------------------------------------------------------

# A Llama-3-style split pattern (contractions, letters with one leading non-letter, up to 3 digits,
# punctuation runs with their newlines, whitespace runs), applied before a regex-less ByteLevel.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _corpus() -> list[str]:
    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    prose = "Ünïcödé wörds, 数字 and emoji \U0001f600 in prose: it's what they'll test. 1234567 apples!\n\n"
    return [p.read_text(errors="replace") for p in src] + [prose * 50]


def _trained(kind: str) -> Tokenizer:
    """A small tokenizer of one family (BPE; WordPiece as bench.sim exports one), trained on stdlib sources."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]") if kind == "wordpiece" else models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind in ("llama3", "wordpiece"):
        split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:  # SentencePiece-style: a word's leading space is part of it, and the text's first word gets one
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind != "spm" else []
    if kind == "wordpiece":
        trainer: trainers.Trainer = trainers.WordPieceTrainer(
            vocab_size=1500, initial_alphabet=alphabet, special_tokens=["<|end|>", "[UNK]"], show_progress=False
        )
    else:
        trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=alphabet, special_tokens=["<|end|>"],
                                      show_progress=False)  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer)
    return tok


class Recording:
    """A tokenizer that notes how many characters it was asked to encode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.chars = tok, 0

    def encode(self, text: str, add_special_tokens: bool):
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool):
        self.chars += sum(map(len, texts))
        return self.tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str):
        return getattr(self.tok, name)


@pytest.fixture(scope="module", params=["gpt2", "llama3", "spm", "wordpiece"])
def family(request):
    return request.param, _trained(request.param)


def test_long_text_encodes_exactly_as_a_whole_and_reuses_a_shared_prefix(family):
    kind, raw = family
    tok = ModelTokenizer(Recording(raw), None, {})
    assert tok.chunk_ok == (kind != "spm")  # Metaspace would prefix each chunk: long pieces go whole
    doc = "".join(_corpus()[::-1])[: 40 * CHUNK_CHARS]
    for i, question in enumerate(["\n\nWhat does this do?", " and then some", "é 数字", "x" * 3000, ""]):
        text = doc[: len(doc) - 97 * i] + question
        assert tok.encode(text, add_special_tokens=False).tolist() == raw.encode(text, add_special_tokens=False).ids, i
        assert tok.encode(text + "<|end|>", add_special_tokens=False)[-1] == raw.token_to_id("<|end|>")
    tok._tok.chars = 0
    tok.encode(doc + " Another question, the document the same?", add_special_tokens=False)
    if kind == "spm":
        assert tok._tok.chars > len(doc)
    else:  # only the last chunk is encoded again
        assert tok._tok.chars < 3 * CHUNK_CHARS


def test_chunked_encoding_matches_at_every_cut_on_varied_text(family):
    """Cuts at every "word word" space of text in every script and spacing: the same ids."""
    kind, raw = family
    if kind == "spm":
        pytest.skip("long pieces are encoded whole")
    rng = random.Random(5)
    words = ["it's", "they'll", "1234", "x1", "Ünïcödé", "数字", "\U0001f600", "a", "B", "end.", "(x)", "--",
             "\t", "\n", "\r\n", "  ", " ", "don't", "HELLO", "ok;", "ñ", "'", "9", "z"]  # fmt: skip
    for _ in range(30):
        text = "".join(rng.choice(words) + rng.choice([" ", "", " ", "\n", "  "]) for _ in range(400))
        cuts = [0, *(m.start() for m in _CUT.finditer(text)), len(text)]
        chunked = [i for a, b in itertools.pairwise(cuts) for i in raw.encode(text[a:b], add_special_tokens=False).ids]
        assert chunked == raw.encode(text, add_special_tokens=False).ids


def test_a_planned_encoding_equals_the_whole_and_caches_each_piece_once(family):
    """plan / encode_missing (in a batch, as off the event loop) / finish give encode's ids; two requests
    planned before either finishes (one waited on the tokenizer thread) cache their shared text once."""
    kind, raw = family
    tok, once = ModelTokenizer(raw, None, {}), ModelTokenizer(raw, None, {})
    doc = "".join(_corpus())[: 12 * CHUNK_CHARS]
    first, second = tok.plan(doc, add_special_tokens=True), tok.plan(doc, add_special_tokens=True)
    assert first.missing_chars == second.missing_chars >= len(doc) - 1  # nothing cached yet
    assert tok.encode_missing(first, batch=True) == tok.encode_missing(first)
    want = raw.encode(doc, add_special_tokens=True).ids
    assert tok.finish(first, tok.encode_missing(first, batch=True)).tolist() == want
    assert tok.finish(second, tok.encode_missing(second, batch=True)).tolist() == want
    assert once.encode(doc, add_special_tokens=True).tolist() == want
    assert tok._cache.weight == once._cache.weight and list(tok._cache) == list(once._cache)
    again = tok.plan(doc + " One more question?", add_special_tokens=True)
    assert again.missing_chars < (len(doc) if kind == "spm" else 3 * CHUNK_CHARS) + 20


class Plain:
    """A tokenizer as tokenizers < 0.21 has it: no encode_batch_fast."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def __getattr__(self, name: str):
        if name == "encode_batch_fast":
            raise AttributeError(name)
        return getattr(self.tok, name)


def test_one_fast_batch_call_gives_each_texts_own_ids_and_older_tokenizers_fall_back(family):
    """The missing pieces go to the tokenizer in one encode_batch_fast call (no offsets): each gets the
    ids encoding it alone gives, with and without special tokens; without that method, per text."""
    kind, raw = family
    fast, plain = ModelTokenizer(raw, None, {}), ModelTokenizer(Plain(raw), None, {})
    assert fast._encode_fast is not None and plain._encode_fast is None
    doc = "".join(_corpus())[: 6 * CHUNK_CHARS] + " é 数字 <|end|> and the tail"
    for special in (False, True):
        p1, p2 = fast.plan(doc, special), plain.plan(doc, special)
        assert list(p1.missing) == list(p2.missing) and len(p1.missing) > 1, kind
        want = {t: raw.encode(t, add_special_tokens=special).ids for t in p1.missing}
        assert fast.encode_missing(p1) == want == plain.encode_missing(p2) == plain.encode_missing(p2, batch=True)


def test_a_rest_is_encoded_a_text_per_call_with_the_same_ids(family):
    """one_thread (a deferred rest): each missing text in a batch call of its own, which the tokenizer
    encodes on the calling thread (several in one call go to its pool, on every core); the ids are
    those of one batch, and of tokenizers without encode_batch_fast (their encode_batch, a text a call)."""
    kind, raw = family
    sizes: list[int] = []

    class Counting(Recording):
        def encode_batch_fast(self, texts: list[str], add_special_tokens: bool):
            sizes.append(len(texts))
            return super().encode_batch_fast(texts, add_special_tokens)

    tok, plain = ModelTokenizer(Counting(raw), None, {}), ModelTokenizer(Plain(raw), None, {})
    doc = "".join(_corpus())[: 6 * CHUNK_CHARS] + " é 数字 <|end|> and the tail"
    for special in (False, True):
        plan = tok.plan(doc, special)
        assert len(plan.missing) > 1, kind
        sizes.clear()
        assert tok.encode_missing(plan, one_thread=True) == tok.encode_missing(plan)
        assert sizes == [1] * len(plan.missing) + [len(plan.missing)]
        assert plain.encode_missing(plain.plan(doc, special), one_thread=True) == tok.encode_missing(plan)


def _precise(raw: Tokenizer, **extra: Any) -> tuple[ExternalProcessor, Router]:
    """Three pods keyed precisely with ``raw`` (model ``m``, blocks of 16); ``extra``: more config."""
    pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    cfg = {"pools": {"p": {"endpoints": [{"address": a} for a in pods]}},
           "models": {"m": {"pool": "p", "block_size": 16}}, "kv_events": {"enabled": True}, **extra}  # fmt: skip
    router = Router(build_config(cfg), Metrics())
    router.tokenizers["m"] = ModelTokenizer(raw, None, {})
    return ExternalProcessor(router), router


def hold_encoding(
    monkeypatch, tok: ModelTokenizer, batch_only: bool = False
) -> tuple[threading.Event, threading.Event, list[str]]:
    """``tok``'s encoding held until the test sets the second event (the first is set once one is
    held); with ``batch_only``, only encodings in a thread (``batch``: the whole long prompt;
    ``one_thread``: a rest). The third: the threads each encoding ran in."""
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []
    encode_missing = tok.encode_missing

    def held(plan, batch=False, one_thread=False):
        threads.append(threading.current_thread().name)
        if batch or one_thread or not batch_only:
            entered.set()
            assert release.wait(10)
        return encode_missing(plan, batch, one_thread)

    monkeypatch.setattr(tok, "encode_missing", held)
    return entered, release, threads


def _completion(prompt: str) -> list:
    body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 4})
    return [headers_msg(path="/v1/completions"), *body_msgs(body)]


async def test_a_long_new_prompt_is_encoded_off_the_loop_while_other_streams_are_answered(monkeypatch):
    """A precise decision over a long new prompt waits for its encoding in the tokenizer thread, and a
    short request's stream is answered meanwhile; both decide as they would inline."""
    raw = _trained("llama3")
    long_prompt, short_prompt = "".join(_corpus())[: 3 * OFF_LOOP_CHARS], "Say hello to the world. " * 20
    proc, router = _precise(raw)
    tok = router.tokenizers["m"]
    entered, release, threads = hold_encoding(monkeypatch, tok, batch_only=True)  # the long prompt, in the thread
    monkeypatch.setattr(tok, "heads", lambda plan: iter(()))  # the whole prompt's path (heads: test_head_decision.py)
    slow = asyncio.create_task(run(proc, _completion(long_prompt)))
    assert await asyncio.to_thread(entered.wait, 10)
    quick = await run(proc, _completion(short_prompt))  # answered while the long one is held
    assert not slow.done()
    release.set()
    out = await slow
    assert threads[0].startswith("kvroute-tokenize") and threads[1] == threading.current_thread().name
    assert _index_decisions(router) == {"precise": 2.0, "approx": 0.0}
    assert router.metrics.tokenize_off_loop._value.get() == 1

    inline, inline_router = _precise(raw)  # the same two decisions in the same order, both encoded on the loop
    monkeypatch.setattr("extproc.server.OFF_LOOP_CHARS", 1 << 30)
    want_quick = await run(inline, _completion(short_prompt))
    want_slow = await run(inline, _completion(long_prompt))
    assert [r.SerializeToString() for r in out] == [r.SerializeToString() for r in want_slow]
    assert [r.SerializeToString() for r in quick] == [r.SerializeToString() for r in want_quick]
    assert inline_router.metrics.tokenize_off_loop._value.get() == 0
    proc.close()
    inline.close()


async def test_a_stream_that_ends_while_its_prompt_is_encoded_holds_nothing(monkeypatch):
    raw = _trained("llama3")
    proc, router = _precise(raw)
    tok = router.tokenizers["m"]
    entered, release, _ = hold_encoding(monkeypatch, tok)
    monkeypatch.setattr(tok, "heads", lambda plan: iter(()))  # the whole prompt, off the loop
    task = asyncio.create_task(run(proc, _completion("".join(_corpus())[: 2 * OFF_LOOP_CHARS])))
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()  # Envoy closed the stream (client gone)
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert all(e.inflight == 0 for e in router.registry.by_address.values())
    assert _index_decisions(router)["precise"] == 0  # never decided: nothing recorded
    proc.close()


def _index_decisions(router: Router) -> dict[str, float]:
    return {s.labels["index"]: s.value for m in router.metrics.index_decisions.collect() for s in m.samples
            if s.name.endswith("_total")}  # fmt: skip


def test_chunk_cuts_found_by_scanning_spaces_are_the_regex_matches() -> None:
    """_next_cut (str.find from space to space) finds exactly where _CUT matches from any start,
    lookbehind before the start included, on text of every script and spacing."""
    from extproc.tokenize import _next_cut

    rng = random.Random(9)
    alphabet = ["a", "Z", "9", " ", "  ", "é", "数", "\n", ".", "x y", "1 a", "a 1", " z"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        for pos in range(len(text) + 1):
            m = _CUT.search(text, pos)
            assert _next_cut(text, pos) == (m.start() if m else -1), (text, pos)


def test_a_long_piece_met_again_is_cut_from_the_memo_within_its_bound(family, monkeypatch) -> None:
    """A document's chunks are remembered by its text: met again (a new string, the same text) it gets
    the same chunks, the same ids, and the memo stays under PIECE_MEMO_BYTES, oldest out first."""
    import sys

    from extproc import tokenize

    kind, raw = family
    if kind == "spm":
        pytest.skip("long pieces are encoded whole")
    tok = ModelTokenizer(raw, None, {})
    doc = "".join(_corpus())[: 8 * CHUNK_CHARS]
    first = tok._chunks(doc)
    again = tok._chunks("".join([doc[:10], doc[10:]]))  # equal text, another object
    assert again is first and "".join(first) == doc and len(first) > 3
    assert tok.encode(doc, add_special_tokens=False).tolist() == raw.encode(doc, add_special_tokens=False).ids
    docs = [f"{i} {doc}" for i in range(5)]
    monkeypatch.setattr(tokenize, "PIECE_MEMO_BYTES", sum(map(sys.getsizeof, docs[-3:])))
    for d in docs:
        tok._chunks(d)
    assert list(tok._pieces) == docs[-3:] and tok._pieces_bytes <= tokenize.PIECE_MEMO_BYTES


def test_splitting_at_added_tokens_by_find_is_the_regex_split(monkeypatch) -> None:
    """_split_added (str.find at the tokens' first characters) gives exactly the regex's split, tokens
    that overlap or share a prefix included, and falls back to the regex when those characters abound."""
    import re
    from types import SimpleNamespace

    from extproc import tokenize

    rng = random.Random(3)
    # The last: Llama 3's shape, many tokens of a few lengths behind one long common start, and others beside.
    reserved = [f"<|r_{i}|>" for i in range(0, 120, 7)] + ["<|s|>", "<|e", "|>"]
    for added in (["<|end|>", "<|user|>", "\n"], ["bc", "ab", "a", "<|x|>", "<|xy|>", "x"], ["aa", "aaa"], reserved):
        added = sorted(added, key=len, reverse=True)
        tok = SimpleNamespace(_split=re.compile("(" + "|".join(map(re.escape, added)) + ")"),
                              _added_by_first=tokenize._by_first_char(added))  # fmt: skip
        alphabet = [*added, *(a[:-1] for a in added if len(a) > 1), "q", " ", "<", "|", "é"]
        for cap in (0, 5, 10_000):  # 5: texts with more places fall back midway through the scan
            monkeypatch.setattr(tokenize, "SPLIT_SCAN_MAX", cap)
            for _ in range(400):
                text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
                assert ModelTokenizer._split_added(tok, text) == tok._split.split(text), (added, text)  # type: ignore[arg-type]


def test_a_piece_that_starts_as_a_remembered_one_is_cut_where_a_scan_cuts_it(family) -> None:
    """A document followed by ever new text in the same message: the chunks taken over from the
    remembered piece, checked in place, are exactly what scanning the new piece gives, wherever the
    two part (inside a chunk, at a cut, one character either side)."""
    from extproc.tokenize import _next_cut

    kind, raw = family
    if kind == "spm":
        pytest.skip("long pieces are encoded whole")

    def scanned(text: str) -> list[str]:
        out, start = [], 0
        while (cut := _next_cut(text, start + CHUNK_CHARS)) >= 0:
            out.append(text[start:cut])
            start = cut
        return [*out, text[start:]]

    tok = ModelTokenizer(raw, None, {})
    rng = random.Random(2)
    words = ["alpha", "beta", "x1", "9", "é", "  ", "\n", "Z", " a", "b ", "数字"]
    doc = "".join(rng.choice(words) + " " for _ in range(3000))
    cuts = [len("".join(scanned(doc)[:k])) for k in range(1, 6)]
    taken = 0
    for i in range(300):
        at = rng.choice([rng.randint(0, len(doc)), *(c + d for c in cuts for d in (-1, 0, 1, 2))])
        text = doc[:at] + "".join(rng.choice(words) + rng.choice([" ", ""]) for _ in range(rng.randint(0, 300)))
        if len(text) < 2 * CHUNK_CHARS:
            continue
        chunks = tok._chunks(text)
        assert chunks == scanned(text), (i, at)
        taken += sum(c is d for c, d in zip(chunks, tok._chunks(doc), strict=False))
    assert taken > 100  # the chunks were the remembered strings, not new ones


def test_a_chat_template_never_renders_a_large_media_payload() -> None:
    """An image reaches a template that iterates content as ``{"type": "image"}`` (vLLM's "openai" format: the
    template writes its placeholder) and is left out of one that writes content whole ("string" format): no
    base64 to encode either way."""
    import base64

    by_type = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% elif p['type'] == 'image' %}"
        "<|image|>{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    )
    whole = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    image = "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 4000).decode()

    def chat(url: str) -> dict:
        parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}

    raw = _trained("llama3")
    typed = ModelTokenizer(raw, by_type, {})
    assert typed.render_chat(chat(image)) == typed.render_chat(chat("x")) == "<|user|>what is this?<|image|><|end|>"
    plain = ModelTokenizer(raw, whole, {})
    assert plain.render_chat(chat(image)) == "<|user|>what is this?<|end|>"


def test_continue_final_message_renders_up_to_the_final_messages_text() -> None:
    """transformers' cut: the render ends where the final message's text does (before any whitespace the
    template trimmed); with add_generation_prompt too, the request is refused (vLLM answers 400)."""
    kept = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    trimmed = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"
    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two, "}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    raw = _trained("llama3")
    assert ModelTokenizer(raw, kept, {}).render_chat(body) == "<|user|>count<|end|><|assistant|>one, two, "
    assert ModelTokenizer(raw, trimmed, {}).render_chat(body) == "<|user|>count<|end|><|assistant|>one, two,"
    with pytest.raises(ValueError, match="not compatible"):
        ModelTokenizer(raw, kept, {}).render_chat({**body, "add_generation_prompt": True})


def test_the_templates_tojson_is_json_dumps_remembered(monkeypatch) -> None:
    """``tojson`` gives exactly ``json.dumps`` with the filter's arguments (transformers' filter), from the
    memo when asked again; values orjson cannot write, or too large to keep, are dumped as asked."""
    import json

    from extproc import tokenize

    monkeypatch.setattr(tokenize, "_tojson_memo", {})
    monkeypatch.setattr(tokenize, "_tojson_bytes", 0)
    tool = {
        "type": "function",
        "function": {"name": "f", "description": "Größe “x”", "parameters": {"b": 1, "a": [1.5, None, True]}},
    }
    values = [tool, [tool, tool], "s", 3, 2.0, None, {"z": 1, "a": 2}, {1: "int key"}, 2**70, []]
    asks = [
        {},
        {"indent": 4},
        {"indent": "  "},
        {"ensure_ascii": True},
        {"separators": [",", ":"]},
        {"sort_keys": True},
    ]
    for v in values:
        for kw in asks:
            want = json.dumps(v, **{"ensure_ascii": False, **kw})
            assert tokenize._tojson(v, **kw) == want
            assert tokenize._tojson(v, **kw) == want  # again: from the memo where it was kept
    first = tokenize._tojson(tool, indent=4)
    assert tokenize._tojson(json.loads(json.dumps(tool)), indent=4) is first  # an equal value: the memo's answer
    assert tokenize._tojson({**tool, "x": 1}, indent=4) is not first
    monkeypatch.setattr(tokenize, "TOJSON_MEMO_ITEM", 10)
    big = tokenize._tojson(tool, indent=2)
    assert big == json.dumps(tool, indent=2, ensure_ascii=False) and tokenize._tojson(tool, indent=2) is not big
    monkeypatch.setattr(tokenize, "TOJSON_MEMO_ITEM", 1 << 16)
    monkeypatch.setattr(tokenize, "TOJSON_MEMO_BYTES", 100)
    for i in range(20):
        tokenize._tojson({"i": i, "pad": "x" * 50})
    assert len(tokenize._tojson_memo) <= 2  # started over past its bytes


def test_a_template_asking_for_todays_date_gets_it_as_transformers_gives_it() -> None:
    """Llama 3.2 and 3.3's templates write today's date into the system header through ``strftime_now`` when
    it is defined (transformers, and so vLLM, define it), a fixed date when not: kvroute must render the same."""
    from datetime import datetime

    shape = (
        "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
        "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
        "<|system|>Today Date: {{ date_string }}<|end|>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "<|end|>{% endfor %}"
    )
    tok = ModelTokenizer(_trained("llama3"), shape, {})
    before = datetime.now().strftime("%d %b %Y")
    text = tok.render_chat({"messages": [{"role": "user", "content": "hi"}]})
    assert text in {
        f"<|system|>Today Date: {d}<|end|><|user|>hi<|end|>" for d in (before, datetime.now().strftime("%d %b %Y"))
    }


def test_a_template_with_generation_blocks_renders_their_body() -> None:
    """``{% generation %}`` (transformers' training marks, in some models' templates) compiles and renders its
    body as transformers renders it."""
    shape = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    )
    tok = ModelTokenizer(_trained("llama3"), shape, {})
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.render_chat({"messages": msgs}) == "<|user|>hi<|end|><|assistant|>hello<|end|>"


def test_a_request_asking_for_special_tokens_gets_them_as_vllm_adds_them() -> None:
    """vLLM adds the tokenizer's special tokens (a BOS) to a chat only when the request's add_special_tokens is
    true, and to a completion unless it is false: kvroute's precise tokens follow the request."""
    from tokenizers import processors

    raw = _trained("llama3")
    bos = raw.token_to_id("<|end|>")
    raw.post_processor = processors.TemplateProcessing(single="<|end|> $A", special_tokens=[("<|end|>", bos)])
    tok = ModelTokenizer(raw, "{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    plain = tok.chat_ids(chat).tolist()
    assert plain[0] != bos and tok.chat_ids({**chat, "add_special_tokens": True}).tolist() == [bos, *plain]

    def ids(path: str, body: dict) -> list[int]:
        req = InferenceRequest(path, "POST", "r", "default", model="m", prompt_text=body.get("prompt", ""), body=body)
        return list(Router._token_ids(req, tok))

    assert ids("/v1/chat/completions", chat) == plain
    assert ids("/v1/chat/completions", {**chat, "add_special_tokens": True}) == [bos, *plain]
    completion = {"model": "m", "prompt": "hello there"}
    assert ids("/v1/completions", completion) == [bos, *plain]
    assert ids("/v1/completions", {**completion, "add_special_tokens": False}) == plain
