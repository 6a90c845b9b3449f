"""Cache-bucket routing: route keys map to cache buckets, and only then to the pods in the bucket.

Policy (``routing.buckets``; SGLang cache_aware.rs style: the rule and its thresholds first)

* A pod's bucket is its ``cache-bucket`` label (``EndpointConfig.cache_bucket``); a pod without one
  is a bucket of its own, named by its address. Buckets outlive pods: a pod rebuilt in the same
  bucket (new name, new IP) takes the bucket's keys back, so the keyspace stays put across rebuilds
  and a per-bucket KV offload tier (LMCache on shared storage) keeps serving hits after one.
* The bucket key is the request's route/session id when it has one, else its chained block key at
  depth ``key_blocks`` (the first blocks: every turn of a conversation shares them).
* Buckets are ordered by rendezvous (highest-random-weight) hashing of their *names* with the key:
  every kvroute replica agrees, and adding or losing a bucket moves only the keys that bucket gains
  or owned (the minimal share).
* Bounded load (consistent hashing with bounded loads, over buckets): the first bucket in that order
  whose in-flight requests stay within ``⌈(1 + load_factor) · mean per pod · its pods⌉ + slack``
  takes the request; a hot key spills to its next bucket instead of queueing. ``slack`` keeps keys
  home at low load, where spilling would only cost cache hits.
* Within the chosen bucket the usual scoring (prefix index, cost) picks the pod; the other buckets'
  pods follow as fallbacks in bucket order.

Why a filter before the scorers and not one more scorer: the bucket must win over the prefix index.
While a bucket is empty (its pod being rebuilt) its keys spill and are recorded on other pods; a
scorer weighing that index against the bucket would keep them there, and the rebuilt pod would never
get its keys (or its offload tier's hits) back. Load still bounds the bucket choice, and the prefix
and cost scoring still decide among a bucket's replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from extproc.config import BucketsConfig
from extproc.endpoints.pool import EndpointState


def bucket_of(e: EndpointState) -> str:
    return e.cache_bucket if e.cache_bucket is not None else e.address


def bucket_order(names: Sequence[str], key: int) -> list[str]:
    """Highest-random-weight order of bucket ``names`` for ``key`` (stable across replicas)."""
    return sorted(names, key=lambda n: xxhash.xxh3_64_intdigest(n.encode(), seed=key), reverse=True)


def bucket_key(keys: Sequence[int], route_key: int | None, key_blocks: int) -> int | None:
    """What names a request's bucket: its route id, else its chained key ``key_blocks`` deep."""
    if route_key is not None:
        return route_key
    if not keys:
        return None
    return keys[min(key_blocks, len(keys)) - 1]


class BucketRouter:
    """Picks a request's bucket among the eligible pods (bounded-load rendezvous over bucket names)."""

    name = "bucket"

    def __init__(self, cfg: BucketsConfig) -> None:
        self.load_factor = cfg.load_factor
        self.slack = cfg.slack
        self.key_blocks = cfg.key_blocks

    @staticmethod
    def applies(endpoints: Sequence[EndpointState]) -> bool:
        """Only pools whose pods carry buckets are routed by bucket."""
        return any(e.cache_bucket is not None for e in endpoints)

    def capacity(self, bucket_pods: int, total_inflight: int, total_pods: int) -> int:
        mean = (total_inflight + 1) / total_pods
        return math.ceil((1 + self.load_factor) * mean * bucket_pods) + self.slack

    def split(
        self, keys: Sequence[int], route_key: int | None, endpoints: list[EndpointState]
    ) -> tuple[list[EndpointState], list[EndpointState]] | None:
        """(the chosen bucket's pods, every other pod in bucket order), or None when bucket routing
        does not apply (no bucket labels, or nothing to key the request by)."""
        key = bucket_key(keys, route_key, self.key_blocks)
        if key is None or not endpoints or not self.applies(endpoints):
            return None
        groups: dict[str, list[EndpointState]] = {}
        for e in endpoints:
            groups.setdefault(bucket_of(e), []).append(e)
        order = bucket_order(list(groups), key)
        total = sum(e.inflight for e in endpoints)

        def fits(name: str) -> bool:
            pods = groups[name]
            return sum(e.inflight for e in pods) + 1 <= self.capacity(len(pods), total, len(endpoints))

        # Some bucket is at or below the mean per pod, so with load_factor ≥ 0 one always fits; the
        # least loaded per pod is the guard all the same.
        chosen = next(
            (n for n in order if fits(n)),
            min(order, key=lambda n: sum(e.inflight for e in groups[n]) / len(groups[n])),
        )
        rest = [e for n in order if n != chosen for e in groups[n]]
        return groups[chosen], rest
