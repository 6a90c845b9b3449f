"""Precise decisions on a prompt's head (its cached first pieces, or up to a new piece): when no pod holds
all of the head's blocks, the whole prompt could match no further; when one pod does and the decision picks
it, more blocks could only add to its match. Either way kvroute decides on that head and encodes the rest
after the answer (cached, recorded for the pod chosen, and the pick's predicted hit revised)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import orjson
import pytest

from extproc.endpoints.pool import PrefillQueue
from extproc.index.ends import PromptEnds
from extproc.scheduling.base import WholePromptNeeded
from extproc.server import REST_NICE, lower_thread_priority
from extproc.tokenize import HEAD_MIN_IDS, PROBE_CHARS, ModelTokenizer, TokenPlan
from tests.polling import eventually
from tests.unit.test_hotpath import _completion, _corpus, _index_decisions, _precise, _trained, hold_encoding
from tests.unit.test_server_stream import run

PROMPT = "".join(_corpus())[:7000]  # a new prompt of several chunks (extproc/tokenize.py's CHUNK_CHARS)
# The branch spread off: a head cannot tell a next turn from a new conversation on the prefix (where the earlier
# prompt ended may lie past it), so with the holder busy the spread asks for the whole prompt
# (test_a_head_the_branch_spread_would_move_off_its_busy_holder_asks_for_the_whole_prompt).
NO_SPREAD = {"cost": {"branch_copy_factor": None}}


def _counter(metric, label: str | None = None) -> dict[str, float]:
    return {s.labels.get(label, "") if label else "": s.value for m in metric.collect() for s in m.samples
            if s.name.endswith("_total")}  # fmt: skip


async def _settled(proc) -> None:
    await asyncio.sleep(0)  # the decisions' records, made once their answers were sent
    while proc._deferred:
        await asyncio.gather(*proc._deferred)


def test_each_head_ends_with_one_more_new_piece_and_its_ids_start_the_whole_prompts():
    raw = _trained("llama3")
    tok = ModelTokenizer(raw, None, {})
    plan = tok.plan(PROMPT, True)
    heads = list(tok.heads(plan))
    assert len(heads) == len(plan.missing) > 2
    assert [len(h.missing) for h in heads] == list(range(1, len(heads) + 1))
    whole = raw.encode(PROMPT, add_special_tokens=True).ids
    encoded = tok.encode_missing(plan)
    for head in heads:
        ids = tok.finish(head, encoded).tolist()
        assert ids == whole[: len(ids)]
    first = heads[0]
    n = len(tok.finish(first, encoded))
    estimate = tok.estimate_tokens(plan, first, n, encoded)
    assert n < len(whole) and abs(estimate - len(whole)) <= 0.2 * len(whole), (estimate, len(whole))
    assert tok.finish(heads[-1], encoded).tolist() == whole
    assert not list(tok.heads(TokenPlan([PROMPT], {PROMPT: None}, cache=False)))  # a prompt encoded whole


async def test_a_new_long_prompt_is_decided_on_its_head_as_on_the_whole_and_its_rest_recorded_after(monkeypatch):
    raw = _trained("llama3")
    proc, router = _precise(raw)
    first = await run(proc, _completion(PROMPT))
    await _settled(proc)
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 1.0}
    assert not router.tokenizers["m"].plan(PROMPT, True).missing  # every piece cached for the next turn
    # One prompt end noted, the whole prompt's: the head's last block is where no prompt ended (a new
    # request sharing that head branches off it; index/ends.py).
    assert len(router.precise._ends) == 1

    whole_proc, whole_router = _precise(raw)  # the same request decided on the whole prompt
    monkeypatch.setattr(whole_router.tokenizers["m"], "heads", lambda plan: iter(()))
    want = await run(whole_proc, _completion(PROMPT))
    assert [r.SerializeToString() for r in first] == [r.SerializeToString() for r in want]

    # Again: the head's last block is held now (recorded), so the whole prompt is keyed, and it matches
    # to its end on the same pod: the rest was recorded there, not only the head.
    again = await run(proc, _completion(PROMPT))
    await _settled(proc)  # its metrics, made once its answer was sent
    assert [r.SerializeToString() for r in again] == [r.SerializeToString() for r in first]
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 1.0}
    n = len(raw.encode(PROMPT, add_special_tokens=True).ids)
    assert _counter(router.metrics.predicted_cached)[""] == (n - 1) // 16 * 16
    assert _index_decisions(router) == {"precise": 2.0, "approx": 0.0}
    proc.close()
    whole_proc.close()


async def test_a_head_held_by_one_pod_that_holds_more_is_decided_there_and_its_hit_revised():
    """A pod holds a prompt's first chunks that kvroute's tokenizer cache no longer has (another replica
    routed it, or the cache evicted it): the first head is that pod's alone, the decision
    on it picks that pod, and once the rest is encoded the predicted hit is the whole prompt's match."""
    raw = _trained("llama3")
    proc, router = _precise(raw)
    tok = router.tokenizers["m"]
    await run(proc, _completion(PROMPT))
    await _settled(proc)
    before = _counter(router.metrics.predicted_cached).get("", 0.0)
    tok._cache.clear()
    chunks = tok._chunks(PROMPT)
    shared = "".join(chunks[:3])
    other = "Zebra " + "".join(_corpus())[30000:36000]
    out = await run(proc, _completion(shared + " " + other))
    await _settled(proc)
    assert out[-1].request_body.response.header_mutation.set_headers
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 2.0}  # decided on a head again
    held = len(raw.encode(shared, add_special_tokens=True).ids) // 16
    assert _counter(router.metrics.predicted_cached)[""] - before == held * 16
    proc.close()


