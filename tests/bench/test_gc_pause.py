"""bench.gc_pause: a routed index, the collections it caused, and a full collection's cost frozen or not."""

from __future__ import annotations

import asyncio

from bench.gc_pause import COLUMNS, measure, row


def test_gc_pause_routes_fills_the_index_and_times_collections():
    r = asyncio.run(measure(requests=40, tokens=1000, rounds=2))
    assert r["index_blocks"] >= 40 * 10  # 1000 tokens, ~4000 characters a chat: ~15 blocks each, all new
    assert r["requests_over_10ms"] <= r["requests"]
    assert r["frozen_objects"] > 1000
    # Frozen, a full collection walks only what came after: far less than the whole process's heap.
    assert r["full_collection_frozen_ms"] < r["full_collection_ms"] / 5
    assert len(row(r, "this")) == len(COLUMNS)
