"""Faults through real Envoy (the shipped epp.yaml), small and bounded: Envoy walks kvroute's ranked
list on retries, a dead pod stops getting decisions and loses its index entries, a kvroute killed -9
costs no request and routes again once restarted, a hanging /metrics never delays a decision, and
stuck ext_proc streams are refused past server.max_streams and closed after server.stream_idle_timeout_s.
The measured version (200 req/s, sim pods, KV events) is ``python -m bench.faults``."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.envoy import EnvoyProcess
from bench.faults import metric, stuck, until
from bench.kvroute import KVRouteProcess
from extproc import envoy as pb
from tests.backends import BackendFleet
from tests.integration.test_precise import ask as ask_precise
from tests.integration.test_precise import doc, model_dir, new_blocks, precise, sim  # noqa: F401 - fixtures
from tests.load import Load as ClientLoad
from tests.polling import wait_for

pytestmark = pytest.mark.integration

DEST = "x-gateway-destination-endpoint"


def config(tmp_path: Path, fleet: BackendFleet, **sections: dict[str, Any]) -> str:
    """kvroute's config file: the fleet's pods, and ``sections`` (e.g. scrape, server)."""
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump({"pools": {"p": {"endpoints": [{"address": a} for a in fleet.addresses]}},
                                    **sections}))  # fmt: skip
    return str(path)


SCRAPE = {"enabled": True, "interval_s": 0.1, "timeout_s": 0.5}


def kv_metric(kv: KVRouteProcess, name: str, **labels: str) -> float:
    return metric(kv.metrics(), name, **labels) or 0.0


def ask(c: httpx.Client, text: str, **headers: str) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": text}]},
                  headers=headers)  # fmt: skip


class Load(ClientLoad):
    """Four client threads through Envoy, over six documents."""

    def request(self, c: httpx.Client, worker: int, i: int, sent: float) -> httpx.Response:
        return ask(c, f"document {(i + worker) % 6} " * 60)


@pytest.fixture(params=["grpcio", "h2"])
def transport(request: pytest.FixtureRequest) -> str:
    """The ext_proc server Envoy dials: grpcio's (server.grpc_port) or kvroute's own HTTP/2 server
    (server.h2_port, as deploy/ runs it)."""
    return str(request.param)


@pytest.fixture
def fleet() -> Iterator[BackendFleet]:
    f = BackendFleet(4)
    yield f
    f.close()


class ListPicker(pb_grpc.ExternalProcessorServicer):
    """An endpoint picker that names the same ranked list for every request (EPP protocol: the pick in
    the header, the list in envoy.lb metadata)."""

    def __init__(self, ranked: list[str]) -> None:
        self.ranked = ranked

    def Process(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        for msg in request_iterator:
            if msg.WhichOneof("request") == "request_headers":
                yield pb.request_headers_response()
            elif msg.WhichOneof("request") == "request_body":
                yield pb.request_body_response(set_headers={DEST: self.ranked[0]}, clear_route_cache=True,
                                               metadata={DEST: ",".join(self.ranked)})  # fmt: skip


@pytest.fixture
def picker() -> Iterator[tuple[ListPicker, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    p = ListPicker([])
    pb_grpc.add_ExternalProcessorServicer_to_server(p, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield p, port
    server.stop(0)


def test_envoy_retries_on_the_next_pod_of_the_ranked_list(fleet, picker):
    """The first two pods of the list refuse connections: every request lands on the third, never on
    the fourth (which round robin would reach); with no live pod left in the list, the fallback policy
    still finds one."""
    p, port = picker
    dead1, dead2, third, fourth = fleet.addresses
    fleet.stop(dead1)
    fleet.stop(dead2)
    p.ranked = [dead1, dead2, third]
    with EnvoyProcess("epp.yaml", kvroute_port=port, pods=fleet.addresses) as env, \
            httpx.Client(base_url=env.url, timeout=10) as c:  # fmt: skip
        got = [ask(c, f"walk {i}") for i in range(8)]
        assert [r.status_code for r in got] == [200] * 8
        assert {r.json()["backend"] for r in got} == {third}
        assert (
            env.stats("cluster.vllm_pool.upstream_rq_retry_success")["cluster.vllm_pool.upstream_rq_retry_success"] >= 1
        )
        p.ranked = [dead1, dead2]  # the list is spent: override_host's fallback (round robin) picks
        got = [ask(c, f"spent {i}") for i in range(6)]
        assert [r.status_code for r in got] == [200] * 6
        assert {r.json()["backend"] for r in got} <= {third, fourth}


def test_a_killed_pod_gets_no_new_decision_within_1s_and_is_purged(fleet, tmp_path: Path, transport: str):
    """kvroute's scraper sees the pod refuse and marks it down: no decision names it after <= 1 s, its
    index entries are gone, and Envoy's retries keep clients from seeing the connect failures."""
    with KVRouteProcess(config=config(tmp_path, fleet, scrape=SCRAPE), h2=transport == "h2") as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.ext_proc_port, pods=fleet.addresses) as env, \
            Load(env.url) as load:  # fmt: skip
        load.settle(40)
        # Six documents over four pods: which pods hold them is up to routing, so the victim is one that does.
        dead = max(fleet.addresses, key=lambda a: kv_metric(kv, "kvroute_index_blocks", endpoint=a))
        assert kv_metric(kv, "kvroute_index_blocks", endpoint=dead) > 0
        fleet.stop(dead)
        killed = time.monotonic()
        took = wait_for(lambda: kv_metric(kv, "kvroute_scrape", stat="downs") >= 1, 5, "the pod marked down")
        assert took <= 1.0
        assert metric(kv.metrics(), "kvroute_index_blocks", endpoint=dead) is None  # purged
        decided = kv_metric(kv, "kvroute_decisions_total", endpoint=dead)
        load.settle(40)
        assert kv_metric(kv, "kvroute_decisions_total", endpoint=dead) == decided
    late = [r for r in load.results if r[1] == dead and r[2] > killed]
    assert not late, f"requests sent after the kill served by the dead pod: {late[:3]}"
    # At most the requests in flight on it at the kill fail (one per client thread); here none does,
    # as a refused connection is retried on kvroute's next pod.
    assert len(load.failed()) <= 4, load.failed()[:3]


