"""``python -m bench.faults``: kvroute and its pods failing under load, through real Envoy.

Each scenario starts simulated vLLM pods (bench/sim, one process per pod so one can be killed -9,
KV events on), kvroute and Envoy (``envoy/epp.yaml``: override_host on kvroute's ranked list,
retries of requests that never reached a pod), runs an open-loop load at ``--rate`` and injects one
fault. What each measures (kvroute's own metrics are polled every 10 ms; times are from the fault):

- ``kvroute-kill``: kvroute killed -9, restarted ``--down-s`` later. Failed client requests (target 0:
  Envoy fails open), and ``routed_s``: from the restart (process spawned) to kvroute's first decision
  (target <= 2 s; ``ready_s`` is until its health check says SERVING, ``prefix_s`` until its first
  decision on a prefix hit, i.e. its index is back from the pods' KV-event replay).
- ``pod-kill``: one pod killed -9. Failed requests against kvroute's in-flight count on it at the
  kill; ``last_decision_s`` (no decision names it after that, target <= 1 s); ``down_s`` (kvroute's
  scraper saw it refuse and purged its entries); Envoy's retries onto kvroute's fallbacks.
- ``kv-gap``: one pod's KV-event publisher restarts, loses batches (a sequence gap) and its replay
  socket is down: kvroute resyncs that pod (``resync_s``), and the error of its cached-token
  prediction, (reported - predicted) / reported per 1 s window, returns to its level before the fault
  (``recovered_s``).
- ``slow-metrics``: one pod's /metrics hangs (kvroute scrapes a server that never answers): kvroute's
  mean decision time and the clients' latency before and during it (decisions never wait on scrapes).
- ``stuck-streams``: ``--streams`` ext_proc streams opened straight to kvroute that send their
  request headers and never finish, against ``server.max_streams`` and ``server.stream_idle_timeout_s``:
  kvroute's RSS before, at the peak and after, streams refused and closed idle, and a new request
  routed by kvroute afterwards.

Prints progress; writes ``--out`` (default bench/out/faults/faults.json) as a ``table`` headline that
``python -m bench.results import bench/out/faults/faults.json --as faults`` takes as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from bench.results import table_headline
from bench.soak import proc_sample
from bench.vllm_model import build as build_model
from extproc import envoy as pb

MODEL = "m"
BLOCK = 16
ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("kvroute-kill", "pod-kill", "kv-gap", "slow-metrics", "stuck-streams")
DEFAULT_OUT = Path("bench/out/faults/faults.json")
POLL_S = 0.01
# Envoy sends kvroute the responses too, so kvroute reads usage.cached_tokens (predicted vs reported).
READ_RESPONSES = {"response_header_mode": "SEND", "response_body_mode": "STREAMED"}


# --- kvroute's metrics ------------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``; None when there is none."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total, found = total + s.value, True
    return total if found else None


def metric_of(kv: KVRouteProcess, name: str, **labels: str) -> float:
    try:
        return metric(kv.metrics(), name, **labels) or 0.0
    except OSError:  # kvroute down
        return 0.0


async def until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``cond()`` held (polled every POLL_S, off the event loop); TimeoutError naming ``what``."""
    t0 = time.monotonic()
    while not await asyncio.to_thread(cond):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - t0


# --- load -------------------------------------------------------------------------------------------


@dataclass
class Sent:
    t: float  # when it was sent (monotonic)
    latency_s: float
    status: int  # 0: no answer
    pod: str | None  # Envoy's x-kvroute-upstream
    error: str = ""


