"""extproc/anthropic.py: Anthropic Messages requests as the chat vLLM renders for them, and /v1/messages routed
with prefix keys (it was a pass-through path: routed by load alone). tests/vllm/test_chat_render.py checks
the token ids against a real vLLM pod's."""

from __future__ import annotations

import copy
import json

import pytest

from extproc.anthropic import to_chat
from extproc.conversation import ChatError
from extproc.errors import MalformedBody
from extproc.request import MESSAGES_PATH, parse_request


def _parse(body: dict, path: str = MESSAGES_PATH) -> object:
    """``body`` parsed as kvroute parses a request to ``path`` (tests/unit/test_responses.py's too)."""
    return parse_request(
        path=path,
        method="POST",
        headers={},
        raw_body=json.dumps(body).encode(),
        max_body_bytes=1 << 20,
        tenant_header="x-tenant-id",
        route_id_headers=[],
        request_id_header="x-request-id",
    )


CLAUDE_CODE = {
    "model": "m",
    "max_tokens": 64,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=9a1"},
        {"type": "text", "text": "You are Claude Code."},
        {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "tools": [{"name": "Read", "description": "read a file", "input_schema": {"properties": {"path": {}}}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look first", "signature": "s"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "tu1", "name": "Read", "input": {"path": "a.py"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "x = 1"}]},
                {"type": "text", "text": "go on"},
            ],
        },
        {"role": "system", "content": "<reminder>inline</reminder>"},
    ],
    "thinking": {"type": "disabled"},
}


def test_a_claude_code_request_becomes_the_chat_vllm_renders() -> None:
    sent = copy.deepcopy(CLAUDE_CODE)
    chat = to_chat(CLAUDE_CODE, merge_inline_system=False, disabled_effort="none")
    assert sent == CLAUDE_CODE  # the request is left alone
    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code. Be brief."},
        {"role": "user", "content": "fix the bug"},
        {
            "role": "assistant",
            "reasoning": "look first",
            "tool_calls": [
                {"id": "tu1", "type": "function", "function": {"name": "Read", "arguments": '{"path": "a.py"}'}}
            ],
            "content": "Reading.",
        },
        {"role": "tool", "tool_call_id": "tu1", "content": "x = 1"},
        {"role": "user", "content": "go on"},
        {"role": "system", "content": "<reminder>inline</reminder>"},
    ]
    assert chat["reasoning_effort"] == "none"
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Read",
                "description": "read a file",
                "parameters": {"properties": {"path": {}}, "type": "object"},
            },
        }
    ]
    merged = to_chat(CLAUDE_CODE, merge_inline_system=True, disabled_effort="low")
    assert merged["messages"][0] == {
        "role": "system",
        "content": "You are Claude Code. Be brief.<reminder>inline</reminder>",
    }
    assert all(m["role"] != "system" for m in merged["messages"][1:]) and merged["reasoning_effort"] == "low"


def test_tool_results_images_and_tool_changes() -> None:
    png = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "image", "source": png},
                            {"type": "tool_reference", "tool_name": "Grep"},
                        ],
                    }
                ],
            },
            {"role": "assistant", "content": [{"type": "tool_result", "content": [{"type": "text", "text": "b"}]}]},
            {
                "role": "system",
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Grep"}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Read"}},
                ],
            },
        ],
        "tools": [
            {"name": "Read", "input_schema": {"type": "object"}},
            {"name": "Grep", "input_schema": {"type": "object"}, "defer_loading": True},
        ],
        "output_config": {"effort": "high"},
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": "a"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "tool_reference", "name": "Grep"}]},
        {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'b'}]"},  # vLLM's str() of it
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["Grep"]
    # Added by reference: no longer deferred (vLLM writes no defer_loading then).
    assert chat["tools"][0]["function"] == {"name": "Grep", "description": None, "parameters": {"type": "object"}}
    assert chat["reasoning_effort"] == "high"
    with pytest.raises(ChatError):
        to_chat({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(ChatError):
        to_chat(
            {
                "messages": [
                    {
                        "role": "system",
                        "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "X"}}],
                    }
                ]
            }
        )


def test_messages_requests_are_keyed_by_their_prompt() -> None:
    req = _parse(CLAUDE_CODE)
    assert req.is_inference and req.model == "m" and req.max_tokens == 64  # type: ignore[attr-defined]
    text = req.prompt_text  # type: ignore[attr-defined]
    assert "You are Claude Code." in text and "x = 1" in text and "billing-header" not in text
    follow_up = {**CLAUDE_CODE, "messages": [*CLAUDE_CODE["messages"], {"role": "user", "content": "and then?"}]}
    assert _parse(follow_up).prompt_text.startswith(text)  # type: ignore[attr-defined]
    with pytest.raises(MalformedBody):
        _parse({"model": "m", "max_tokens": 1, "messages": "hi"})
    with pytest.raises(MalformedBody):
        _parse({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"text": "no type"}]}]})


