"""extproc/responses.py: OpenAI Responses requests as the chat vLLM renders for them, and /v1/responses routed
with prefix keys (it was a pass-through path). tests/vllm/test_chat_render.py checks the token ids against a
real vLLM pod's, through vLLM's own conversion."""

from __future__ import annotations

import copy

import orjson

from extproc.request import RESPONSES_PATH
from extproc.responses import to_chat
from tests.unit.test_anthropic import _parse as parse
from tests.unit.test_pd_decision import DECODE, make

CODEX = {
    "model": "m",
    "instructions": "You are a coding agent.",
    "max_output_tokens": 256,
    "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}, {"type": "web_search"}],
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the build"}]},
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "check first"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "make"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "error: x"},
        {
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Found it."}],
        },
    ],
    "reasoning": {"effort": "medium"},
}


def _parse(body: dict) -> object:
    return parse(body, RESPONSES_PATH)


def test_a_codex_request_becomes_the_chat_vllm_renders() -> None:
    sent = copy.deepcopy(CODEX)
    chat = to_chat(CODEX)
    assert sent == CODEX
    call = {"id": "c1", "function": {"name": "shell", "arguments": '{"cmd": "make"}'}, "type": "function"}
    assert chat["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        CODEX["input"][0],
        {"role": "assistant", "reasoning": "check first", "tool_calls": [call]},  # the call joins the reasoning
        {"role": "tool", "content": "error: x", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Found it."},
    ]
    assert chat["add_generation_prompt"] is True and "continue_final_message" not in chat
    assert chat["reasoning_effort"] == "medium"
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"]  # web search is not shown to the model
    partial = {"input": [{"role": "user", "content": "go"}, {**CODEX["input"][-1], "status": "in_progress"}]}
    assert to_chat(partial)["continue_final_message"] is True and to_chat(partial)["add_generation_prompt"] is False
    assert to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_responses_requests_are_keyed_and_never_refused_for_what_is_not_mirrored() -> None:
    req = _parse(CODEX)
    text = req.prompt_text  # type: ignore[attr-defined]
    assert req.is_inference and req.max_tokens == 256 and "fix the build" in text and "error: x" in text  # type: ignore[attr-defined]
    longer = {**CODEX, "input": [*CODEX["input"], {"role": "user", "content": "and run the tests"}]}
    assert _parse(longer).prompt_text.startswith(text)  # type: ignore[attr-defined]
    custom = {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "x", "name": "patch", "input": "..."}]}
    assert "custom_tool_call" in _parse(custom).prompt_text  # type: ignore[attr-defined]  # keyed by its JSON


def test_responses_requests_are_never_split() -> None:
    r = make(threshold_tokens=1000)
    body = orjson.dumps({"model": "m", "input": " ".join(f"doc{i}" for i in range(2000))})
    out = r.route(r.parse(RESPONSES_PATH, "POST", {"x-request-id": "a"}, body))
    assert out.pd is None and out.decision.primary.address in DECODE


def test_a_responses_request_is_converted_once(monkeypatch) -> None:
    """The chat parsing made (for the approximate text) is the one precise mode renders: vLLM's conversion runs
    once a request. An input the conversion refuses has no chat (keyed by its JSON), and precise mode converts
    it itself (and refuses it as vLLM would)."""
    from extproc import router as router_module
    from extproc.router import Router

    req = _parse(CODEX)
    assert req.chat == to_chat(CODEX)  # type: ignore[attr-defined]

    class Tok:
        def render_chat(self, chat: dict, validated: bool = True) -> str:
            self.seen, self.validated = chat, validated
            return "rendered"

    def refused(body: object) -> dict:
        raise AssertionError("converted again")

    monkeypatch.setattr(router_module.responses, "to_chat", refused)
    tok = Tok()
    assert Router._prompt_text(req, tok) == ("rendered", False)  # type: ignore[arg-type]
    assert tok.seen is req.chat and tok.validated is False  # type: ignore[attr-defined]
    custom = {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "x", "name": "patch", "input": "..."}]}
    monkeypatch.undo()
    assert _parse(custom).chat is None  # type: ignore[attr-defined]
