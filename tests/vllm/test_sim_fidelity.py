"""bench.sim against real vLLM: the same requests give the same cache behaviour, and the
``cpu-tiny`` latency profile reproduces the real pods' hit/miss TTFT ratio (within 15 %)."""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest

from bench.harness import wait_quiet
from bench.procs import python_module, start_with_ready_file, stop
from bench.sim.tokenizer import HFTokenizer
from extproc.index.precise import PreciseIndex
from tests.vllm.conftest import KV
from tests.vllm.harness import (
    Messages,
    Outcome,
    chat,
    cpu_snapshot,
    foreign_cores,
    reset_prefix_cache,
    save_result,
    send_chat,
    timed_pairs,
)
from tests.vllm.pods import MODEL_NAME, VLLMPod
from tests.vllm.recorder import RecordingSink, subscriber_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

# The sim's hit/miss TTFT ratio must be within 15 % of the real pods' at the median prompt length of
# the three, and within 35 % at every length: the real pods' miss latency at ~1.7k tokens moved
# between 126, 134 and 171 ms over three quiet runs of this test on the same box (medians of 7
# pairs each), so one length may swing by more than 15 % without the calibration being wrong.
RATIO_TOLERANCE = 0.15
RATIO_TOLERANCE_ANY = 0.35
TTFT_WORDS = (100, 400, 800)  # ~220, ~870, ~1740 prompt tokens
# Latency ratios are only meaningful without foreign load on the 2 cores (CI runs alone; a shared
# developer box may not be quiet): wait for it, else skip rather than compare noise.
QUIET_MAX_CORES = 0.45  # includes our own uncharged CPU (loopback softirq): 0.12-0.26 in a quiet run
QUIET_BUDGET_S = 120.0  # all waiting for quiet, all lengths together (the stage must stay short)


@dataclass
class Engine:
    """A real or simulated pod with its own event log."""

    url: str
    endpoint: str
    index: PreciseIndex
    sink: RecordingSink
    pid: int | None = None  # the simulator's process

    async def send(self, client: httpx.AsyncClient, tok: HFTokenizer, msgs: Messages) -> Outcome:
        return await send_chat(client, self.url, tok, self.endpoint, msgs, index=self.index, sink=self.sink)


@asynccontextmanager
async def sim_pod(model_dir: str, capacity_blocks: int, time_scale: float = 1.0) -> AsyncIterator[Engine]:
    """One simulated pod configured like the real ones (``python -m bench.sim`` in its own process,
    as the real pod has its own), with a subscriber on its KV events."""
    args = python_module(
        "bench.sim",
        *("--pods", "1", "--profile", "cpu-tiny", "--block-size", "32", "--capacity-blocks", str(capacity_blocks)),
        *("--model", MODEL_NAME, "--tokenizer", model_dir, "--base-port", "0", "--zmq-base-port", "0"),
        *("--time-scale", str(time_scale), "--quiet"),
    )
    proc, ready = await asyncio.to_thread(start_with_ready_file, args)
    try:
        assert isinstance(ready, dict)
        pod = ready["pods"][0]
        sink = RecordingSink(PreciseIndex(capacity_blocks=1 << 14))
        sub = subscriber_for(pod["address"], pod["kv_events_endpoint"], pod["replay_endpoint"], sink)
        await sub.start()
        await asyncio.sleep(0.3)  # ZMQ subscription propagation
        try:
            yield Engine(pod["url"], pod["address"], sink.index, sink, proc.pid)
        finally:
            await sub.aclose()
    finally:
        stop(proc)


def sequence() -> list[Messages]:
    """Cold documents, follow-ups, repeats, then enough new documents to force evictions, and revisits."""
    docs = [chat(700 + i, 300) for i in range(9)]
    follow = [chat(700 + i, 300, f"question {i}") for i in range(3)]
    return [docs[0], follow[0], docs[1], follow[1], docs[0], *docs[2:], follow[0], docs[1], follow[2], docs[8], docs[3]]


