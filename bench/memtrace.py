"""Where a process's memory goes: run a Python module under tracemalloc and dump on SIGUSR2.

``python -m bench.memtrace --dump-dir D [--frames N] -m extproc.cli serve ...`` runs the module as
``python -m`` would, in this process. The first SIGUSR2 starts tracemalloc (``N`` frames per
allocation; tracing from the start would make imports ten times slower, and what a leak hunt wants
is what was allocated after a warm-up and is still alive). Each SIGUSR2, the first too, writes
``D/mem-<k>.json`` (RSS, the bytes tracemalloc sees, glibc's heap in use and free, live objects by
type, asyncio tasks) and ``D/mem-<k>.tracemalloc`` (the snapshot). Comparing two
dumps (``python -m bench.memtrace diff D/mem-1 D/mem-3``) says whether growth is Python objects (and
allocated where) or native memory below them (the allocator's free lists, a C library).

``bench.soak --memtrace D`` starts kvroute this way and dumps after the warm-up and at the end.
Debug only: tracemalloc slows every allocation and doubles small objects' footprint.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import json
import os
import re
import runpy
import signal
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any


class _MallInfo2(ctypes.Structure):
    _FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


def malloc_info() -> dict[str, int]:
    """glibc's main-arena view (mallinfo2): bytes in use, free inside the heap, mmapped; {} elsewhere."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    mi = fn()
    return {"heap": mi.arena, "in_use": mi.uordblks, "free": mi.fordblks, "mmapped": mi.hblkhd}


def mappings() -> dict[str, int]:
    """Resident KiB by kind of mapping (/proc/self/smaps): the brk heap, glibc's per-thread arenas
    (64 MiB aligned reservations), other anonymous ones (CPython's object arenas, numpy arrays, large
    mallocs, native libraries' own pools), and files (code)."""
    out: dict[str, int] = collections.Counter()
    kind = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            size, name = hi - lo, head[5] if len(head) > 5 else ""
            if name == "[heap]":
                kind = "heap"
            elif name.startswith("["):
                kind = "other"
            elif name:
                kind = "file"
            elif size <= 64 << 20 and (lo % (64 << 20) == 0 or hi % (64 << 20) == 0):
                kind = "anon_arena"  # glibc thread arenas: 64 MiB aligned reservations
            else:
                kind = "anon_other"
        elif head[0] == "Rss:":
            out[kind] += int(head[1])
    return dict(out)


_OBMALLOC = {
    "arenas": "# arenas allocated current",
    "allocated": "# bytes in allocated blocks",
    "available": "# bytes in available blocks",
}