def test_kvroute_killed_fails_open_and_routes_again_within_2s_of_its_restart(fleet, transport: str):
    with KVRouteProcess(fleet.addresses, h2=transport == "h2") as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.ext_proc_port, pods=fleet.addresses) as env, \
            Load(env.url) as load:  # fmt: skip
        load.settle(20)
        assert kv.proc is not None
        kv.proc.send_signal(signal.SIGKILL)
        kv.proc.wait()
        load.settle(20)  # fail-open: Envoy's pool round robin
        restarted = time.monotonic()
        kv.start()
        took = wait_for(lambda: kv_metric(kv, "kvroute_decisions_total") > 0, 5, "a decision by the new kvroute")
        assert took <= 2.0
        load.settle(20)
    assert not load.failed(), load.failed()[:3]
    routed = [r for r in load.results if r[2] > restarted + took]
    assert routed


def test_a_hanging_metrics_endpoint_never_delays_a_decision(fleet, tmp_path: Path, transport: str):
    slow = fleet.backends[0]
    # A scrape timeout far above a request's time through Envoy, however loaded the machine: a decision
    # that waited on a scrape would stand out.
    scrape = {**SCRAPE, "timeout_s": 1.5}
    with KVRouteProcess(config=config(tmp_path, fleet, scrape=scrape), h2=transport == "h2") as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.ext_proc_port, pods=fleet.addresses) as env, \
            httpx.Client(base_url=env.url, timeout=10) as c:  # fmt: skip
        slow.metrics_delay_s = 3.0  # every scrape of it hangs past kvroute's scrape timeout
        scrapes = slow.scrapes
        wait_for(lambda: slow.scrapes >= scrapes + 2, 5, "scrapes of the hanging pod")
        took = []
        for i in range(20):
            t = time.monotonic()
            assert ask(c, f"hang {i} " * 50).status_code == 200
            took.append(time.monotonic() - t)
        text = kv.metrics()
    mean = (metric(text, "kvroute_decision_seconds_sum") or 0) / (metric(text, "kvroute_decision_seconds_count") or 1)
    assert max(took) < 1.0, took  # a decision waiting on a scrape would take up to its 1.5 s timeout
    assert mean < 0.05


