"""Anthropic Messages API requests (``POST /v1/messages``, which vLLM serves: Claude Code and other Anthropic
clients against vLLM pods) as the OpenAI chat request vLLM turns them into before rendering.

kvroute keys a Messages request by that chat, approximately (extproc/request.py) or token-exactly
(extproc/tokenize.py, vLLM's conversation on top, extproc/conversation.py). The conversion follows vLLM
0.32's ``AnthropicServingMessages.to_chat_completion_request``:

- ``system`` (a string or text blocks; Claude Code's per-request attribution block dropped) joined into one
  leading system message; a system message among ``messages`` stays where it is, or, for a chat template that
  refuses a system message after the first turn, is merged into the leading one (``merge_inline_system``);
- text blocks as text parts (one alone as a string), images as ``image_url`` parts, thinking blocks as the
  message's ``reasoning``, ``tool_use`` blocks as tool calls with their input as a JSON string, a user's
  ``tool_result`` blocks as tool messages before the user's own message (an assistant's as a text part);
- tools as function tools (``input_schema`` an object schema; system messages' ``tool_addition`` and
  ``tool_removal`` blocks applied), ``thinking: disabled`` and
  ``output_config.effort`` as ``reasoning_effort``, ``chat_template_kwargs`` as sent.

"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from extproc.conversation import BILLING_HEADER, ChatError, function_tool

# Reasoning efforts Anthropic requests may carry (vLLM's AnthropicEffort).
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def to_chat(
    body: Mapping[str, Any], merge_inline_system: bool = False, disabled_effort: str = "none"
) -> dict[str, Any]:
    """``body`` (a Messages request) as vLLM's chat request: its messages, tools, reasoning_effort and
    chat_template_kwargs. ``merge_inline_system``, ``disabled_effort``: what vLLM finds for the model's chat
    template (``ModelTokenizer.anthropic_chat``)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ChatError("'messages' must be an array")
    out: list[dict[str, Any]] = []
    system = _system(body.get("system"), messages, merge_inline_system)
    if system:
        out.append({"role": "system", "content": system})
    for m in messages:
        _message(m, out, merge_inline_system)
    chat: dict[str, Any] = {"messages": out}
    config, thinking = body.get("output_config"), body.get("thinking")
    effort = config.get("effort") if isinstance(config, Mapping) else None
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        effort = disabled_effort
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = _tools_in_effect(body.get("tools"), messages)
    choice = _tool_choice(body.get("tool_choice"))
    if tools is not None:
        chat["tools"] = [_tool(t) for t in tools]
        choice = choice or "auto"  # vLLM's default with tools
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _tool_choice(choice: Any) -> Any:
    """An Anthropic ``tool_choice`` as vLLM's conversion writes it into the chat request (a pod run with
    ``--exclude-tools-when-tool-choice-none`` renders no tools for ``none``): ``any`` as required, a named tool
    as that function. None where none is given, or one vLLM's request model would refuse."""
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice, Mapping):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return None


def _tools_in_effect(tools: Any, messages: list[Any]) -> list[Any] | None:
    """``tools`` as the ``tool_addition`` / ``tool_removal`` blocks of system messages leave them at the end of
    the conversation (one list for the template: a tool added by reference no longer deferred, one added by
    value declared, one removed dropped)."""
    if tools is not None:
        tools = _list(tools, "'tools'")
    changes = [
        b
        for m in messages
        if isinstance(m, Mapping) and m.get("role") == "system" and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, Mapping) and b.get("type") in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return tools
    by_name = {t.get("name"): t for t in tools or () if isinstance(t, Mapping)}
    removed: set[Any] = set()
    for b in changes:
        change: Mapping[str, Any] = b["tool"] if isinstance(b.get("tool"), Mapping) else {}
        if change.get("type") == "tool_definition" and isinstance(change.get("definition"), Mapping):
            name = change["definition"].get("name")
            by_name[name] = change["definition"]
        else:
            name = change.get("name")
            if name not in by_name:
                raise ChatError(f"{b['type']} names a tool that is not declared")
            if b["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if b["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for n, t in by_name.items() if n not in removed]


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise ChatError(f"{what} must be an array")
    return v


