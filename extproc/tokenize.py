"""Tokenize requests exactly as vLLM does, so precise block keys equal the pods' own blocks.

A model directory in Hugging Face layout (``tokenizer.json`` + ``tokenizer_config.json`` with a
``chat_template``, or ``chat_template.jinja``) is all that is needed: chat messages are rendered
with the template (jinja2, sandboxed, like ``apply_chat_template``) and encoded without adding
special tokens (the template carries them); completion prompts are encoded with them, as vLLM does.

Tokenizing is the expensive step of a decision, so the rendered text is split at the tokenizer's
added tokens (which HF tokenizers never merge across) and each piece is encoded once and cached:
a follow-up turn or another question over the same document re-encodes only the new text. A
self-check at load time falls back to whole-prompt encoding for tokenizers where splitting would
change the result.

A long piece (a document and its question in one message) is cached in chunks of about
``CHUNK_CHARS``, each cut at the first "word word" space past that length, counted from the piece's
start: two prompts that share a long prefix share all its chunks but the last, so only the tail is
encoded again. Such a cut is a pre-token boundary of byte-level BPE tokenizers (GPT-2's regex, and
Llama-3's or Qwen's split pattern followed by ByteLevel): no pre-token spans it, and BPE, WordPiece
and WordLevel models never look across pre-tokens, so the chunks' ids are exactly the whole piece's.
Other tokenizers (SentencePiece's Metaspace, normalizers that add or replace text) encode long
pieces whole; so does any tokenizer whose chunked encoding of a check text differs from its whole
encoding.

Encoding is three steps so that its slow part can leave the event loop: ``plan`` (split, look the
pieces up in the cache), ``encode_missing`` (the pieces not cached, in one ``encode_batch_fast``
call: no character offsets, a quarter to a third less time than encoding each piece, and the GIL
released; it touches no state of this object, so it may run in a thread) and ``finish`` (cache what
was encoded, join the ids). ``encode`` does all three at once.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from extproc.anthropic import EFFORTS, to_chat
from extproc.conversation import (
    ChatShape,
    PodFlags,
    continued,
    conversation,
    cut_continued,
    render_args,
    shape_of,
)
from extproc.errors import ConfigError
from extproc.lru import ShardedLRU

VLLM_DEFAULTS = PodFlags()  # pods started without the flags that change what they render
# What the piece cache holds, texts and ids, in bytes. It used to count characters (64 M): ids as
# tuples of Python ints cost ~16 bytes a character of English, and a 4-byte-per-character text of
# byte-level tokens far more, so the bound was over 1 GB (bench/fuzz.py's memory check found it).
CACHE_BYTES = 256 * 1024 * 1024
CACHE_PART_BYTES = 1024 * 1024  # its parts' least (ShardedLRU): 64 parts of 4 MiB at CACHE_BYTES
# Long pieces are cached in chunks of about this many characters: the text encoded again for a new
# question over a cached document is the question plus at most about this much of the document.
CHUNK_CHARS = 1024
# A probe (ModelTokenizer.probe): the start of a prompt's first text to encode, about this long (at a cut,
# as chunks end), keyed before the chunk it starts: when no pod holds its blocks, nothing further can
# match, and the decision is made on it (a new prompt: ~0.2 ms of a precise decision's ~1 ms in-process).
PROBE_CHARS = 256
# Up to this many occurrences of the added tokens' first characters in a prompt, it is split at them by
# str.find (ModelTokenizer._split_added); more (HTML, code with many '<'), by the regex.
SPLIT_SCAN_MAX = 256
# A prompt's cached first pieces are a head (ModelTokenizer.heads) from this many ids: fewer fill no
# block of vLLM's default size (16 tokens), so the index has nothing to look up.
HEAD_MIN_IDS = 16
# Ids per character assumed before a tokenizer has encoded anything (English text in byte-level BPE).
DEFAULT_TOKENS_PER_CHAR = 0.25
# A long piece's chunks, remembered by its text (least recently used out first, up to this many bytes
# of piece text; its chunks, the same again, are mostly the cache's own strings): a document met again
# is cut without scanning it, and its chunks' hashes are already known.
PIECE_MEMO_BYTES = 32 * 1024 * 1024
# A chunk ends before a space that follows an ASCII letter or digit and precedes an ASCII letter.
_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")
_CUT_SCAN = re.compile(r"[A-Za-z0-9] (?=[A-Za-z])")  # _CUT's matches, one character to their left
# An added-token group's shortest length k, and its tokens by their first k characters (_by_first_char).
_Starts = tuple[int, dict[str, tuple[tuple[int, frozenset[str]], ...]]]
_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")  # what follows a cut's space
# Tokenizer parts under which such a cut is a pre-token boundary (checked on a sample at load, too).
_CHUNK_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
_CHUNK_NORMALIZERS = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase"}
_CHUNK_MODELS = {"BPE", "WordPiece", "WordLevel"}  # models that encode each pre-token on its own
_SELF_CHECK_TEXT = "Hello world!  Ünïcödé 数字 123\n\tcode: x = [1, 2]; # done"
# Chunked encoding is checked on this at load: a cut at every possible place in it.
_CHUNK_CHECK_TEXT = (
    "It's 2024 and they'll say: don't split words AT the seams. 12345 apples, x1 y2 z3 go;\n\n"
    "def f(a, b):\n    return a + b  # sum it up\r\n  tabs\tand  double  spaces end. "
    "Ünïcödé wörds and 数字 mixed in text ok. The END of it. a b c d e f g 1 2 3 x"
)


@dataclass(slots=True)
class TokenPlan:
    """A prompt's pieces in order: ids found (cached pieces, added tokens) or a text still to encode."""

    parts: list[Sequence[int] | str] = field(default_factory=list)
    missing: dict[str, None] = field(default_factory=dict)  # the texts to encode, each once, in order
    special: bool = False  # encode them with special tokens (a whole prompt, when splitting is off)
    cache: bool = True  # cache what was encoded (not a whole prompt)
    chars: int = 0  # the whole prompt's characters, cached pieces too

    @property
    def missing_chars(self) -> int:
        return sum(map(len, self.missing))

    def without(self, encoded: Mapping[str, Sequence[int]]) -> TokenPlan:
        """The same prompt with ``encoded``'s texts no longer to encode (``finish`` then takes both)."""
        missing = {t: None for t in self.missing if t not in encoded}
        return TokenPlan(self.parts, missing, self.special, self.cache, self.chars)


