"""kvroute renders a chat as vLLM does (extproc/conversation.py): for chat templates of both content formats
(vLLM's own shipped templates among them) and the requests real clients send (content as parts, null content
with tool calls, JSON-string arguments, tools without descriptions, developer messages, reasoning, extra fields,
continue_final_message, template kwargs), kvroute's token ids equal what the pod's
``/v1/chat/completions/render`` gives, or both refuse the request."""

from __future__ import annotations

import json
import subprocess
from array import array
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VLLMPod, document
from extproc import responses
from extproc.anthropic import to_chat
from extproc.tokenize import ModelTokenizer
from tests.vllm.conftest import KV, VLLM_PYTHON
from tests.vllm.harness import request_keys

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
    "special-tokens": {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
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


async def _against_vllm(
    client: httpx.AsyncClient, url: str, request: dict[str, Any], ours: Callable[[], array[int]]
) -> tuple[str, str]:
    """("equal" | "refused" | "wrong", why): the pod's rendering of a chat ``request`` against kvroute's token
    ids (``ours``). Refused: by both, or vLLM found nothing to render where kvroute rendered nothing."""
    r = await client.post(f"{url}/v1/chat/completions/render", json={"model": MODEL_NAME, "max_tokens": 1, **request})
    try:
        ids: list[int] | None = ours().tolist()
    except Exception as e:
        ids, why = None, repr(e)
    if r.status_code != 200:
        assert r.status_code == 400, r.text
        if ids is not None and not (ids == [] and "No token_ids rendered" in r.text):
            return "wrong", f"vLLM refused it ({r.text[:300]}), kvroute rendered it"
        return "refused", r.text[:200]
    if ids is None:
        return "wrong", f"kvroute refused it: {why}"
    return ("equal", "") if ids == r.json()["token_ids"] else ("wrong", "tokens differ")


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
            outcome, why = await _against_vllm(
                aclient, pods[0].url, {"chat_template": source, **body}, partial(tok.chat_ids, body)
            )
            if outcome == "wrong":
                wrong.append((tname, cname, f"{why}; kvroute rendered {tok.render_chat(body)!r}"))
            refused += outcome == "refused"
            compared += outcome == "equal"
    assert not wrong, "\n".join(map(str, wrong))
    assert formats["parts-or-string"] == formats["parts-only"] == formats["macro"] == "openai"
    assert formats["whole"] == formats["tools"] == formats["developer"] == "string"
    assert compared > 50 and refused >= len(templates)  # continue-and-prompt at least, on every template


ANTHROPIC: dict[str, dict[str, Any]] = {
    "claude-code": {
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=1f"},
            {"type": "text", "text": "You are a coding agent."},
            {"type": "text", "text": " Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [{"name": "Read", "description": "read", "input_schema": {"properties": {"p": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "fix it"}, {"type": "text", "text": ""}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "look", "signature": "s"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "tu1", "name": "Read", "input": {"p": "a.py", "n": [1, 2]}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": "x = 1"}]},
            {"role": "system", "content": "<reminder>go on</reminder>"},
            {"role": "user", "content": "and now?"},
        ],
    },
    "results": {
        "system": "plain system",
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_result", "content": [{"type": "text", "text": "r"}]}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"type": "tool_result", "tool_use_id": "t3"},
                ],
            },
            {"role": "assistant", "content": []},
        ],
        "output_config": {"effort": "high"},
        "chat_template_kwargs": {"flag": 1},
    },
    "tool-changes": {
        "tools": [
            {"name": "Read", "input_schema": {"type": "object"}},
            {"name": "Grep", "input_schema": {"type": "object"}, "defer_loading": True, "strict": True},
        ],
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Grep"}},
                    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Read"}},
                    {"type": "text", "text": "tools changed"},
                ],
            },
            {"role": "user", "content": "search"},
        ],
    },
}

# Run in vLLM's Python: each Anthropic body converted by vLLM's own code, for each template (its inline-system
# probe too), as JSON chat requests to render.
_CONVERT = """
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as S
job = json.load(sys.stdin)
out = {}
for t, src in job["templates"].items():
    merge = S._detect_merge_inline_system(src)
    for c, body in job["bodies"].items():
        req = S.to_chat_completion_request(AnthropicMessagesRequest.model_validate(body), merge_inline_system=merge)
        keep = {"messages", "tools", "reasoning_effort", "chat_template_kwargs"}
        chat = req.model_dump(mode="json", exclude_unset=True, include=keep)
        out[t + "|" + c] = {"merge": merge, "chat": chat}
print(json.dumps(out))
"""


