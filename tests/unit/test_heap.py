"""The serving process's heap: nothing per cached block for the garbage collector to walk, startup's
objects frozen, and every collection timed on /metrics."""

from __future__ import annotations

import gc

from extproc.heap import settle
from extproc.index.approx import ApproxPrefixIndex
from extproc.observability import Metrics


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_the_approximate_index_adds_no_tracked_object_per_block():
    """A full collection walks every tracked object: a container per cached block (a set of holders,
    as before) made one over a full index stall the event loop for 80-130 ms."""
    idx = ApproxPrefixIndex(3000)
    pods = [f"10.0.0.{i}:8000" for i in range(6)]
    idx.record([0], pods[0])  # the first record's LRU and bit exist before counting
    before = _tracked()
    for i in range(3000):
        idx.record([i * 7 + j for j in range(8)], pods[i % len(pods)])  # overlapping prefixes: shared holders
    grown = _tracked() - before
    assert sum(idx.block_counts().values()) == 6 * 3000  # every pod's LRU full
    assert grown <= len(pods), f"{grown} tracked objects for {sum(idx.block_counts().values())} blocks"
    assert not any(gc.is_tracked(shard) for shard in idx._holders)


def test_settle_freezes_what_exists_and_times_each_collection():
    metrics = Metrics()
    undo = settle(metrics)
    try:
        assert gc.get_freeze_count() > 1000  # this process's modules, at least
        gc.collect(0)
        gc.collect(2)
        counts = {
            s.labels["generation"]: s.value
            for fam in metrics.registry.collect()
            if fam.name == "kvroute_gc_pause_seconds"
            for s in fam.samples
            if s.name.endswith("_count")
        }
        assert counts["0"] >= 1 and counts["2"] >= 1, counts
    finally:
        undo()
    assert gc.get_freeze_count() == 0
    n = len(gc.callbacks)
    gc.collect()
    assert len(gc.callbacks) == n  # the callback went with undo