class ModelTokenizer:
    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | Mapping[str, str] | None,
        special: Mapping[str, str],
        flags: PodFlags = VLLM_DEFAULTS,
    ) -> None:
        """``chat_template``: one template, or several by name (transformers' named templates: "default", and
        "tool_use" for requests with tools). ``flags``: how the pods render (extproc/conversation.py)."""
        self._tok = tokenizer
        # tokenizers >= 0.21: a batch encoded without character offsets (the ids are the same).
        self._encode_fast = getattr(tokenizer, "encode_batch_fast", None)
        self._special = dict(special)
        named = {"default": chat_template} if isinstance(chat_template, str) else dict(chat_template or {})
        self._templates = {
            name: _ChatTemplate.of(src, flags.chat_template_content_format) for name, src in named.items() if src
        }
        self._flags = flags
        self._anthropic: tuple[bool, str] | None = None  # what vLLM finds for Messages requests (anthropic_chat)
        self.loaded_from: tuple[str, ...] = ()  # from_dir's arguments (origin), where it made this one
        added = sorted(
            (t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content), key=len, reverse=True
        )
        self._split = re.compile("(" + "|".join(re.escape(a) for a in added) + ")") if added else None
        self._added_by_first = _by_first_char(added)  # the regex's alternatives by first character, in its order
        self._added_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        empty = tokenizer.encode("", add_special_tokens=True).ids
        self._bos: array[int] = array("I", empty)
        # In parts of at least CACHE_PART_BYTES (ShardedLRU): one OrderedDict of its ~128,000 chunks held
        # the event loop 11-13 ms at each rebuild of its table (python -m bench.index_churn --lru).
        self._cache: ShardedLRU[str, array[int]] = ShardedLRU(CACHE_BYTES, _held, min_part=CACHE_PART_BYTES)
        self._chars_cached = 0  # every text cached so far, and its ids (tokens_per_char)
        self._ids_cached = 0
        self._pieces: OrderedDict[str, list[str]] = OrderedDict()  # a long piece's chunks
        self._by_first: dict[str, str] = {}  # a remembered piece by its first chunk (the latest such)
        self._pieces_bytes = 0
        self.cache_hits = 0
        self.cache_misses = 0
        # The tokenizers library starts its thread pool at its first batch call, its threads taking the
        # calling thread's priority: here, not in the deferred rests' niced thread (server.py REST_NICE).
        batch = self._encode_fast or getattr(tokenizer, "encode_batch", None)
        if batch is not None:
            batch(["a", "b"], add_special_tokens=False)
        self.split_ok = self._check_split()
        self.chunk_ok = self.split_ok and _chunkable(tokenizer) and self._check_chunks()

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        flags: PodFlags = VLLM_DEFAULTS,
        chat_template: str | None = None,
    ) -> ModelTokenizer:
        """The tokenizer and chat template in ``path`` (``chat_template``: the source of the pods'
        ``--chat-template`` instead of the directory's)."""
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a dependency of kvroute
            raise ConfigError("precise routing needs the 'tokenizers' package") from None
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise ConfigError(f"{d}: no tokenizer.json")
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special_tokens = {k: v for k, v in special.items() if v}
        templates = {"default": chat_template} if chat_template is not None else _templates_in(d, cfg)
        tok = cls(Tokenizer.from_file(str(tj)), templates, special_tokens, flags)
        tok.loaded_from = cls.origin(path, flags, chat_template)
        return tok

    @staticmethod
    def origin(path: str | Path, flags: PodFlags, chat_template: str | None) -> tuple[str, ...]:
        """What ``from_dir`` loads from these: a tokenizer loaded from equal ones can be shared (its caches too)."""
        return str(path), repr(flags), chat_template or ""

    # -- public API ------------------------------------------------------------------------------------

    @property
    def chat_shape(self) -> ChatShape | None:
        """The default template's shape (None: the tokenizer has no default template)."""
        default = self._templates.get("default")
        return default.shape if default else None

    def render_chat(self, body: Mapping[str, Any], validated: bool = True) -> str:
        """``body``'s chat rendered as the pods render it (vLLM's conversation, extproc/conversation.py;
        ``validated`` False for a Responses request's chat, which vLLM builds without its request model);
        ChatError where vLLM would refuse it."""
        args = render_args(body, self._flags)
        template = self._template_for(args["tools"])
        args["messages"] = conversation(body.get("messages") or [], template.shape, validated)
        tag = cut_continued(args, template.source)
        text = str(template.compiled.render({**self._special, **args}))
        return continued(text, tag) if tag else text

    def _template_for(self, tools: Any) -> _ChatTemplate:
        """transformers' choice among named templates: "tool_use" for a request with tools, else "default"."""
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" not in self._templates:
            raise ConfigError("the model's tokenizer has no (default) chat_template")
        return self._templates["default"]

    def anthropic_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """An Anthropic Messages request as the chat vLLM renders for it with this template
        (extproc/anthropic.py; what vLLM finds for the template found the same way, once)."""
        if self._anthropic is None:
            effort = self._flags.anthropic_disabled_thinking_effort
            self._anthropic = (self._merges_inline_system(), self._disabled_effort() if effort == "auto" else effort)
        return to_chat(body, *self._anthropic)

    def _merges_inline_system(self) -> bool:
        """Whether vLLM merges a Messages request's inline system messages into the first: when the template,
        in a bare environment (vLLM's probe: no tojson, no raise_exception), fails on a system message after
        the first turn (Qwen's templates raise there); the templates for requests without and with tools."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        turns = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
        no_tools_and_tools: tuple[list[Any] | None, ...] = (None, [])
        for tools in no_tools_and_tools:
            try:
                env.from_string(self._template_for(tools).source).render(messages=turns, add_generation_prompt=False)
            except (jinja2.TemplateError, ConfigError):
                return True
        return False

    def _disabled_effort(self) -> str:
        """The reasoning_effort vLLM sends for ``thinking: disabled``: "none", unless the template refuses it or
        renders it as it renders an effort (then "low", a model that cannot stop thinking)."""

        def rendered(effort: str) -> str | None:
            try:
                return self.render_chat({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort})
            except Exception:
                return None

        none = rendered("none")
        return "low" if none is None or any(rendered(e) == none for e in EFFORTS) else "none"

    def chat_ids(self, body: Mapping[str, Any], validated: bool = True) -> array[int]:
        """``body``'s chat as vLLM's token ids (special tokens added only where the request asks)."""
        special = body.get("add_special_tokens") is True
        return self.encode(self.render_chat(body, validated), add_special_tokens=special)

    def encode(self, text: str, add_special_tokens: bool) -> array[int]:
        plan = self.plan(text, add_special_tokens)
        return self.finish(plan, self.encode_missing(plan))

    def plan(self, text: str, add_special_tokens: bool) -> TokenPlan:
        """``text`` split into pieces, each looked up in the cache (see the module docstring)."""
        if not self.split_ok:
            return TokenPlan([text], {text: None}, special=add_special_tokens, cache=False, chars=len(text))
        plan = TokenPlan([self._bos] if add_special_tokens and self._bos else [], chars=len(text))
        for piece in self._split_added(text):
            if not piece:
                continue
            special = self._added_ids.get(piece)
            if special is not None:
                plan.parts.append((special,))
                continue
            for chunk in self._chunks(piece):
                ids = self._cache.get(chunk)
                if ids is None:
                    self.cache_misses += 1
                    plan.missing[chunk] = None
                    plan.parts.append(chunk)
                else:
                    self.cache_hits += 1
                    plan.parts.append(ids)
        return plan

    def encode_missing(
        self, plan: TokenPlan, batch: bool = False, one_thread: bool = False
    ) -> dict[str, Sequence[int]]:
        """The ids of ``plan``'s texts to encode. Reads nothing of this object but the tokenizer, so it
        may run in another thread. Tokenizers older than 0.21 (no ``encode_batch_fast``) encode each
        text in turn, or with ``batch`` in one ``encode_batch`` call that releases the GIL.

        ``one_thread``: each text in a batch call of its own, which the tokenizer encodes on the calling
        thread (GIL released) where a batch of several goes to its thread pool, on every core at once.
        For work nobody waits on (a deferred rest): on this 2-core host twelve 1.6k-character pieces
        took 2.5 ms of one thread that way against 3.2-3.5 ms of CPU over both cores in one batch."""
        texts = list(plan.missing)
        if not texts:
            return {}
        if one_thread:
            encode = self._encode_fast or self._tok.encode_batch
            return {t: encode([t], add_special_tokens=plan.special)[0].ids for t in texts}
        if self._encode_fast is not None:
            encodings = self._encode_fast(texts, add_special_tokens=plan.special)
            return {t: e.ids for t, e in zip(texts, encodings, strict=True)}
        if batch:
            encodings = self._tok.encode_batch(texts, add_special_tokens=plan.special)
            return {t: e.ids for t, e in zip(texts, encodings, strict=True)}
        return {t: self._tok.encode(t, add_special_tokens=plan.special).ids for t in texts}

    @staticmethod
    def heads(plan: TokenPlan) -> Iterator[TokenPlan]:
        """``plan``'s heads, shortest first: its cached first pieces when they hold ``HEAD_MIN_IDS`` ids or
        more (nothing to encode: a conversation's history before its new message), then each head ending
        with one more of its texts to encode, the last one with its last (only cached pieces, if any,
        follow). A head's ids are the whole prompt's first ids (pieces and chunks end where no token
        spans), so the prompt's first blocks can be keyed, and looked up, before the rest is encoded. No
        head for a prompt encoded whole (``plan.cache`` false) or with nothing to encode."""
        if not plan.cache or not plan.missing:
            return
        cached = 0
        for part in plan.parts:
            if isinstance(part, str):
                break
            cached += len(part)
        missing: dict[str, None] = {}
        for i, part in enumerate(plan.parts):
            if isinstance(part, str) and part not in missing:
                if not missing and cached >= HEAD_MIN_IDS:
                    yield TokenPlan(plan.parts[:i], {}, special=plan.special)
                missing[part] = None
                yield TokenPlan(plan.parts[: i + 1], dict(missing), special=plan.special)

    def probe(self, plan: TokenPlan) -> TokenPlan | None:
        """A head ending ``PROBE_CHARS`` or so into ``plan``'s first text to encode, at a cut (where no token
        spans, as chunks end): its ids are the prompt's first ids. Not cached (``cache`` false: the text is
        no chunk). None when that text is too short to cut, or this tokenizer's chunks are off."""
        if not plan.cache or not plan.missing or not self.chunk_ok:
            return None
        for i, part in enumerate(plan.parts):
            if isinstance(part, str):
                cut = _next_cut(part, PROBE_CHARS)
                if cut < 0 or cut > len(part) - PROBE_CHARS:
                    return None  # about as short as the probe: the head with the whole text is as cheap
                text = part[:cut]
                return TokenPlan([*plan.parts[:i], text], {text: None}, special=plan.special, cache=False)
        return None

    def estimate_tokens(
        self, plan: TokenPlan, head: TokenPlan, head_ids: int, encoded: Mapping[str, Sequence[int]]
    ) -> int:
        """The whole prompt's tokens from ``head`` encoded (``head_ids`` of them; ``encoded``: its texts'
        ids): the rest's cached pieces as they are, its texts at the head's characters per token (a head
        of cached pieces only: at those of every text this tokenizer has encoded). A probe's text is the
        start of the plan's part in its place: that part's other characters count too."""
        if head.missing:
            per_char = sum(len(encoded[t]) for t in head.missing) / max(1, head.missing_chars)
        else:
            per_char = self.tokens_per_char
        n = len(head.parts)
        rest = plan.parts[n:]
        left = 0
        if n and isinstance(last := head.parts[-1], str) and plan.parts[n - 1] is not last:
            left = round((len(plan.parts[n - 1]) - len(last)) * per_char)  # a probe's part, past the probe
        return head_ids + left + sum(round(len(p) * per_char) if isinstance(p, str) else len(p) for p in rest)

    @property
    def tokens_per_char(self) -> float:
        """Ids per character over every text this tokenizer has cached (``DEFAULT_TOKENS_PER_CHAR`` before
        the first)."""
        return self._ids_cached / self._chars_cached if self._chars_cached else DEFAULT_TOKENS_PER_CHAR

    def finish(self, plan: TokenPlan, encoded: Mapping[str, Sequence[int]]) -> array[int]:
        """``plan``'s ids in order, what was encoded cached (on the event loop: the cache is not locked).
        A u32 array, as the cache holds them: joining cached pieces is a copy of their bytes, and the
        block keys hash those bytes (``hashing.chain_tokens``), where a list of ints would be built and
        converted back (a fifth of a warm 8k-token decision)."""
        out: array[int] = array("I")
        for part in plan.parts:
            if isinstance(part, str):
                part = self._store(part, encoded[part]) if plan.cache else encoded[part]
            out.extend(part)  # a cached u32 array's bytes copied at once; an encoding's list of ints
        return out

    # -- internals -----------------------------------------------------------------------------------

    def _split_added(self, text: str) -> list[str]:
        """``text`` split at the added tokens, as ``self._split.split`` splits it (the tokens kept, empty
        pieces too). The regex engine tries every character (0.4 ms for a 68k-character prompt). Here
        ``str.find`` (at memory speed) lists the places where a token's first character occurs, and each
        place, left to right, takes the longest token that starts there (``_by_first_char``'s lookups):
        the regex's own rule for an alternation of literals listed longest first (leftmost, then first
        alternative). Where those characters abound (HTML, code with many '<'), the regex."""
        if self._split is None:
            return [text]
        by_first = self._added_by_first
        places: list[int] = []
        for c in by_first:
            i = text.find(c)
            while i >= 0:
                if len(places) == SPLIT_SCAN_MAX:  # that many: the regex, before a loop of Python per place
                    return self._split.split(text)
                places.append(i)
                i = text.find(c, i + 1)
        places.sort()
        out: list[str] = []
        start = 0
        for i in places:
            if i < start:  # inside the token just cut
                continue
            k, starts = by_first[text[i]]
            for n, tokens in starts.get(text[i : i + k], ()):
                if (token := text[i : i + n]) in tokens:
                    out += (text[start:i], token)
                    start = i + n
                    break
        out.append(text[start:])
        return out

    def _chunks(self, text: str) -> list[str]:
        if len(text) < 2 * CHUNK_CHARS or not self.chunk_ok:
            return [text]
        known = self._pieces.get(text)
        if known is not None:
            self._pieces.move_to_end(text)
            return known
        out: list[str] = []
        start = 0
        cut = _next_cut(text, CHUNK_CHARS)
        # A piece that starts as a remembered one (a document, then another question in the same
        # message) has its chunks up to where the two differ: each is checked in place (its text and the
        # two characters after it, where its cut is), not searched for, and is the same string again.
        like = self._pieces.get(self._by_first.get(text[:cut], "")) if cut >= 0 else None
        for chunk in like[:-1] if like else ():  # a remembered piece's last chunk ends at its end, not a cut
            end = start + len(chunk)
            if end + 1 < len(text) and text[end] == " " and text[end + 1] in _LETTERS and text.startswith(chunk, start):
                out.append(chunk)
                start = end
            else:
                break
        if start:  # chunks taken over: the scan goes on from the last one's end
            cut = _next_cut(text, start + CHUNK_CHARS)
        while cut >= 0:
            out.append(text[start:cut])
            start = cut
            cut = _next_cut(text, start + CHUNK_CHARS)
        out.append(text[start:])
        self._remember_piece(text, out)
        return out

    def _remember_piece(self, text: str, chunks: list[str]) -> None:
        self._pieces[text] = chunks
        self._by_first[chunks[0]] = text
        self._pieces_bytes += sys.getsizeof(text)
        while self._pieces_bytes > PIECE_MEMO_BYTES:
            old, old_chunks = self._pieces.popitem(last=False)
            self._pieces_bytes -= sys.getsizeof(old)
            if self._by_first.get(old_chunks[0]) is old:
                del self._by_first[old_chunks[0]]

    def _store(self, text: str, ids: Sequence[int]) -> array[int]:
        held = self._cache.get(text)  # another request may have cached it since this one's plan
        if held is not None:
            return held
        held = array("I", ids)
        self._cache.put(text, held)
        self._chars_cached += len(text)
        self._ids_cached += len(held)
        return held

    def _check_split(self) -> bool:
        """Splitting at added tokens must give exactly what encoding the whole text gives."""
        specials = list(self._added_ids)[:3]
        sample = _SELF_CHECK_TEXT + "".join(f"{s} after {s}{_SELF_CHECK_TEXT}" for s in specials)
        self.split_ok = True
        try:
            split = self.encode(sample, add_special_tokens=False).tolist() == list(
                self._tok.encode(sample, add_special_tokens=False).ids
            ) and self.encode(sample, add_special_tokens=True).tolist() == list(
                self._tok.encode(sample, add_special_tokens=True).ids
            )
        finally:
            self._cache.clear()
            self._chars_cached = self._ids_cached = 0
            self._pieces.clear()
            self._by_first.clear()
            self._pieces_bytes = 0
            self.cache_hits = self.cache_misses = 0
        return split

    def _check_chunks(self) -> bool:
        """Encoding the check text cut at every possible chunk boundary gives its whole encoding."""
        text = _CHUNK_CHECK_TEXT
        cuts = [0, *(m.start() for m in _CUT.finditer(text)), len(text)]
        chunked = [
            i for a, b in itertools.pairwise(cuts) for i in self._tok.encode(text[a:b], add_special_tokens=False).ids
        ]
        return chunked == list(self._tok.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True, slots=True)
