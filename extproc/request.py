"""OpenAI request parsing: bytes + headers in, a frozen ``InferenceRequest`` out.

Nothing here knows about Envoy. Parsing is one pass of orjson; the prompt is normalised into the
text kvroute hashes (chat: the rendered message sequence, so a follow-up turn extends the earlier
turns' prefix) or kept as token ids when the client sent ids.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, dataclass_transform

import orjson
import xxhash

from extproc import anthropic, responses
from extproc.conversation import ChatError
from extproc.errors import BodyTooLarge, MalformedBody, MalformedHeader

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API, which vLLM serves (extproc/anthropic.py)
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API, which vLLM serves (extproc/responses.py)
INFERENCE_PATHS = (CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH, RESPONSES_PATH)
MAX_TOKEN_ID = (1 << 32) - 1  # token ids are hashed as u32 (extproc/hashing.py); vocabularies are far smaller
# A content part that is not text (an image, audio) stands in the prompt for what it is: its canonical JSON up
# to this many bytes, past it its type and that JSON's 128-bit digest. A base64 image is megabytes: inlined, it
# was most of the prompt (its first blocks keyed, its characters counted as tokens: a 1 MB image read as 250k
# prompt tokens to the cost model) and several copies of it were made; vLLM reads it as one item in a prompt.
MEDIA_INLINE_BYTES = 512
_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[_T]) -> type[_T]:
    """A per-request record: a slotted dataclass, frozen for the type checker (assigning a field is an
    error) but not at run time, where a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``: ~2 us more per request's InferenceRequest alone than plain assignment."""
    return dataclass(slots=True)(cls)


@record
class InferenceRequest:
    """Everything later stages need about one request, and nothing from Envoy."""

    path: str
    method: str
    request_id: str
    tenant: str
    model: str | None = None
    prompt_text: str = ""
    prompt_token_ids: tuple[int, ...] | None = None
    stream: bool = False
    max_tokens: int | None = None
    user: str | None = None
    cache_salt: str | None = None
    route_id: str | None = None
    priority: int = 0
    ttft_slo_s: float | None = None  # the client's time-to-first-token objective (headers.ttft_slo)
    body: dict[str, Any] | None = field(default=None, repr=False)
    # A Responses request's chat as vLLM converts it (extproc/responses.py), made once: its approximate text
    # here, its tokens in precise mode. None for the other APIs, or where the conversion refused the input.
    chat: dict[str, Any] | None = field(default=None, repr=False)
    rewritten: bool = False  # kvroute changed ``body`` (e.g. tenancy's cache_salt): the pod gets it re-serialized

    @property
    def is_inference(self) -> bool:
        return self.path in INFERENCE_PATHS

    @property
    def prompt_chars(self) -> int:
        return len(self.prompt_text)


def _opt(body: Mapping[str, Any], name: str, typ: type | tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    # bool is an int subclass: refuse it where a number is expected.
    if not isinstance(v, typ) or (isinstance(v, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,))):
        raise MalformedBody(f"'{name}' must be {what}, got {type(v).__name__}", param=name)
    return v


def _canonical(value: Any, where: str, param: str) -> str:
    """Sorted-key JSON of a client value hashed into the prompt."""
    return _canonical_bytes(value, where, param).decode()


def _canonical_bytes(value: Any, where: str, param: str) -> bytes:
    """``_canonical`` as bytes. orjson serializes at most 254 levels deep although it parses 1024: deeper
    is the client's error, not kvroute's."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        raise MalformedBody(f"{where} is nested too deeply", param=param) from None


def _media(part: dict[str, Any], where: str) -> str:
    """What a content part that is not text stands as in the prompt (``MEDIA_INLINE_BYTES``): its canonical
    JSON, or for a large one its type and that JSON's digest (the same image, the same text)."""
    raw = _canonical_bytes(part, where, "messages")
    if len(raw) <= MEDIA_INLINE_BYTES:
        return raw.decode()
    kind = part.get("type")
    kind = kind if isinstance(kind, str) and len(kind) <= 32 else "media"  # the client's word: bounded
    return f"{kind}#{xxhash.xxh3_128_hexdigest(raw)}"


