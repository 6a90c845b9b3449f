"""Pickers: turn scores into a ranked list (first = pick, rest = fallbacks)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import xxhash

from extproc.endpoints.pool import EndpointState
from extproc.index.base import EndpointId


def rendezvous_order(endpoints: list[EndpointState], key: int) -> list[EndpointState]:
    """Highest-random-weight order for ``key``: every kvroute replica agrees on it, and removing a pod
    only moves the keys that pod owned."""
    return sorted(endpoints, key=lambda e: xxhash.xxh3_64_intdigest(e.address.encode(), seed=key), reverse=True)


def tie_key(keys: Sequence[int], matches: Mapping[EndpointId, int]) -> int:
    """The block whose rendezvous order ranks equal pods for a prompt of ``keys`` (non-empty), the pods
    holding its leading blocks as ``matches`` says: the first block past the longest run, the part new
    to the fleet. Not the first block: every prompt on one system prompt would rank equal pods alike,
    and while pods tie (idle, or equally loaded) each new conversation on it would go to the same one,
    which then evicts first."""
    held = max(matches.values(), default=0)
    return keys[held] if held < len(keys) else keys[-1]


def spread_near_cheapest(
    ranked: list[EndpointState], cost: Callable[[EndpointState], float], within_s: float, key: int
) -> list[EndpointState]:
    """``ranked`` (cheapest first) with the pods costing at most ``within_s`` more than the first put
    in ``key``'s rendezvous order: concurrent deciders with one view then split near-equal pods
    between their requests instead of all taking the first."""
    if len(ranked) < 2:
        return ranked
    limit = cost(ranked[0]) + within_s
    near = [e for e in ranked if cost(e) <= limit]
    if len(near) < 2:
        return ranked
    ids = {id(e) for e in near}
    return [*rendezvous_order(near, key), *(e for e in ranked if id(e) not in ids)]


def rank_by_score(endpoints: list[EndpointState], scores: dict[EndpointId, float], key: int) -> list[EndpointState]:
    """Highest score first; ties broken by rendezvous order so equal pods don't all get the first one."""
    get, h = scores.get, xxhash.xxh3_64_intdigest
    # Decorated (score, tie, -position): one tuple per pod instead of a key call; -position keeps a
    # full tie (never seen: equal hashes) in list order, as the stable sort did.
    ranked = sorted([(get(e.address, 0.0), h(e.address.encode(), key), -i) for i, e in enumerate(endpoints)],
                    reverse=True)  # fmt: skip
    return [endpoints[-i] for _, _, i in ranked]