def obmalloc() -> dict[str, Any]:
    """CPython's small-object allocator (sys._debugmallocstats, which writes to fd 2): arenas of
    1 MiB held, bytes in live objects, bytes free inside pools in use (fragmentation), and per size
    class (bytes) its pools, blocks in use and free blocks. Empty while tracemalloc traces (it wraps
    the allocator, and CPython then prints nothing): ``--frames 0`` for these."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    out: dict[str, Any] = {}
    for key, label in _OBMALLOC.items():
        m = re.search(re.escape(label) + r"\s*=\s*([\d,]+)", text)
        if m:
            out[key] = int(m[1].replace(",", ""))
    out["classes"] = {
        int(m[1]): [int(m[2]), int(m[3]), int(m[4])]
        for m in re.finditer(r"^\s*\d+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", text, re.M)
    }
    return out


def rss_kib() -> int:
    m = re.search(r"^VmRSS:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)
    return int(m[1]) if m else 0


def _tasks() -> dict[str, int]:
    """Live asyncio tasks by coroutine name (a signal handler runs on the loop's thread)."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # no running loop
        return {}
    return dict(collections.Counter(t.get_coro().__qualname__ for t in tasks).most_common(20))  # type: ignore[union-attr]


class Dumper:
    def __init__(self, directory: Path, frames: int) -> None:
        self.dir = directory
        self.frames = frames
        self.count = 0

    def dump(self, *_: object) -> None:
        if self.frames and not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        self.count += 1
        base = self.dir / f"mem-{self.count}"
        gc.collect()
        traced, peak = tracemalloc.get_traced_memory()
        types = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        info: dict[str, Any] = {
            "time": time.time(),
            "rss_kib": rss_kib(),
            "traced": traced,
            "traced_peak": peak,
            "malloc": malloc_info(),
            "mappings_kib": mappings(),
            "obmalloc": obmalloc(),
            "objects": dict(types.most_common(60)),
            "tasks": _tasks(),
        }
        if self.frames:
            tracemalloc.take_snapshot().dump(str(base.with_suffix(".tracemalloc")))
        tmp = base.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(base.with_suffix(".json"))  # the JSON last: its presence says the dump is whole


def diff(a: str, b: str, top: int = 25, frames: int = 6) -> str:
    """What grew from dump ``a`` to dump ``b`` (paths without suffix): totals, object counts, and the
    allocation sites (tracebacks) that gained the most bytes (from the first dump: those of what was
    allocated since and is still alive)."""
    ja, jb = (json.loads(Path(p + ".json").read_text()) for p in (a, b))
    minutes = (jb["time"] - ja["time"]) / 60 or 1.0
    mib = 1 / (1 << 20)
    lines = [f"{minutes:.1f} min between the dumps"]
    rss_a, rss_b = ja["rss_kib"] / 1024, jb["rss_kib"] / 1024
    tr_a, tr_b = ja["traced"] * mib, jb["traced"] * mib
    lines.append(
        f"RSS {rss_a:.1f} -> {rss_b:.1f} MiB ({(rss_b - rss_a) / minutes:+.3f} MiB/min); "
        f"traced by tracemalloc {tr_a:.1f} -> {tr_b:.1f} MiB ({(tr_b - tr_a) / minutes:+.3f} MiB/min)"
    )
    if ja["malloc"] and jb["malloc"]:
        m = ", ".join(f"{k} {ja['malloc'][k] * mib:.1f} -> {jb['malloc'][k] * mib:.1f}" for k in ja["malloc"])
        lines.append(f"  glibc malloc (MiB): {m}")
    if "mappings_kib" in ja and "mappings_kib" in jb:
        ma, mb = ja["mappings_kib"], jb["mappings_kib"]
        m = ", ".join(f"{k} {ma.get(k, 0) / 1024:.1f} -> {mb.get(k, 0) / 1024:.1f}" for k in sorted(ma | mb))
        lines.append(f"  resident by mapping (MiB): {m}")
    if "arenas" in ja.get("obmalloc", {}) and "arenas" in jb.get("obmalloc", {}):
        oa, ob = ja["obmalloc"], jb["obmalloc"]
        lines.append(
            f"  CPython obmalloc: arenas {oa['arenas']} -> {ob['arenas']} (MiB), objects "
            f"{oa['allocated'] * mib:.1f} -> {ob['allocated'] * mib:.1f} MiB, free in arenas "
            f"{oa['available'] * mib:.1f} -> {ob['available'] * mib:.1f} MiB"
        )
        ca, cb = oa.get("classes", {}), ob.get("classes", {})
        grew = sorted(cb, key=lambda c: cb[c][0] - ca.get(c, [0, 0, 0])[0], reverse=True)[:6]
        rows = (f"{c} B: pools {ca.get(c, [0] * 3)[0]} -> {cb[c][0]}, in use {ca.get(c, [0] * 3)[1]} -> {cb[c][1]}, "
                f"free {ca.get(c, [0] * 3)[2]} -> {cb[c][2]}" for c in grew)  # fmt: skip
        lines.append("  size classes that gained most pools: " + "; ".join(rows))
    grown = sorted(
        ((n - ja["objects"].get(t, 0), t, n) for t, n in jb["objects"].items() if n != ja["objects"].get(t, 0)),
        reverse=True,
    )
    lines.append("objects (type: change, now): " + ", ".join(f"{t}: {d:+d} ({n})" for d, t, n in grown[:15]))
    lines.append(f"asyncio tasks: {ja['tasks']} -> {jb['tasks']}")
    if not Path(a + ".tracemalloc").exists() or not Path(b + ".tracemalloc").exists():
        return "\n".join(lines)  # --frames 0: counts only
    sa = tracemalloc.Snapshot.load(a + ".tracemalloc")
    sb = tracemalloc.Snapshot.load(b + ".tracemalloc")
    # The dumps' own allocations (tracemalloc's, this module's object census) are not the process's.
    noise = [tracemalloc.Filter(False, f, all_frames=True) for f in (tracemalloc.__file__, __file__)]
    stats = sb.filter_traces(noise).compare_to(sa.filter_traces(noise), "traceback")
    lines.append(f"top {top} allocation sites by bytes gained:")
    for st in stats[:top]:
        lines.append(f"{st.size_diff / 1024:+10.1f} KiB {st.count_diff:+8d} blocks (now {st.size / 1024:.1f} KiB)")
        lines.extend(f"      {frame}" for frame in st.traceback.format(limit=frames, most_recent_first=True))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "diff":
        p = argparse.ArgumentParser(prog="bench.memtrace diff")
        p.add_argument("a")
        p.add_argument("b")
        p.add_argument("--top", type=int, default=25)
        p.add_argument("--frames", type=int, default=6)
        d = p.parse_args(argv[1:])
        print(diff(d.a, d.b, d.top, d.frames))
        return
    p = argparse.ArgumentParser(prog="bench.memtrace", description=__doc__.split("\n\n")[0])
    p.add_argument("--dump-dir", required=True, type=Path)
    p.add_argument("--frames", type=int, default=8, help="frames kept per allocation (0: no tracemalloc)")
    p.add_argument("-m", dest="module", required=True, help="the module to run; what follows it is its own")
    cut = argv.index("-m") + 2 if "-m" in argv else len(argv)  # the module's flags are not parsed here
    args, rest = p.parse_args(argv[:cut]), argv[cut:]
    args.dump_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGUSR2, Dumper(args.dump_dir, args.frames).dump)
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
