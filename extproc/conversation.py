"""A chat request as vLLM hands it to the model's chat template, so precise mode renders the pods' prompt.

vLLM (0.32's renderer, through transformers' ``apply_chat_template``) does not render the client's
messages as sent. Each difference below changed the rendered text, so the tokens, so every block key
from the first block it touched: precise mode then matched nothing a pod held past it.

- **Content format.** vLLM reads the template's syntax tree: a template that loops over a message's
  ``content`` gets every message's content as a list of parts (``"openai"``: text parts as
  ``{"type": "text", "text": ...}``, a plain string content wrapped as one such part, an image as
  ``{"type": "image"}``); any other gets one string, its text parts joined with newlines
  (``"string"``). A template of the first kind given a string iterates its characters, and one that
  writes parts one by one joins them without the newline. ``--chat-template-content-format`` forces one
  (``models.<name>.chat_template_content_format``).
- **Messages.** Only the fields vLLM passes reach the template (role, content; name; an assistant's
  ``tool_calls`` and ``reasoning``, the latter also as ``reasoning_content``; a tool result's
  ``tool_call_id``, its text parts joined); null content is empty; a tool call's JSON ``arguments``
  string becomes the object it spells (``{}`` when it is not one), an empty ``tool_calls`` list is dropped;
  a system message's Claude Code attribution line (``x-anthropic-billing-header``, new each request) is cut.
- **Developer messages**, for a template that never names the role: renamed system, and every system
  message merged into one at the front.
- **Tools**, as vLLM's request model writes them back: ``{"type", "function": {"name", "description",
  "parameters"}}`` in that order, absent fields as null, unknown ones dropped.
- **Template arguments.** The request's ``chat_template_kwargs`` under its own ``add_generation_prompt``,
  ``continue_final_message``, ``documents``, ``reasoning_effort`` (and ``enable_thinking``, from it), over the
  pods' ``--default-chat-template-kwargs`` (``models.<name>.chat_template_kwargs``); null and "auto" values
  unset.

The pods' flags that change these (``--chat-template-content-format``, ``--default-chat-template-kwargs``,
``--exclude-tools-when-tool-choice-none``, ``--anthropic-disabled-thinking-effort``) are ``PodFlags``.

Not mirrored: media in a "string"-format template (vLLM writes a placeholder of the model's processor before
the message's text; blocks past an image never match anyway, the pods key them with the image's hash).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# Part types whose text a template gets as a text part, and the key the text is under.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Media part types and the modality a template gets in their place ("openai" format).
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# A part's fields that vLLM reads itself; any other field is passed on with the part ("openai" format).
_KNOWN_PART_FIELDS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request attribution line
# transformers' apply_chat_template parameters that never reach the template as variables.
_APPLY_PARAMS = frozenset(
    {"conversation", "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


@dataclass(frozen=True)
class PodFlags:
    """How the pods were started where it changes what they render: vLLM's flags of the same names
    (``models.<name>`` in kvroute's config)."""

    chat_template_content_format: str = "auto"  # auto: read from the template
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False
    anthropic_disabled_thinking_effort: str = "auto"  # auto: probed from the template (ModelTokenizer)


class ChatError(ValueError):
    """A chat request vLLM would refuse rather than render (precise mode falls back to approximate keys)."""


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What a chat template's source tells about the conversation it expects, read once at load."""

    content_format: ContentFormat
    developer: bool  # the template names the developer role itself


def shape_of(source: str, ast: Any, content_format: str = "auto") -> ChatShape:
    """``source``'s shape (``ast``: its jinja2 syntax tree); ``content_format`` "string" or "openai" forces
    that format, as vLLM's ``--chat-template-content-format`` does."""
    fmt: ContentFormat = "string"
    if content_format == "openai" or (content_format != "string" and _iterates_content(ast)):
        fmt = "openai"
    return ChatShape(fmt, '"developer"' in source or "'developer'" in source)


def render_args(body: Mapping[str, Any], flags: PodFlags) -> dict[str, Any]:
    """The template's arguments for ``body`` (tools, documents, add_generation_prompt and the rest) as vLLM and
    transformers pass them, but the messages (``conversation``: their shape depends on the template, which
    may depend on the tools); under the pods' ``--default-chat-template-kwargs`` (``flags``).
    ``continue_final_message`` stays in it for the caller (``cut_continued``)."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, Mapping):
        raise ChatError("chat_template_kwargs must be an object")
    asked = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    if asked["reasoning_effort"] is not None and "enable_thinking" not in user:
        asked["enable_thinking"] = asked["reasoning_effort"] != "none"
    args = dict(flags.default_chat_template_kwargs)
    tools = tool_dicts(body.get("tools"))
    if flags.exclude_tools_when_tool_choice_none and body.get("tool_choice") == "none":
        tools = None
    if tools is not None:
        args["tools"] = tools
    # The request's fields over its kwargs, both over the pods' defaults, unset values passing nothing.
    request = {**user, **{k: v for k, v in asked.items() if not _unset(v)}}
    args.update((k, v) for k, v in request.items() if not _unset(v) and k not in _APPLY_PARAMS)
    if args.get("continue_final_message") and args.get("add_generation_prompt"):
        raise ChatError("continue_final_message and add_generation_prompt are not compatible")
    args.setdefault("tools", None)
    args.setdefault("documents", None)
    args.setdefault("add_generation_prompt", False)
    return args


def cut_continued(args: dict[str, Any], source: str) -> str | None:
    """With ``continue_final_message``: marks the final message's text (its last text part's) with a tag, as
    transformers does, and returns the tag; the rendered text ends where the tag starts (``continued``)."""
    key = args.pop("continue_final_message", False)
    if not key:
        return None
    key = key if isinstance(key, str) else "content"
    messages = args["messages"]
    if not messages or messages[-1].get(key) is None:
        raise ChatError(f'continue_final_message: the final message has no "{key}"')
    if key not in source:
        raise ChatError(f'continue_final_message: "{key}" is not a field of the chat template')
    last = messages[-1] = dict(messages[-1])
    value = last[key]
    if isinstance(value, list):
        value = last[key] = [dict(p) if isinstance(p, Mapping) else p for p in value]
        for p in reversed(value):
            if isinstance(p, dict) and "text" in p:
                p["text"] = f"{p['text']}{_CONTINUE_TAG}"
                break
        else:
            raise ChatError("continue_final_message: no text in the final message")
    else:
        last[key] = f"{value}{_CONTINUE_TAG}"
    return _CONTINUE_TAG


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def continued(rendered: str, tag: str) -> str:
    """``rendered`` up to ``tag`` (transformers' cut: where the template kept the tag's trailing space, just
    before it; where it trimmed the message, before it and any whitespace)."""
    at = rendered.rfind(tag.strip())
    if at < 0:
        raise ChatError("continue_final_message: the template dropped the final message")
    return rendered[:at] if rendered.startswith(tag, at) else rendered[:at].rstrip()


def conversation(messages: Any, shape: ChatShape, validated: bool = True) -> list[dict[str, Any]]:
    """``messages`` as vLLM hands them to the template (the module docstring). ``validated``: they came
    through vLLM's request model (the chat and Messages APIs), which gives a tool call's function back as
    ``arguments`` then ``name``; the Responses API's conversion builds them itself, ``name`` first, and a
    template writing the calls whole shows the order. The request is not changed."""
    if not isinstance(messages, list):
        raise ChatError("messages must be a list")
    out = [_message(m, shape.content_format, validated) for m in messages]
    if not shape.developer and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out


def tool_dicts(tools: Any) -> Any:
    """``tools`` as vLLM's request model writes them back (``model_dump``); as sent when they are not a list
    of function tools (vLLM refuses such a request)."""
    if not isinstance(tools, list):
        return tools
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(f, Mapping) or t.get("type", "function") != "function":
            return tools
        defer = t.get("defer_loading")
        f_defer = f.get("defer_loading")
        if f_defer is None:
            f_defer = defer  # the tool's, carried into its function as vLLM's model does
        tool = function_tool(f.get("name"), f.get("description"), f.get("parameters"), f.get("strict"), f_defer)
        if defer is not None:
            tool["defer_loading"] = defer
        out.append(tool)
    return out


def function_tool(
    name: Any, description: Any, parameters: Any, strict: Any = None, defer_loading: Any = None
) -> dict[str, Any]:
    """A function tool as vLLM's request model writes it back: its function's name, description and parameters
    (null when absent), strict and defer_loading only when set."""
    fn = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        fn["strict"] = strict
    if defer_loading is not None:
        fn["defer_loading"] = defer_loading
    return {"type": "function", "function": fn}


def _unset(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v == "auto")


def _message(m: Any, fmt: ContentFormat, validated: bool = True) -> dict[str, Any]:
    if type(m) is dict and len(m) == 2 and fmt == "string":  # most messages: a role and a string, passed as sent
        role, content = m.get("role"), m.get("content")
        plain = isinstance(role, str) and role != "developer" and isinstance(content, str)
        if plain and (role != "system" or not str(content).startswith(BILLING_HEADER)):
            return {"role": role, "content": content}
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
        raise ChatError("each message must be an object with a string role")
    role = m["role"]
    content = m.get("content")
    out: dict[str, Any] = {"role": role}
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [content]
    elif not isinstance(content, list):
        raise ChatError("message content must be a string, null or a list of parts")
    if role == "system":
        content = list(_without_billing_header(content))
    parts = [p for p in map(_part, content) if p is not None]
    if fmt == "openai":
        out["content"] = parts
    else:  # texts (a tool reference's is its name) joined; media left out (the module docstring)
        out["content"] = "\n".join(_text(p) for p in parts if p["type"] in ("text", "tool_reference"))
    if role == "assistant":
        if m.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(m["tool_calls"], validated)
            if out["tool_calls"] == []:
                del out["tool_calls"]
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(out["content"], list) and all(p["type"] == "text" for p in out["content"]):
            out["content"] = "\n".join(p["text"] for p in out["content"])
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _text(part: dict[str, Any]) -> str:
    return str(part["text"] if part["type"] == "text" else part["name"])


def _part(p: Any) -> dict[str, Any] | None:
    """A content part as the "openai" format gives it (None: a part vLLM skips)."""
    if isinstance(p, str):
        return {"type": "text", "text": p}
    if not isinstance(p, Mapping):
        raise ChatError("content parts must be objects or strings")
    kind = p.get("type")
    if kind is None or p.get("uuid") is not None:  # vLLM takes the part's kind from its fields then
        kind = next((k for k in (*_MEDIA_PARTS, "tool_reference") if k in p), None)
    extra = {k: v for k, v in p.items() if k not in _KNOWN_PART_FIELDS}
    if kind in _TEXT_PARTS:
        text = p.get(_TEXT_PARTS[kind])
        return None if text is None else {"type": "text", "text": text, **extra}
    if kind in _MEDIA_PARTS:
        return {"type": _MEDIA_PARTS[kind], **extra}
    if kind == "tool_reference":
        return {"type": "tool_reference", "name": p.get("name")}
    raise ChatError(f"unsupported content part type {kind!r}")


def _without_billing_header(parts: list[Any]) -> Iterator[Any]:
    """A system message's parts without Claude Code's attribution line (its value changes each request)."""
    for p in parts:
        text = (
            p if isinstance(p, str) else p.get("text") if isinstance(p, Mapping) and p.get("type") == "text" else None
        )
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            yield p
        elif rest := text.partition("\n")[2]:
            yield rest if isinstance(p, str) else {**p, "text": rest}


def _tool_calls(calls: Any, validated: bool = True) -> Any:
    """An assistant's tool calls with each ``arguments`` JSON string as the object it spells (``{}`` when it
    is empty, invalid or not an object), as templates expect them; each call with vLLM's fields in vLLM's
    order (``id``, ``function``, ``type``; others dropped), the function's ``arguments`` then ``name`` where
    vLLM's request model gave it back (``validated``), ``name`` first where its Responses conversion built it:
    a template writing the calls whole (``tojson``) shows the order."""
    if not isinstance(calls, list):
        return calls
    out = []
    for c in calls:
        if (
            not isinstance(c, Mapping)
            or not isinstance(c.get("function"), Mapping)
            or c.get("type", "function") != "function"
        ):
            raise ChatError("assistant tool_calls entries must be function calls")
        args = c["function"].get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        fn = {"arguments": args if isinstance(args, dict) else {}}
        if "name" in c["function"]:
            fn = {**fn, "name": c["function"]["name"]} if validated else {"name": c["function"]["name"], **fn}
        call = {"id": c["id"]} if "id" in c else {}
        call["function"] = fn
        call["type"] = c.get("type", "function")
        out.append(call)
    return out


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones; more than one system message, or one not first, merged into one at
    the front (their texts joined by a blank line), as vLLM does for a template without the developer role."""
    renamed = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in messages
    ]
    systems = [i for i, m in enumerate(renamed) if m["role"] == "system"]
    if systems in ([], [0]):
        return renamed
    texts = []
    for i in systems:
        content = renamed[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in renamed if m["role"] != "system")]


