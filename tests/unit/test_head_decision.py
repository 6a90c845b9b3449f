"""Precise decisions on a prompt's head: when no pod holds the last block of the prompt up to its first
new piece, the whole prompt could match no further, so kvroute decides on that head and encodes the
rest after the answer (cached, and recorded for the pod chosen)."""

from __future__ import annotations

import asyncio

from extproc.tokenize import ModelTokenizer, TokenPlan
from tests.polling import eventually
from tests.unit.test_hotpath import _completion, _corpus, _index_decisions, _precise, _trained, hold_encoding
from tests.unit.test_server_stream import run

PROMPT = "".join(_corpus())[:7000]  # a new prompt of several chunks (extproc/tokenize.py's CHUNK_CHARS)


def _counter(metric, label: str | None = None) -> dict[str, float]:
    return {s.labels.get(label, "") if label else "": s.value for m in metric.collect() for s in m.samples
            if s.name.endswith("_total")}  # fmt: skip


async def _settled(proc) -> None:
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
    assert [r.SerializeToString() for r in again] == [r.SerializeToString() for r in first]
    assert _counter(router.metrics.tokenize_deferred, "result") == {"recorded": 1.0}
    n = len(raw.encode(PROMPT, add_special_tokens=True).ids)
    assert _counter(router.metrics.predicted_cached)[""] == (n - 1) // 16 * 16
    assert _index_decisions(router) == {"precise": 2.0, "approx": 0.0}
    proc.close()
    whole_proc.close()


async def test_heads_grow_past_blocks_a_pod_holds_that_the_tokenizer_cache_forgot():
    """A pod holds a prompt's first chunks that kvroute's tokenizer cache no longer has (another replica
    routed it, or the cache evicted it): each head whose last block a pod holds gives way to the next,
    and the decision is made on the first head past them, the match as long as the whole prompt's."""
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
