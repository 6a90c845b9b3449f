"""The block-key hash shared by every index: chained xxh3-64 over each block's bytes.

A block's key depends on its parent's key, so equal keys mean equal *prefixes*, not just equal
blocks. Character blocks hash their UTF-8 bytes; token blocks hash their ids as little-endian u32.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_xxh = xxhash.xxh3_64_intdigest


def seed_key(*parts: str) -> int:
    """The chain's root: model, tenant and cache_salt, so equal prompts never match across tenants."""
    return _xxh("\x1f".join(parts).encode("utf-8", "surrogatepass"))


def chain(parent: int, block: bytes) -> int:
    """Key of ``block`` whose predecessor has key ``parent``."""
    return _xxh(block, seed=parent)


def token_block_bytes(token_ids: Sequence[int]) -> bytes:
    """Canonical bytes of a block of token ids (u32 little-endian on every platform we run)."""
    return array("I", token_ids).tobytes()


def chain_tokens(seed: int, token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Keys of the full ``block_size`` blocks of ``token_ids`` (a partial last block is not cached)."""
    n = min(len(token_ids) // block_size, max_blocks)
    if n <= 0:
        return []
    # One conversion for the whole prompt, then zero-copy slices: same bytes as token_block_bytes.
    return chain_spans(seed, array("I", token_ids[: n * block_size]).tobytes(), block_size * 4)


def chain_spans(seed: int, data: bytes, step: int) -> list[int]:
    """Chained keys of ``data``'s consecutive ``step``-byte spans (``len(data)`` a multiple of
    ``step``): ``chain`` over zero-copy slices, without a call per block."""
    view = memoryview(data)
    keys: list[int] = []
    parent = seed
    for off in range(0, len(data), step):
        parent = _xxh(view[off : off + step], seed=parent)
        keys.append(parent)
    return keys