def dump_body(body: Mapping[str, Any]) -> bytes:
    """A body kvroute rewrote, serialized for the pod (MalformedBody if nested past orjson's writer)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise MalformedBody("request body is nested too deeply (at most 254 levels)") from None


def _are_token_ids(ids: list[Any]) -> bool:
    """Every item an int in 0..MAX_TOKEN_ID, none a bool. In C, not a Python call per id (an 8k-id prompt's
    check had cost ~1 ms): a u32 array takes ints in that range only, and bool, an int to it, is told by type."""
    try:
        array("I", ids)
    except (TypeError, OverflowError):
        return False
    return set(map(type, ids)) == {int}


def _content_text(content: Any, where: str) -> str:
    """Flatten a message's content: a string, or an array of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if part.get("type") == "text" or "text" in part:
                    text = part.get("text", "")
                    if not isinstance(text, str):
                        raise MalformedBody(f"{where}.content[{i}].text must be a string", param="messages")
                    parts.append(text)
                else:
                    # Images/audio: their identity matters for the prefix, their bytes don't need to be read.
                    parts.append("<" + _media(part, f"{where}.content[{i}]") + ">")
            else:
                raise MalformedBody(f"{where}.content[{i}] must be an object or string", param="messages")
        return "".join(parts)
    raise MalformedBody(f"{where}.content must be a string or an array of parts", param="messages")


