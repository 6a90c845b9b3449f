"""A simulated pod's chat front, as vLLM 0.32's: the conversation its chat template is given, so the prompt.

vLLM does not render a client's messages as sent. It first builds a conversation from them (the content
format read from the template, tool-call ``arguments`` strings as objects, null content as empty, tools
rewritten as its request model writes them: extproc/conversation.py lists each step). The simulator takes
kvroute's mirror of that step, which tests/vllm/test_chat_render.py checks against a real vLLM 0.32 pod, so a
simulated pod builds the prompt a vLLM pod with the same template builds (bench.vllm_model.CHAT_TEMPLATE for
the built-in tokenizer, the directory's own for ``--tokenizer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.sim.refusals import lax_bool
from bench.sim.tokenizer import ChatError, Tokenizer
from extproc import conversation as conv
from extproc.tokenize import template_shape


class ChatFront:
    """Chat requests to prompt token ids, as a vLLM pod with ``tokenizer``'s template builds them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        source = tokenizer.chat_template
        try:
            self.shape = template_shape(source) if source is not None else conv.ChatShape("string", False)
        except Exception as e:  # a template that does not compile: vLLM refuses it at start too
            raise ValueError(f"chat template does not compile: {e}") from e

    def tokens(self, body: Mapping[str, Any], validated: bool = True) -> list[int]:
        """``body`` (a chat request) as its prompt's token ids; ChatError where vLLM answers 400. ``validated``
        False: a chat vLLM built from a Responses request, not through its chat request model."""
        messages, tools = body.get("messages"), body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ChatError("tools must be a list")
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        talk = conv.conversation(messages, self.shape, validated)
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        return self.tokenizer.render_chat(talk, conv.tool_dicts(tools) if tools else None, add_generation_prompt)


def carry(body: Mapping[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """``chat`` (an agent API request's conversion) with what vLLM carries over from ``body`` to the chat it runs:
    the model, cache salt, KV transfer parameters and whether it streams."""
    for key in ("model", "cache_salt", "kv_transfer_params"):
        if key in body:
            chat[key] = body[key]
    if lax_bool(body, "stream"):
        chat["stream"] = True
    return chat