@dataclass
class Traffic:
    """An open-loop load at ``rate`` requests/s through Envoy: shared documents (prefix hits) and
    fresh ones, every third streamed. ``stream=False`` for all when responses must carry usage."""

    url: str
    rate: float
    seed: int = 24
    streamed: bool = True  # False: no request streamed (kvroute reads usage only from whole bodies)
    sent: list[Sent] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def body(self, rng: random.Random, i: int) -> dict[str, Any]:
        doc = f"document {rng.randrange(16)}" if i % 3 else f"fresh {i}"
        msgs = [{"role": "system", "content": f"{doc}: " + "lorem ipsum dolor sit amet " * 60},
                {"role": "user", "content": f"question {rng.randrange(5)}"}]  # fmt: skip
        return {"model": MODEL, "messages": msgs, "max_tokens": 4, "stream": self.streamed and i % 3 == 0}

    async def run(self) -> None:
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=30, limits=limits) as client:

            async def one(i: int) -> None:
                t = time.monotonic()
                try:
                    r = await client.post("/v1/chat/completions", json=self.body(rng, i))
                    await r.aread()
                    ok = r.status_code == 200
                    s = Sent(t, time.monotonic() - t, r.status_code, r.headers.get("x-kvroute-upstream"),
                             "" if ok else r.text[:200])  # fmt: skip
                except httpx.HTTPError as e:
                    s = Sent(t, time.monotonic() - t, 0, None, repr(e))
                self.sent.append(s)

            t0 = time.monotonic()
            for i in itertools.count():
                await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
                if self._stop.is_set():
                    break
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)

    def stop(self) -> None:
        self._stop.set()

    def failed(self, since: float = 0.0) -> list[Sent]:
        return [s for s in self.sent if s.status != 200 and s.t >= since]

    def progress(self) -> str:
        return f"{len(self.sent)} answered, {len(self.failed())} failed"


@contextlib.asynccontextmanager
async def traffic(url: str, rate: float, streamed: bool = True) -> AsyncIterator[Traffic]:
    t = Traffic(url, rate, streamed=streamed)
    task = asyncio.create_task(t.run())
    try:
        yield t
    finally:
        t.stop()
        await task


# --- the fleet --------------------------------------------------------------------------------------


@dataclass
class Pod:
    proc: Any  # subprocess.Popen
    info: dict[str, Any]

    @property
    def address(self) -> str:
        return str(self.info["address"])

    def fault(self, **fault: Any) -> None:
        httpx.post(self.info["url"] + "/sim/fault", json=fault, timeout=5).raise_for_status()


def tokenizer() -> Path:
    """The tiny model's tokenizer (bench/vllm_model.py), shared by the pods and kvroute: kvroute keys
    prompts as the pods do, so its precise index (KV events) predicts their cached tokens."""
    return build_model(ROOT / ".cache" / "tiny-llama")


@contextlib.contextmanager
def sim_pods(n: int, capacity_blocks: int = 2000) -> Iterator[list[Pod]]:
    """``n`` simulated pods, each its own process (kill -9 takes one pod only)."""
    pods: list[Pod] = []
    try:
        for _ in range(n):
            proc, info = start_with_ready_file(python_module(
                "bench.sim", "--pods", "1", "--base-port", "0", "--zmq-base-port", "0", "--profile", "fast",
                "--model", MODEL, "--capacity-blocks", str(capacity_blocks), "--tokenizer", str(tokenizer()),
                "--block-size", str(BLOCK), "--quiet"))  # fmt: skip
            pods.append(Pod(proc, info["pods"][0]))  # type: ignore[index]
        yield pods
    finally:
        for p in pods:
            stop(p.proc)


def kvroute_config(path: Path, pods: list[Pod], metrics_at: dict[str, str] | None = None, **extra: Any) -> str:
    """kvroute's config for ``pods`` (KV events and scraping on), written to ``path``."""
    eps = [{"address": p.address, "kv_events": p.info["kv_events_endpoint"], "kv_replay": p.info["replay_endpoint"],
            **({"metrics": metrics_at[p.address]} if metrics_at and p.address in metrics_at else {})}
           for p in pods]  # fmt: skip
    cfg: dict[str, dict[str, Any]] = {
        "pools": {"default": {"endpoints": eps}},
        "models": {MODEL: {"pool": "default", "tokenizer": str(tokenizer()), "block_size": BLOCK}},
        "kv_events": {"enabled": True},
        "scrape": {"enabled": True},
    }
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- scenarios --------------------------------------------------------------------------------------