def _system(system: Any, messages: list[Any], merge: bool) -> str:
    parts: list[str] = []
    if isinstance(system, str):
        parts.append(system)
    elif system:
        for b in _list(system, "'system'"):
            text = _text(_block(b))
            if b.get("type") == "text" and text and not text.startswith(BILLING_HEADER):
                parts.append(text)
    if merge:
        for m in messages:
            if isinstance(m, Mapping) and m.get("role") == "system" and (text := _system_text(m.get("content"))):
                parts.append(text)
    return "".join(parts)


def _system_text(content: Any) -> str | None:
    """A system message's text, Claude Code's attribution block left out (None: no text)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    texts = []
    for b in _list(content, "message content"):
        text = _text(_block(b))
        if b.get("type") == "text" and text and not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "".join(texts) or None


def _text(b: Mapping[str, Any]) -> str | None:
    text = b.get("text")
    if text is not None and not isinstance(text, str):
        raise ChatError("a block's text must be a string")
    return text


def _block(b: Any) -> Mapping[str, Any]:
    if not isinstance(b, Mapping) or not isinstance(b.get("type"), str):
        raise ChatError("content blocks must be objects with a type")
    return b


def _message(m: Any, out: list[dict[str, Any]], merge: bool) -> None:
    if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
        raise ChatError("each message must be an object with role user, assistant or system")
    role, content = m["role"], m.get("content")
    if role == "system":
        if not merge and (text := _system_text(content)):
            out.append({"role": "system", "content": text})
        return
    msg: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        msg["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in _list(content, "message content"):
            kind = _block(b)["type"]
            if kind == "text" and (text := _text(b)):
                parts.append({"type": "text", "text": text})
            elif kind == "image" and b.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
            elif kind == "thinking" and b.get("thinking") is not None:
                if not isinstance(b["thinking"], str):
                    raise ChatError("a thinking block's thinking must be a string")
                reasoning.append(b["thinking"])
            elif kind == "tool_use":
                args = json.dumps(b.get("input") or {})  # json.dumps' default spacing, as vLLM writes it
                name = b.get("name") or ""
                calls.append({"id": b.get("id") or f"call_{int(time.time())}", "type": "function",
                              "function": {"name": name, "arguments": args}})  # fmt: skip
            elif kind == "tool_result":
                if role == "user":
                    out.extend(_tool_result(b))
                else:
                    parts.append({"type": "text", "text": f"Tool result: {b['content'] if b.get('content') else ''}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            msg["content"] = parts[0]["text"]
        elif parts:
            msg["content"] = parts
    if role != "user" or "content" in msg:
        out.append(msg)


def _tool_result(b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A user's tool_result block as vLLM writes it: a tool message (texts joined by newlines), then a user
    message of its images and a tool message of its tool references, where it has them."""
    content, text, images, refs = b.get("content"), "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image" and (url := _image_url(item.get("source") or {})):
                images.append(url)
            elif item.get("type") == "tool_reference" and (ref := item.get("tool_name") or item.get("name")):
                refs.append({"type": "tool_reference", "name": ref})
        text = "\n".join(texts)
    call_id = b.get("tool_use_id") or ""
    out: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def _image_url(source: Any) -> str:
    if not isinstance(source, Mapping):
        raise ChatError("an image's source must be an object")
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool(t: Any) -> dict[str, Any]:
    if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
        raise ChatError("each tool must be an object with a name and an input_schema object")
    schema = t["input_schema"] if "type" in t["input_schema"] else {**t["input_schema"], "type": "object"}
    return function_tool(t["name"], t.get("description"), schema, t.get("strict"), t.get("defer_loading"))
