"""Where recorded prompts ended: tells a conversation's next turn from a new request on a shared prefix.

Both hold a run of blocks some pod has cached. A next turn's prompt is the previous turn's prompt plus
the reply and a new message, so the run it holds reaches the block where that earlier prompt ended
(or a few blocks past it, where the pod also cached the reply's tokens). A new conversation on a
shared system prompt or document holds a run that ends where the prompts that share it branch apart:
no recorded prompt ended there. Moving the first away from its pod makes the fleet prefill a
conversation's history twice; placing the second on another pod copies a prefix that many requests
reuse once, after which both pods serve them (the scheduler's branch spread acts on the second only).

Kept per index, fed by ``record`` (so replicas sharing an index's records learn the same ends), and
pod-agnostic: the question is whether this request continues an earlier one, wherever that went.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_CAPACITY = 100_000  # the newest prompts remembered, up to twice as many held (~11 MB of tables)
# How far before the end of the held run an earlier prompt's end may lie: the pod may also hold the
# reply's blocks (vLLM caches generated tokens; KV events report them). 64 blocks: a 1k-token reply
# at 16 tokens a block.
WINDOW_BLOCKS = 64


class PromptEnds:
    """The last block key of each recorded prompt: every one of the newest ``capacity`` and at most
    twice that many, in two generations of up to ``capacity`` keys. A new key goes into the newer;
    when it is full it becomes the older and the older is dropped whole.

    Not one dict evicting its oldest key per note: a dict finds its first key by scanning past every
    slot deleted since its table was last rebuilt, which made a note cost 15-117 us once 100,000 ends
    were held, more the longer kvroute ran (``python -m bench.index_churn --ends``); an OrderedDict
    evicts at once but its table's rebuilds held the event loop for 11 ms. Two plain dicts never
    delete: a note is one insert, and what waits is a dict growing and the older one freed."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._new: dict[int, None] = {}
        self._old: dict[int, None] = {}

    def note(self, keys: Sequence[int]) -> None:
        """A prompt with these block keys was recorded (routed or replayed from a peer)."""
        if not len(keys):
            return
        new, last = self._new, int(keys[-1])
        if last in new:
            return
        new[last] = None  # (a key of the older generation is renewed into the newer)
        if len(new) >= self.capacity:
            self._old, self._new = new, {}

    def continues(self, keys: Sequence[int], held: int) -> bool:
        """Whether a recorded prompt ended among the last ``WINDOW_BLOCKS`` of ``keys[:held]``."""
        if held <= 0:
            return False
        start = held - WINDOW_BLOCKS if held > WINDOW_BLOCKS else 0
        # From the run's end back: a next turn's previous prompt usually ended on its last block.
        window = keys[start:held]
        return any(map(self._new.__contains__, reversed(window))) or any(map(self._old.__contains__, reversed(window)))

    def __len__(self) -> int:
        """Keys held (one renewed into the newer generation is counted in both)."""
        return len(self._new) + len(self._old)
