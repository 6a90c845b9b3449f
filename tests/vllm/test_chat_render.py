"""kvroute renders a chat as vLLM does (extproc/conversation.py): for chat templates of both content formats
(vLLM's own shipped templates among them) and the requests real clients send (content as parts, null content
with tool calls, JSON-string arguments, tools without descriptions, developer messages, reasoning, extra fields,
continue_final_message, template kwargs), kvroute's token ids equal what the pod's
``/v1/chat/completions/render`` gives, or both refuse the request."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.tokenize import ModelTokenizer
from tests.vllm.conftest import VLLM_PYTHON
from tests.vllm.pods import MODEL_NAME, VLLMPod

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Template shapes that real models' templates take (written for this test): content written whole, content
# iterated with a string check (Gemma 3 style), iterated without one (Idefics 3 style), through a macro, and
# one writing tools, tool calls, reasoning and names (Llama 3.1 / Qwen style), one naming the developer role.
_HEAD = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
_TAIL = "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
SHAPES = {
    "whole": _HEAD + "{{ m['content'] }}" + _TAIL,
    "parts-or-string": _HEAD + "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] | trim }}{% elif p['type'] == 'image' %}"
    "<image>{% endif %}{% endfor %}{% endif %}" + _TAIL,
    "parts-only": _HEAD + "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% else %}<{{ p.type }}>"
    "{% endif %}{% endfor %}" + _TAIL,
    "macro": "{% macro body(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    + _HEAD
    + "{% if m.content is string %}{{ m.content }}{% else %}{{ body(m.content) }}{% endif %}"
    + _TAIL,
    "tools": "{{ bos_token }}{% if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.name is defined %}[{{ m.name }}]{% endif %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}{% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %}{{ m | length }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined %}"
    "{{ enable_thinking }}{% endif %}{% endif %}",
    "developer": _HEAD + "{% if m.role == 'developer' %}(dev){% endif %}{{ m.content }}" + _TAIL,
}

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}},
    {"function": {"description": "time now", "name": "clock", "strict": True}, "type": "function"},
]
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "n": 2}'}}

CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi there"}]},
    "parts": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "first part "}, {"type": "text", "text": "second"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": ["a bare string part", {"type": "text", "text": "and more"}]},
        ]
    },
    "extra-fields": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "hello", "reasoning_content": "dropped", "reasoning": "kept", "x": 1},
            {"role": "user", "name": "bob", "content": "again"},
        ]
    },
    "tool-calls": {
        "tools": TOOLS,
        "tool_choice": "none",  # the pods run without a tool-call parser; the tools still reach the template
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
            {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "user", "content": "and tomorrow?"},
        ],
    },
    "bad-arguments": {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{**CALL, "function": {"name": "g", "arguments": "{x"}}],
            },
            {"role": "user", "content": "done"},
        ]
    },
    "developer": {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "developer", "content": "dev rules"},
            {"role": "user", "content": "hi"},
        ]
    },
    "billing-header": {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=123\nYou are helpful."},
            {"role": "user", "content": "hi"},
        ]
    },
    "kwargs": {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": None},
        "reasoning_effort": "low",
    },
    "thinking-off": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"},
    "continue": {
        "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two, "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "continue-and-prompt": {
        "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one"}],
        "continue_final_message": True,
    },
}


def _shipped_templates() -> dict[str, str]:
    """The chat templates vLLM ships (read from its install, not copied here)."""
    assert VLLM_PYTHON
    where = subprocess.run(
        [VLLM_PYTHON, "-c", "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    found = sorted(Path(where, "transformers_utils", "chat_templates").glob("*.jinja"))
    assert found, where
    return {f"vllm:{p.stem}": p.read_text() for p in found}


async def test_kvroute_renders_each_chat_as_vllm_does(
    pods: list[VLLMPod], model_dir: str, aclient: httpx.AsyncClient
) -> None:
    templates = {**SHAPES, **_shipped_templates()}
    formats: dict[str, str] = {}
    compared = refused = 0
    wrong: list[tuple[str, str, str]] = []
    for tname, source in templates.items():
        tok = ModelTokenizer.from_dir(model_dir, chat_template=source)
        assert tok.chat_shape is not None
        formats[tname] = tok.chat_shape.content_format
        for cname, body in CASES.items():
            r = await aclient.post(
                f"{pods[0].url}/v1/chat/completions/render",
                json={"model": MODEL_NAME, "chat_template": source, "max_tokens": 1, **body},
            )
            try:
                ours: list[int] | None = tok.chat_ids(body).tolist()
            except Exception as e:
                ours, why = None, repr(e)
            if r.status_code != 200:
                assert r.status_code == 400, (tname, cname, r.text)
                if ours is not None and not (ours == [] and "No token_ids rendered" in r.text):
                    wrong.append((tname, cname, f"vLLM refused it ({r.text[:300]}), kvroute rendered it"))
                refused += 1
            elif ours is None:
                wrong.append((tname, cname, f"kvroute refused it: {why}"))
            elif ours != r.json()["token_ids"]:
                wrong.append((tname, cname, f"tokens differ; kvroute rendered {tok.render_chat(body)!r}"))
            else:
                compared += 1
    assert not wrong, "\n".join(map(str, wrong))
    assert formats["parts-or-string"] == formats["parts-only"] == formats["macro"] == "openai"
    assert formats["whole"] == formats["tools"] == formats["developer"] == "string"
    assert compared > 50 and refused >= len(templates)  # continue-and-prompt at least, on every template