def render_chat(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MalformedBody("'messages' must be a non-empty array", param="messages")
    out: list[str] = []
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise MalformedBody("'tools' must be an array", param="tools")
        out.append("<|tools|>\n" + _canonical(tools, "'tools'", "tools") + "\n")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise MalformedBody(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if not isinstance(role, str):
            raise MalformedBody(f"messages[{i}].role must be a string", param="messages")
        text = _content_text(m.get("content"), f"messages[{i}]")
        if m.get("tool_calls"):
            text += _canonical(m["tool_calls"], f"messages[{i}].tool_calls", "messages")
        out.append(f"<|{role}|>\n{text}\n")
    return "".join(out)


def _responses_prompt(body: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """A Responses request's prompt and chat: its chat as vLLM makes it, or where that cannot be made (an item
    type the conversion does not know: vLLM may still serve it) its instructions and input as sorted-key JSON
    and no chat."""
    try:
        chat = responses.to_chat(body)
        return render_chat(chat), chat
    except (ChatError, MalformedBody):
        whole = {"instructions": body.get("instructions"), "input": body.get("input")}
        return _canonical(whole, "'input'", "input"), None


def _completion_prompt(body: Mapping[str, Any]) -> tuple[str, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            # A batch of prompts goes to one pod: the first prompt decides.
            if not all(isinstance(p, str) for p in prompt):
                raise MalformedBody("'prompt' array must hold only strings or only token ids", param="prompt")
            return first, None
        if isinstance(first, int) and not isinstance(first, bool):
            if not _are_token_ids(prompt):
                raise MalformedBody("'prompt' token ids must be integers in 0..2^32-1", param="prompt")
            return "", tuple(prompt)
        if isinstance(first, list):
            ids = first
            if not ids or not _are_token_ids(ids):
                raise MalformedBody("'prompt' token ids must be integers in 0..2^32-1", param="prompt")
            return "", tuple(ids)
    raise MalformedBody("'prompt' must be a string, an array of strings, or token ids", param="prompt")


def parse_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise BodyTooLarge(f"request body is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson's message names the position (and says so for invalid UTF-8); never echo the body.
        raise MalformedBody(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise MalformedBody(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_request(
    *,
    path: str,
    method: str,
    headers: Mapping[str, str],
    raw_body: bytes | None,
    max_body_bytes: int,
    tenant_header: str,
    route_id_headers: list[str],
    request_id_header: str,
    priority_headers: tuple[str, ...] = (),
    ttft_slo_header: str | None = None,
    route_id_fields: Sequence[str] = (),
) -> InferenceRequest:
    """``route_id_fields``: top-level body fields read as the route id when no ``route_id_headers`` is set (a
    non-empty string; anything else is not a route id)."""
    path = path.split("?", 1)[0]
    tenant = headers.get(tenant_header) or "default"
    route_id: str | None = None
    for h in route_id_headers:  # a loop, not next() over a generator: this runs for every request
        if v := headers.get(h):
            route_id = v
            break
    common: dict[str, Any] = {
        "path": path,
        "method": method,
        "request_id": headers.get(request_id_header, ""),
        "tenant": tenant,
        "route_id": route_id,
        "priority": _priority(headers, priority_headers),
        "ttft_slo_s": _ttft_slo(headers, ttft_slo_header),
    }
    if not raw_body:
        if path in INFERENCE_PATHS and method == "POST":
            raise MalformedBody(f"{path} needs a JSON body")
        return InferenceRequest(**common)
    if path not in INFERENCE_PATHS:
        # Pass-through paths: read the model if the body is JSON, never fail on it.
        model = None
        if len(raw_body) <= max_body_bytes:
            try:
                b = orjson.loads(raw_body)
                model = b.get("model") if isinstance(b, dict) and isinstance(b.get("model"), str) else None
            except orjson.JSONDecodeError:
                pass
        return InferenceRequest(**common, model=model)

    body = parse_body(raw_body, max_body_bytes)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MalformedBody("'model' must be a non-empty string", param="model")
    if route_id is None:
        for field in route_id_fields:
            if isinstance(v := body.get(field), str) and v:
                common["route_id"] = v
                break
    chat = None
    if path == CHAT_PATH:
        text, ids = render_chat(body), None
    elif path == MESSAGES_PATH:
        try:
            text, ids = render_chat(anthropic.to_chat(body)), None
        except ChatError as e:
            raise MalformedBody(str(e), param="messages") from None
    elif path == RESPONSES_PATH:
        (text, chat), ids = _responses_prompt(body), None
    else:
        text, ids = _completion_prompt(body)
    max_tokens = _opt(body, "max_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = _opt(body, "max_completion_tokens" if path != RESPONSES_PATH else "max_output_tokens", int,
                          "an integer")  # fmt: skip
    return InferenceRequest(
        **common,
        model=model,
        prompt_text=text,
        prompt_token_ids=ids,
        stream=bool(_opt(body, "stream", bool, "a boolean")),
        max_tokens=max_tokens,
        user=_opt(body, "user", str, "a string"),
        cache_salt=_opt(body, "cache_salt", str, "a string"),
        body=body,
        chat=chat,
    )


def _ttft_slo(headers: Mapping[str, str], name: str | None) -> float | None:
    """The TTFT objective header, milliseconds → seconds; anything but a positive number is an error."""
    v = headers.get(name) if name else None
    if v is None or not v.strip():
        return None
    try:
        ms = float(v)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise MalformedHeader(f"{name} must be a positive number of milliseconds, got {v[:32]!r}", param=name)
    return ms / 1e3


_OBJECTIVE_PRIORITY = {"sheddable": -1, "critical": 1, "standard": 0}


def _priority(headers: Mapping[str, str], names: tuple[str, ...]) -> int:
    """Negative = sheddable. Accepts an integer or the words sheddable/standard/critical."""
    for h in names:
        v = headers.get(h)
        if not v:
            continue
        v = v.strip().lower()
        if v in _OBJECTIVE_PRIORITY:
            return _OBJECTIVE_PRIORITY[v]
        try:
            return int(v)
        except ValueError:
            continue
    return 0