async def test_a_rest_is_not_encoded_when_too_many_wait(monkeypatch):
    monkeypatch.setattr("extproc.server.DEFERRED_MAX", 0)
    proc, router = _precise(_trained("llama3"))
    out = await run(proc, _completion(PROMPT))
    assert out[-1].request_body.response.header_mutation.set_headers  # routed all the same
    assert _counter(router.metrics.tokenize_deferred, "result") == {"skipped": 1.0}
    assert router.tokenizers["m"].plan(PROMPT, True).missing  # the rest never encoded
    proc.close()


async def test_a_prompt_whose_new_text_is_another_requests_rest_waits_for_it_and_matches_it_whole(monkeypatch):
    """Two requests with the same long new prompt, the second arriving while the first's rest is still
    being encoded: the second waits for that rest, then finds the whole prompt cached and indexed."""
    monkeypatch.setattr("extproc.server.REST_WAIT_S", 30.0)  # the release below ends the wait, not a timeout
    raw = _trained("llama3")
    proc, router = _precise(raw)
    entered, release, _ = hold_encoding(monkeypatch, router.tokenizers["m"], batch_only=True)  # the rest, held
    first = await run(proc, _completion(PROMPT))
    assert await asyncio.to_thread(entered.wait, 10)
    second = asyncio.create_task(run(proc, _completion(PROMPT)))
    await eventually(lambda: _counter(router.metrics.tokenize_deferred, "result").get("waited") == 1.0, "a wait")
    assert not second.done()
    release.set()
    again = await second
    await _settled(proc)
    assert [r.SerializeToString() for r in again] == [r.SerializeToString() for r in first]
    n = len(raw.encode(PROMPT, add_special_tokens=True).ids)
    assert _counter(router.metrics.predicted_cached)[""] == (n - 1) // 16 * 16  # the whole prompt matched
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 1.0, "waited": 1.0}
    proc.close()


# A conversation's history (three chunks and more) and a next turn's new message of ~2k characters: more
# than the cached head's threshold (CACHED_HEAD_MIN_CHARS), less than DEFER_MIN_CHARS.
HISTORY = "".join(_corpus())[:5000]
TURN = HISTORY + " " + "".join(_corpus())[40000:42000]