async def test_anthropic_messages_render_as_vllm_converts_and_renders_them(
    pods: list[VLLMPod], model_dir: str, aclient: httpx.AsyncClient
) -> None:
    """Each Anthropic body, converted by vLLM's own code (run in its Python) and rendered by the pod, gives the
    token ids kvroute gets from its conversion and rendering; and kvroute finds, for each template, what vLLM's
    probe finds about inline system messages."""
    assert VLLM_PYTHON
    templates = {**SHAPES, **_shipped_templates()}
    bodies = {c: {"model": MODEL_NAME, "max_tokens": 1, **b} for c, b in ANTHROPIC.items()}
    job = json.dumps({"templates": templates, "bodies": bodies})
    ran = subprocess.run([VLLM_PYTHON, "-c", _CONVERT], input=job, capture_output=True, text=True, check=True)
    converted = json.loads(ran.stdout.strip().splitlines()[-1])
    wrong: list[tuple[str, str, str]] = []
    refused: list[tuple[str, str, str]] = []
    compared = 0
    for tname, source in templates.items():
        tok = ModelTokenizer.from_dir(model_dir, chat_template=source)
        merge = tok._merges_inline_system()
        for cname, body in bodies.items():
            theirs = converted[f"{tname}|{cname}"]
            if merge != theirs["merge"]:
                wrong.append((tname, cname, f"inline system merged: kvroute {merge}, vLLM {theirs['merge']}"))
                continue
            chat = {"chat_template": source, "tool_choice": "none", **theirs["chat"]}
            outcome, why = await _against_vllm(
                aclient,
                pods[0].url,
                chat,
                partial(lambda t, b, m: t.chat_ids(to_chat(b, m, "none")), tok, body, merge),
            )
            if outcome == "wrong":
                wrong.append((tname, cname, f"{why}; vLLM's chat {theirs['chat']}"))
            elif outcome == "refused":
                refused.append((tname, cname, why))
            else:
                compared += 1
    assert not wrong, "\n".join(map(str, wrong))
    # Refused by both: templates that insist on alternating roles or render nothing for these chats.
    assert compared + len(refused) == len(templates) * len(bodies) and compared >= 30, refused


RESPONSES: dict[str, dict[str, Any]] = {
    "string": {"instructions": "Be terse.", "input": "What is a KV cache?"},
    "agent": {
        "instructions": "You are a coding agent.",
        "tools": [
            {"type": "function", "name": "read", "description": "read a file", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix a.py"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path": "a.py"}'},
            {"type": "function_call", "call_id": "c2", "name": "read", "arguments": '{"path": "b.py"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "x = 1"},
            {"type": "function_call_output", "call_id": "c2", "output": "y = 2"},
            {
                "type": "message",
                "id": "m1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Both read.", "annotations": []}],
            },
            {"role": "user", "content": "now fix it"},
        ],
        "reasoning": {"effort": "low"},
    },
    "partial": {
        "input": [
            {"role": "user", "content": "count to five"},
            {
                "type": "message",
                "id": "m2",
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "one, two,", "annotations": []}],
            },
        ]
    },
}

# Run in vLLM's Python: each Responses body as the chat vLLM renders for it (its own conversion and template
# arguments), as a chat request to render. vLLM renders the Responses chat without the chat API's validation,
# which refuses input_text parts: they are written as the text parts vLLM's conversation reads them as.
_CONVERT_RESPONSES = """
import json, sys
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts
out = {}
for c, body in json.load(sys.stdin).items():
    req = ResponsesRequest.model_validate(body)
    msgs = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
    kw = req.build_chat_params(None, "auto").chat_template_kwargs
    chat = {"messages": msgs, "tools": construct_tool_dicts(req.tools, req.tool_choice)}
    chat.update((k, kw[k]) for k in ("add_generation_prompt", "continue_final_message", "reasoning_effort") if k in kw)
    text = json.dumps(chat, default=lambda o: o.model_dump(mode="json"))
    text = text.replace('"type": "input_text"', '"type": "text"')
    out[c] = json.loads(text)
print(json.dumps(out))
"""