class _ChatTemplate:
    source: str
    compiled: Any  # a jinja2 Template
    shape: ChatShape  # what the source tells about the conversation it expects

    @classmethod
    def of(cls, source: str, content_format: str) -> _ChatTemplate:
        compiled = compile_template(source)
        return cls(source, compiled, shape_of(source, compiled.environment.parse(source), content_format))


def template_shape(source: str, content_format: str = "auto") -> ChatShape:
    """What vLLM reads from a chat template's source (parsed in transformers' environment, its extensions too);
    jinja2's TemplateError where it does not compile."""
    return _ChatTemplate.of(source, content_format).shape


def _templates_in(d: Path, cfg: Mapping[str, Any]) -> dict[str, str]:
    """A model directory's chat templates by name, as transformers loads them: ``chat_template.jinja`` (the
    default) and ``additional_chat_templates/*.jinja`` where there are such files, else tokenizer_config.json's
    ``chat_template`` (one, or a list of named ones)."""
    files = {"default": d / "chat_template.jinja"} if (d / "chat_template.jinja").is_file() else {}
    if (d / "additional_chat_templates").is_dir():
        files.update((f.stem, f) for f in sorted((d / "additional_chat_templates").glob("*.jinja")))
    if files:
        return {name: f.read_text() for name, f in files.items()}
    raw = cfg.get("chat_template")
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t and "template" in t}
    return {"default": raw} if isinstance(raw, str) else {}