def test_a_probe_is_the_start_of_the_first_text_to_encode_and_its_ids_start_the_whole_prompts():
    raw = _trained("llama3")
    tok = ModelTokenizer(raw, None, {})
    plan = tok.plan(PROMPT, True)
    probe = tok.probe(plan)
    assert probe is not None and not probe.cache and len(probe.missing) == 1
    (text,) = probe.missing
    first = next(p for p in plan.parts if isinstance(p, str))
    assert first.startswith(text) and PROBE_CHARS <= len(text) < PROBE_CHARS + 64 and first[len(text)] == " "
    encoded = tok.encode_missing(probe)
    ids = tok.finish(probe, encoded).tolist()
    whole = raw.encode(PROMPT, add_special_tokens=True).ids
    assert ids == whole[: len(ids)] and len(ids) >= 32  # two blocks of 16 at least
    assert text not in tok._cache  # no chunk: nothing cached
    # The whole prompt's length estimated from the probe counts the rest of the probe's text too (without
    # it, three quarters of a chunk short here: -13 %).
    estimate = tok.estimate_tokens(plan, probe, len(ids), encoded)
    assert abs(estimate - len(whole)) <= 0.05 * len(whole), (estimate, len(whole))
    # No probe where the first text to encode is about as short, or for a tokenizer encoding pieces whole.
    assert tok.probe(tok.plan("Zebra " * 60, True)) is None
    assert ModelTokenizer(_trained("spm"), None, {}).probe(plan) is None


async def test_a_new_prompt_is_decided_on_its_probe_with_no_more_encoded_before_the_answer(monkeypatch):
    """No pod holds the probe's blocks: the prompt can match nowhere, so the answer goes out with only the
    probe encoded, the same pod as deciding on the whole prompt; the rest (the whole prompt's texts) after."""
    raw = _trained("llama3")
    proc, router = _precise(raw)
    tok = router.tokenizers["m"]
    calls: list[tuple[int, bool]] = []  # (characters, in the rests' thread) per encoding
    encode_missing = tok.encode_missing

    def counted(plan, batch=False, one_thread=False):
        calls.append((plan.missing_chars, one_thread))
        return encode_missing(plan, batch, one_thread)

    monkeypatch.setattr(tok, "encode_missing", counted)
    new_chars = tok.plan(PROMPT, True).missing_chars  # all of it: nothing cached yet
    first = await run(proc, _completion(PROMPT))
    before = list(calls)
    await _settled(proc)
    assert len(before) == 1 and PROBE_CHARS <= before[0][0] < PROBE_CHARS + 64 and not before[0][1]
    assert calls[1:] == [(new_chars, True)] and new_chars >= len(PROMPT) - 1
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 1.0}
    whole_proc, _ = _whole_only(raw, monkeypatch)
    want = await run(whole_proc, _completion(PROMPT))
    assert [r.SerializeToString() for r in first] == [r.SerializeToString() for r in want]
    proc.close()
    whole_proc.close()


def test_a_plan_with_cached_first_pieces_yields_them_as_its_first_head():
    raw = _trained("llama3")
    tok = ModelTokenizer(raw, None, {})
    assert tok.tokens_per_char == 0.25  # nothing encoded yet: the default
    tok.encode(HISTORY, True)
    plan = tok.plan(TURN, True)
    first, *more = tok.heads(plan)
    assert not first.missing and first.parts == plan.parts[: len(first.parts)]
    assert [len(h.missing) for h in more] == list(range(1, len(plan.missing) + 1))
    whole = raw.encode(TURN, add_special_tokens=True).ids
    ids = tok.finish(first, {}).tolist()
    assert len(ids) >= HEAD_MIN_IDS and ids == whole[: len(ids)]
    assert 0.1 < tok.tokens_per_char < 1.0
    assert tok.tokens_per_char == tok._ids_cached / tok._chars_cached
    estimate = tok.estimate_tokens(plan, first, len(ids), {})  # the rest at the tokenizer's own ratio
    assert abs(estimate - len(whole)) <= 0.1 * len(whole), (estimate, len(whole))
    # Only the BOS before the first new text: too few ids to key a block, no cached head.
    assert all(h.missing for h in tok.heads(tok.plan("Zebra " + TURN, True)))


async def _turns(proc) -> list[list]:
    """The conversation's first turn, then its next: their answers (the rests settled after each)."""
    out = []
    for prompt in (HISTORY, TURN):
        out.append(await run(proc, _completion(prompt)))
        await _settled(proc)
    return out


def _req(router, prompt: str):
    return router.parse("/v1/completions", "POST", {}, orjson.dumps({"model": "m", "prompt": prompt}))


def _whole_only(raw, monkeypatch, **extra):
    proc, router = _precise(raw, **extra)
    monkeypatch.setattr(router.tokenizers["m"], "heads", lambda plan: iter(()))
    return proc, router