Row = dict[str, Any]


async def kvroute_kill(args: argparse.Namespace, tmp: Path) -> Row:
    with sim_pods(3) as pods, KVRouteProcess(config=kvroute_config(tmp / "kv.yaml", pods)) as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=[p.address for p in pods]) as env:  # fmt: skip
        async with traffic(env.url, args.rate) as load:
            await asyncio.sleep(args.warmup_s)
            say(f"kvroute-kill: warm ({load.progress()}); kill -9 kvroute")
            assert kv.proc is not None
            kv.proc.send_signal(signal.SIGKILL)
            kv.proc.wait()
            await asyncio.sleep(args.down_s)
            t_restart = time.monotonic()
            say(f"kvroute-kill: down {args.down_s:g} s ({load.progress()}); restart")
            ready = asyncio.create_task(asyncio.to_thread(kv.start))
            await until(lambda: metric_of(kv, "kvroute_decisions_total") > 0, 30, "decision")
            routed_s = time.monotonic() - t_restart
            await until(lambda: metric_of(kv, "kvroute_decisions_total", reason="prefix") > 0, 30, "prefix hit")
            prefix_s = time.monotonic() - t_restart
            await ready
            ready_s = time.monotonic() - t_restart  # an upper bound: kv.start polls every 0.1 s
            await asyncio.sleep(args.after_s)
        failed = load.failed()
        say(f"kvroute-kill: {load.progress()}; routed again {routed_s:.2f} s after the restart")
    return {"scenario": "kvroute-kill", "requests": len(load.sent), "failed": len(failed),
            "routed_s": round(routed_s, 3), "prefix_s": round(prefix_s, 3), "ready_s": round(ready_s, 3),
            "examples": [f.error for f in failed[:3]]}  # fmt: skip


async def pod_kill(args: argparse.Namespace, tmp: Path) -> Row:
    with sim_pods(3) as pods, KVRouteProcess(config=kvroute_config(tmp / "kv.yaml", pods)) as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=[p.address for p in pods]) as env:  # fmt: skip
        victim = pods[0]
        async with traffic(env.url, args.rate) as load:
            await asyncio.sleep(args.warmup_s)
            text = await asyncio.to_thread(kv.metrics)
            inflight = metric(text, "kvroute_inflight_requests", endpoint=victim.address) or 0.0
            say(f"pod-kill: warm ({load.progress()}); kill -9 {victim.address} ({inflight:.0f} in flight there)")
            t_kill = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            last_change, seen = t_kill, metric(text, "kvroute_decisions_total", endpoint=victim.address)
            down_s: float | None = None
            while time.monotonic() - t_kill < args.after_s:
                text = await asyncio.to_thread(kv.metrics)
                now = metric(text, "kvroute_decisions_total", endpoint=victim.address)
                if now != seen:
                    seen, last_change = now, time.monotonic()
                if down_s is None and (metric(text, "kvroute_scrape", stat="downs") or 0) >= 1:
                    down_s = time.monotonic() - t_kill
                await asyncio.sleep(POLL_S)
            blocks = metric(text, "kvroute_index_blocks", endpoint=victim.address)
        stats = env.stats("cluster.vllm_pool.upstream_rq_retry")
        failed = load.failed(since=t_kill - 30)
        say(f"pod-kill: {load.progress()}; last decision to it {last_change - t_kill:.2f} s after the kill")
    return {"scenario": "pod-kill", "requests": len(load.sent), "failed": len(failed),
            "inflight_at_kill": inflight, "last_decision_s": round(last_change - t_kill, 3),
            "down_s": None if down_s is None else round(down_s, 3), "index_blocks_left": blocks or 0,
            "envoy_retries": stats.get("cluster.vllm_pool.upstream_rq_retry", 0),
            "envoy_retries_ok": stats.get("cluster.vllm_pool.upstream_rq_retry_success", 0),
            "examples": [f.error for f in failed[:3]]}  # fmt: skip


