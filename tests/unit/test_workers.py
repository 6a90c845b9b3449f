"""``--workers``: the setting, the merged metrics, the supervisor's health and relay (in-process; the
processes themselves are in tests/integration/test_workers.py)."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from extproc.cli import _parser, overrides_from_args
from extproc.config import ConfigError, build_config
from extproc.index.approx import ApproxPrefixIndex
from extproc.observability import Metrics, merge_metrics
from extproc.reload import requires_restart
from extproc.state.relay import RelayState
from extproc.workers import Supervisor, usable_cpus, worker_count
from tests.polling import eventually

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
POOL = {"pools": {"p": {"endpoints": [{"address": A}, {"address": B}]}}}


def test_the_setting_and_the_flag():
    assert build_config(POOL).server.workers == 1  # one process unless asked: no supervisor
    assert build_config({**POOL, "server": {"workers": "auto"}}).server.workers == "auto"
    for bad in (0, "many"):
        with pytest.raises(ConfigError):
            build_config({**POOL, "server": {"workers": bad}})
    assert worker_count("auto") == usable_cpus() >= 1 and worker_count(3) == 3
    args = _parser().parse_args(["serve", "--endpoints", A, "--workers", "auto"])
    assert overrides_from_args(args)["server"]["workers"] == "auto"
    assert overrides_from_args(_parser().parse_args(["serve", "--workers", "2"]))["server"]["workers"] == 2
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--workers", "0"])
    assert requires_restart("server.workers")


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


class _Merged(Collector):
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def collect(self) -> Any:
        return merge_metrics(self.texts)


def test_merged_metrics_add_up_traffic_and_keep_shared_views():
    a, b = Metrics(), Metrics()
    a.decisions.labels("p", A, "prefix").inc(3)
    b.decisions.labels("p", A, "prefix").inc(2)
    b.decisions.labels("p", B, "load").inc()
    a.decision_seconds.observe(0.001)
    b.decision_seconds.observe(0.2)
    a.streams.set(2)
    b.streams.set(1)
    a.config_last_reload.set(100)
    b.config_last_reload.set(200)
    b.config_valid.set(0)  # one worker read an invalid file: the merged flag says so
    reg = CollectorRegistry()
    reg.register(_Merged([generate_latest(m.registry).decode() for m in (a, b)]))
    got = _values(generate_latest(reg).decode())
    assert got[("kvroute_decisions_total", (("endpoint", A), ("pool", "p"), ("reason", "prefix")))] == 5
    assert got[("kvroute_decisions_total", (("endpoint", B), ("pool", "p"), ("reason", "load")))] == 1
    assert got[("kvroute_decision_seconds_count", ())] == 2
    assert got[("kvroute_decision_seconds_bucket", (("le", "0.001"),))] == 1
    assert got[("kvroute_decision_seconds_bucket", (("le", "+Inf"),))] == 2
    assert got[("kvroute_open_streams", ())] == 3  # one process's own traffic: summed
    assert got[("kvroute_config_last_reload_timestamp_seconds", ())] == 200  # a shared view: the largest
    assert got[("kvroute_config_valid", ())] == 0
    assert not any(name.endswith("_created") for name, _ in got)


@pytest.fixture
async def supervisor():
    """A supervisor's Unix socket (control and relay) without its worker processes."""
    cfg = build_config({**POOL, "redis": {"flush_interval_s": 0.002, "retry_max_s": 0.1}})
    sup = Supervisor(cfg, [], 2)
    server = await asyncio.start_unix_server(sup._accept, path=sup.socket_path)
    yield sup
    server.close()
    shutil.rmtree(sup._dir, ignore_errors=True)


def _relay(sup: Supervisor) -> tuple[RelayState, ApproxPrefixIndex, Any]:
    state = RelayState(sup.config.redis, sup.socket_path)
    index = ApproxPrefixIndex(100)
    return state, index, state.share_index("approx", index)


async def test_the_relay_shares_records_and_replays_them_to_a_worker_that_starts_later(supervisor):
    (a, index_a, shared_a), (b, index_b, _) = _relay(supervisor), _relay(supervisor)
    await a.start()
    await b.start()
    try:
        await eventually(lambda: a.up and b.up, "both connected")
        shared_a.record([1, 2, 3], A)
        await eventually(lambda: index_b.match([1, 2, 3], [A, B]) == {A: 3}, "B to learn A's record")
        assert index_a.match([1, 2, 3], [A, B]) == {A: 3} and a.stats()["received_records"] == 0  # not echoed
        c, index_c, _ = _relay(supervisor)
        await c.start()
        await eventually(lambda: index_c.match([1, 2, 3], [A, B]) == {A: 3}, "C to replay the log")
        await c.aclose()
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_relay_without_its_supervisor_degrades_to_local_state(tmp_path):
    cfg = build_config({**POOL, "redis": {"retry_max_s": 0.1}})
    state = RelayState(cfg.redis, str(tmp_path / "gone.sock"))
    index = state.share_index("approx", ApproxPrefixIndex(100))
    await state.start()
    try:
        await eventually(lambda: state.counters["errors"] >= 1, "the failed connection")
        index.record([7], A)  # routing goes on: the record is local, and kept for when it connects
        assert not state.up and state.stats()["outbox"] == 1 and index.match([7], [A]) == {A: 1}
    finally:
        await state.aclose()


async def test_health_serves_while_a_worker_does(supervisor):
    async def status() -> int:
        r = await supervisor.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        return int(r.status)

    await supervisor._set_health()
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    supervisor.workers[1].serving = True
    await supervisor._set_health()
    assert await status() == health_pb2.HealthCheckResponse.SERVING
    supervisor._stopping = True  # draining: not serving, whatever the workers say
    await supervisor._set_health()
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