def _by_first_char(added: Sequence[str]) -> dict[str, _Starts]:
    """The added tokens by their first character: the length ``k`` of that group's shortest token, and the
    group by its tokens' first ``k`` characters, each as (length, the tokens that long), longest first.
    At a place the split regex (its alternatives longest first) takes the longest token that starts there,
    and two tokens of one length cannot both start at one place: one lookup of the place's first ``k``
    characters, then a set lookup per length, find it. Trying each token in turn cost ~4 us a place for
    Llama 3's 256 added tokens (``<|reserved_special_token_0|>`` ...), a millisecond a conversation."""
    firsts: dict[str, list[str]] = {}
    for a in added:
        firsts.setdefault(a[0], []).append(a)
    out: dict[str, _Starts] = {}
    for c, group in firsts.items():
        k = min(map(len, group))
        by_start: dict[str, dict[int, set[str]]] = {}
        for a in group:
            by_start.setdefault(a[:k], {}).setdefault(len(a), set()).add(a)
        out[c] = (k, {p: tuple((n, frozenset(g[n])) for n in sorted(g, reverse=True)) for p, g in by_start.items()})
    return out


def _next_cut(text: str, pos: int) -> int:
    """Where ``_CUT`` next matches in ``text`` from ``pos`` (-1: nowhere). The same cut as a match of
    three plain characters one to its left: its lookbehind, tried at every character, took a tenth of
    a warm precise decision."""
    m = _CUT_SCAN.search(text, max(0, pos - 1))
    return m.start() + 1 if m is not None else -1