async def kv_gap(args: argparse.Namespace, tmp: Path) -> Row:
    """Prediction error per 1 s window, (reported - predicted) / reported, from kvroute's counters."""
    with sim_pods(2, capacity_blocks=args.kv_capacity) as pods, \
            KVRouteProcess(config=kvroute_config(tmp / "kv.yaml", pods)) as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=[p.address for p in pods],
                         processing_mode=READ_RESPONSES) as env:  # fmt: skip
        victim = pods[0]
        windows: list[tuple[float, float]] = []  # (seconds since the fault, error)

        def sample() -> tuple[float, float, float]:
            text = kv.metrics()
            return (metric(text, "kvroute_predicted_cached_tokens_total") or 0.0,
                    metric(text, "kvroute_reported_cached_tokens_total") or 0.0,
                    sum(metric(text, "kvroute_kv_events", endpoint=victim.address, stat=k) or 0.0
                        for k in ("resyncs", "restarts")))  # fmt: skip

        prev = (0.0, 0.0, 0.0)

        async def measure(seconds: float, t_fault: float) -> float | None:
            """Windows for ``seconds``; when the victim's stream was first resynced (since the fault)."""
            nonlocal prev
            resync_at = None
            for _ in range(round(seconds)):
                await asyncio.sleep(1.0)
                cur = await asyncio.to_thread(sample)
                pred, rep = cur[0] - prev[0], cur[1] - prev[1]
                if rep > 0:
                    windows.append((time.monotonic() - t_fault, (rep - pred) / rep))
                if resync_at is None and cur[2] > prev[2]:
                    resync_at = time.monotonic() - t_fault
                prev = cur
            return resync_at

        async with traffic(env.url, args.rate, streamed=False) as load:  # usage in every response
            prev = await asyncio.to_thread(sample)
            await measure(args.warmup_s, time.monotonic() + args.warmup_s)
            say(f"kv-gap: warm ({load.progress()}); publisher restart, {args.kv_lose} batches lost, replay down")
            t_fault = time.monotonic()
            await asyncio.to_thread(victim.fault, kv_replay_down=True, kv_publisher_restart=True, kv_lose=args.kv_lose)
            resync_s = await measure(args.after_s, t_fault)
        base = [e for t, e in windows if t < 0][-5:]
        level = statistics.median(base) if base else 0.0
        after = [(t, e) for t, e in windows if t > 0]
        recovered = next((t for (t, e), (_, e2) in itertools.pairwise(after)
                          if abs(e - level) <= args.tolerance and abs(e2 - level) <= args.tolerance), None)  # fmt: skip
        worst = max((e for _, e in after), default=0.0)
        say(f"kv-gap: {load.progress()}; error before {level:.3f}, worst after {worst:.3f}, back after {recovered}")
    return {"scenario": "kv-gap", "requests": len(load.sent), "failed": len(load.failed()),
            "resync_s": None if resync_s is None else round(resync_s, 1), "error_before": round(level, 4),
            "error_worst_after": round(worst, 4), "recovered_s": None if recovered is None else round(recovered, 1),
            "windows": [[round(t, 1), round(e, 4)] for t, e in windows]}  # fmt: skip


