"""vLLM KV-cache events on the wire: their decoding (and encoding, for the simulator and tests). The
ZMQ subscribers that feed them to the precise prefix index are extproc/endpoints/events.py."""

from extproc.kvevents.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventDecodeError,
    KVEventMessage,
    decode_message,
    decode_payload,
    decode_replay_reply,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventDecodeError",
    "KVEventMessage",
    "decode_message",
    "decode_payload",
    "decode_replay_reply",
]
