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

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY = 100_000  # prompts remembered (routing.route_table_size's default: ~10 MB)
# How far before the end of the held run an earlier prompt's end may lie: the pod may also hold the
# reply's blocks (vLLM caches generated tokens; KV events report them). 64 blocks: a 1k-token reply
# at 16 tokens a block.
WINDOW_BLOCKS = 64


class PromptEnds:
    """A bounded set of the last block key of each recorded prompt (the oldest forgotten first).

    An OrderedDict, not a dict kept in insertion order: a dict finds its first key by scanning past
    every key deleted since its table was last rebuilt, so forgetting the oldest that way cost each
    note more the longer kvroute ran once full (up to a scan of ~250k deleted slots at the default
    capacity: ``python -m bench.index_churn --ends``); an OrderedDict unlinks it at once."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._ends: OrderedDict[int, None] = OrderedDict()  # the first is the oldest

    def note(self, keys: Sequence[int]) -> None:
        """A prompt with these block keys was recorded (routed or replayed from a peer)."""
        if not len(keys):
            return
        ends, last = self._ends, int(keys[-1])
        if last in ends:
            ends.move_to_end(last)  # renewed: the newest again
            return
        ends[last] = None
        if len(ends) > self.capacity:
            ends.popitem(last=False)

    def continues(self, keys: Sequence[int], held: int) -> bool:
        """Whether a recorded prompt ended among the last ``WINDOW_BLOCKS`` of ``keys[:held]``."""
        if held <= 0:
            return False
        start = held - WINDOW_BLOCKS if held > WINDOW_BLOCKS else 0
        # From the run's end back: a next turn's previous prompt usually ended on its last block.
        return any(map(self._ends.__contains__, reversed(keys[start:held])))

    def __len__(self) -> int:
        return len(self._ends)