class MetricsStandIn:
    """A pod's /metrics that kvroute scrapes (its ``metrics:`` address): answers at once until
    ``hang`` is set, then never (a wedged exporter)."""

    TEXT = 'vllm:num_requests_waiting{model_name="m"} 0\nvllm:num_requests_running{model_name="m"} 0\n'

    def __init__(self) -> None:
        self.hang = False
        self.address = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> MetricsStandIn:
        async def metrics(_request: web.Request) -> web.Response:
            if self.hang:
                await asyncio.sleep(3600)
            return web.Response(text=self.TEXT)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.address = f"127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def slow_metrics(args: argparse.Namespace, tmp: Path) -> Row:
    async with MetricsStandIn() as stand_in:
        with sim_pods(3) as pods:
            cfg = kvroute_config(tmp / "kv.yaml", pods, {pods[0].address: stand_in.address})
            with (
                KVRouteProcess(config=cfg) as kv,
                EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=[p.address for p in pods]) as env,
            ):

                def decisions() -> tuple[float, float]:
                    text = kv.metrics()
                    return (metric(text, "kvroute_decision_seconds_sum") or 0.0,
                            metric(text, "kvroute_decision_seconds_count") or 0.0)  # fmt: skip

                async with traffic(env.url, args.rate) as load:
                    await asyncio.sleep(args.warmup_s / 2)
                    s0, n0 = await asyncio.to_thread(decisions)
                    t0 = time.monotonic()
                    await asyncio.sleep(args.warmup_s / 2)
                    s1, n1 = await asyncio.to_thread(decisions)
                    say(f"slow-metrics: warm ({load.progress()}); {pods[0].address}'s /metrics hangs")
                    stand_in.hang = True
                    t1 = time.monotonic()
                    await asyncio.sleep(args.after_s)
                    s2, n2 = await asyncio.to_thread(decisions)
                failures = metric_of(kv, "kvroute_scrape", stat="failures")

        def p99(since: float, until: float) -> float | None:
            lat = sorted(x.latency_s for x in load.sent if since <= x.t < until and x.status == 200)
            return round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 1) if lat else None

        before_ms, during_ms = (s1 - s0) / max(n1 - n0, 1) * 1e3, (s2 - s1) / max(n2 - n1, 1) * 1e3
        say(f"slow-metrics: {load.progress()}; decision mean {before_ms:.3f} ms before, {during_ms:.3f} ms during")
    return {"scenario": "slow-metrics", "requests": len(load.sent), "failed": len(load.failed()),
            "decision_mean_ms_before": round(before_ms, 3), "decision_mean_ms_during": round(during_ms, 3),
            "client_p99_ms_before": p99(t0, t1), "client_p99_ms_during": p99(t1, float("inf")),
            "scrape_failures": failures}  # fmt: skip