def test_a_messages_responses_usage_is_read_as_prompt_and_cached_tokens() -> None:
    from extproc.server import _usage

    whole = b'{"type":"message","usage":{"input_tokens":40,"cache_read_input_tokens":960,"output_tokens":5}}'
    assert _usage(whole, MESSAGES_PATH) == (1000, 960)
    created = b'"usage": {"input_tokens": 7, "cache_creation_input_tokens": 3, "output_tokens": 1}'
    assert _usage(created, MESSAGES_PATH) == (10, None)
    streamed = (
        b'event: message_start\ndata: {"message":{"usage":{"input_tokens":16,"cache_read_input_tokens":32}}}\n\n'
        b'event: message_delta\ndata: {"usage":{"output_tokens":9}}\n\n'
    )
    assert _usage(streamed, MESSAGES_PATH) == (48, 32)
    assert _usage(b'{"usage":{"output_tokens":9}}', MESSAGES_PATH) == (None, None)
    openai = b'"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":64}}'
    assert _usage(openai, "/v1/chat/completions") == (100, 64)
    responses = b'"usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":256},"output_tokens":4}'
    assert _usage(responses, "/v1/responses") == (300, 256)


def test_thinking_disabled_becomes_the_effort_vllm_finds_or_is_told() -> None:
    """vLLM sends reasoning_effort "none" for thinking disabled, or "low" where the template renders "none" as it
    renders an effort (it cannot stop thinking); --anthropic-disabled-thinking-effort sets it outright."""
    from extproc.conversation import PodFlags
    from extproc.tokenize import ModelTokenizer
    from tests.unit.test_hotpath import _trained

    raw = _trained("llama3")
    ignores = "{% for m in messages %}{{ m.content }}{% endfor %}"
    honours = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" + ignores
    body = {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
    assert ModelTokenizer(raw, ignores, {}).anthropic_chat(body)["reasoning_effort"] == "low"
    assert ModelTokenizer(raw, honours, {}).anthropic_chat(body)["reasoning_effort"] == "none"
    told = ModelTokenizer(raw, honours, {}, PodFlags(anthropic_disabled_thinking_effort="medium"))
    assert told.anthropic_chat(body)["reasoning_effort"] == "medium"


def test_the_tool_choice_as_vllm_writes_it_into_the_chat() -> None:
    """auto (also where tools come without one), any as required, a named tool as that function, none as
    none: a pod run with --exclude-tools-when-tool-choice-none then renders no tools for a Messages request
    that says none, as for a chat request that does."""
    from extproc.conversation import PodFlags, render_args

    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert to_chat(body)["tool_choice"] == "auto"
    chosen = {
        "auto": "auto", "any": "required", "none": "none",
        "tool": {"type": "function", "function": {"name": "f"}},
    }  # fmt: skip
    for kind, want in chosen.items():
        assert to_chat({**body, "tool_choice": {"type": kind, "name": "f"}})["tool_choice"] == want, kind
    assert "tool_choice" not in to_chat({"messages": body["messages"]})
    dropping = PodFlags(exclude_tools_when_tool_choice_none=True)
    assert render_args(to_chat({**body, "tool_choice": {"type": "none"}}), dropping)["tools"] is None
    assert render_args(to_chat(body), dropping)["tools"] is not None