def _chunkable(tokenizer: Any) -> bool:
    """Whether a "word word" space is a pre-token boundary for ``tokenizer``, by its parts: a model of
    ``_CHUNK_MODELS`` after pre-tokenizers that split at spaces (and never prefix a chunk), and only
    normalizers that act on characters where they are."""
    try:
        cfg = json.loads(tokenizer.to_str())
    except Exception:  # not a tokenizers.Tokenizer we can read: encode long pieces whole
        return False

    def parts(node: Any, key: str) -> list[dict[str, Any]]:
        if node is None:
            return []
        return [p for n in node[key] for p in parts(n, key)] if node.get("type") == "Sequence" else [node]

    pre = parts(cfg.get("pre_tokenizer"), "pretokenizers")
    norm = parts(cfg.get("normalizer"), "normalizers")
    return (
        (cfg.get("model") or {}).get("type") in _CHUNK_MODELS
        and any(p.get("type") in ("ByteLevel", "Split") for p in pre)
        and all(p.get("type") in _CHUNK_PRE_TOKENIZERS for p in pre)
        and all(p.get("type") in _CHUNK_NORMALIZERS for p in norm)
    )


def _held(text: str, ids: array[int]) -> int:
    """Bytes a cache entry holds: the text object (1, 2 or 4 bytes a character) and its u32 ids."""
    return sys.getsizeof(text) + ids.itemsize * len(ids)


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


