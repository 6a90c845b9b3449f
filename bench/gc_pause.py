"""How long Python's garbage collector stops kvroute's event loop, with the approximate index full.

    python -m bench.gc_pause [--requests 1000] [--tokens 8000] [--rounds 5] [--out FILE.json]

``--out`` writes a ``table`` headline (bench/results.py; ``python -m bench.results import FILE --as gc-pause``).

Routes ``--requests`` distinct chats (``--tokens`` prompt tokens each, every one a new document, so
each adds its blocks to the approximate index) through kvroute's servicer in-process, as
``bench.servicer`` drives it (EPP mode, BUFFERED, 4 pods, the defaults of ``kvroute serve``), and
times every collection the interpreter runs meanwhile (``gc.callbacks``). Then, with the index as
the requests left it: the objects the collector tracks, and a full collection's time (median of
``--rounds``) as the process is, and after ``extproc.heap.settle`` froze what existed (what
``kvroute serve`` does once it serves). A collection stops every stream: its time is added to the
decision of each request that waits behind it. Compare figures of one run, or of two commits run
back to back on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.overhead import chat_bodies
from bench.results import table_headline
from bench.servicer import ProcessDriver, kvroute_processor, request_messages
from extproc.heap import settle, time_collections
from extproc.index.approx import ApproxPrefixIndex
from extproc.observability import Metrics


def _full_collection_ms(rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


async def measure(requests: int, tokens: int, rounds: int) -> dict[str, Any]:
    kvroute = kvroute_processor()
    driver = ProcessDriver(kvroute)
    batch = [request_messages(b) for b in chat_bodies(tokens, requests, docs=requests)]
    pauses: dict[int, list[float]] = defaultdict(list)
    walls = []
    gc.collect()
    stop = time_collections(lambda generation, seconds: pauses[generation].append(seconds * 1e3))
    try:
        for messages in batch:
            t0 = time.perf_counter()
            await driver.exchange(messages)
            walls.append((time.perf_counter() - t0) * 1e3)
    finally:
        stop()
    index = kvroute.router.index
    assert isinstance(index, ApproxPrefixIndex)  # kvroute serve's default (no tokenizer)
    out: dict[str, Any] = {
        "requests": requests,
        "tokens": tokens,
        "index_blocks": sum(index.block_counts().values()),
        "request_ms_p50": statistics.median(walls),
        "request_ms_max": max(walls),
        "requests_over_10ms": sum(w > 10 for w in walls),
        "collections": {str(g): {"n": len(v), "max_ms": max(v), "total_ms": sum(v)} for g, v in sorted(pauses.items())},
    }
    gc.collect()
    out["tracked_objects"] = len(gc.get_objects())
    out["full_collection_ms"] = _full_collection_ms(rounds)
    undo = settle(Metrics())
    try:
        out["frozen_objects"] = gc.get_freeze_count()
        out["full_collection_frozen_ms"] = _full_collection_ms(rounds)
    finally:
        undo()
    return out


def render(r: dict[str, Any]) -> str:
    lines = [
        f"{r['requests']} distinct {r['tokens']}-token chats routed; approximate index {r['index_blocks']} blocks",
        "",
        "| generation | collections while routing | longest ms | total ms |",
        "|---|---|---|---|",
    ]
    for g, c in r["collections"].items():
        lines.append(f"| {g} | {c['n']} | {c['max_ms']:.2f} | {c['total_ms']:.1f} |")
    lines += [
        "",
        f"requests: p50 {r['request_ms_p50']:.3f} ms, slowest {r['request_ms_max']:.2f} ms, "
        f"{r['requests_over_10ms']} over 10 ms",
        f"tracked objects after: {r['tracked_objects']}; a full collection {r['full_collection_ms']:.1f} ms, "
        f"{r['full_collection_frozen_ms']:.2f} ms once settle() froze {r['frozen_objects']} objects",
    ]
    return "\n".join(lines)


COLUMNS = (
    "code", "chats routed", "index blocks", "collections while routing (gen 0 / 1 / 2)", "longest collection ms",
    "request p50 ms", "slowest request ms", "tracked objects after", "full collection ms",
    "full collection ms, startup frozen",
)  # fmt: skip


def row(r: dict[str, Any], code: str) -> list[str]:
    c = r["collections"]
    return [
        code,
        f"{r['requests']} x {r['tokens']} tokens",
        str(r["index_blocks"]),
        " / ".join(str(c.get(g, {}).get("n", 0)) for g in "012"),
        f"{max((v['max_ms'] for v in c.values()), default=0):.2f}",
        f"{r['request_ms_p50']:.3f}",
        f"{r['request_ms_max']:.2f}",
        str(r["tracked_objects"]),
        f"{r['full_collection_ms']:.1f}",
        f"{r['full_collection_frozen_ms']:.2f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gc_pause", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--requests", type=int, default=1000, help="distinct chats routed (each a new document)")
    ap.add_argument("--tokens", type=int, default=8000, help="prompt tokens per chat (about 4 characters each)")
    ap.add_argument("--rounds", type=int, default=5, help="full collections timed, median taken")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = ap.parse_args()
    if a.requests < 1 or a.tokens < 1 or a.rounds < 1:
        ap.error("--requests, --tokens and --rounds must be 1 or more")
    r = asyncio.run(measure(a.requests, a.tokens, a.rounds))
    print(render(r))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        h = table_headline("Garbage collection pauses", "bench.gc_pause", COLUMNS, [row(r, "this")], figures=r)
        a.out.write_text(json.dumps(h, indent=1) + "\n")


if __name__ == "__main__":
    main()
