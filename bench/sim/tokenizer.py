"""Deterministic, prefix-stable tokenization for simulated pods.

The default tokenizer splits text into GPT-like pieces (an optional leading space plus a word, a
punctuation mark, a run of spaces, or a newline on its own) and maps each piece to
``xxh3_64(piece) % vocab``. Chat messages are rendered segment by segment (role tag, newline,
content, end tag) and each segment is tokenized on its own, so a later chat turn's tokens always
start with the earlier turn's prompt.

``HFTokenizer`` loads a real ``tokenizer.json`` (HF ``tokenizers``) and renders chats with the
``chat_template`` of ``tokenizer_config.json`` (jinja2); both libraries are imported lazily.

``export_tokenizer`` writes the built-in tokenizer as such a directory (the same pieces, and the same
ids for a given set of known pieces such as the bench's vocabulary), so kvroute's precise mode, which
loads Hugging Face directories, can tokenize exactly as the pods do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import xxhash

from bench.vllm_model import CHAT_TEMPLATE
from extproc.conversation import ChatError  # a chat request vLLM refuses (the pods answer 400)
from extproc.tokenize import compile_template

# A newline is always a piece of its own: a chat's segments are a tag, a newline and the text, each tokenized
# apart here, and the exported tokenizer (kvroute's) reads the rendered chat whole with this same pattern, so
# a newline must split off there too, and then in message text as well.
_PIECE_RE = r"\n|[^\S\n]?\w+|[^\S\n]?[^\w\s]|[^\S\n]+"
_PIECE = re.compile(_PIECE_RE)
_SPACE_RUNS = 16  # the longest run of spaces the exported tokenizer knows as one piece
_xxh = xxhash.xxh3_64_intdigest

SPECIALS = ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<|developer|>")
_NUM_RESERVED = 16
_MEMO_MAX = 1 << 16
_FILLER = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")


def message_text(content: Any, sep: str = "") -> str:
    """OpenAI message content: a string, None, or a list of parts whose text parts are joined with
    ``sep`` (vLLM renders chat templates with them joined by newlines)."""
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
        return sep.join(parts)
    raise ChatError("message content must be a string or a list of content parts")


def tojson(value: Any) -> str:
    """transformers' ``tojson`` filter as chat templates use it (no arguments)."""
    return json.dumps(value, ensure_ascii=False)


class Tokenizer(Protocol):
    vocab_size: int
    chat_template: str | None  # the template ``render_chat`` renders as (vLLM reads its shape from it)

    def encode(self, text: str) -> list[int]: ...

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    def output_token(self, i: int) -> tuple[int, str]: ...


class SimTokenizer:
    """Fast hashed-piece tokenizer; see the module docstring."""

    def __init__(self, vocab_size: int = 32_000) -> None:
        self.vocab_size = vocab_size
        self.chat_template: str | None = CHAT_TEMPLATE
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
        """``messages`` (vLLM's conversation, bench/sim/chat.py) as the exported chat template
        (bench.vllm_model.CHAT_TEMPLATE) renders them: tools first as a system segment, then a segment per
        message, an assistant's tool calls after its text, JSON written as transformers' ``tojson`` does."""
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        ids: list[int] = self._segment("system", tojson(tools)) if tools else []
        for msg in messages:
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise ChatError("each message must be an object with a string 'role'")
            text = message_text(msg.get("content"), "\n")
            if msg.get("tool_calls"):
                text += tojson(msg["tool_calls"])
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
        # Ids, not entries, bound what a prompt may hold (an exported SimTokenizer's ids are sparse).
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        cfg_file = tok_file.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self._bos = cfg.get("bos_token") if isinstance(cfg.get("bos_token"), str) else ""
        self._eos = cfg.get("eos_token") if isinstance(cfg.get("eos_token"), str) else ""
        self._template: Any = None
        self._filler = []
        for w in _FILLER:  # SimTokenizer's: an exported one answers with the same ids
            enc = self._tok.encode(w, add_special_tokens=False).ids or [0]
            # A word that is one token is that token's text (decoding a hashed id could give another word).
            self._filler.append((enc[0], w if len(enc) == 1 else self._tok.decode([enc[0]])))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """``messages`` as vLLM's conversation gives them (bench/sim/chat.py: list content joined or kept as the
        template's content format asks) through the directory's template, compiled as kvroute compiles it."""
        if self.chat_template is None:
            raise ChatError("tokenizer has no chat_template")
        if self._template is None:
            self._template = compile_template(self.chat_template)  # kvroute's: transformers' environment
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


_EXPORT_FORMAT = 2  # bump when the exported files change for the same pieces


def export_tokenizer(out: Path, pieces: Iterable[str], vocab_size: int = 32_000) -> Path:
    """Write ``SimTokenizer(vocab_size)`` as a Hugging Face tokenizer directory in ``out``.

    tokenizer.json: the same pre-tokenizer (``_PIECE``) and, for every one of ``pieces`` and the
    special and newline tokens, the id ``SimTokenizer`` gives it (WordPiece over byte-level
    characters); an unknown piece falls back to one token per UTF-8 byte instead of a hash, so it
    differs from ``SimTokenizer`` but never collides with another piece. The specials are added tokens,
    so the chat template's segments tokenize apart as ``render_chat``'s do (a newline is a piece of
    its own in both, by ``_PIECE``); runs of up to ``_SPACE_RUNS`` spaces are known pieces. Only the
    chat tags are added tokens, as in a real model's tokenizer: kvroute splits a prompt at its added
    tokens and looks each piece up, so a newline among them cut guidellm's 8k-token chats into ~1,000
    pieces (1.2 ms a warm chat, against 0.06).
    tokenizer_config.json: bench.vllm_model's chat template, one segment per message as
    ``render_chat`` builds them. Idempotent and safe against concurrent writers:
    files are replaced whole, a ``.built`` stamp of the inputs' digest skips rewriting.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    sim = SimTokenizer(vocab_size)
    # Runs of spaces are pieces too (a space before a newline is one): byte-level, a lone space would be the
    # character that stands for it, under that character's id.
    known = sorted(set(pieces) | set(_FILLER) | {"\n"} | {" " * n for n in range(1, _SPACE_RUNS + 1)})
    digest = hashlib.sha256(
        json.dumps([_EXPORT_FORMAT, vocab_size, _PIECE_RE, SPECIALS, CHAT_TEMPLATE, known]).encode()
    ).hexdigest()
    stamp = out / ".built"
    if stamp.is_file() and stamp.read_text() == digest:
        return out
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def as_bytes(piece: str) -> str:
        return "".join(p for p, _ in byte_level.pre_tokenize_str(piece))

    vocab = {"[UNK]": 0}  # never produced: every byte has a token
    vocab.update((ch, sim._piece_id(ch)) for ch in pre_tokenizers.ByteLevel.alphabet())
    vocab.update((as_bytes(p), sim._piece_id(p)) for p in known)
    added = sim._special
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_PIECE_RE), "isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    spec = json.loads(tok.to_str())
    # Written by hand: the library keeps one token per id, but hashed ids collide (as SimTokenizer's
    # do), and added tokens take the model's id for their text only when the vocabulary holds it.
    spec["model"]["vocab"] = {**vocab, **added}
    spec["model"]["max_input_chars_per_word"] = 1 << 20
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for t, i in added.items()
    ]  # fmt: skip
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|pad|>", "add_bos_token": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / "tokenizer.json", json.dumps(spec))
    _replace(out / "tokenizer_config.json", json.dumps(config, indent=1))
    _replace(stamp, digest)
    return out


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole: a reader sees the old file or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
