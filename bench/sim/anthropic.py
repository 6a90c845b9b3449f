"""The Anthropic Messages API (``POST /v1/messages``) on a simulated pod, as vLLM 0.32 serves it: the request
converted into a chat request (extproc/anthropic.py, kvroute's mirror of vLLM's
``to_chat_completion_request``, checked against vLLM's own in tests/vllm/test_chat_render.py), run as one, and
the chat answer written back in the Messages API's shapes (vLLM's entrypoints/anthropic/serving.py):

- a whole answer: ``{"id", "type": "message", "role", "content": [{"type": "text", "text"}], "model",
  "stop_reason", "usage"}``, null fields left out;
- a stream: ``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` for the text, ``message_delta``
  (stop reason, usage) and ``message_stop``, each an SSE ``event:`` line and its ``data:``;
- usage as Anthropic counts it: ``cache_read_input_tokens`` the prompt's tokens read from the cache (vLLM's
  ``cached_tokens``), ``cache_creation_input_tokens`` those its full blocks wrote to it, ``input_tokens`` the rest;
- errors as vLLM 0.32 writes them: ``{"type": "error", "error": {"type", "message"}}`` with the OpenAI error's type
  (``BadRequestError``, ``NotFoundError``, ``InternalServerError``); a request its request model refuses (not
  JSON, no ``max_tokens``, malformed content) in the OpenAI shape, as its request validation answers every path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from bench.sim.chat import carry
from bench.sim.refusals import check_list, empty_chat, invalid, lax_bool, lax_int, missing
from extproc import anthropic


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` as the chat request vLLM runs for it (ChatError or BadRequest where vLLM answers 400). The template the
    simulator ships takes a system message anywhere, so inline system messages are not merged."""
    if "messages" not in body:
        raise missing(body, "messages")
    check_list(body, "messages")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise invalid(("system",), "string_type", "Input should be a valid string", system)
    if "max_tokens" not in body:
        raise missing(body, "max_tokens")
    max_tokens = lax_int(body, "max_tokens")
    if max_tokens is None:
        raise invalid(("max_tokens",), "int_type", "Input should be a valid integer", None)
    if max_tokens <= 0:
        raise invalid(("max_tokens",), "value_error", "Value error, max_tokens must be positive", max_tokens,
                      error=ValueError("max_tokens must be positive"))  # fmt: skip
    chat = anthropic.to_chat(body)
    if not chat["messages"]:
        raise empty_chat()
    chat["max_completion_tokens"] = max_tokens  # (vLLM's conversion's name: its refusals say it)
    if lax_bool(body, "stream"):
        chat["stream_options"] = {"include_usage": True}  # vLLM asks for it: message_delta carries usage
    return carry(body, chat)


def usage(prompt: int, cached: int, output: int, created: int = 0) -> dict[str, int]:
    """As vLLM 0.32 writes it: ``input_tokens`` the prompt's tokens neither read from the cache nor written to it
    (``created``: its full blocks computed here), both others beside it."""
    return {"input_tokens": max(prompt - cached - created, 0), "output_tokens": output,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}  # fmt: skip


def stop_reason(finish_reason: str | None) -> str:
    return "max_tokens" if finish_reason == "length" else "end_turn"


def message(rid: str, model: str, text: str, finish_reason: str | None, use: dict[str, int]) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": stop_reason(finish_reason),
        "usage": use,
    }


def error(message: str, err_type: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": err_type, "message": message}}


def event(name: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageStream:
    """A chat answer's stream as the Messages API's events, one text block."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = rid, model
        self.started = False  # message_start sent
        self.opened = False  # the text block started

    def _start(self, use: dict[str, int]) -> bytes:
        if self.started:
            return b""
        self.started = True
        start: dict[str, Any] = {"id": self.rid, "type": "message", "role": "assistant", "content": []}
        start.update(model=self.model, stop_reason=None, stop_sequence=None, usage=use)
        return event("message_start", {"type": "message_start", "message": start})

    def token(self, text: str, use: dict[str, int]) -> bytes:
        """The events for one generated token (``use``: the usage so far, for message_start)."""
        out = self._start(use)
        if not self.opened:
            self.opened = True
            out += event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})  # fmt: skip
        delta = {"type": "text_delta", "text": text}
        return out + event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})

    def end(self, finish_reason: str | None, use: dict[str, int]) -> bytes:
        out = self._start(use)
        if self.opened:
            out += event("content_block_stop", {"type": "content_block_stop", "index": 0})
        delta = {"stop_reason": stop_reason(finish_reason), "stop_sequence": None}
        out += event("message_delta", {"type": "message_delta", "delta": delta, "usage": use})
        return out + event("message_stop", {"type": "message_stop"})