def test_stuck_streams_are_refused_past_the_limit_and_closed_when_idle(fleet, tmp_path: Path, transport: str):
    limits = {"max_streams": 5, "stream_idle_timeout_s": 1.0}
    with KVRouteProcess(config=config(tmp_path, fleet, server=limits), h2=transport == "h2") as kv, \
            EnvoyProcess("epp.yaml", kvroute_port=kv.ext_proc_port, pods=fleet.addresses) as env, \
            httpx.Client(base_url=env.url, timeout=10) as c:  # fmt: skip
        # A request whose generation outlasts the idle timeout: kvroute closes its silent stream, the
        # request goes on.
        assert ask(c, "long " * 50, **{"x-test-delay": "1.5"}).status_code == 200

        async def open_stuck() -> None:
            calls = await stuck(kv.ext_proc_port, 12, connections=12)
            await until(lambda: kv_metric(kv, "kvroute_streams_limited_total", reason="max_streams") == 7, 5,
                        "7 streams refused")  # fmt: skip
            assert kv_metric(kv, "kvroute_open_streams") == 5
            await until(lambda: kv_metric(kv, "kvroute_open_streams") == 0, 5, "idle streams closed")
            for call in calls:
                call.cancel()

        asyncio.run(open_stuck())
        assert kv_metric(kv, "kvroute_streams_limited_total", reason="idle") >= 5
        r = ask(c, "after " * 50)
        assert r.status_code == 200 and r.json()["headers"].get(DEST) == r.json()["backend"]  # routed by kvroute


def _kv_events(k: KVRouteProcess, pod: str, stat: str) -> float:
    return kv_metric(k, "kvroute_kv_events", endpoint=pod, stat=stat)


def test_kv_event_publisher_restart_and_gap_with_replay_down_resync_and_predictions_recover(precise, sim):  # noqa: F811
    """The pod's publisher restarts (numbering from 0) and later loses batches (a sequence gap), its
    replay socket down: kvroute purges, then resyncs that pod, and follows its events again:
    a document the pod stores afterwards is predicted exactly."""
    c, k = precise
    msgs = [{"role": "system", "content": doc(1)}, {"role": "user", "content": "q"}]
    ask_precise(c, k, msgs)
    predicted, reported, pod = ask_precise(c, k, msgs)
    assert predicted == reported > 0
    victim = next(p for p in sim if p["address"] == pod)

    def direct(n: int) -> None:
        """A fresh document served by the victim itself (its KV events follow)."""
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "system", "content": doc(1000 + n)},
                                                           {"role": "user", "content": "x"}]}  # fmt: skip
        httpx.post(victim["url"] + "/v1/chat/completions", json=body, timeout=10).raise_for_status()

    def fault_until(fault: dict[str, Any], stat: str, start: int) -> int:
        before = _kv_events(k, pod, stat)
        httpx.post(victim["url"] + "/sim/fault", json=fault, timeout=5).raise_for_status()
        for n in range(start, start + 20):
            direct(n)
            if _kv_events(k, pod, stat) > before:
                return n + 1
            time.sleep(0.2)
        raise AssertionError(f"kvroute counted no {stat} for {pod}")

    # Wherever its publisher stands (even at seq 0: its new batch 0 differs from the old one), a restart shows.
    n = fault_until({"kv_replay_down": True, "kv_publisher_restart": True}, "restarts", 0)
    fault_until({"kv_lose": 2}, "resyncs", n)  # a gap no replay fills: the pod is cleared and followed anew
    assert _kv_events(k, pod, "replay_failures") >= 1

    def taken_in() -> bool:  # every batch the victim sent so far (kvroute takes them in windows)
        return _kv_events(k, pod, "messages") >= httpx.get(victim["url"] + "/sim/stats").json()["kv_batches_sent"]

    wait_for(taken_in, 5, "kvroute took in the victim's batches")
    stored = k.precise_stat("blocks_stored")
    msgs = [{"role": "system", "content": doc(2000)}, {"role": "user", "content": "x"}]
    r = httpx.post(victim["url"] + "/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": msgs},
                   timeout=10)  # fmt: skip
    r.raise_for_status()
    usage = r.json()["usage"]  # the victim's events for it applied again (all of them: not just a first batch)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    k.wait_precise_stat("blocks_stored", stored + new_blocks(usage["prompt_tokens"], cached))
    predicted, reported, routed_to = ask_precise(c, k, msgs)
    assert routed_to == pod and predicted == reported > 0
