"""vLLM KV cache events over ZMQ, byte-compatible with vllm/distributed/kv_events.py.

Wire format (one message per engine step that changed the cache):
``[topic, seq (u64 big-endian, 0, 1, 2, ...), msgpack(batch)]`` on a PUB socket.

Encodings (``--kv-events-encoding``):
- ``map`` (vLLM 0.26-0.32, the default): batch ``[ts, [events], dp_rank]``, events are maps with a
  ``type`` tag, fields that equal their default omitted (msgspec ``omit_defaults``);
- ``array`` (older vLLM): events are tagged arrays ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium]``;
- ``map-batch`` (vLLM main since the batch lost ``array_like``): the batch too is a map
  ``{"ts", "events", "data_parallel_rank"}``, events as in ``map``.

Replay: a DEALER sends ``[b"", start_seq]`` to the ROUTER; each buffered batch from ``start_seq``
comes back as ``[b"", topic, seq, payload]`` and the end as ``[b"", b"", 0xFF*8, b""]`` (the
framing of current vLLM ``_service_replay``; the DEALER sees the empty delimiter first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

Encoding = Literal["map", "array", "map-batch"]
ENCODINGS: tuple[str, ...] = ("map", "array", "map-batch")
END_SEQ = b"\xff" * 8
MEDIUM = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[Any] | None = None

    def to_map(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
        }
        if self.extra_keys is not None:
            d["extra_keys"] = self.extra_keys
        return d

    def to_array(self) -> list[Any]:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size, None, MEDIUM]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]

    def to_map(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": MEDIUM}

    def to_array(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, MEDIUM]


@dataclass(slots=True)
class AllBlocksCleared:
    def to_map(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}

    def to_array(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(events: list[KVEvent], encoding: str, ts: float | None = None, dp_rank: int = 0) -> bytes:
    ts = time.time() if ts is None else ts
    if encoding == "array":
        return msgpack.packb([ts, [e.to_array() for e in events], dp_rank])
    body = [e.to_map() for e in events]
    if encoding == "map-batch":
        return msgpack.packb({"ts": ts, "events": body, "data_parallel_rank": dp_rank})
    return msgpack.packb([ts, body, dp_rank])


def _bound_endpoint(sock: zmq.Socket[Any]) -> str:
    ep = sock.getsockopt(zmq.LAST_ENDPOINT)
    return ep.decode() if isinstance(ep, bytes) else str(ep)


class KVEventPublisher:
    """PUB socket + replay ROUTER for one pod. ``port``/``replay_port`` 0 picks a free port."""

    def __init__(
        self,
        host: str,
        port: int,
        replay_port: int | None,
        topic: str = "kv",
        encoding: str = "map",
        buffer_steps: int = 10_000,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {ENCODINGS}")
        self.encoding = encoding
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._lost = 0  # batches still to lose (``lose``)
        self.sent = 0  # batches sent on the PUB socket, over every restart (a subscriber has them all once it
        # has taken in as many)
        self._actx = zmq.asyncio.Context.instance()
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(f"tcp://{host}:{port or '*'}")
        self.endpoint = _bound_endpoint(self._pub)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_port is not None:
            self._router = self._actx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(f"tcp://{host}:{replay_port or '*'}")
            self.replay_endpoint = _bound_endpoint(self._router)
        self._task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events, self.encoding)
        seq = self._seq
        self._seq += 1
        if self._lost:
            self._lost -= 1
            return
        # PUB never blocks: past the high-water mark ZMQ drops, like vLLM's publisher thread.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.sent += 1
        self._buffer.append((seq, payload))

    def lose(self, batches: int) -> None:
        """The next ``batches`` batches are lost for good (numbered, never sent or buffered): a gap no
        replay can fill, as when the publisher's high-water mark drops and its buffer has moved on."""
        self._lost += batches

    def restart(self) -> None:
        """A new publisher process: numbering starts again at 0 and the replay buffer is empty."""
        self._seq = 0
        self._buffer.clear()

    async def close_replay(self) -> None:
        """The replay socket goes down (a replay request then times out)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            try:
                frames = await router.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await router.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