async def test_a_next_turn_is_decided_on_its_cached_history_on_the_pod_holding_it(monkeypatch):
    raw = _trained("llama3")
    proc, router = _precise(raw)
    first, nxt = await _turns(proc)
    whole_proc, whole_router = _whole_only(raw, monkeypatch)
    want = await _turns(whole_proc)
    # The same pods as deciding on every whole prompt, the next turn on the first turn's pod.
    assert [[r.SerializeToString() for r in out] for out in (first, nxt)] == [
        [r.SerializeToString() for r in out] for out in want
    ]
    assert (
        nxt[-1].request_body.response.header_mutation.set_headers
        == first[-1].request_body.response.header_mutation.set_headers
    )
    # The first turn decided on its whole prompt (too little new text past its first chunk to defer), the
    # next on its cached history (the first turn's pod its one holder), its new message recorded after.
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 1.0}
    # The hit predicted, once the rest was encoded, is the whole prompt's: as deciding on it.
    assert _counter(router.metrics.predicted_cached) == _counter(whole_router.metrics.predicted_cached)
    n = len(raw.encode(HISTORY, add_special_tokens=True).ids)
    assert _counter(router.metrics.predicted_cached)[""] == n // 16 * 16
    proc.close()
    whole_proc.close()


async def test_a_head_decision_that_would_leave_the_holder_is_made_on_the_whole_prompt(monkeypatch):
    """The history's pod is busy: a decision on the cached head picks another pod, where the holder's
    whole match might keep the request: it is made again on the whole prompt, as without heads."""
    raw = _trained("llama3")
    procs = [_precise(raw), _whole_only(raw, monkeypatch)]
    outs = []
    for proc, router in procs:
        await run(proc, _completion(HISTORY))
        await _settled(proc)
        (holder,) = router.precise._slot_of  # the one pod the index knows: the history's
        for _ in range(200):  # each in flight a decoding stream on the holder
            router.registry.acquire(holder)
        outs.append(await run(proc, _completion(TURN)))
        await _settled(proc)
    assert [r.SerializeToString() for r in outs[0]] == [r.SerializeToString() for r in outs[1]]
    assert _counter(procs[0][1].metrics.tokenize_deferred, "result") == {}  # decided on whole prompts
    for proc, _ in procs:
        proc.close()


async def test_a_head_two_pods_hold_is_not_decided_on():
    raw = _trained("llama3")
    proc, router = _precise(raw)
    await run(proc, _completion(HISTORY))
    await _settled(proc)
    tok = router.tokenizers["m"]
    (holder,) = set(router.precise._slot_of)
    other = next(a for a in router.registry.by_address if a != holder)
    keys = router.keys(_req(router, HISTORY), router.registry.pools["p"].endpoints, tok.encode(HISTORY, True))
    router.precise.record(keys.keys, other)  # the history copied to a second pod
    await run(proc, _completion(TURN))
    await _settled(proc)
    assert _counter(router.metrics.tokenize_deferred, "result") == {}  # decided on whole prompts
    proc.close()


@pytest.mark.parametrize("disaggregation", ["never", "conditional"])
def test_a_held_head_is_not_decided_on_where_the_request_may_split(disaggregation):
    """A P/D plan weighs the prompt's uncached tokens, which the holder's match past the head would cut."""
    raw = _trained("llama3")
    _, router = _precise(raw, pd={"disaggregation": disaggregation}, routing=NO_SPREAD)
    tok = router.tokenizers["m"]
    router.route(_req(router, HISTORY), token_ids=tok.encode(HISTORY, True))
    plan = tok.plan(TURN, True)
    head = next(tok.heads(plan))
    ids = tok.finish(head, {})
    estimate = tok.estimate_tokens(plan, head, len(ids), {})
    if disaggregation == "never":
        assert router.route(_req(router, TURN), token_ids=ids, head_tokens=estimate).decision.reason == "prefix"
    else:
        with pytest.raises(WholePromptNeeded):
            router.route(_req(router, TURN), token_ids=ids, head_tokens=estimate)


