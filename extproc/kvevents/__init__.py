"""vLLM KV-cache events: wire decoding and ZMQ subscribers that feed the precise prefix index."""

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
