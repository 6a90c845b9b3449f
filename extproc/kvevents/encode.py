"""Encode KV-event batches the way vLLM's msgspec Structs serialise them (for simulators and tests).

Map form (current vLLM): ``{"ts", "events", "data_parallel_rank"}`` with events tagged by ``"type"``;
fields without a default are always written (``lora_id``, ``medium``, ``lora_name`` even when null),
defaulted ones only when set (``omit_defaults``). Array form (``array_like`` builds):
``[ts, events, dp_rank]`` with events ``["BlockStored", field, ...]`` in declaration order.
"""

from __future__ import annotations

from typing import Any, Literal

import msgpack

from extproc.kvevents.decode import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

WireForm = Literal["map", "array"]


def event_fields(ev: KVEvent) -> tuple[str, list[tuple[str, Any, bool]]]:
    """(tag, [(field, value, has_default)]) in vLLM's declaration order."""
    if isinstance(ev, BlockStored):
        extra = None if ev.extra_keys is None else [None if e is None else list(e) for e in ev.extra_keys]
        return "BlockStored", [
            ("block_hashes", list(ev.block_hashes), False),
            ("parent_block_hash", ev.parent_block_hash, False),
            ("token_ids", list(ev.token_ids), False),
            ("block_size", ev.block_size, False),
            ("lora_id", ev.lora_id, False),
            ("medium", ev.medium, False),
            ("lora_name", ev.lora_name, False),
            ("extra_keys", extra, True),
            ("group_idx", ev.group_idx, True),
        ]
    if isinstance(ev, BlockRemoved):
        return "BlockRemoved", [
            ("block_hashes", list(ev.block_hashes), False),
            ("medium", ev.medium, False),
            ("group_idx", ev.group_idx, True),
        ]
    if isinstance(ev, AllBlocksCleared):
        return "AllBlocksCleared", []
    raise TypeError(f"not a KV event: {ev!r}")


def encode_event(ev: KVEvent, form: WireForm = "map") -> Any:
    tag, fields = event_fields(ev)
    if form == "map":
        out: dict[str, Any] = {"type": tag}
        out.update((k, v) for k, v, has_default in fields if not (has_default and v is None))
        return out
    values = [v for _, v, _ in fields]
    defaulted = [d for _, _, d in fields]
    while values and defaulted[len(values) - 1] and values[-1] is None:
        values.pop()  # omit_defaults drops trailing defaulted fields
    return [tag, *values]


def encode_batch(events: list[KVEvent], ts: float = 0.0, dp_rank: int | None = 0, form: WireForm = "map") -> bytes:
    evs = [encode_event(e, form) for e in events]
    if form == "map":
        batch: Any = {"ts": ts, "events": evs}
        if dp_rank is not None:
            batch["data_parallel_rank"] = dp_rank
    else:
        batch = [ts, evs, dp_rank]
    return msgpack.packb(batch, use_bin_type=True)
