"""Precise mode's rests held while prompts reuse little (extproc/rests.py): the gauge that decides it, the
bounded store, and the server holding a rest, then encoding it when a later prompt needs its text."""

from __future__ import annotations

import math

import pytest

from extproc.rests import EAGER_FROM, GAUGE_WEIGHT, HeldRests, ReuseGauge
from tests.unit.test_head_decision import PROMPT, _counter, _settled
from tests.unit.test_hotpath import _completion, _corpus, _precise, _trained
from tests.unit.test_server_stream import run


def test_the_gauge_turns_rests_held_after_prompts_of_new_text_and_eager_again_when_text_recurs():
    g = ReuseGauge()
    assert g.eager and g.value == 1.0  # eager until prompts show otherwise
    new = 0
    while g.eager:
        g.note(0, 1000)
        new += 1
    # 1 - w, (1 - w)^2, ...: the first value under EAGER_FROM
    assert new == math.ceil(math.log(EAGER_FROM) / math.log(1 - GAUGE_WEIGHT))
    back = 0
    while not g.eager:
        g.note(900, 1000)  # most of each prompt known before
        back += 1
    assert 0 < back < new
    g.note(5000, 1000)  # never above 1, whatever a caller counts
    assert g.value <= 1.0
    before = g.value
    g.note(0, 0)  # an empty prompt says nothing
    assert g.value == before


def test_held_rests_are_taken_once_by_any_of_their_texts_and_the_oldest_age_out_first():
    started: list[str] = []
    held = HeldRests(max_rests=2, max_chars=100)
    assert held.hold(["a1", "a2"], 20, lambda: started.append("a")) == 0
    assert held.hold(["b1"], 30, lambda: started.append("b")) == 0
    assert held.known(["a2", "b1", "zz"]) == 4 and len(held) == 2 and held.chars == 50
    assert held.hold(["c1"], 10, lambda: started.append("c")) == 1  # three rests: a, the oldest, out
    assert held.known(["a1", "a2"]) == 0 and held.chars == 40
    for start in held.take(["b1", "c1", "b1"]):
        start()
    assert sorted(started) == ["b", "c"] and not held and held.chars == 0
    assert held.take(["b1"]) == []  # taken once
    # Past max_chars the oldest go, but the newest is kept whatever its size.
    held.hold(["d1"], 60, lambda: None)
    assert held.hold(["e1"], 70, lambda: None) == 1 and held.known(["d1", "e1"]) == 2
    assert held.hold(["f1"], 500, lambda: None) == 1 and len(held) == 1 and held.known(["f1"]) == 2
    # A text in two rests: the later holds it; taking it leaves the earlier with its other texts.
    held.clear()
    held.hold(["g1", "shared"], 10, lambda: started.append("g"))
    held.hold(["shared"], 5, lambda: started.append("h"))
    for start in held.take(["shared"]):
        start()
    assert started[-1] == "h" and held.known(["g1", "shared"]) == 2


async def test_a_rest_is_held_while_prompts_reuse_little_and_encoded_when_a_later_prompt_needs_it(monkeypatch):
    raw = _trained("llama3")
    proc, router = _precise(raw)
    tok = router.tokenizers["m"]
    proc._reuse.value = 0.0  # as after many prompts of new text
    first = await run(proc, _completion(PROMPT))
    await _settled(proc)
    assert _counter(router.metrics.tokenize_deferred, "result") == {"held": 1.0}
    assert tok.plan(PROMPT, True).missing  # the rest not encoded
    assert len(proc._held) == 1
    # The answer is the one the rest encoded at once gives (the decision is the head's either way).
    eager_proc, _ = _precise(raw)
    assert [r.SerializeToString() for r in await run(eager_proc, _completion(PROMPT))] == [
        r.SerializeToString() for r in first
    ]
    assert proc._reuse.value == 0.0  # all of it was new

    # The same prompt again: its new text is the held rest's, which is encoded and recorded now; the
    # request waits for it and matches the whole prompt on the pod the first went to.
    again = await run(proc, _completion(PROMPT))
    await _settled(proc)
    assert [r.SerializeToString() for r in again] == [r.SerializeToString() for r in first]
    assert _counter(router.metrics.tokenize_deferred, "result") == {
        "held": 1.0, "asked": 1.0, "recorded": 1.0, "waited": 1.0,
    }  # fmt: skip
    n = len(raw.encode(PROMPT, add_special_tokens=True).ids)
    assert _counter(router.metrics.predicted_cached)[""] == (n - 1) // 16 * 16  # the whole prompt matched
    assert not tok.plan(PROMPT, True).missing and not proc._held
    # That prompt was known before it came (its head cached, its rest held): the gauge rose by a prompt's
    # weight, and /metrics shows it.
    assert proc._reuse.value == pytest.approx(GAUGE_WEIGHT)
    assert router.metrics.prompt_reuse.v == proc._reuse.value
    eager_proc.close()
    proc.close()


async def test_prompts_of_new_text_turn_the_rests_held():
    """Driven by the prompts themselves: eager at first, held once enough prompts came with only new text."""
    proc, router = _precise(_trained("llama3"))
    text = "".join(_corpus())
    held = 0
    for i in range(100):
        await run(proc, _completion(text[i * 7000 : i * 7000 + 7000]))
        await _settled(proc)
        held = int(_counter(router.metrics.tokenize_deferred, "result").get("held", 0))
        if held:
            break
    counts = _counter(router.metrics.tokenize_deferred, "result")
    assert held == 1 and counts.get("recorded", 0) >= 10, counts  # eager for the first, then held
    assert not proc._reuse.eager and router.metrics.prompt_reuse.v < EAGER_FROM
    proc.close()