def _iterates_content(ast: Any) -> bool:
    """Whether the template loops over a message's content (vLLM's test for the "openai" format): a loop over
    ``m.content`` or ``m['content']`` (through filters, tests and slices) where ``m`` is a loop variable over
    the messages (or a variable set from them); a loop in a macro over a parameter some call passes such a
    content; or a loop outside macros over a variable named ``content``."""
    from jinja2 import nodes

    def base(n: Any) -> Any:
        while True:
            wrapped = isinstance(n, (nodes.Filter, nodes.Test)) and n.node is not None
            if not (wrapped or (isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice))):
                return n
            n = n.node

    def name(n: Any) -> str | None:
        return n.name if isinstance(n, nodes.Name) and n.ctx == "load" else None

    def content_of(n: Any) -> str | None:
        """The variable whose ``content`` ``n`` reads."""
        n = base(n)
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content":
            return name(n.node)
        if isinstance(n, nodes.Getattr) and n.attr == "content":
            return name(n.node)
        return None

    lists = {"messages"}
    grown = True
    assigns = list(ast.find_all(nodes.Assign))
    while grown:
        grown = False
        for a in assigns:
            if name(base(a.node)) in lists and isinstance(a.target, nodes.Name) and a.target.name not in lists:
                lists.add(a.target.name)
                grown = True
    loops = list(ast.find_all(nodes.For))
    items = {f.target.name for f in loops if name(base(f.iter)) in lists and isinstance(f.target, nodes.Name)}
    if any(content_of(f.iter) in items for f in loops):
        return True
    in_macros: set[int] = set()
    calls = list(ast.find_all(nodes.Call))
    for macro in ast.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        fed: set[str] = set()
        for call in calls:
            if name(call.node) == macro.name:
                fed.update(params[i] for i, a in enumerate(call.args[: len(params)]) if content_of(a) in items)
                fed.update(k.key for k in call.kwargs if k.key in params and content_of(k.value) in items)
        for f in macro.find_all(nodes.For):
            in_macros.add(id(f))
            if isinstance(f.iter, nodes.Name) and f.iter.name in fed:
                return True
    return any(id(f) not in in_macros and isinstance(f.iter, nodes.Name) and f.iter.name == "content" for f in loops)