def test_a_revised_hit_shortens_the_prefill_queued_on_the_pod():
    raw = _trained("llama3")
    _, router = _precise(raw, routing=NO_SPREAD)
    tok = router.tokenizers["m"]
    router.route(_req(router, HISTORY), token_ids=tok.encode(HISTORY, True))
    tok._cache.clear()  # the history's text forgotten (another replica's turn): its first chunk is new here
    plan = tok.plan(TURN, True)
    head = next(h for h in tok.heads(plan) if h.missing)
    encoded = tok.encode_missing(head)
    ids = tok.finish(head, encoded)
    out = router.route(
        _req(router, TURN), token_ids=ids, head_tokens=tok.estimate_tokens(plan, head, len(ids), encoded)
    )
    assert out.keys is not None and out.keys.head and out.local_prefill
    assert out.decision.matched_blocks == len(out.keys.keys)  # the pick holds all of the head: it may hold more
    pod = router.registry.by_address[out.endpoint]
    whole_ids = tok.encode(TURN, True)
    # The history's prefill runs first on that pod (this replica's run one after another): this one's
    # work stays as queued until it starts.
    queued = _work(pod, out.local_prefill)
    revised = router.record_whole(out, whole_ids)
    n = len(raw.encode(HISTORY, add_special_tokens=True).ids)
    assert out.predicted_cached < revised.predicted_cached == n // 16 * 16
    cost = router.config.routing.cost
    whole = len(raw.encode(TURN, add_special_tokens=True).ids)
    saved = cost.prefill_s(out.keys.prompt_tokens - out.predicted_cached, out.predicted_cached) - cost.prefill_s(
        whole - revised.predicted_cached, revised.predicted_cached)  # fmt: skip
    assert saved > 0
    assert _work(pod, out.local_prefill) == pytest.approx(queued - saved)


def test_a_head_the_branch_spread_would_move_off_its_busy_holder_asks_for_the_whole_prompt():
    """A next turn (its history's text no longer in the tokenizer's cache) decided on its head: the head ends
    before the history's prompt did, so it reads as a new conversation branching off the prefix, and the spread
    would send it off its busy holder to an idle pod. Decided on the whole prompt instead, it continues the
    history and stays."""
    raw = _trained("llama3")
    _, router = _precise(raw)
    tok = router.tokenizers["m"]
    first = router.route(_req(router, HISTORY), token_ids=tok.encode(HISTORY, True))  # in flight still
    tok._cache.clear()
    plan = tok.plan(TURN, True)
    head = next(h for h in tok.heads(plan) if h.missing)
    encoded = tok.encode_missing(head)
    ids = tok.finish(head, encoded)
    with pytest.raises(WholePromptNeeded):
        router.route(_req(router, TURN), token_ids=ids, head_tokens=tok.estimate_tokens(plan, head, len(ids), encoded))
    whole = router.route(_req(router, TURN), token_ids=tok.encode(TURN, True))
    assert whole.endpoint == first.endpoint and whole.decision.continues is True


def _work(pod, ticket: int) -> float:
    """The work left of the prefill ``ticket``, queued behind another on ``pod``."""
    pod.prefills.wait(time.monotonic())
    (entry,) = [e for e in pod.prefills._queue if e.ticket == ticket and e is not pod.prefills._queue[0]]
    return entry.work


def test_a_head_stands_on_a_pinned_route_even_off_its_holder():
    """A route id pins the request whatever the pods hold: a decision on the head is the whole prompt's."""
    _, router = _precise(_trained("llama3"))
    tok = router.tokenizers["m"]
    router.route(_req(router, HISTORY), token_ids=tok.encode(HISTORY, True))
    (holder,) = router.precise._slot_of  # the history's pod, busy from now on
    for _ in range(200):
        router.registry.acquire(holder)
    sid = {"x-session-id": "conversation-1"}
    chat = "Hi there, what is new today? " * 20
    req = router.parse("/v1/completions", "POST", sid, orjson.dumps({"model": "m", "prompt": chat}))
    pinned = router.route(req, token_ids=tok.encode(chat, True)).endpoint
    assert pinned != holder
    plan = tok.plan(TURN, True)
    head = next(tok.heads(plan))
    ids = tok.finish(head, {})
    req = router.parse("/v1/completions", "POST", sid, orjson.dumps({"model": "m", "prompt": TURN}))
    out = router.route(req, token_ids=ids, head_tokens=tok.estimate_tokens(plan, head, len(ids), {}))
    assert (out.endpoint, out.decision.reason, out.keys.head) == (pinned, "route-id", True)