async def test_responses_render_as_vllm_converts_and_renders_them(
    pods: list[VLLMPod], model_dir: str, aclient: httpx.AsyncClient
) -> None:
    """Each Responses body, converted by vLLM's own code and rendered by the pod through each template, gives
    kvroute's token ids; with the pod's own template, so does the pod's /v1/responses/render."""
    assert VLLM_PYTHON
    bodies = {c: {"model": MODEL_NAME, **b} for c, b in RESPONSES.items()}
    ran = subprocess.run(
        [VLLM_PYTHON, "-c", _CONVERT_RESPONSES], input=json.dumps(bodies), capture_output=True, text=True, check=True
    )
    converted = json.loads(ran.stdout.strip().splitlines()[-1])
    templates = {**SHAPES, **_shipped_templates()}
    wrong: list[tuple[str, str, str]] = []
    compared = 0
    for tname, source in templates.items():
        tok = ModelTokenizer.from_dir(model_dir, chat_template=source)
        for cname, body in bodies.items():
            chat = {"chat_template": source, "tool_choice": "none", **converted[cname]}
            ours = partial(lambda t, b: t.chat_ids(responses.to_chat(b), validated=False), tok, body)
            outcome, why = await _against_vllm(aclient, pods[0].url, chat, ours)
            if outcome == "wrong":
                wrong.append((tname, cname, f"{why}; vLLM's chat {converted[cname]}"))
            compared += outcome == "equal"
    assert not wrong, "\n".join(map(str, wrong))
    assert compared >= 30
    own = ModelTokenizer.from_dir(model_dir)
    for cname, body in bodies.items():
        r = await aclient.post(f"{pods[0].url}/v1/responses/render", json=body)
        assert r.status_code == 200, r.text
        assert own.chat_ids(responses.to_chat(body), validated=False).tolist() == r.json()["token_ids"], cname


async def test_anthropic_messages_are_keyed_as_the_pod_caches_them(
    pods: list[VLLMPod], kv: KV, model_dir: str, aclient: httpx.AsyncClient
) -> None:
    """A Claude Code shaped conversation over ``/v1/messages`` (system blocks with the attribution line,
    thinking, tool use and results, an inline system reminder): kvroute's token ids for it are the prompt's
    length, every full block of them is a block the pod reports (its KV events), and the next turn's predicted
    hit is the pod's ``cache_read_input_tokens``."""
    tok = ModelTokenizer.from_dir(model_dir)  # the pods' own template
    pod = pods[1]
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=77f"},
        {"type": "text", "text": "You are a coding agent. " + document(300, 120)},
    ]
    turns: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": document(301, 60)}]}]
    reply = [
        {"type": "thinking", "thinking": "read it first", "signature": "x"},
        {"type": "text", "text": "Reading the file."},
        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "src/a.py"}},
    ]
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": document(302, 80)}]}
    conversation = [
        turns,
        [*turns, {"role": "assistant", "content": reply}, {"role": "user", "content": [result]}],
        [
            *turns,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": [result, {"type": "text", "text": "now fix it"}]},
            {"role": "system", "content": "<system-reminder>keep going</system-reminder>"},
        ],
    ]
    tools = [
        {"name": "Read", "description": "read a file", "input_schema": {"properties": {"path": {"type": "string"}}}}
    ]
    hits = []
    for i, messages in enumerate(conversation):
        body = {"model": MODEL_NAME, "max_tokens": 1, "system": system, "messages": messages, "tools": tools,
                "tool_choice": {"type": "none"}, "thinking": {"type": "disabled"}}  # fmt: skip
        ids = tok.chat_ids(tok.anthropic_chat(body)).tolist()
        predicted = kv.index.match(request_keys(ids, None), [pod.address]).get(pod.address, 0) * BLOCK_SIZE
        r = await aclient.post(f"{pod.url}/v1/messages", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached = usage.get("cache_read_input_tokens") or 0
        assert usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0) == len(ids), (i, usage)
        assert cached == predicted, (i, usage, predicted)
        full = request_keys(ids, None, lookup=False)
        await kv.sink.wait_for(lambda full=full: kv.index.match(full, [pod.address]).get(pod.address, 0) == len(full))
        hits.append(cached)
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > hits[1]