async def stuck(port: int, n: int, connections: int = 1) -> list[grpc.aio.StreamStreamCall[Any, Any]]:
    """``n`` ext_proc streams to kvroute that send request headers and never anything more, spread over
    ``connections`` connections (kvroute's own HTTP/2 server advertises server.max_streams streams per
    connection: past that a client queues its calls, as Envoy opens another connection, rather than
    sending them to be refused)."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, not one shared
    stubs = [pb_grpc.ExternalProcessorStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options))
             for _ in range(connections)]  # fmt: skip
    headers = pb.ProcessingRequest()
    for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")):
        headers.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    calls = []
    for i in range(n):
        call = stubs[i % connections].Process()
        calls.append(call)
        with contextlib.suppress(grpc.aio.AioRpcError):  # refused (server.max_streams): counted by kvroute
            await call.write(headers)
    return calls


async def stuck_streams(args: argparse.Namespace, tmp: Path) -> Row:
    """Rounds of ``--streams`` stuck streams, each left to kvroute's limits: RSS after each round (flat:
    bounded), the peak while they are open, and a request routed by kvroute after each round."""
    limits = {"max_streams": args.max_streams, "stream_idle_timeout_s": args.idle_s}
    with sim_pods(2) as pods, KVRouteProcess(config=kvroute_config(tmp / "kv.yaml", pods, server=limits)) as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=[p.address for p in pods]) as env, \
            httpx.Client(base_url=env.url, timeout=10) as client:  # fmt: skip
        assert kv.proc is not None
        pid = kv.proc.pid

        def routed(i: int) -> bool:
            before = metric_of(kv, "kvroute_decisions_total")
            r = client.post("/v1/chat/completions", json=Traffic(env.url, 1).body(random.Random(i), i))
            return r.status_code == 200 and metric_of(kv, "kvroute_decisions_total") > before

        ok = await asyncio.to_thread(routed, 0)  # kvroute's request path warm before the first RSS sample
        rss = [proc_sample(pid, 0).rss_kib]
        peaks, closed = [], []
        for n in range(1, args.rounds + 1):
            calls = await stuck(kv.grpc_port, args.streams)
            await until(lambda: metric_of(kv, "kvroute_open_streams") >= min(args.streams, args.max_streams), 30,
                        "streams open")  # fmt: skip
            peaks.append(proc_sample(pid, 0).rss_kib)
            closed.append(await until(lambda: metric_of(kv, "kvroute_open_streams") == 0, args.idle_s + 30, "idle"))
            for c in calls:
                c.cancel()
            ok = ok and await asyncio.to_thread(routed, n)
            rss.append(proc_sample(pid, 0).rss_kib)
            say(f"stuck-streams: round {n}: RSS peak {peaks[-1] / 1024:.1f} MiB, after {rss[-1] / 1024:.1f} MiB")
        refused = metric_of(kv, "kvroute_streams_limited_total", reason="max_streams")
        idle = metric_of(kv, "kvroute_streams_limited_total", reason="idle")
        say(f"stuck-streams: refused {refused:.0f}, closed idle {idle:.0f}; requests routed after each round: {ok}")
    return {"scenario": "stuck-streams", "streams": args.streams, "rounds": args.rounds,
            "max_streams": args.max_streams,
            "refused": refused, "closed_idle": idle, "closed_after_s": round(max(closed), 2),
            "rss_mib_after_rounds": [round(x / 1024, 1) for x in rss],
            "rss_mib_peak": round(max(peaks) / 1024, 1), "new_requests_routed": ok}  # fmt: skip


RUNNERS: dict[str, Callable[[argparse.Namespace, Path], Any]] = {
    "kvroute-kill": kvroute_kill,
    "pod-kill": pod_kill,
    "kv-gap": kv_gap,
    "slow-metrics": slow_metrics,
    "stuck-streams": stuck_streams,
}


def headline(args: argparse.Namespace, rows: list[Row]) -> dict[str, Any]:
    """A ``table`` headline (bench/results.py): one row per scenario, its figures as ``key=value``."""

    def figures(r: Row) -> str:
        return ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("scenario", "windows", "examples"))

    rows_ = [[r["scenario"], figures(r)] for r in rows]
    return table_headline("Faults through real Envoy", "bench.faults", ["scenario", "figures"], rows_, scenarios=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable; default all)")
    p.add_argument("--rate", type=float, default=200.0, help="requests per second (open loop; default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="load before the fault (default %(default)s)")
    p.add_argument("--after-s", type=float, default=10.0, help="load measured after the fault (default %(default)s)")
    p.add_argument("--down-s", type=float, default=3.0, help="kvroute-kill: how long kvroute stays dead")
    p.add_argument("--kv-capacity", type=int, default=600, help="kv-gap: blocks per pod (eviction renews the cache)")
    p.add_argument("--kv-lose", type=int, default=20, help="kv-gap: batches the publisher loses")
    p.add_argument("--tolerance", type=float, default=0.05, help="kv-gap: error within this of before = recovered")
    p.add_argument("--streams", type=int, default=2000, help="stuck-streams: streams opened per round")
    p.add_argument("--rounds", type=int, default=3, help="stuck-streams: rounds (RSS after each: flat = bounded)")
    p.add_argument("--max-streams", type=int, default=500, help="stuck-streams: kvroute's server.max_streams")
    p.add_argument("--idle-s", type=float, default=5.0, help="stuck-streams: kvroute's server.stream_idle_timeout_s")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON headline (default %(default)s)")
    args = p.parse_args(argv)
    rows: list[Row] = []
    for name in args.scenario or SCENARIOS:
        say(f"{name}: start (rate {args.rate:g}/s)")
        with tempfile.TemporaryDirectory(prefix="kvroute-faults-") as tmp:
            rows.append(asyncio.run(RUNNERS[name](args, Path(tmp))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(headline(args, rows), indent=1) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
