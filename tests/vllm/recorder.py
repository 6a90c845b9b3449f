"""A KV-event sink for tests: forwards to a ``PreciseIndex`` and records every event per pod,
rewritten from engine hashes to token-chain keys so two engines (real vLLM, the simulator) whose
hashes differ can be compared block by block."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from extproc import hashing
from extproc.endpoints.events import KVEventSubscriber
from extproc.index.base import EndpointId
from extproc.index.precise import PreciseIndex, precise_seed
from extproc.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch


@dataclass
class PodLog:
    """What one pod reported: stored/removed blocks as chain keys, in arrival order."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    removed_unknown: int = 0
    cleared: int = 0
    batches: int = 0
    engine_to_key: dict[int, int] = field(default_factory=dict)

    def mark(self) -> tuple[int, int]:
        return len(self.stored), len(self.removed)


class RecordingSink:
    """``KVEventSink`` that applies to ``index`` and keeps a ``PodLog`` per endpoint."""

    def __init__(self, index: PreciseIndex) -> None:
        self.index = index
        self.logs: dict[EndpointId, PodLog] = {}
        self.changed = asyncio.Event()

    def log(self, endpoint: EndpointId) -> PodLog:
        return self.logs.setdefault(endpoint, PodLog())

    def apply_batch(self, endpoint: EndpointId, batch: EventBatch) -> None:
        self.index.apply_batch(endpoint, batch)
        log = self.log(endpoint)
        log.batches += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                log.stored += self._stored_keys(log, ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    key = log.engine_to_key.pop(h, None)
                    if key is None:
                        log.removed_unknown += 1
                    else:
                        log.removed.append(key)
            elif isinstance(ev, AllBlocksCleared):
                self._forget(log)
        self.changed.set()

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        self.index.clear_endpoint(endpoint)
        self._forget(self.log(endpoint))
        self.changed.set()

    @staticmethod
    def _forget(log: PodLog) -> None:
        log.cleared += 1
        log.engine_to_key.clear()

    @staticmethod
    def _stored_keys(log: PodLog, ev: BlockStored) -> list[int]:
        if ev.parent_block_hash is None:
            first = ev.extra_keys[0] if ev.extra_keys else None
            parent = precise_seed(str(first[-1]) if first else None)
        else:
            parent = log.engine_to_key[ev.parent_block_hash]
        keys = []
        bs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            parent = hashing.chain(parent, hashing.token_block_bytes(ev.token_ids[i * bs : (i + 1) * bs]))
            log.engine_to_key[h] = parent
            keys.append(parent)
        return keys

    async def wait_for(self, predicate: object, timeout: float = 10.0) -> None:
        """Until ``predicate()`` is true, re-checked after each batch."""
        assert callable(predicate)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError("KV events did not arrive in time")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.2))


def subscriber_for(endpoint: EndpointId, pub: str, replay: str | None, sink: RecordingSink) -> KVEventSubscriber:
    return KVEventSubscriber(endpoint, sink, pub_address=pub, replay_address=replay)
