"""Decode vLLM KV-cache event messages (``--kv-events-config ... "publisher": "zmq"``).

Wire format (vllm/distributed/kv_events.py, ZmqEventPublisher):
- live PUB message: 3 frames ``[topic, seq (u64 big-endian, +1 per batch, from 0), msgpack payload]``;
- payload: an EventBatch, either a map ``{"ts", "events", "data_parallel_rank"}`` (msgspec Struct,
  current builds) or an array ``[ts, events, dp_rank]`` (``array_like`` builds);
- each event: a map tagged by ``"type"`` or a tagged array ``["BlockStored", field, ...]`` whose
  fields follow the Struct's declaration order (trailing defaults may be omitted).
- block hashes: uint64 ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) or raw digest bytes; vLLM's own
  conversion keeps the last 8 bytes big-endian, so a bytes hash maps to the same int either way.

Everything here is defensive: the publisher's version is not ours to pick. A message we cannot
make sense of raises ``KVEventDecodeError``; an event type we do not know is skipped and counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from extproc.errors import KVRouteError

SEQ_BYTES = 8
U64_MASK = (1 << 64) - 1
U32_MAX = (1 << 32) - 1  # token ids are hashed as u32 (extproc/hashing.py)
# Guard rails against garbage that happens to parse as msgpack.
MAX_PAYLOAD_BYTES = 64 << 20
MAX_TOPIC_BYTES = 4096
MAX_EXTRA_KEYS_DEPTH = 16  # vLLM's are (hash, offset) pairs in a tuple: two levels

# Field order of the tagged-array form, as declared in vLLM's Structs (after the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_STORED_REQUIRED = 4  # block_hashes, parent_block_hash, token_ids, block_size


class KVEventDecodeError(KVRouteError):
    """A KV-event message is malformed (wrong frame count, bad msgpack, wrong field types)."""


ExtraKeys = tuple[tuple[Any, ...] | None, ...]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: ExtraKeys | None = None  # one entry per block (None = no extra keys for it)
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None
    skipped_unknown: int = 0  # events of a type this decoder does not know


@dataclass(frozen=True, slots=True)
class KVEventMessage:
    """One live PUB message, or one replayed batch."""

    topic: bytes
    seq: int
    batch: EventBatch


def block_hash_to_int(value: object) -> int:
    """An engine block hash as uint64: ints are masked, bytes keep their last 8 bytes (big-endian)."""
    if isinstance(value, bool):
        raise KVEventDecodeError(f"block hash must be int or bytes, got {value!r}")
    if isinstance(value, int):
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(value)[-SEQ_BYTES:], "big")
    raise KVEventDecodeError(f"block hash must be int or bytes, got {type(value).__name__}")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise KVEventDecodeError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes]) -> KVEventMessage:
    """Decode a live message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(topic) > MAX_TOPIC_BYTES:
        raise KVEventDecodeError("topic frame too long")
    return KVEventMessage(bytes(topic), decode_seq(seq), decode_payload(payload))


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one msgpack EventBatch (map or array form)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVEventDecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError, ...)
        raise KVEventDecodeError(f"payload is not valid msgpack: {exc}") from exc
    if isinstance(obj, dict):
        ts, raw_events, dp_rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, list) and len(obj) >= 2:
        ts, raw_events = obj[0], obj[1]
        dp_rank = obj[2] if len(obj) > 2 else None
    else:
        raise KVEventDecodeError(f"batch must be a map or [ts, events, dp_rank], got {type(obj).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise KVEventDecodeError(f"batch ts must be a number, got {ts!r}")
    if not isinstance(raw_events, list):
        raise KVEventDecodeError("batch events must be an array")
    events: list[KVEvent] = []
    skipped = 0
    for raw in raw_events:
        ev = decode_event(raw)
        if ev is None:
            skipped += 1
        else:
            events.append(ev)
    return EventBatch(float(ts), tuple(events), _opt_int(dp_rank, "data_parallel_rank"), skipped)


def decode_event(raw: object) -> KVEvent | None:
    """Decode one event; None for a well-formed event of an unknown type."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KVEventDecodeError(f"event must be a map or a tagged array, got {type(raw).__name__}")
    if not isinstance(kind, str):
        raise KVEventDecodeError(f"event tag must be a string, got {kind!r}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return BlockRemoved(
            _hashes(fields.get("block_hashes")),
            _opt_str(fields.get("medium"), "medium"),
            _opt_int(fields.get("group_idx"), "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(f: dict[Any, Any]) -> BlockStored:
    missing = [n for n in _STORED_FIELDS[:_STORED_REQUIRED] if n not in f]
    if missing:
        raise KVEventDecodeError(f"BlockStored lacks {', '.join(missing)}")
    hashes = _hashes(f["block_hashes"])
    parent = f["parent_block_hash"]
    tokens = f["token_ids"]
    # Checked in C-speed passes (the types seen, then the range): a 2k-token prefill event's ids took
    # ~0.2 ms one by one in a generator, most of decoding it.
    if not isinstance(tokens, list) or (
        tokens and (set(map(type, tokens)) != {int} or min(tokens) < 0 or max(tokens) > U32_MAX)
    ):
        raise KVEventDecodeError("BlockStored token_ids must be an array of ints in 0..2^32-1")
    block_size = f["block_size"]
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise KVEventDecodeError(f"BlockStored block_size must be a positive int, got {block_size!r}")
    extra = f.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or not all(e is None or isinstance(e, list) for e in extra):
            raise KVEventDecodeError("BlockStored extra_keys must be an array of arrays or nulls")
        extra = tuple(None if e is None else _freeze(e) for e in extra)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else block_hash_to_int(parent),
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=extra,
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KVEventDecodeError("block_hashes must be an array")
    if value and set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= U64_MASK:
        return tuple(value)  # (int hashes, as vLLM sends them: already uint64)
    return tuple(block_hash_to_int(h) for h in value)


def _freeze(value: list[Any], depth: int = 0) -> tuple[Any, ...]:
    """msgpack turns vLLM's tuples into lists; make them hashable again (frozen dataclass). msgpack
    nests up to 1024 levels, past Python's recursion limit: deeper than vLLM ever sends is refused."""
    if depth > MAX_EXTRA_KEYS_DEPTH:
        raise KVEventDecodeError(f"BlockStored extra_keys nested deeper than {MAX_EXTRA_KEYS_DEPTH}")
    return tuple(_freeze(v, depth + 1) if isinstance(v, list) else v for v in value)


def _opt_int(value: object, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVEventDecodeError(f"{name} must be an int or null, got {value!r}")
    return value


def _opt_str(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise KVEventDecodeError(f"{name} must be a string or null, got {value!r}")
    return value


REPLAY_END_SEQ = b"\xff" * SEQ_BYTES  # vLLM: (-1).to_bytes(8, "big", signed=True), with an empty payload


def decode_replay_reply(frames: Sequence[bytes], topic: bytes = b"") -> KVEventMessage | None:
    """Decode one reply a DEALER gets from the replay ROUTER; None marks the end of the replay.

    Replies are ``[b"", seq, payload]`` (current vLLM) or ``[b"", topic, seq, payload]``; the empty
    delimiter is optional here so either socket flavour on our side works.
    """
    parts = list(frames)
    if parts and parts[0] == b"" and len(parts) in (3, 4):
        parts = parts[1:]
    if len(parts) == 3:
        topic, seq_frame, payload = parts
    elif len(parts) == 2:
        seq_frame, payload = parts
    else:
        raise KVEventDecodeError(f"replay reply has {len(frames)} frames")
    if seq_frame == REPLAY_END_SEQ or not payload:
        return None
    return KVEventMessage(bytes(topic), decode_seq(seq_frame), decode_payload(payload))
