"""The built-in tokenizer: deterministic, prefix-stable, and generated text re-tokenizes identically."""

from __future__ import annotations

import importlib.util

import pytest

from bench.sim.tokenizer import ChatError, HFTokenizer, SimTokenizer, message_text


def test_deterministic_and_in_vocab() -> None:
    a, b = SimTokenizer(), SimTokenizer()
    text = "Hello, world!  Tabs\tand\nnewlines 123"
    assert a.encode(text) == b.encode(text)
    assert all(16 <= t < a.vocab_size for t in a.encode(text))
    assert a.encode("hello world")[:1] == a.encode("hello there")[:1]


def test_generated_text_retokenizes_to_the_same_ids() -> None:
    t = SimTokenizer()
    outs = [t.output_token(i) for i in range(12)]
    assert t.encode("".join(text for _, text in outs)) == [i for i, _ in outs]


def test_chat_is_prefix_stable_across_turns() -> None:
    t = SimTokenizer()
    turn1 = [{"role": "user", "content": "ends with space "}]
    p1 = t.render_chat(turn1, None)
    turn2 = [*turn1, {"role": "assistant", "content": " the quick"}, {"role": "user", "content": "\nmore"}]
    assert t.render_chat(turn2, None)[: len(p1)] == p1
    # Tools live in the system part, so they change the very first tokens.
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert t.render_chat(turn1, tools)[:3] != p1[:3]


def test_content_parts_and_errors() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    assert message_text(parts) == "ab"
    with pytest.raises(ChatError):
        message_text(42)
    with pytest.raises(ChatError):
        SimTokenizer().render_chat([{"content": "no role"}], None)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers installed")
def test_hf_tokenizer_without_the_package_errors_clearly(tmp_path: object) -> None:
    with pytest.raises(RuntimeError, match="tokenizers"):
        HFTokenizer(str(tmp_path))
