"""``kvroute serve --workers 2``: real processes on loopback, driven over the ext_proc port directly
(bench.workers' client; the pods' addresses are never dialed)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.kvroute import KVRouteProcess
from bench.workers import channel, decide, request_messages
from tests import polling
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

PODS = [f"127.0.1.{i}:8000" for i in range(1, 9)]


def body(doc: int, question: str) -> bytes:
    text = f"Document {doc}: " + " ".join(f"w{doc}-{j}" for j in range(400))
    return orjson.dumps({"model": "m", "messages": [{"role": "system", "content": text},
                                                     {"role": "user", "content": question}]})  # fmt: skip


def samples(kv: KVRouteProcess, name: str) -> dict[str, float]:
    """``name``'s samples on the supervisor's /metrics: labels text → value."""
    out = {}
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", kv.metrics(), re.M):
        out[m[1] or ""] = float(m[2])
    return out


def value(kv: KVRouteProcess, name: str, labels: str = "") -> float:
    return samples(kv, name).get(labels, 0.0)


eventually = functools.partial(polling.eventually, timeout=15.0, poll_s=0.05)  # conditions scrape kvroute


def both_serving(kv: KVRouteProcess) -> bool:
    return value(kv, "kvroute_workers", '{state="serving"}') == 2


class Conn:
    """One gRPC connection to the port, and the worker it landed on (from the decision's log line)."""

    def __init__(self, kv: KVRouteProcess) -> None:
        self.kv = kv
        self.channel = channel(kv.grpc_port)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.worker: str | None = None

    async def decide(self, payload: bytes, rid: str) -> tuple[str, dict[str, Any]]:
        pod = await decide(self.stub, payload, {"x-request-id": rid})
        line = await asyncio.to_thread(self.kv.decision, rid, 5.0)
        self.worker = self.worker or line["worker"]
        assert line["worker"] == self.worker, "a connection stays on its worker"
        return pod, line


async def one_per_worker(kv: KVRouteProcess, tag: str) -> dict[str, Conn]:
    """New connections until each worker has one (SO_REUSEPORT hashes them: a few suffice)."""
    found: dict[str, Conn] = {}
    for i in range(64):
        c = Conn(kv)
        await c.decide(body(1000 + i, "probe"), f"{tag}-probe-{i}")
        assert c.worker is not None
        found.setdefault(c.worker, c)
        if len(found) == 2:
            return found
    raise AssertionError(f"64 connections all went to worker(s) {sorted(found)}")


@pytest.fixture
def config_file(tmp_path):
    """Debug logs (each decision's line names its worker); quick sharing (the relay's timings are redis')."""
    p = tmp_path / "kvroute.yaml"
    p.write_text("server: {log_level: debug}\nredis: {flush_interval_s: 0.002, heartbeat_s: 0.2}\n")
    return str(p)


@pytest.fixture
def workers2(config_file) -> Iterator[KVRouteProcess]:
    with KVRouteProcess(PODS, ["--workers", "2"], config=config_file) as kv:
        yield kv


async def test_both_workers_take_streams_and_metrics_add_up(workers2):
    kv = workers2
    await eventually(lambda: both_serving(kv), "both workers to serve")
    conns = await one_per_worker(kv, "spread")
    for w, c in conns.items():
        for i in range(3):
            await c.decide(body(i, f"q{i}"), f"spread-{w}-{i}")
    per_worker = samples(kv, "kvroute_worker_decisions_total")
    assert set(per_worker) == {'{worker="0"}', '{worker="1"}'} and min(per_worker.values()) >= 4
    total = sum(samples(kv, "kvroute_decisions_total").values())
    assert total == sum(per_worker.values())  # the one endpoint sums both workers
    hist = value(kv, "kvroute_decision_seconds_count")
    assert hist == total
    pids = samples(kv, "kvroute_worker_pid")
    assert len(set(pids.values())) == 2 and kv.proc is not None and kv.proc.pid not in pids.values()


@pytest.mark.parametrize("sharing", ["relay", "redis"])
async def test_a_conversation_keeps_its_pod_on_either_worker(sharing, config_file):
    with RedisServer() if sharing == "redis" else contextlib.nullcontext() as redis:
        args = ["--workers", "2", *(["--redis-url", redis.url] if redis else [])]
        with KVRouteProcess(PODS, args, config=config_file) as kv:
            await eventually(lambda: both_serving(kv), "both workers to serve")
            conns = await one_per_worker(kv, sharing)
            first, second = conns["0"], conns["1"]
            homes = {}
            for i in range(6):
                homes[i], line = await first.decide(body(i, "turn 1"), f"{sharing}-t1-{i}")
            assert len(set(homes.values())) >= 2
            family = f"kvroute_{sharing}"

            def shared() -> bool:  # every record one worker sent, the other applied
                s = samples(kv, family)
                return s.get('{stat="outbox"}') == 0 and s['{stat="received_records"}'] >= s['{stat="sent_records"}']

            await eventually(shared, f"the records to reach the other worker through {sharing}")
            for i, home in homes.items():
                pod, line = await second.decide(body(i, "turn 2"), f"{sharing}-t2-{i}")
                assert (pod, line["reason"], line["worker"]) == (home, "prefix", "1")


async def test_a_killed_worker_is_restarted_and_the_port_keeps_serving(workers2):
    kv = workers2
    await eventually(lambda: both_serving(kv), "both workers to serve")
    old = samples(kv, "kvroute_worker_pid")
    os.kill(int(old['{worker="0"}']), signal.SIGKILL)
    await eventually(lambda: value(kv, "kvroute_worker_restarts_total", '{worker="0"}') == 1, "the restart")
    for i in range(8):  # meanwhile (and after), new connections are served by whichever worker lives
        pod, _ = await Conn(kv).decide(body(i, "during"), f"kill-{i}")
        assert pod in PODS
    await eventually(lambda: both_serving(kv), "the new worker to serve")
    new = samples(kv, "kvroute_worker_pid")
    assert new['{worker="0"}'] != old['{worker="0"}'] and new['{worker="1"}'] == old['{worker="1"}']
    assert set(await one_per_worker(kv, "after")) == {"0", "1"}
    assert "worker exited: restarting it" in kv.log_path.read_text()


async def test_sigterm_drains_open_streams(workers2):
    kv = workers2
    await eventually(lambda: both_serving(kv), "both workers to serve")
    head, tail = request_messages(body(1, "drain"), {"x-request-id": "drain"})
    ch = channel(kv.grpc_port)
    call = pb_grpc.ExternalProcessorStub(ch).Process()
    await call.write(head)
    assert (await call.read()).HasField("request_headers")  # the stream is open on a worker
    kv.signal(signal.SIGTERM)
    await eventually(lambda: kv.health() == "NOT_SERVING", "health to say NOT_SERVING")
    await call.write(tail)
    await call.done_writing()
    answer = await call.read()
    assert answer.HasField("request_body") and answer.request_body.response.header_mutation.set_headers
    await ch.close()
    assert kv.proc is not None
    assert await asyncio.to_thread(kv.proc.wait, 15) == 0
    with pytest.raises(grpc.aio.AioRpcError):  # nothing listens any more
        await decide(pb_grpc.ExternalProcessorStub(channel(kv.grpc_port)), body(2, "late"))


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "extproc.cli", "serve", "--listen", "127.0.0.1", "--health-port", "0",
           "--metrics-port", "0", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_workers_that_cannot_start_stop_the_server_with_a_clear_message(tmp_path):
    res = _serve("--workers", "2", "--grpc-port", "0", "--endpoints-file", str(tmp_path / "missing.yaml"))
    assert res.returncode == 3
    assert re.search(r"kvroute: cannot start: worker [01] exited with code 3 before serving", res.stderr)
    assert "cannot read" in res.stderr  # the worker's own reason, just above


def test_a_taken_port_stops_the_supervisor():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = _serve("--workers", "2", "--grpc-port", str(taken.getsockname()[1]), "--endpoints", PODS[0])
    assert res.returncode == 3 and "server.grpc_port: cannot listen" in res.stderr