def test_a_queued_prefill_shortened_or_lengthened_by_its_ticket():
    q = PrefillQueue()
    now = time.monotonic()
    first, second = q.add(1.0, now), q.add(0.5, now)
    q.shorten(second, 0.2, now)
    assert q.wait(now) == pytest.approx(1.3)
    q.shorten(second, -0.1, now)  # a longer prefill than queued
    assert q.wait(now) == pytest.approx(1.4)
    q.shorten(second, 5.0, now)  # never below nothing
    q.shorten(12345, 1.0, now)  # a ticket no longer queued: nothing
    assert q.wait(now) == pytest.approx(1.0)
    q.finished(first, now)
    assert q.wait(now) == 0.0


def test_the_rest_recorded_after_a_head_notes_where_the_prompt_ended_even_with_no_block_of_its_own():
    """Only the rest's keys are recorded after a head (the decision recorded the head's on its pick);
    where the rest fills no block of its own, the head's last key is recorded again to note the end."""
    _, router = _precise(_trained("llama3"), routing=NO_SPREAD)
    tok = router.tokenizers["m"]
    ids = tok.encode(HISTORY, True)
    cut = len(ids) // 16 * 16
    for head_ids, whole_ids in ((ids[: cut - 64], ids), (ids[:cut], ids[: cut + 5])):  # 4 blocks of rest; none
        router.precise._ends = PromptEnds()
        out = router.route(_req(router, HISTORY), token_ids=head_ids, head_tokens=len(whole_ids))
        assert out.keys.head and not router.precise._ends  # a head notes no end
        router.record_whole(out, whole_ids)
        whole = router.keys(_req(router, HISTORY), router.registry.pools["p"].endpoints, whole_ids).keys
        assert len(router.precise._ends) == 1 and router.precise._ends.continues([whole[-1]], 1)
        assert router.precise.match(whole, [out.endpoint]) == {out.endpoint: len(whole)}


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_the_rests_thread_runs_nicer_than_the_decisions(tmp_path):
    """A rest only speeds up later requests: its thread yields the cores to the event loop, Envoy and
    the pods (REST_NICE above the process); the thread encoding a whole long prompt, which a decision
    waits on, keeps the process's priority, and so does the thread that lowered another's."""
    base = _nice()
    proc, _ = _precise(_trained("llama3"))
    try:
        assert proc._tokenize_rest.submit(_nice).result(10) == min(19, base + REST_NICE)
        assert proc._tokenize.submit(_nice).result(10) == base
        assert _nice() == base
        seen: list[int] = []
        t = threading.Thread(target=lambda: (lower_thread_priority(3), seen.append(_nice())))
        t.start()
        t.join(10)
        assert seen == [min(19, base + 3)] and _nice() == base
    finally:
        proc.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_the_tokenizers_pool_keeps_the_process_priority_when_a_rest_comes_first(tmp_path):
    """The tokenizers library starts its thread pool at its first batch call, from the calling thread, whose
    priority its threads take: a rest (niced) encoding before any other batch call must not leave the pool
    that critical encodes use niced. A fresh process: a tokenizer loaded, a rest encoded in a niced thread
    first, then every thread left runs at the process's priority."""
    import subprocess

    from bench.harness import precise_tokenizer

    script = f"""
import glob, threading
from extproc.server import lower_thread_priority
from extproc.tokenize import ModelTokenizer
tok = ModelTokenizer.from_dir({str(precise_tokenizer(tmp_path / "tok"))!r})
plan = tok.plan("alpha beta gamma " * 400, False)
def rest():
    lower_thread_priority(10)
    tok.encode_missing(plan, one_thread=True)
t = threading.Thread(target=rest)
t.start()
t.join()
tok.encode_missing(tok.plan("delta epsilon zeta " * 400, False))  # a batch of several: the pool's threads
nices = [int(open(d + "/stat").read().rsplit(")", 1)[1].split()[16]) for d in glob.glob("/proc/self/task/*")]
print(len(nices), sorted(set(nices)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    count, levels = out.stdout.split(" ", 1)
    assert int(count) > 1 and levels.strip() == str([os.getpriority(os.PRIO_PROCESS, 0)]), out.stdout
