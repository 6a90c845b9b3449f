"""The block-key hash shared by every index: chained xxh3-64 over each block's bytes.

A block's key depends on its parent's key, so equal keys mean equal *prefixes*, not just equal
blocks. Character blocks hash their UTF-8 bytes; token blocks hash their ids as little-endian u32.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

_xxh = xxhash.xxh3_64_intdigest
_xxh128 = xxhash.xxh3_128_intdigest

# ``chain_spans``' memo: the keys of groups of GROUP_BLOCKS blocks by (parent key, block size, the
# group's 128-bit digest), least recently used out first; ~1 KB an entry. A group enters on
# probation and joins the memo when met again, so the one-off groups of every request (the tail
# with its new question) cannot push out the documents that recur. 6144 + 2048 entries: the keys of
# 24 MiB of recurring prompts in 256-character blocks (~750 documents of 8k tokens), ~8 MB in all.
GROUP_BLOCKS = 16
MEMO_GROUPS = 6144
PROBATION_GROUPS = 2048
_Group = tuple[int, int, int]
_memo: OrderedDict[_Group, tuple[int, ...]] = OrderedDict()
_probation: OrderedDict[_Group, tuple[int, ...]] = OrderedDict()


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
    # One conversion for the whole prompt (none for a u32 array: ModelTokenizer's ids), then slices of
    # its bytes: the same bytes as token_block_bytes.
    head = token_ids[: n * block_size]
    data = head.tobytes() if isinstance(head, array) and head.typecode == "I" else array("I", head).tobytes()
    return chain_spans(seed, data, block_size * 4)


def chain_spans(seed: int, data: bytes, step: int) -> list[int]:
    """Chained keys of ``data``'s consecutive ``step``-byte spans (``len(data)`` a multiple of
    ``step``), as ``chain`` gives them. A Python call costs more than hashing a block, and most
    prompts repeat text keyed before (a document, a conversation's history): spans are taken
    ``GROUP_BLOCKS`` at a time, and a group met before under the same parent key (its bytes' 128-bit
    digest) gets its keys from the memo in one step."""
    keys: list[int] = []
    parent = seed
    group = step * GROUP_BLOCKS
    whole = len(data) - len(data) % group
    view = memoryview(data)
    for off in range(0, whole, group):
        key = (parent, step, _xxh128(view[off : off + group]))
        run = _recall(key)
        if run is None:
            run = _chain_run(parent, data, off, off + group, step)
            _remember(_probation, key, run, PROBATION_GROUPS)
        keys += run
        parent = run[-1]
    if whole < len(data):
        keys += _chain_run(parent, data, whole, len(data), step)
    return keys


def chain_chars(seed: int, text: str, chars: int, n: int) -> list[int]:
    """Chained keys of ``text``'s first ``n`` blocks of ``chars`` characters, each block hashed as its
    UTF-8 bytes (``chain``). Past ASCII a block's bytes vary in length, so each is encoded on its own;
    but groups of ``GROUP_BLOCKS`` blocks met before come from ``chain_spans``' memo, under their UTF-8
    bytes' digest (an ASCII group under the key ``chain_spans`` gives it, for the same keys): a prompt
    with one character past ASCII (a curly quote, an accent, an emoji) cost three to five times an
    ASCII one when every block was encoded and hashed again."""
    keys: list[int] = []
    parent = seed
    group = chars * GROUP_BLOCKS
    whole = n - n % GROUP_BLOCKS
    for start in range(0, whole * chars, group):
        data = text[start : start + group].encode("utf-8", "surrogatepass")
        ascii_group = len(data) == group  # as many bytes as characters
        key = (parent, chars if ascii_group else -chars, _xxh128(data))
        run = _recall(key)
        if run is None:
            if ascii_group:
                run = _chain_run(parent, data, 0, group, chars)
            else:
                run = _chain_blocks(parent, text, start, start + group, chars)
            _remember(_probation, key, run, PROBATION_GROUPS)
        keys += run
        parent = run[-1]
    if whole < n:
        keys += _chain_blocks(parent, text, whole * chars, n * chars, chars)
    return keys


def _recall(key: _Group) -> tuple[int, ...] | None:
    """A group's keys from the memo, or from probation (met again: into the memo); None if neither."""
    run = _memo.get(key)
    if run is not None:
        _memo.move_to_end(key)
    elif (run := _probation.pop(key, None)) is not None:
        _remember(_memo, key, run, MEMO_GROUPS)
    return run


def _remember(table: OrderedDict[_Group, tuple[int, ...]], key: _Group, run: tuple[int, ...], bound: int) -> None:
    table[key] = run
    if len(table) > bound:
        table.popitem(last=False)


def _chain_run(parent: int, data: bytes, start: int, stop: int, step: int) -> tuple[int, ...]:
    """``chain_spans`` of ``data[start:stop]``, one block at a time (slices of ``bytes``, one small
    copy each, beat memoryview slices; a positional seed beats a keyword)."""
    keys: list[int] = []
    append = keys.append
    for off in range(start, stop, step):
        parent = _xxh(data[off : off + step], parent)
        append(parent)
    return tuple(keys)


def _chain_blocks(parent: int, text: str, start: int, stop: int, chars: int) -> tuple[int, ...]:
    """``chain_chars`` of ``text[start:stop]``, one block at a time, each block's UTF-8 bytes."""
    keys: list[int] = []
    append = keys.append
    for i in range(start, stop, chars):
        parent = _xxh(text[i : i + chars].encode("utf-8", "surrogatepass"), parent)
        append(parent)
    return tuple(keys)
