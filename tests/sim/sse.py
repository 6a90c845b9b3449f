"""Server-sent events as the agent APIs (Anthropic Messages, OpenAI Responses) stream them, parsed strictly."""

from __future__ import annotations

from typing import Any

import orjson


def events(text: str) -> list[dict[str, Any]]:
    """Every event an ``event:`` line naming its ``type``, one ``data:`` line, a blank line."""
    out = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        obj = orjson.loads(data[len("data: ") :])
        assert obj["type"] == name[len("event: ") :]
        out.append(obj)
    return out