async def test_sim_cache_matches_vllm(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient, model_dir: str
) -> None:
    real_pod = pods[1]
    await reset_prefix_cache(aclient, real_pod.url, kv.sink, real_pod.address)
    real = Engine(real_pod.url, real_pod.address, kv.index, kv.sink)
    rows = []
    async with sim_pod(model_dir, real_pod.kv_cache_blocks - 1) as sim:  # vLLM keeps one null block
        for i, msgs in enumerate(sequence()):
            marks = [e.sink.log(e.endpoint).mark() for e in (real, sim)]
            r = await real.send(aclient, tok, msgs)
            s = await sim.send(aclient, tok, msgs)
            runs = []
            for e, (st, rm) in zip((real, sim), marks, strict=True):
                log = e.sink.log(e.endpoint)
                runs.append((log.stored[st:], sorted(log.removed[rm:])))
            rows.append(
                {
                    "step": i,
                    "prompt_tokens": r.prompt_tokens,
                    "real_cached": r.cached_tokens,
                    "sim_cached": s.cached_tokens,
                    "real_predicted": r.predicted_tokens,
                    "sim_predicted": s.predicted_tokens,
                    "stored_equal": runs[0][0] == runs[1][0],
                    "removed_equal": runs[0][1] == runs[1][1],
                    "real_stored": len(runs[0][0]),
                    "sim_stored": len(runs[1][0]),
                    "real_removed": len(runs[0][1]),
                    "sim_removed": len(runs[1][1]),
                }
            )
    save_result("cache_sequence", rows)
    for row in rows:
        assert row["real_predicted"] == row["real_cached"] and row["sim_predicted"] == row["sim_cached"], row
        assert row["real_cached"] == row["sim_cached"], row
        assert row["stored_equal"] and row["removed_equal"], row
    assert any(row["real_removed"] for row in rows), "the sequence never evicted"


async def test_sim_ttft_ratio_matches_vllm(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient, model_dir: str
) -> None:
    real_pod = pods[1]
    await reset_prefix_cache(aclient, real_pod.url, kv.sink, real_pod.address)
    rows = []
    async with sim_pod(model_dir, real_pod.kv_cache_blocks - 1) as sim:
        pgids = [p.pgid for p in pods if p.pgid is not None]
        pids = [os.getpid(), sim.pid or 0]
        deadline, foreign = time.monotonic() + QUIET_BUDGET_S, 0.0
        for n, words in enumerate(TTFT_WORDS):
            msgs = chat(800 + n, words)
            for attempt in itertools.count():
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.skip(f"host busy for {QUIET_BUDGET_S:.0f} s (last: {foreign:.2f} cores of other work)")
                busy = await asyncio.to_thread(wait_quiet, left, QUIET_MAX_CORES, True)
                before = cpu_snapshot(pgids, pids)
                (real_miss, real_hit), (sim_miss, sim_hit) = await timed_pairs(
                    aclient, [real_pod.url, sim.url], tok, [{**m, "content": f"{attempt} {m['content']}"} for m in msgs]
                )
                foreign = foreign_cores(before, cpu_snapshot(pgids, pids))
                if busy < QUIET_MAX_CORES and foreign < QUIET_MAX_CORES:
                    break
            rows.append(
                {
                    "prompt_tokens": len(tok.render_chat([dict(m) for m in msgs], None)),
                    "foreign_cores": round(foreign, 2),
                    "real_miss_ms": round(real_miss * 1e3, 1),
                    "real_hit_ms": round(real_hit * 1e3, 1),
                    "sim_miss_ms": round(sim_miss * 1e3, 1),
                    "sim_hit_ms": round(sim_hit * 1e3, 1),
                    "real_ratio": round(real_hit / real_miss, 3),
                    "sim_ratio": round(sim_hit / sim_miss, 3),
                }
            )
    save_result("ttft", rows)
    errors = [abs(r["sim_ratio"] - r["real_ratio"]) / r["real_ratio"] for r in rows]
    assert statistics.median(errors) <= RATIO_TOLERANCE, rows
    assert max(errors) <= RATIO_TOLERANCE_ANY, rows
