"""Deterministic, prefix-stable tokenization for simulated pods.

The default tokenizer splits text into GPT-like pieces (an optional leading space plus a word, a
punctuation mark, or a whitespace run) and maps each piece to ``xxh3_64(piece) % vocab``. Chat
messages are rendered segment by segment (role tag, newline, content, end tag) and each segment is
tokenized on its own, so a later chat turn's tokens always start with the earlier turn's prompt.

``HFTokenizer`` loads a real ``tokenizer.json`` (HF ``tokenizers``) and renders chats with the
``chat_template`` of ``tokenizer_config.json`` (jinja2); both libraries are imported lazily.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

import xxhash

_PIECE = re.compile(r"\s?\w+|\s?[^\w\s]|\s+")
_xxh = xxhash.xxh3_64_intdigest

SPECIALS = ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<|developer|>")
_NUM_RESERVED = 16
_MEMO_MAX = 1 << 16
_FILLER = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")


class ChatError(ValueError):
    """A chat request the renderer cannot turn into a prompt (answered with HTTP 400)."""


def message_text(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of parts whose text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif not isinstance(part, dict):
                raise ChatError("content parts must be objects")
        return "".join(parts)
    raise ChatError("message content must be a string or a list of content parts")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    def output_token(self, i: int) -> tuple[int, str]: ...


class SimTokenizer:
    """Fast hashed-piece tokenizer; see the module docstring."""

    def __init__(self, vocab_size: int = 32_000) -> None:
        self.vocab_size = vocab_size
        self._memo: dict[str, int] = {}
        self._special = {s: i + 1 for i, s in enumerate(SPECIALS)}
        self._nl = self._piece_id("\n")
        self._filler = [(self._piece_id(t), t) for t in _FILLER]

    def _piece_id(self, piece: str) -> int:
        h = _xxh(piece.encode("utf-8", "surrogatepass"))
        return _NUM_RESERVED + h % (self.vocab_size - _NUM_RESERVED)

    def encode(self, text: str) -> list[int]:
        # Pieces repeat a lot (shared prefixes, common words): a bounded memo halves the CPU cost.
        memo = self._memo
        out = []
        for m in _PIECE.findall(text):
            i = memo.get(m)
            if i is None:
                if len(memo) >= _MEMO_MAX:
                    memo.clear()
                i = memo[m] = self._piece_id(m)
            out.append(i)
        return out

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        ids: list[int] = []
        tools_text = json.dumps(tools, sort_keys=True, separators=(",", ":")) if tools else ""
        if tools_text and not (isinstance(messages[0], dict) and messages[0].get("role") == "system"):
            # No system message: tools get one of their own, still at the very start.
            ids += self._segment("system", "# Tools\n" + tools_text)
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise ChatError("each message must be an object with a string 'role'")
            text = message_text(msg.get("content"))
            if msg.get("tool_calls"):
                text += json.dumps(msg["tool_calls"], sort_keys=True, separators=(",", ":"))
            if i == 0 and tools_text and msg["role"] == "system":
                text += "\n# Tools\n" + tools_text
            ids += self._segment(msg["role"], text)
        if add_generation_prompt:
            ids += [self._special["<|assistant|>"], self._nl]
        return ids

    def _segment(self, role: str, text: str) -> list[int]:
        tag = self._special.get(f"<|{role}|>")
        head = [tag] if tag is not None else self.encode(f"<|{role}|>")
        return [*head, self._nl, *self.encode(text), self._special["<|end|>"], self._nl]

    def output_token(self, i: int) -> tuple[int, str]:
        """The ``i``-th generated token: a fixed filler sentence, re-tokenizing to the same ids."""
        return self._filler[i % len(self._filler)]


class HFTokenizer:
    """A real tokenizer directory (tokenizer.json + tokenizer_config.json with a chat_template)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:
            raise RuntimeError("--tokenizer needs the 'tokenizers' package (pip install tokenizers)") from e
        p = Path(path)
        tok_file = p / "tokenizer.json" if p.is_dir() else p
        self._tok = _HFTok.from_file(str(tok_file))
        self.vocab_size = self._tok.get_vocab_size()
        cfg_file = tok_file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self._template_src: str | None = cfg.get("chat_template")
        self._bos = cfg.get("bos_token") if isinstance(cfg.get("bos_token"), str) else ""
        self._eos = cfg.get("eos_token") if isinstance(cfg.get("eos_token"), str) else ""
        self._template: Any = None
        words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "."]
        self._filler = []
        for w in words:
            enc = self._tok.encode(" " + w, add_special_tokens=False).ids or [0]
            self._filler.append((enc[0], self._tok.decode([enc[0]])))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        if self._template_src is None:
            raise ChatError("tokenizer has no chat_template")
        if self._template is None:
            try:
                import jinja2
            except ImportError as e:
                raise RuntimeError("chat templates need the 'jinja2' package (pip install jinja2)") from e
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self._template_src)
        for m in messages:
            if isinstance(m, dict):
                m["content"] = message_text(m.get("content"))
        text = self._template.render(
            messages=messages,
            tools=tools,
            bos_token=self._bos,
            eos_token=self._eos,
            add_generation_prompt=add_generation_prompt,
        )
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def output_token(self, i: int) -> tuple[int, str]:
        return self._filler[i % len(self._filler)]


def make_tokenizer(path: str | None) -> Tokenizer:
    return HFTokenizer(path) if path else SimTokenizer()
