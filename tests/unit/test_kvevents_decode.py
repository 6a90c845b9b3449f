"""Decoding vLLM KV-event messages: both payload forms, both hash types, garbage."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from extproc.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventDecodeError,
    decode_message,
    decode_payload,
    decode_replay_reply,
)
from extproc.kvevents.decode import REPLAY_END_SEQ, block_hash_to_int
from extproc.kvevents.encode import encode_batch


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


# Literal payloads as vLLM's msgspec encoder writes them (not via our encoder), one per wire form.
MAP_BATCH = {
    "ts": 1732000000.25,
    "events": [
        {
            "type": "BlockStored",
            "block_hashes": [11, 12],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [["salt-a"], None],
        },
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ],
    "data_parallel_rank": 0,
}
ARRAY_BATCH = [
    1.5,
    [
        ["BlockStored", [21], 11, list(range(16)), 16, None, "GPU", None],
        ["BlockRemoved", [21], "GPU"],
        ["AllBlocksCleared"],
    ],
    2,
]


def test_map_form_batch() -> None:
    msg = decode_message([b"kv", seq(41), msgpack.packb(MAP_BATCH)])
    assert (msg.topic, msg.seq, msg.batch.ts, msg.batch.dp_rank) == (b"kv", 41, 1732000000.25, 0)
    stored, removed, cleared = msg.batch.events
    assert stored == BlockStored(
        block_hashes=(11, 12),
        parent_block_hash=None,
        token_ids=tuple(range(32)),
        block_size=16,
        medium="GPU",
        extra_keys=(("salt-a",), None),
    )
    assert removed == BlockRemoved((7,), "GPU")
    assert cleared == AllBlocksCleared()


def test_array_form_batch_and_old_field_layout() -> None:
    batch = decode_payload(msgpack.packb(ARRAY_BATCH))
    assert batch.dp_rank == 2
    stored, removed, _ = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == 11 and stored.medium == "GPU" and stored.extra_keys is None
    assert removed == BlockRemoved((21,), "GPU")
    # Oldest layout: no medium, no dp rank.
    old = decode_payload(msgpack.packb([0, [["BlockStored", [1], None, [1, 2], 2, None]]]))
    assert old.dp_rank is None and isinstance(old.events[0], BlockStored)


def test_bytes_hashes_keep_last_8_bytes_big_endian() -> None:
    digest = hashlib.sha256(b"block").digest()
    expected = int.from_bytes(digest, "big") & ((1 << 64) - 1)  # vLLM's maybe_convert_block_hash
    assert block_hash_to_int(digest) == expected
    batch = decode_payload(
        msgpack.packb(
            {"ts": 0, "events": [{"type": "BlockRemoved", "block_hashes": [digest], "medium": None}]},
            use_bin_type=True,
        )
    )
    assert batch.events[0] == BlockRemoved((expected,), None)


def test_unknown_event_types_are_skipped_and_counted() -> None:
    payload = msgpack.packb({"ts": 0, "events": [{"type": "BlockPinned", "x": 1}, ["Future", 1, 2]]})
    batch = decode_payload(payload)
    assert batch.events == () and batch.skipped_unknown == 2


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", seq(1)],  # missing payload
        [b"kv", b"\x01", msgpack.packb(MAP_BATCH)],  # short seq
        [b"kv", seq(1), b"\xc1"],  # invalid msgpack
        [b"kv", seq(1), msgpack.packb("text")],
        [b"kv", seq(1), msgpack.packb({"ts": "x", "events": []})],
        [b"kv", seq(1), msgpack.packb({"ts": 0, "events": [{"type": "BlockStored"}]})],
        [b"kv", seq(1), msgpack.packb({"ts": 0, "events": [["BlockStored", [1], None, ["a"], 16]]})],
        [b"kv", seq(1), msgpack.packb({"ts": 0, "events": [["BlockRemoved", [1.5], None]]})],
        [b"kv", seq(1), msgpack.packb({"ts": 0, "events": [42]})],
    ],
)
def test_malformed_messages_raise_named_error(frames: list[bytes]) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_message(frames)


def test_replay_replies_both_layouts_and_end_marker() -> None:
    payload = msgpack.packb(MAP_BATCH)
    assert decode_replay_reply([b"", seq(5), payload]).seq == 5  # type: ignore[union-attr]
    with_topic = decode_replay_reply([b"", b"kv", seq(6), payload])
    assert with_topic is not None and (with_topic.topic, with_topic.seq) == (b"kv", 6)
    assert decode_replay_reply([b"", REPLAY_END_SEQ, b""]) is None
    with pytest.raises(KVEventDecodeError):
        decode_replay_reply([b"", b"", b"", b"", b""])


@pytest.mark.parametrize("form", ["map", "array"])
def test_encoder_round_trip(form: str) -> None:
    events = [
        BlockStored((1, 2), None, tuple(range(8)), 4, None, "GPU", "lora", (("lora", "s"), ("lora",))),
        BlockRemoved((2,), "GPU"),
        AllBlocksCleared(),
    ]
    batch = decode_payload(encode_batch(events, ts=3.0, dp_rank=1, form=form))  # type: ignore[arg-type]
    assert batch.events == tuple(events) and batch.dp_rank == 1 and batch.ts == 3.0


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize(
    "event",
    [
        # msgpack nests 1024 deep, past Python's recursion limit: a RecursionError ended the consumer
        ["BlockStored", [1], None, [1] * 4, 4, None, None, None, [_nested(990)]],
        # token ids are hashed as u32: these raised OverflowError in the index (sink error + resync)
        ["BlockStored", [1], None, [-1] * 4, 4],
        ["BlockStored", [1], None, [2**40] * 4, 4],
        # a bool or a float among the ids (msgpack keeps them apart from ints): refused, not taken as 1
        ["BlockStored", [1], None, [1, True, 2, 3], 4],
        ["BlockStored", [1], None, [1, 2.0, 2, 3], 4],
        ["BlockStored", [1], None, [1, 2, 3, 2**32], 4],
        # a bool block hash
        ["BlockRemoved", [True], None],
    ],
)
def test_garbage_found_by_fuzzing_is_a_decode_error(event):
    with pytest.raises(KVEventDecodeError):
        decode_payload(msgpack.packb({"ts": 1.0, "events": [event]}))


def test_block_hashes_as_ints_or_bytes_decode_to_uint64() -> None:
    """Int hashes within uint64 are taken as they are; anything else goes through block_hash_to_int
    (bytes: their last 8 bytes; a negative int, as Python's hash() gives: masked to 64 bits)."""
    hashes = [0, 1, 2**64 - 1, b"\x00" * 24 + (5).to_bytes(8, "big"), -1]
    ev = decode_payload(msgpack.packb({"ts": 1.0, "events": [["BlockRemoved", hashes, None]]})).events[0]
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == (0, 1, 2**64 - 1, 5, 2**64 - 1)
    ev = decode_payload(msgpack.packb({"ts": 1.0, "events": [["BlockRemoved", [3, 2**64 - 1], None]]})).events[0]
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == (3, 2**64 - 1)
