"""How long one record into a full approximate index stops kvroute's event loop.

    python -m bench.index_churn [--pods 4,64] [--blocks 100] [--fill 3] [--out FILE.json]
    python -m bench.index_churn --ends 500000 [--out FILE.json]

``--out`` writes a ``table`` headline (bench/results.py; ``python -m bench.results import FILE --as
index-churn``, or ``--as index-churn-ends`` for ``--ends``).

A pod's blocks come and go once its part of the index is full: each record of new blocks evicts as
many old ones. A Python dict frees nothing when a key is deleted, it marks the slot, and when an
insert finds no free slot left it rebuilds its whole table at once: the larger the dict, the longer
that record holds the event loop, and every stream's decision waits behind it. This records distinct
prompts of ``--blocks`` new blocks each, every one to a random pod of ``--pods``, into an
``ApproxPrefixIndex`` at ``kvroute serve``'s capacity (31,250 blocks a pod), until ``--fill`` times the
pool's capacity has been written, and times every record: p50, p99, the slowest, how many took over
1 ms and over 10 ms, and the most entries any one of the index's dicts held (what one rebuild copies).
In-process and single-threaded; compare figures of one run, or of two commits run back to back.

``--ends N`` times the index's prompt ends instead (``extproc.index.ends.PromptEnds``, the last block
of each prompt recorded, the newest 100,000: what tells a conversation's next turn from a new one): N
distinct prompts noted one after another, as N requests on new conversations note them, and per
``WINDOW`` of them the mean microseconds a note took and the slowest. Its cost must not grow with
how long kvroute has run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.loadgen import percentile
from bench.results import table_headline
from extproc.index.approx import ApproxPrefixIndex
from extproc.index.ends import PromptEnds

WINDOW = 50_000  # notes per row of --ends


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
    return {
        "pods": pods,
        "blocks_per_record": blocks,
        "records": len(times),
        "index_blocks": sum(index.block_counts().values()),
        "record_ms_p50": percentile(times, 0.5),
        "record_ms_p99": percentile(times, 0.99),
        "record_ms_max": max(times),
        "records_over_1ms": sum(t > 1 for t in times),
        "records_over_10ms": sum(t > 10 for t in times),
        "largest_dict": max(index.table_sizes()),
    }


def measure_ends(notes: int, window: int = WINDOW, seed: int = 0) -> list[dict[str, Any]]:
    """``notes`` distinct prompt ends noted into a default ``PromptEnds``, timed per ``window``."""
    ends = PromptEnds()
    rng = random.Random(seed)
    rows = []
    for start in range(0, notes, window):
        keys = [[rng.getrandbits(64)] for _ in range(min(window, notes - start))]
        times = []
        for k in keys:
            t0 = time.perf_counter()
            ends.note(k)
            times.append(time.perf_counter() - t0)
        rows.append({"notes": start + len(keys), "held": len(ends), "note_us_mean": 1e6 * statistics.fmean(times),
                     "note_ms_max": 1e3 * max(times)})  # fmt: skip
    return rows


ENDS_COLUMNS = ("code", "prompts noted", "ends held", "us per note (mean of the last 50,000)", "slowest note ms")


def ends_row(r: dict[str, Any], code: str) -> list[str]:
    return [code, str(r["notes"]), str(r["held"]), f"{r['note_us_mean']:.2f}", f"{r['note_ms_max']:.2f}"]


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
    ap.add_argument("--ends", type=int, metavar="N", help="time N notes into the prompt ends instead (see above)")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = ap.parse_args()
    if a.ends is not None:
        if a.ends < 1:
            ap.error("--ends must be 1 or more")
        windows = measure_ends(a.ends)
        for r in windows:
            print(f"{r['notes']} prompts noted, {r['held']} held: {r['note_us_mean']:.2f} us a note, slowest "
                  f"{r['note_ms_max']:.2f} ms")  # fmt: skip
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            h = table_headline("Prompt ends over a long run", "bench.index_churn", ENDS_COLUMNS,
                               [ends_row(r, "this") for r in windows], figures=windows)  # fmt: skip
            a.out.write_text(json.dumps(h, indent=1) + "\n")
        return
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
