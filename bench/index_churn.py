"""How long one record into a full approximate index stops kvroute's event loop.

    python -m bench.index_churn [--pods 4,64] [--blocks 100] [--fill 3] [--out FILE.json]
    python -m bench.index_churn --ends 500000 [--out FILE.json]
    python -m bench.index_churn --lru [--fill 3] [--out FILE.json]

``--out`` writes a ``table`` headline (bench/results.py; ``python -m bench.results import FILE --as
index-churn``, or ``--as index-churn-ends`` for ``--ends``, ``--as index-churn-lru`` for ``--lru``).

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

``--lru`` times kvroute's two large least-recently-used tables the same way, each beside the single
OrderedDict it was before (the same ``ShardedLRU`` in one part, in the same run): the route-id pins
(``LocalRouteTable``, ``routing.route_table_size`` 100,000) and precise mode's chunk cache
(``ModelTokenizer``'s, 256 MiB of ~1 KB texts and their ids, ~128,000 chunks), each written with ``--fill``
times its capacity of new entries (a lookup that misses, then the entry put, as a new conversation or a
new document brings them), with the collector off (kvroute freezes both with its startup heap: no
collection walks them).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.loadgen import percentile
from bench.results import table_headline
from extproc.index.approx import ApproxPrefixIndex
from extproc.index.ends import PromptEnds
from extproc.lru import ShardedLRU
from extproc.tokenize import CACHE_BYTES, CACHE_PART_BYTES, _held

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


def _timed(table: ShardedLRU[Any, Any], entries: Iterable[tuple[Any, Any]]) -> list[float]:
    times = []
    for k, v in entries:
        t0 = time.perf_counter()
        if table.get(k) is None:
            table.put(k, v)
        times.append(time.perf_counter() - t0)
    return times


def measure_lru(
    fill: float, seed: int = 0, pins_n: int = 100_000, cache_bytes: int = CACHE_BYTES
) -> list[dict[str, Any]]:
    """The pins and the chunk cache, each as kvroute builds it and as one OrderedDict, ``fill`` x filled
    (``pins_n`` and ``cache_bytes``: kvroute's bounds)."""
    rng = random.Random(seed)
    text = "".join(rng.choice("abcdefgh ") for _ in range(1 << 16))
    per_chunk = _held(text[:1024], array("I", range(256)))  # a 1 KB chunk and its ~256 ids
    chunks_n = cache_bytes // per_chunk

    def pins() -> Iterator[tuple[int, str]]:
        return ((rng.getrandbits(64), "10.0.0.1:8000") for _ in range(int(fill * pins_n)))

    def chunks() -> Iterator[tuple[str, array[int]]]:
        for i in range(int(fill * chunks_n)):
            at = rng.randrange(len(text) - 1024)
            yield f"{i} {text[at : at + 1016]}", array("I", range(256))

    rows = []
    # Each as kvroute builds it (LocalRouteTable's, ModelTokenizer's) and in one part: one OrderedDict, as it was.
    for name, entries, cap, tables in (
        ("route pins", pins, pins_n, (("ShardedLRU", lambda: ShardedLRU(pins_n)),
                                      ("OrderedDict", lambda: ShardedLRU(pins_n, min_part=pins_n)))),
        ("chunk cache", chunks, chunks_n, (("ShardedLRU", lambda: ShardedLRU(cache_bytes, _held, CACHE_PART_BYTES)),
                                           ("OrderedDict", lambda: ShardedLRU(cache_bytes, _held, cache_bytes)))),
    ):  # fmt: skip
        for kind, make in tables:
            table: ShardedLRU[Any, Any] = make()
            # The collector off: kvroute builds both tables at startup and ``serve`` freezes that heap
            # (extproc/heap.py), so no collection walks them; here one would, and its pause is not theirs.
            gc.disable()
            try:
                times = _timed(table, entries())
            finally:
                gc.enable()
            rows.append({"table": name, "kind": kind, "capacity": cap, "held": len(table), "ops": len(times),
                         "op_us_p50": 1e6 * statistics.median(times), "op_ms_max": 1e3 * max(times),
                         "ops_over_1ms": sum(t > 1e-3 for t in times)})  # fmt: skip
            del table
    return rows


LRU_COLUMNS = ("table", "kept as", "entries held", "new entries", "us per entry p50", "slowest ms", "over 1 ms")


def lru_row(r: dict[str, Any]) -> list[str]:
    return [r["table"], r["kind"], f"{r['held']:,}", f"{r['ops']:,}", f"{r['op_us_p50']:.2f}",
            f"{r['op_ms_max']:.2f}", str(r["ops_over_1ms"])]  # fmt: skip


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


def _write(out: Path, title: str, columns: tuple[str, ...], rows: list[list[str]], figures: Any) -> None:
    """``--out``: the figures as a ``table`` headline (bench/results.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    h = table_headline(title, "bench.index_churn", columns, rows, figures=figures)
    out.write_text(json.dumps(h, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.index_churn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pods", default="4,64", help="pool sizes, comma-separated (each its own index)")
    ap.add_argument("--blocks", type=int, default=100, help="new blocks per record (a 6k-token prompt: ~100)")
    ap.add_argument("--fill", type=float, default=3.0, help="blocks written, as a multiple of the pool's capacity")
    ap.add_argument("--ends", type=int, metavar="N", help="time N notes into the prompt ends instead (see above)")
    ap.add_argument("--lru", action="store_true", help="time the route pins and the chunk cache instead (see above)")
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = ap.parse_args()
    if a.lru:
        if a.fill <= 0:
            ap.error("--fill must be above 0")
        lru = measure_lru(a.fill)
        for r in lru:
            print(
                f"{r['table']} as {r['kind']} ({r['held']} held): {r['ops']} new entries, p50 "
                f"{r['op_us_p50']:.2f} us, slowest {r['op_ms_max']:.2f} ms, {r['ops_over_1ms']} over 1 ms"
            )
        if a.out:
            _write(a.out, "Large LRU tables under churn", LRU_COLUMNS, [lru_row(r) for r in lru], lru)
        return
    if a.ends is not None:
        if a.ends < 1:
            ap.error("--ends must be 1 or more")
        windows = measure_ends(a.ends)
        for r in windows:
            print(f"{r['notes']} prompts noted, {r['held']} held: {r['note_us_mean']:.2f} us a note, slowest "
                  f"{r['note_ms_max']:.2f} ms")  # fmt: skip
        if a.out:
            _write(a.out, "Prompt ends over a long run", ENDS_COLUMNS, [ends_row(r, "this") for r in windows], windows)
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
        _write(a.out, "Approximate index rebuilds", COLUMNS, [row(r, "this") for r in runs], runs)


if __name__ == "__main__":
    main()
