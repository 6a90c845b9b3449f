"""extproc/conversation.py: a chat request as vLLM hands it to the chat template. tests/vllm/test_chat_render.py
checks the same against a real vLLM pod's rendering; these run without one."""

from __future__ import annotations

import copy
import json
from typing import Any

import jinja2
import pytest

from extproc.conversation import ChatError, ChatShape, PodFlags, conversation, render_args, shape_of, tool_dicts

STRING = ChatShape("string", developer=False)
OPENAI = ChatShape("openai", developer=False)


def _format(source: str, forced: str = "auto") -> str:
    return shape_of(
        source, jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source), forced
    ).content_format


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for p in m.content[1:] %}{% endfor %}{% endfor %}", "openai"),
        ("{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content %}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% set content = m.content %}{% for c in content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro body(x) %}{% for c in x %}{{ c.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ body(m.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% macro body(x, y) %}{% for c in y %}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ body(1, y=m['content']) }}{% endfor %}",
            "openai",
        ),
        (  # a macro looping over a parameter no call feeds a message's content
            "{% macro body(x) %}{% for c in x %}{{ c }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ body(m.role) }}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %}{% for c in other.content %}{% endfor %}{{ m.content }}{% endfor %}", "string"),
        ("{% for c in messages[0]['content'] %}{% endfor %}", "string"),  # not a loop variable's content
    ],
)
def test_the_content_format_is_read_from_the_template_as_vllm_reads_it(source: str, expected: str) -> None:
    assert _format(source) == expected


def test_a_content_format_given_in_config_wins() -> None:
    iterating = "{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}"
    assert _format(iterating, "string") == "string"
    assert _format("{{ messages }}", "openai") == "openai"


def test_string_format_joins_text_parts_and_leaves_media_out() -> None:
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, "b", {"type": "image_url", "image_url": {"url": "x"}}],
        },
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "input_text", "text": "c"}, {"type": "refusal", "refusal": "d"}]},
        {"role": "user", "content": [{"type": "thinking", "thinking": "e"}, {"type": "text", "text": None}]},
    ]
    out = conversation(msgs, STRING)
    assert [m["content"] for m in out] == ["a\nb", "", "c\nd", "e"]


def test_openai_format_gives_every_content_as_parts() -> None:
    msgs = [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": None},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}, "detail_x": 1},
                {"image_url": "http://example.com/a.png", "uuid": "u1"},  # the kind taken from its field
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            ],
        },
    ]
    out = conversation(msgs, OPENAI)
    assert out[0]["content"] == [{"type": "text", "text": "plain"}]
    assert out[1]["content"] == []
    assert out[2]["content"] == [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "detail_x": 1},  # no base64 reaches the template
        {"type": "image"},
        {"type": "audio"},
    ]
    with pytest.raises(ChatError):
        conversation([{"role": "user", "content": [{"type": "hologram"}]}], OPENAI)
    with pytest.raises(ChatError):
        conversation([{"role": "user", "content": 5}], STRING)
    with pytest.raises(ChatError):
        conversation([{"content": "no role"}], STRING)


def test_messages_carry_only_the_fields_vllm_passes_and_the_request_is_left_alone() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [2]}'}}
    msgs = [
        {"role": "user", "content": "q", "name": "bob", "x": 1},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "why", "reasoning_content": "old"},
        {"role": "assistant", "content": "", "tool_calls": [], "reasoning_content": "dropped"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "g", "arguments": "[1]"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "h", "arguments": "{bad"}}]},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "k", "arguments": ""}}]},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
        },
    ]
    sent = copy.deepcopy(msgs)
    out = conversation(msgs, OPENAI)
    assert msgs == sent
    assert out[0] == {"role": "user", "content": [{"type": "text", "text": "q"}], "name": "bob"}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"b": 1, "a": [2]}
    # A call as vLLM's request model gives it back: its fields in the declared order, others dropped (a template
    # writing the calls whole with tojson shows the order; tests/vllm/test_chat_render.py's Messages turns).
    odd = {"type": "function", "function": {"name": "f", "arguments": "{}", "x": 1}, "id": "c2", "index": 0}
    (back,) = conversation([{"role": "assistant", "content": "", "tool_calls": [odd]}], STRING)[0]["tool_calls"]
    assert json.dumps(back) == '{"id": "c2", "function": {"arguments": {}, "name": "f"}, "type": "function"}'
    # Built by vLLM's Responses conversion (not through its request model): the function's name first.
    (built,) = conversation([{"role": "assistant", "content": "", "tool_calls": [odd]}], STRING, validated=False)[0][
        "tool_calls"
    ]
    assert json.dumps(built) == '{"id": "c2", "function": {"name": "f", "arguments": {}}, "type": "function"}'
    assert out[1]["reasoning"] == out[1]["reasoning_content"] == "why"
    # An empty string is a text part; empty tool_calls are dropped, a client's reasoning_content is not passed.
    assert out[2] == {"role": "assistant", "content": [{"type": "text", "text": ""}]}
    assert [m["tool_calls"][0]["function"]["arguments"] for m in out[3:6]] == [{}, {}, {}]
    assert out[6] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"}


