"""How a simulated pod refuses a request, in vLLM 0.32's words and shapes (tests/vllm/test_sim_fidelity.py holds
them to a real pod's).

Two kinds of 400, as vLLM answers them:

- its request model's (pydantic) validation: type ``"Bad Request"``, ``param`` the field's place in the body
  (``body.messages``, ``body.prompt.1``), the message a count of errors and each error's fields
  (``invalid``). Where the request model tries a union's branches in turn (a message, a prompt), vLLM reports an
  error per branch; the simulator names the first, with vLLM's ``param``.
- its own checks after that: type ``BadRequestError``, the message followed by `` (parameter=..., value=...)``
  where vLLM names them (``refused``).

The request-model checks here cover the fields the simulator reads; vLLM's model is lax where pydantic is
(``"3"``, ``3.0`` and ``true`` are an integer; ``"yes"`` a boolean).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

VALIDATION = "Bad Request"  # the error type of vLLM's answer to a request its request model refuses
REFUSED = "BadRequestError"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, err_type: str = REFUSED) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.err_type = message, param, status, err_type


def error_body(message: str, err_type: str = REFUSED, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def refused(message: str, parameter: str | None = None, value: Any = None, param: str | None = None) -> BadRequest:
    """vLLM's own refusal (``VLLMValidationError``): ``(parameter=..., value=...)`` after the message where it
    names them, ``param`` the parameter unless given."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    text = f"{message} ({', '.join(extras)})" if extras else message
    return BadRequest(text, parameter if param is None else param)


def empty_chat() -> BadRequest:
    """vLLM's refusal of a request whose conversation has no message (a chat's, or an agent API's converted)."""
    return refused("Cannot apply chat template to an empty conversation. Provide at least one message.")


def _shown(value: Any) -> str:
    """An error's ``input`` as vLLM shows it: containers described, long strings cut."""
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def invalid(loc: tuple[str | int, ...], kind: str, msg: str, value: Any, **ctx: Any) -> BadRequest:
    """The request model's refusal of the value at ``loc`` (under the body)."""
    where = ".".join(str(p) for p in ("body", *loc))
    err: dict[str, Any] = {"type": kind, "loc": where, "msg": msg, "input": _shown(value)}
    if ctx:
        err["ctx"] = ctx
    return BadRequest(f"1 validation error:\n  {err}", where, err_type=VALIDATION)


def read_json(raw: bytes) -> Any:
    """A request body parsed as vLLM's server (FastAPI, the standard library's decoder) parses it, refused in its
    words (the error's character offset in ``param``); orjson first, the standard library where it refuses."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    if not raw:
        raise invalid((), "missing", "Field required", None)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise invalid((e.pos,), "json_invalid", "JSON decode error", {}, error=e.msg) from None
    except ValueError as e:  # (bytes in no encoding JSON allows)
        raise invalid((0,), "json_invalid", "JSON decode error", {}, error=str(e)) from None


def missing(body: Mapping[str, Any], key: str) -> BadRequest:
    return invalid((key,), "missing", "Field required", body)


def lax_int(body: Mapping[str, Any], key: str) -> int | None:
    """``body[key]`` as an integer as pydantic reads one (lax), None when absent or null."""
    v = body.get(key)
    if v is None or isinstance(v, int):  # (bool too: pydantic takes true as 1)
        return None if v is None else int(v)
    if isinstance(v, float):
        if v.is_integer():
            return int(v)
        raise invalid((key,), "int_from_float", "Input should be a valid integer, got a number with a fractional "
                      "part", v)  # fmt: skip
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise invalid((key,), "int_parsing", "Input should be a valid integer, unable to parse string as an "
                          "integer", v) from None  # fmt: skip
    raise invalid((key,), "int_type", "Input should be a valid integer", v)


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(body: Mapping[str, Any], key: str) -> bool | None:
    """``body[key]`` as a boolean as pydantic reads one (lax: "no" is false), None when absent or null."""
    v = body.get(key)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and (word := v.strip().lower()) in _TRUE | _FALSE:
        return word in _TRUE
    if isinstance(v, str):
        raise invalid((key,), "bool_parsing", "Input should be a valid boolean, unable to interpret input", v)
    raise invalid((key,), "bool_type", "Input should be a valid boolean", v)


def check_object(body: Mapping[str, Any], key: str, model: bool = False) -> None:
    """``body[key]``, when present, is an object (``model``: one of vLLM's request sub-models, refused in
    pydantic's words for a model)."""
    v = body.get(key)
    if v is None or isinstance(v, dict):
        return
    if model:
        raise invalid((key,), "model_attributes_type", "Input should be a valid dictionary or object to extract "
                      "fields from", v)  # fmt: skip
    raise invalid((key,), "dict_type", "Input should be a valid dictionary", v)


def check_list(body: Mapping[str, Any], key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, list):
        raise invalid((key,), "list_type", "Input should be a valid list", v)


def not_an_object(body: Any) -> BadRequest:
    """A JSON body that is not an object."""
    return invalid((), "model_attributes_type", "Input should be a valid dictionary or object to extract fields from",
                   body)  # fmt: skip


# vLLM's chat request model reads each message as a union of these; an invalid one is reported under the first.
FIRST_MESSAGE_MODEL = "ChatCompletionDeveloperMessageParam"


def check_messages(body: Mapping[str, Any]) -> list[Any]:
    """A chat request's ``messages`` as vLLM's request model takes them: a list of objects, each with a role and
    content that is text, null or a list."""
    if "messages" not in body:
        raise missing(body, "messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise invalid(("messages",), "list_type", "Input should be a valid list", messages)
    for i, m in enumerate(messages):
        at: tuple[str | int, ...] = ("messages", i, FIRST_MESSAGE_MODEL)
        if not isinstance(m, dict):
            raise invalid(at, "dict_type", "Input should be a valid dictionary", m)
        if "role" not in m:
            raise invalid((*at, "role"), "missing", "Field required", m)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise invalid((*at, "content"), "string_type", "Input should be a valid string", content)
    return messages


def check_prompt(prompt: Any) -> None:
    """A completion's ``prompt`` as vLLM's request model takes it: text, token ids (non-negative), or a list of
    either; refused as its first branch (a list of token ids) reports it."""
    if prompt is None or isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise invalid(("prompt",), "list_type", "Input should be a valid list", prompt)
    if not prompt or not any(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return  # a batch (texts or token lists), or nothing: vLLM's own checks answer
    for i, p in enumerate(prompt):
        if isinstance(p, bool) or not isinstance(p, int):
            raise invalid(("prompt", i), "int_parsing" if isinstance(p, str) else "int_type",
                          "Input should be a valid integer" + (", unable to parse string as an integer"
                                                               if isinstance(p, str) else ""), p)  # fmt: skip
        if p < 0:
            raise invalid(("prompt", i), "greater_than_equal", "Input should be greater than or equal to 0", p, ge=0)
