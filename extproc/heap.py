"""The serving process's heap as Python's cyclic garbage collector sees it.

A collection stops the event loop while it walks the objects it tracks: every stream's decision
waits. A full (generation 2) collection walks them all, and after startup that is the ~70k
objects of the imported modules, gRPC, pydantic and the config (64 ms on this project's 2-core host,
``python -m bench.gc_pause``), for objects that live as long as the process. ``settle`` freezes them once kvroute serves
(``gc.freeze``: later collections skip them) and times every collection into
``kvroute_gc_pause_seconds{generation}``, so a stall shows on /metrics instead of only in a p99.
A frozen object still goes when its last reference does (a reload's replaced config); only a cycle
among frozen objects would stay.
Per-block index state must not add tracked objects either (extproc/index/approx.py keeps its
holders as int bitmasks for that reason).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from extproc.observability import Metrics


def time_collections(observe: Callable[[int, float], None]) -> Callable[[], None]:
    """``observe(generation, seconds)`` after each collection from now on; returns the undo."""
    started = [0.0]

    def on_collect(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            observe(info["generation"], time.perf_counter() - started[0])

    gc.callbacks.append(on_collect)

    def undo() -> None:
        if on_collect in gc.callbacks:
            gc.callbacks.remove(on_collect)

    return undo


def settle(metrics: Metrics) -> Callable[[], None]:
    """Freeze what exists now and time each later collection into ``metrics``; returns the undo
    (callback removed, objects unfrozen), for a process that serves again or a test."""
    gc.collect()  # what startup left as garbage goes now, not frozen for the process's life
    gc.freeze()
    children = {g: metrics.gc_pause_seconds.labels(str(g)) for g in range(3)}
    stop = time_collections(lambda generation, seconds: children[generation].observe(seconds))

    def undo() -> None:
        stop()
        gc.unfreeze()

    return undo