def test_the_billing_header_line_is_cut_from_system_messages_only() -> None:
    header = "x-anthropic-billing-header: cch=5f2\n"
    msgs = [
        {"role": "system", "content": header + "You help."},
        {"role": "system", "content": [{"type": "text", "text": header.strip()}, {"type": "text", "text": "More."}]},
        {"role": "user", "content": header + "kept"},
    ]
    out = conversation(msgs, ChatShape("string", developer=True))
    assert [m["content"] for m in out] == ["You help.", "More.", header + "kept"]


def test_developer_messages_become_one_system_message_where_the_template_lacks_the_role() -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": [{"type": "text", "text": "d"}], "tools": [1]},
    ]
    assert conversation(msgs, ChatShape("string", developer=True))[2]["role"] == "developer"
    assert conversation(msgs, STRING) == [{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]
    alone = conversation([{"role": "developer", "content": "d", "tools": [1]}, msgs[1]], STRING)
    assert alone == [{"role": "system", "content": "d"}, {"role": "user", "content": "u"}]


def test_tools_are_written_back_as_vllms_request_model_writes_them() -> None:
    tools = [
        {"function": {"parameters": {"type": "object"}, "name": "f", "extra": 1}, "type": "function"},
        {"type": "function", "function": {"name": "g", "description": "d", "strict": True}, "defer_loading": True},
    ]
    out = tool_dicts(tools)
    assert json.dumps(out) == json.dumps(
        [
            {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}},
            {
                "type": "function",
                "function": {
                    "name": "g",
                    "description": "d",
                    "parameters": None,
                    "strict": True,
                    "defer_loading": True,
                },
                "defer_loading": True,
            },
        ]
    )  # the order too: a template writes them with tojson
    odd = [{"type": "web_search"}]
    assert tool_dicts(odd) is odd and tool_dicts(None) is None


def test_template_arguments_follow_vllms_precedence() -> None:
    def args(**body: Any) -> dict[str, Any]:
        flags = PodFlags(default_chat_template_kwargs={"enable_thinking": False, "x": 1})
        return render_args({"messages": [{"role": "user", "content": "hi"}], **body}, flags)

    a = args()
    assert a["add_generation_prompt"] is True and a["enable_thinking"] is False and a["x"] == 1
    assert a["tools"] is None and a["documents"] is None and "messages" not in a  # conversation() gives them
    b = args(
        chat_template_kwargs={"add_generation_prompt": False, "enable_thinking": True, "x": None, "tokenize": True}
    )
    assert b["add_generation_prompt"] is True  # the request's own field over its kwargs
    assert b["enable_thinking"] is True and b["x"] == 1  # over the defaults; an unset value passes nothing
    assert "tokenize" not in b
    assert args(reasoning_effort="none")["enable_thinking"] is False
    assert args(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})["enable_thinking"] is False
    assert args(reasoning_effort="auto").get("reasoning_effort") is None
    assert args(documents=[{"title": "t", "text": "x"}])["documents"] == [{"title": "t", "text": "x"}]
    assert args(chat_template_kwargs={"tools": [1]})["tools"] == [1]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert args(tools=tools, tool_choice="none")["tools"] is not None  # vLLM's default keeps them
    dropping = PodFlags(exclude_tools_when_tool_choice_none=True)
    assert render_args({"tools": tools, "tool_choice": "none"}, dropping)["tools"] is None
    assert render_args({"tools": tools, "tool_choice": "auto"}, dropping)["tools"] is not None
    with pytest.raises(ChatError):
        args(continue_final_message=True)  # with the default add_generation_prompt
    with pytest.raises(ChatError):
        args(chat_template_kwargs=["not", "an", "object"])


def test_named_templates_are_loaded_and_chosen_as_transformers_does(tmp_path) -> None:
    """A model with named templates renders a request with tools through "tool_use" and any other through
    "default" (tokenizer_config.json's list, or chat_template.jinja plus additional_chat_templates/, which win
    over it); the pods' --chat-template replaces them all."""
    from bench.harness import precise_tokenizer
    from extproc.tokenize import ModelTokenizer

    d = precise_tokenizer(tmp_path / "tok")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    named = [
        {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named}))
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    with_tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    tok = ModelTokenizer.from_dir(d)
    assert tok.render_chat(plain) == "Dhi" and tok.render_chat(with_tools) == "T1hi"
    assert ModelTokenizer.from_dir(d, chat_template="L{{ messages | length }}").render_chat(with_tools) == "L1"
    (d / "chat_template.jinja").write_text("J{% for m in messages %}{{ m.content }}{% endfor %}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(
        "K{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tok = ModelTokenizer.from_dir(d)
    assert tok.render_chat(plain) == "Jhi" and tok.render_chat(with_tools) == "Khi"
