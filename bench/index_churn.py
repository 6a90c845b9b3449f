"""How long one record into a full approximate index stops kvroute's event loop.

    python -m bench.index_churn [--pods 4,64] [--blocks 100] [--fill 3] [--out FILE.json]

``--out`` writes a ``table`` headline (bench/results.py; ``python -m bench.results import FILE --as
index-churn``).

A pod's blocks come and go once its part of the index is full: each record of new blocks evicts as
many old ones. A Python dict frees nothing when a key is deleted, it marks the slot, and when an
insert finds no free slot left it rebuilds its whole table at once: the larger the dict, the longer
that record holds the event loop, and every stream's decision waits behind it. This records distinct
prompts of ``--blocks`` new blocks each, every one to a random pod of ``--pods``, into an
``ApproxPrefixIndex`` at ``kvroute serve``'s capacity (31,250 blocks a pod), until ``--fill`` times the
pool's capacity has been written, and times every record: p50, p99, the slowest, how many took over
1 ms and over 10 ms, and the most entries any one of the index's dicts held (what one rebuild copies).
In-process and single-threaded; compare figures of one run, or of two commits run back to back.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.results import table_headline
from extproc.index.approx import ApproxPrefixIndex


def measure(pods: int, blocks: int, fill: float, seed: int = 0) -> dict[str, Any]:
    index = ApproxPrefixIndex()
    rng = random.Random(seed)
    names = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(pods)]
    total = int(fill * pods * index.capacity_blocks)
    times: list[float] = []
    for _ in range(0, total, blocks):
        keys = [rng.getrandbits(64) for _ in range(blocks)]
        pod = names[rng.randrange(pods)]
        t0 = time.perf_counter()
        index.record(keys, pod)
        times.append((time.perf_counter() - t0) * 1e3)
    ordered = sorted(times)
    return {
        "pods": pods,
        "blocks_per_record": blocks,
        "records": len(times),
        "index_blocks": sum(index.block_counts().values()),
        "record_ms_p50": statistics.median(times),
        "record_ms_p99": ordered[int(0.99 * (len(ordered) - 1))],
        "record_ms_max": ordered[-1],
        "records_over_1ms": sum(t > 1 for t in times),
        "records_over_10ms": sum(t > 10 for t in times),
        "largest_dict": max(index.table_sizes()),
    }


COLUMNS = (
    "code", "pods", "records", "index blocks", "record p50 ms", "record p99 ms", "slowest record ms",
    "records over 1 ms", "records over 10 ms", "largest dict entries",
)  # fmt: skip


def row(r: dict[str, Any], code: str) -> list[str]:
    return [
        code,
        str(r["pods"]),
        f"{r['records']} x {r['blocks_per_record']} blocks",
        str(r["index_blocks"]),
        f"{r['record_ms_p50']:.3f}",
        f"{r['record_ms_p99']:.3f}",
        f"{r['record_ms_max']:.2f}",
        str(r["records_over_1ms"]),
        str(r["records_over_10ms"]),
        str(r["largest_dict"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.index_churn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pods", default="4,64", help="pool sizes, comma-separated (each its own index)")
    ap.add_argument("--blocks", type=int, default=100, help="new blocks per record (a 6k-token prompt: ~100)")
    ap.add_argument("--fill", type=float, default=3.0, help="blocks written, as a multiple of the pool's capacity")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = ap.parse_args()
    try:
        sizes = [int(p) for p in a.pods.split(",")]
    except ValueError:
        ap.error(f"--pods {a.pods!r}: comma-separated whole numbers")
    if any(p < 1 for p in sizes) or a.blocks < 1 or a.fill <= 0:
        ap.error("--pods and --blocks must be 1 or more, --fill above 0")
    runs = []
    for pods in sizes:
        r = measure(pods, a.blocks, a.fill)
        runs.append(r)
        print(f"{pods} pods: {r['records']} records of {a.blocks} blocks, p50 {r['record_ms_p50']:.3f} ms, "
              f"p99 {r['record_ms_p99']:.3f}, slowest {r['record_ms_max']:.2f} ms; {r['records_over_1ms']} over "
              f"1 ms, {r['records_over_10ms']} over 10 ms; largest dict {r['largest_dict']} entries")  # fmt: skip
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        rows = [row(r, "this") for r in runs]
        h = table_headline("Approximate index rebuilds", "bench.index_churn", COLUMNS, rows, figures=runs)
        a.out.write_text(json.dumps(h, indent=1) + "\n")


if __name__ == "__main__":
    main()