# ``_tojson``'s answers by what was asked, up to this many bytes of keys and answers (started over when
# past it); a value whose JSON is longer than ``TOJSON_MEMO_ITEM`` bytes is dumped as asked, unremembered.
TOJSON_MEMO_BYTES = 8 << 20
TOJSON_MEMO_ITEM = 64 << 10
_tojson_memo: dict[tuple[bytes, Any, bool, Any, bool], str] = {}
_tojson_bytes = 0


def _tojson(
    x: Any, indent: Any = None, ensure_ascii: bool = False, separators: Any = None, sort_keys: bool = False
) -> str:
    """The chat templates' ``tojson`` filter as transformers defines it (``json.dumps`` with these
    arguments), remembered by the value's orjson bytes: a template writes a request's tools through it
    each turn, and ``json.dumps`` with an indent took ~50 us a tool (Llama 3.1's template: 0.5 ms for
    ten), where orjson names the same value in ~2. A value orjson cannot write (an int past 64 bits,
    a key that is not a string) is dumped as asked."""
    global _tojson_bytes
    try:
        raw = orjson.dumps(x)
    except (orjson.JSONEncodeError, TypeError):
        raw = b""  # not remembered: dumped as asked
    key = (raw, indent, ensure_ascii, tuple(separators) if separators else None, sort_keys)
    keep = 0 < len(raw) <= TOJSON_MEMO_ITEM
    out = _tojson_memo.get(key) if keep else None
    if out is None:
        out = json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
        if keep:
            if _tojson_bytes > TOJSON_MEMO_BYTES:
                _tojson_memo.clear()
                _tojson_bytes = 0
            _tojson_memo[key] = out
            _tojson_bytes += len(raw) + len(out)
    return out


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """A chat template compiled as transformers compiles it for vLLM's renderer (its sandboxed environment,
    extensions, ``tojson``, ``raise_exception`` and ``strftime_now``); jinja2's TemplateError where it does
    not compile."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``, which transformers' environment knows (it marks the
        assistant's text for training masks): its body rendered as is. Without it such a template would not
        compile, and the model's tokenizer would not load."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    # As transformers defines it (vLLM renders chats through it): Llama 3.2 and 3.3's templates write today's date
    # into the system header when it is defined, their fixed "26 Jul 2024" when not, so without it no prompt's
    # tokens were the pods' from the first block on. The pods' local time; kvroute's container should share
    # their time zone (both UTC by default).
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
