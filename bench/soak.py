"""Soak: a steady, moderate rate through real Envoy + kvroute for a long time, with pod churn.

``make soak`` (30 minutes) and ``make soak-ci`` (2 minutes, in CI). The simulated vLLM fleet
(bench/sim, KV events on) runs a few more pods than are in service; kvroute follows an endpoints
file (``discovery.provider: file``) that this script rewrites every ``--churn-s`` seconds: a
ready pod is drained, then removed, and a spare one added under a new UID (a restart, as
Kubernetes would show it), so kvroute keeps scraping, subscribing and purging pods all along.

Targets (exit 1 when one is missed):
- RSS growth of the kvroute process below 5 %, from just after the warm-up to the end;
- open file descriptors flat: at the end no more than ``--fd-slack`` above just after the warm-up;
- no errors: every request answered 200, and no internal error counted by kvroute.

RSS and descriptors are read from /proc/<pid> every ``--sample-s``. Why a warm-up: until the
prefix index, the route table, the tokenizer and the allocator's arenas are at their working
size, RSS grows without a leak (the precise index's numpy tables touch their pages as they fill).
The tables are made small here (``--index-blocks``) so they are full within the warm-up; after
it, growth is a leak. Each end of the comparison is the median of
the samples in its first and last fifth of the measured window, so one sample taken mid-burst or
mid-garbage-collection does not decide it; the slope (least squares over the measured window, MiB/min)
is reported beside it.

``--memtrace DIR`` (debug) runs kvroute under bench/memtrace.py: kvroute dumps at the end of the
warm-up, every ``--memtrace-every`` seconds and at the end, and the report ends with what grew between
the first and last dump: by allocation site (tracemalloc, started at the first dump), or with
``--memtrace-frames 0`` (no tracing) in CPython's and glibc's allocators and by kind of mapping.
How the churn's RSS creep was found: CPython's 32- and 48-byte pools grew with every KV-event
catch-up, which held a pod's whole replay buffer decoded at once (fixed in extproc/endpoints/events.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.memtrace import diff as memtrace_diff
from bench.procs import python_module, start_with_ready_file, stop

MODEL = "m"


@dataclass
class Sample:
    t: float
    rss_kib: int
    fds: int


@dataclass
class Report:
    minutes: float
    rate: float
    requests: int = 0
    errors: int = 0
    error_examples: list[str] = field(default_factory=list)
    internal_errors: float = 0.0
    churn_events: int = 0
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    rss_growth: float = 0.0
    rss_slope_mib_min: float = 0.0
    fds_start: float = 0.0
    fds_end: float = 0.0
    fds_max: int = 0
    failures: list[str] = field(default_factory=list)
    memtrace: str = ""  # --memtrace: what grew between the first and last dump


def proc_sample(pid: int, t: float) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M)[1])  # type: ignore[index]
    return Sample(t, rss, len(list(Path(f"/proc/{pid}/fd").iterdir())))


class Churn:
    """The endpoints file: which simulated pods are in service, drained or out. One step at a time:
    drain the longest-serving ready pod, remove the drained one, add a spare one under a new UID."""

    def __init__(self, path: Path, pods: list[dict[str, Any]], serving: int) -> None:
        self.path = path
        self.pods = {p["address"]: p for p in pods}
        self.ready = [p["address"] for p in pods[:serving]]
        self.draining: list[str] = []
        self.spare = [p["address"] for p in pods[serving:]]
        self.uids = itertools.count()
        self.uid = {a: f"uid-{next(self.uids)}" for a in self.pods}
        self.steps = 0
        self.write()

    def write(self) -> None:
        def entry(a: str, ready: bool) -> dict[str, Any]:
            p = self.pods[a]
            return {
                "address": a,
                "ready": ready,
                "uid": self.uid[a],
                "kv_events": p["kv_events_endpoint"],
                "kv_replay": p["replay_endpoint"],
            }

        eps = [entry(a, True) for a in self.ready] + [entry(a, False) for a in self.draining]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"pools": {"default": {"endpoints": eps}}}))
        tmp.replace(self.path)  # atomic, as a ConfigMap update is

    def step(self) -> None:
        k = self.steps % 3
        if k == 0 and len(self.ready) > 2:
            self.draining.append(self.ready.pop(0))
        elif k == 1 and self.draining:
            self.spare.append(self.draining.pop(0))
        elif k == 2 and self.spare:
            a = self.spare.pop(0)
            self.uid[a] = f"uid-{next(self.uids)}"  # back as a new pod: kvroute purges what it knew
            self.ready.append(a)
        self.steps += 1
        self.write()


def prompt(rng: random.Random, i: int) -> list[dict[str, str]]:
    """Shared documents (affinity, hits) and fresh ones (new index entries), ~2 KB each."""
    doc = f"document {rng.randrange(12)}" if i % 3 else f"fresh {i}"
    return [
        {"role": "system", "content": f"{doc}: " + "lorem ipsum dolor sit amet " * 70},
        {"role": "user", "content": f"question {rng.randrange(5)}"},
    ]


async def load(url: str, rate: float, until: float, rep: Report) -> None:
    """Open loop at ``rate`` requests/s (every third streamed) until ``until``."""
    rng = random.Random(24)
    tasks: set[asyncio.Task[None]] = set()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(i: int) -> None:
            body = {"model": MODEL, "messages": prompt(rng, i), "max_tokens": 8, "stream": i % 3 == 0}
            try:
                r = await client.post("/v1/chat/completions", json=body)
                await r.aread()
                ok = r.status_code == 200
                what = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                ok, what = False, repr(e)
            rep.requests += 1
            if not ok:
                rep.errors += 1
                if len(rep.error_examples) < 5:
                    rep.error_examples.append(what)

        t0 = time.monotonic()
        for i in itertools.count():
            due = t0 + i / rate
            if due >= until:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


class MemDumps:
    """Asks kvroute run under bench/memtrace.py for a dump (SIGUSR2) and waits until it is written."""

    def __init__(self, pid: int, directory: Path) -> None:
        self.pid, self.dir = pid, directory
        self.taken: list[str] = []

    async def take(self, timeout: float = 120.0) -> None:
        base = str(self.dir / f"mem-{len(self.taken) + 1}")
        os.kill(self.pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while not Path(base + ".json").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvroute wrote no memory dump {base}.json in {timeout:.0f}s")
            await asyncio.sleep(0.2)
        self.taken.append(base)


def internal_errors(kv: KVRouteProcess) -> float:
    m = re.search(r'^kvroute_errors_total\{kind="internal"\} (\S+)$', kv.metrics(), re.M)
    return float(m[1]) if m else 0.0


async def watch(
    args: argparse.Namespace,
    pid: int,
    churn: Churn,
    t0: float,
    until: float,
    rep: Report,
    samples: list[Sample],
    dumps: MemDumps | None = None,
) -> None:
    from tqdm import tqdm

    next_churn = t0 + args.churn_s
    next_dump = t0 + args.warmup_s
    with tqdm(total=round(until - t0), unit="s", disable=args.quiet, mininterval=2.0) as bar:
        while (now := time.monotonic()) < until:
            if now >= next_churn:
                churn.step()
                rep.churn_events += 1
                next_churn += args.churn_s
            if dumps is not None and now >= next_dump:
                await dumps.take()
                next_dump += args.memtrace_every or float("inf")
            s = proc_sample(pid, now - t0)
            samples.append(s)
            bar.update(round(now - t0) - bar.n)
            bar.set_postfix(
                req=rep.requests, err=rep.errors, rss_mib=s.rss_kib // 1024, fds=s.fds, ready=len(churn.ready)
            )
            await asyncio.sleep(min(args.sample_s, max(0.0, until - time.monotonic())))


def judge(args: argparse.Namespace, rep: Report, samples: list[Sample]) -> None:
    measured = [s for s in samples if s.t >= args.warmup_s]
    if len(measured) < 10:
        rep.failures.append(f"only {len(measured)} samples after the warm-up: run longer")
        return
    fifth = max(2, len(measured) // 5)
    start, end = measured[:fifth], measured[-fifth:]
    rss0 = statistics.median(s.rss_kib for s in start)
    rss1 = statistics.median(s.rss_kib for s in end)
    rep.rss_start_mib, rep.rss_end_mib = rss0 / 1024, rss1 / 1024
    rep.rss_growth = rss1 / rss0 - 1
    rep.rss_slope_mib_min = statistics.linear_regression(
        [s.t / 60 for s in measured], [s.rss_kib / 1024 for s in measured]
    ).slope
    rep.fds_start = statistics.median(s.fds for s in start)
    rep.fds_end = statistics.median(s.fds for s in end)
    rep.fds_max = max(s.fds for s in measured)
    if rep.rss_growth >= args.max_rss_growth:
        rep.failures.append(f"RSS grew {rep.rss_growth:.1%} (limit {args.max_rss_growth:.0%})")
    if rep.fds_end > rep.fds_start + args.fd_slack:
        rep.failures.append(f"open fds went from {rep.fds_start:.0f} to {rep.fds_end:.0f} (slack {args.fd_slack})")
    if rep.errors:
        rep.failures.append(f"{rep.errors} of {rep.requests} requests failed: {rep.error_examples}")
    if rep.internal_errors:
        rep.failures.append(f"kvroute counted {rep.internal_errors:.0f} internal error(s)")
    if rep.requests < 0.9 * args.rate * args.minutes * 60:
        rep.failures.append(f"only {rep.requests} requests sent: the load generator fell behind")


def run(args: argparse.Namespace) -> Report:
    rep = Report(args.minutes, args.rate)
    samples: list[Sample] = []
    sim_proc, info = start_with_ready_file(
        python_module(
            "bench.sim",
            "--pods",
            str(args.pods),
            "--base-port",
            "0",
            "--zmq-base-port",
            "0",
            "--profile",
            "fast",
            "--model",
            MODEL,
            "--quiet",
        )
    )
    try:
        pods = info["pods"]  # type: ignore[index]
        with tempfile.TemporaryDirectory(prefix="kvroute-soak-") as tmp:
            churn = Churn(Path(tmp) / "endpoints.yaml", pods, serving=args.pods - 2)
            cfg = Path(tmp) / "kvroute.yaml"
            cfg.write_text(
                yaml.safe_dump(
                    {
                        "discovery": {"provider": "file", "file": {"path": str(churn.path), "poll_interval_s": 0.2}},
                        "kv_events": {"enabled": True, "capacity_blocks": max(1024, args.index_blocks)},
                        "scrape": {"enabled": True},
                        "routing": {"index_capacity_blocks": args.index_blocks, "route_table_size": args.index_blocks},
                    }
                )
            )
            trace_dir = Path(args.memtrace).resolve() if args.memtrace else None
            launcher = []
            if trace_dir is not None:
                launcher = ["-m", "bench.memtrace", "--dump-dir", str(trace_dir), "--frames", str(args.memtrace_frames)]
            with (
                KVRouteProcess(config=str(cfg), launcher=launcher, h2=args.h2) as kv,
                EnvoyProcess("epp.yaml", kvroute_port=kv.ext_proc_port, pods=[p["address"] for p in pods]) as env,
            ):
                assert kv.proc is not None
                pid = kv.proc.pid
                t0 = time.monotonic()
                until = t0 + args.minutes * 60
                dumps = MemDumps(pid, trace_dir) if trace_dir is not None else None

                async def both() -> None:
                    await asyncio.gather(
                        load(env.url, args.rate, until, rep), watch(args, pid, churn, t0, until, rep, samples, dumps)
                    )
                    if dumps is not None:
                        await dumps.take()

                asyncio.run(both())
                rep.internal_errors = internal_errors(kv)
                if dumps is not None and len(dumps.taken) >= 2:
                    rep.memtrace = memtrace_diff(dumps.taken[0], dumps.taken[-1])
    finally:
        stop(sim_proc)
    judge(args, rep, samples)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"report": asdict(rep), "samples": [asdict(s) for s in samples]}))
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (open loop)")
    p.add_argument("--pods", type=int, default=6, help="simulated pods; two of them are out of service at a time")
    p.add_argument("--churn-s", type=float, default=5.0, help="seconds between pod changes")
    p.add_argument("--warmup-s", type=float, default=300.0, help="excluded from the RSS and descriptor comparison")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument(
        "--index-blocks",
        type=int,
        default=1024,
        help="kvroute's index, route table and precise index sizes (numpy tables: pages are touched as "
        "they fill, so a large table grows RSS for a long time without a leak)",
    )
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--fd-slack", type=int, default=8, help="descriptors above the start allowed at the end")
    p.add_argument("--h2", action="store_true",
                   help="Envoy's ext_proc stream on kvroute's own HTTP/2 server (server.h2_port), as deploy/ "
                   "runs kvroute")  # fmt: skip
    p.add_argument("--out", help="write the report and every sample here (JSON)")
    p.add_argument("--memtrace", help="debug: run kvroute under tracemalloc, dumps in this directory")
    p.add_argument("--memtrace-every", type=float, default=0.0, help="seconds between dumps after the warm-up")
    p.add_argument("--memtrace-frames", type=int, default=8, help="0: no tracemalloc (RSS, allocators, objects only)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.warmup_s >= args.minutes * 60:
        p.error("--warmup-s must be shorter than the run")
    rep = run(args)
    print(
        f"soak: {rep.minutes:g} min at {rep.rate:g} req/s, {rep.churn_events} pod changes: {rep.requests} requests, "
        f"{rep.errors} errors, {rep.internal_errors:.0f} internal errors"
    )
    print(
        f"kvroute RSS after the warm-up {rep.rss_start_mib:.1f} MiB, at the end {rep.rss_end_mib:.1f} MiB "
        f"({rep.rss_growth:+.1%}, slope {rep.rss_slope_mib_min:+.3f} MiB/min)"
    )
    print(f"open fds {rep.fds_start:.0f} -> {rep.fds_end:.0f} (max {rep.fds_max})")
    if rep.memtrace:
        print(rep.memtrace)
    for f in rep.failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
