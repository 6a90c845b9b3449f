"""OpenAI Responses API requests (``POST /v1/responses``, which vLLM serves: Codex, the Agents SDK) as the chat
request vLLM renders for them, so kvroute keys them as it keys chats (approximately, or token-exactly through
extproc/conversation.py).

The conversion follows vLLM 0.32's ``construct_input_messages`` and ``ResponsesRequest.build_chat_params`` for
models rendered with a chat template (not gpt-oss, which vLLM renders with Harmony):

- ``instructions`` as a leading system message, a string ``input`` as one user message;
- input items in order: messages as sent (``input_text`` parts are text parts); ``function_call`` items as tool
  calls (joined to the assistant message just before, as are ``reasoning`` items as its ``reasoning`` and
  assistant output messages as its content), ``function_call_output`` items as tool messages;
- a last assistant message or reasoning item marked ``in_progress`` / ``incomplete`` continued rather than
  answered (``continue_final_message``); ``reasoning.effort`` as ``reasoning_effort``;
- function tools (flat: ``{"type": "function", "name", "parameters", ...}``) as chat tools; other tool types
  are not shown to the model.

Not mirrored: ``previous_response_id`` (the history vLLM stored is not in the request: only the new input is
keyed), custom tools (ChatError: keyed approximately).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.conversation import ChatError, function_tool


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` (a Responses request) as vLLM's chat: messages, tools and template arguments."""
    messages: list[dict[str, Any]] = []
    if instructions := body.get("instructions"):
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if (m := _message(item, messages[-1] if messages else None)) is not None:
                messages.append(m)
    else:
        raise ChatError("'input' must be a string or an array of items")
    partial = isinstance(items, list) and bool(items) and _partial(items[-1])
    chat: dict[str, Any] = {"messages": messages, "add_generation_prompt": not partial}
    if partial:
        chat["continue_final_message"] = True
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    return chat


def _message(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """``item`` as a chat message, or None where it was joined to ``prev`` (an assistant message)."""
    if not isinstance(item, Mapping):
        raise ChatError("input items must be objects")
    kind = item.get("type")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    if kind == "function_call":
        name = f"{item['namespace']}__{item.get('name')}" if item.get("namespace") else item.get("name")
        call = {"id": item.get("call_id"), "function": {"name": name, "arguments": item.get("arguments")},
                "type": "function"}  # fmt: skip
        calls = assistant.get("tool_calls") if assistant is not None else None
        if assistant is not None and (calls is None or isinstance(calls, list)):
            assistant["tool_calls"] = [*(calls or []), call]
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise ChatError("encrypted reasoning is refused by vLLM")
        texts = item.get("content") or item.get("summary")
        if texts is not None and not isinstance(texts, list):
            raise ChatError("a reasoning item's content and summary must be arrays")
        first = texts[0] if texts else {}
        text = first.get("text", "") if isinstance(first, Mapping) else ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind in ("custom_tool_call", "custom_tool_call_output"):
        raise ChatError("custom tool calls are not keyed")
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else None
        if isinstance(content, list) and content and isinstance(content[0], Mapping):
            text = content[0].get("text")
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)
    raise ChatError(f"unsupported input item type {kind!r}")


def _partial(item: Any) -> bool:
    """A last item vLLM continues: an assistant message or reasoning item still in progress."""
    if not isinstance(item, Mapping) or item.get("type", "message") not in ("message", "reasoning"):
        return False
    return item.get("status") in ("in_progress", "incomplete")


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The function tools the model is shown, in request order: a namespace's as ``namespace__name``; custom
    tools (a one-string shim in vLLM) are refused here, other tool types (web search, ...) not shown."""
    out = []
    for t in tools if isinstance(tools, list) else ():
        if not isinstance(t, Mapping):
            raise ChatError("tools must be objects")
        if t.get("type") == "function":
            out.append(_tool(t, t.get("name")))
        elif t.get("type") == "namespace":
            out += [
                _tool(n, f"{t.get('name')}__{n.get('name')}")
                for n in t.get("tools") or ()
                if n.get("type") == "function"
            ]
        elif t.get("type") == "custom":
            raise ChatError("custom tools are not keyed")
    return out


def _tool(t: Mapping[str, Any], name: Any) -> dict[str, Any]:
    return function_tool(name, t.get("description"), t.get("parameters"), t.get("strict"))
