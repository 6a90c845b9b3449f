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

from bench.sim.tokenizer import ChatError, Tokenizer
from extproc import conversation as conv


def template_shape(source: str | None) -> conv.ChatShape:
    """What vLLM reads from a chat template's syntax tree (content format, developer role)."""
    if source is None:
        return conv.ChatShape("string", False)
    from jinja2 import Environment

    try:
        return conv.shape_of(source, Environment().parse(source))
    except Exception as e:  # a template jinja2 cannot parse: vLLM refuses it at start too
        raise ValueError(f"chat template does not parse: {e}") from e


class ChatFront:
    """Chat requests to prompt token ids, as a vLLM pod with ``tokenizer``'s template builds them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.shape = template_shape(tokenizer.chat_template)

    def tokens(self, body: Mapping[str, Any]) -> list[int]:
        """``body`` (a chat request) as its prompt's token ids; ChatError where vLLM answers 400."""
        messages, tools = body.get("messages"), body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ChatError("tools must be a list")
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        try:
            talk = conv.conversation(messages, self.shape)
        except conv.ChatError as e:
            raise ChatError(str(e)) from None
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        return self.tokenizer.render_chat(talk, conv.tool_dicts(tools) if tools else None, add_generation_prompt)
