"""The OpenAI Responses API (``POST /v1/responses``) on a simulated pod, as vLLM 0.32 serves it for a model
rendered with a chat template: the request converted into the chat vLLM renders for it (extproc/responses.py,
kvroute's mirror of vLLM's ``construct_input_messages``, checked against vLLM's own in
tests/vllm/test_chat_render.py), run as one, and the answer written back in the API's shapes (vLLM's
entrypoints/openai/responses/serving.py and streaming_events.py):

- a whole answer: a ``response`` object, its ``output`` one assistant ``message`` item with one ``output_text``
  part, ``status`` "incomplete" (``incomplete_details.reason`` "max_output_tokens") where the output ran to
  ``max_output_tokens``;
- a stream: ``response.created``, ``response.in_progress``, then with the first token
  ``response.output_item.added`` and ``response.content_part.added``, a ``response.output_text.delta`` per token,
  and at the end ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
  ``response.completed`` (the whole response, with usage), each an SSE ``event:`` line and its ``data:``, every
  event numbered (``sequence_number``);
- usage as vLLM counts it: ``input_tokens`` the whole prompt, ``input_tokens_details.cached_tokens`` the part
  read from the cache and ``cache_write_tokens`` the part its full blocks wrote to it, each per turn too (one);
- errors in the OpenAI error shape, as the chat API's. ``previous_response_id`` names a stored response, and the
  store is off (vLLM's default): 404, as vLLM answers. ``prompt_cache_key`` is accepted and ignored, as vLLM
  does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from bench.sim.chat import carry
from bench.sim.refusals import empty_chat, invalid, lax_int, missing
from extproc import responses


class NotStored(Exception):
    """``previous_response_id`` names a response this pod does not hold (its store is off)."""


def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` as the chat request vLLM runs for it (ChatError or BadRequest where vLLM answers 400, NotStored
    404)."""
    if body.get("previous_response_id") is not None:
        raise NotStored(f"Response with id '{body['previous_response_id']}' not found.")
    if "input" not in body:
        raise missing(body, "input")
    if not isinstance(body["input"], (str, list)):
        raise invalid(("input",), "string_type", "Input should be a valid string", body["input"])
    max_tokens = lax_int(body, "max_output_tokens")
    chat = responses.to_chat(body)
    if not chat["messages"]:
        raise empty_chat()
    if max_tokens is not None:
        chat["max_output_tokens"] = max_tokens  # (the name vLLM's refusals say; the pod reads it for this API)
    return carry(body, chat)


def usage(prompt: int, cached: int, output: int, created: int = 0) -> dict[str, Any]:
    """As vLLM 0.32 writes it for a one-turn response (``created``: the prompt tokens its full blocks wrote to the
    cache)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": created,
                                 "input_tokens_per_turn": [prompt], "cached_tokens_per_turn": [cached]},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [output],
                                  "tool_output_tokens_per_turn": [0]},
        "total_tokens": prompt + output,
    }  # fmt: skip


def _text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


class Response:
    """One response's envelope: its id, model, the request's echoed fields, and its events' numbering."""

    def __init__(self, body: Mapping[str, Any], model: str, max_tokens: int) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.max_tokens = model, max_tokens
        self.instructions = body.get("instructions")
        self.tools = body.get("tools") or []
        self.sequence = 0
        self.opened = False  # the output item and its text part announced

    def whole(self, text: str | None, finish_reason: str | None, use: dict[str, Any] | None) -> dict[str, Any]:
        """The response object (``text`` None: still in progress, no output yet)."""
        if text is None:
            status, output = "in_progress", []
        else:
            status = "incomplete" if finish_reason == "length" else "completed"
            output = [_text_item(self.item_id, text, "completed")]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.instructions,
            "max_output_tokens": self.max_tokens,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "tool_choice": "auto",
            "tools": self.tools,
            "usage": use,
        }

    def event(self, name: str, **fields: Any) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> bytes:
        snapshot = self.whole(None, None, None)
        return self.event("response.created", response=snapshot) + self.event("response.in_progress",
                                                                              response=snapshot)  # fmt: skip

    def token(self, text: str) -> bytes:
        """The events for one generated token."""
        out = b""
        where = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        if not self.opened:
            self.opened = True
            item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            out += self.event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self.event("response.content_part.added", **where, part=part)
        return out + self.event("response.output_text.delta", **where, delta=text, logprobs=[])

    def end(self, text: str, finish_reason: str | None, use: dict[str, Any]) -> bytes:
        out = b""
        if self.opened:
            where = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
            out += self.event("response.output_text.done", **where, text=text, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": []}
            out += self.event("response.content_part.done", **where, part=part)
            out += self.event("response.output_item.done", output_index=0,
                              item=_text_item(self.item_id, text, "completed"))  # fmt: skip
        return out + self.event("response.completed", response=self.whole(text, finish_reason, use))
