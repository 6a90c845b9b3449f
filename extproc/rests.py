"""Precise mode's rests: encoded at once while prompts reuse text, else held until a later prompt needs one.

A precise decision made on a prompt's head leaves the rest of the prompt to encode (extproc/server.py).
Encoded right after the answer, its pieces are cached for the next turn or question and its keys recorded
for the pod chosen; that pays while prompts reuse earlier prompts' text. Where they do not (every prompt
new: a batch job, the no-reuse workload), it is CPU taken from the event loop, Envoy and the pods sharing
the cores for text nobody asks for again (bench/RESULTS.md, the grid's notes: 0.14-0.15 cores at 36 req/s
on 4 simulated pods).

``ReuseGauge`` follows the share of each prompt's text known before it came (cached, being encoded, or in
a held rest). From ``EAGER_FROM`` rests are encoded at once; below it ``HeldRests`` keeps them unencoded
until a later prompt's new text is one of a rest's pieces: that rest is then encoded and recorded (the
request waits for it, as for a rest being encoded) and the gauge counts the piece as known, so a workload
that turns to reuse turns rests eager again. A held rest nobody asks for ages out; the pods' KV events
tell the index what the pod cached of it meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

# Rests are encoded at once while at least this share of recent prompts' characters was known before them.
# Low on purpose: a held rest a later prompt asks for costs that prompt a wait for its encoding, so only
# workloads of nearly all new text hold them (at 0.25 the Mooncake synthetic trace's first requests,
# 0.13, held rests that were asked for: p50 +10 %).
EAGER_FROM = 0.1
# Each precise prompt's weight in the gauge (an exponential average: about the last 1 / weight prompts).
GAUGE_WEIGHT = 1 / 32
# Held rests, at most: this many, and this many characters of their texts (what holding one keeps alive is
# about its prompt's size again: the request's body and plan); the oldest go first.
HELD_MAX = 256
HELD_MAX_CHARS = 16 * 1024 * 1024


class ReuseGauge:
    """The share of recent prompts' characters known before each came, averaged over about
    ``1 / weight`` prompts; it starts at 1 (rests eager until prompts show otherwise)."""

    __slots__ = ("value", "weight")

    def __init__(self, weight: float = GAUGE_WEIGHT) -> None:
        self.value = 1.0
        self.weight = weight

    def note(self, known_chars: int, chars: int) -> None:
        if chars > 0:
            self.value += self.weight * (min(known_chars, chars) / chars - self.value)

    @property
    def eager(self) -> bool:
        return self.value >= EAGER_FROM


class _Held:
    __slots__ = ("chars", "start", "texts")

    def __init__(self, texts: Sequence[str], chars: int, start: Callable[[], None]) -> None:
        self.texts, self.chars, self.start = texts, chars, start


class HeldRests:
    """Rests waiting for a later prompt to need one of their texts (``take``), oldest out first past
    ``max_rests`` or ``max_chars``. ``start`` is what encodes and records a rest once it is needed."""

    def __init__(self, max_rests: int = HELD_MAX, max_chars: int = HELD_MAX_CHARS) -> None:
        self.max_rests, self.max_chars = max_rests, max_chars
        self._by_text: dict[str, _Held] = {}
        self._order: dict[_Held, None] = {}  # oldest first
        self.chars = 0

    def __len__(self) -> int:
        return len(self._order)

    def hold(self, texts: Sequence[str], chars: int, start: Callable[[], None]) -> int:
        """Hold a rest of ``texts`` (``chars`` characters); returns how many older rests aged out for it."""
        rest = _Held(texts, chars, start)
        self._order[rest] = None
        for t in texts:
            self._by_text[t] = rest
        self.chars += chars
        dropped = 0
        while len(self._order) > self.max_rests or (self.chars > self.max_chars and len(self._order) > 1):
            self._drop(next(iter(self._order)))
            dropped += 1
        return dropped

    def known(self, texts: Iterable[str]) -> int:
        """Characters of ``texts`` that a held rest holds."""
        by_text = self._by_text
        return sum(len(t) for t in texts if t in by_text)

    def take(self, texts: Iterable[str]) -> list[Callable[[], None]]:
        """The rests holding any of ``texts``, no longer held: their ``start``, to call."""
        by_text = self._by_text
        found = dict.fromkeys(r for t in texts if (r := by_text.get(t)) is not None)
        for rest in found:
            self._drop(rest)
        return [r.start for r in found]

    def clear(self) -> None:
        self._by_text.clear()
        self._order.clear()
        self.chars = 0

    def _drop(self, rest: _Held) -> None:
        del self._order[rest]
        self.chars -= rest.chars
        for t in rest.texts:
            if self._by_text.get(t) is rest:
                del self._by_text[t]
