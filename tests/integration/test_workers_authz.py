"""bench.workers on kvroute's ext_authz HTTP port: the load drives it as Envoy's --api ext_authz_http does
(keep-alive Checks, finished requests reported on the gRPC access log), and every slot comes back."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from bench.kvroute import KVRouteProcess
from bench.overhead import chat_bodies
from bench.workers import PODS, AuthzHttp, _authz_http_load, _released, run_once, runs
from tests import polling

pytestmark = pytest.mark.integration


def test_the_http_load_is_answered_and_every_slot_released_through_the_access_log():
    bodies = chat_bodies(500, 16)
    with KVRouteProcess(PODS[:4], authz_http=True) as kv:
        target = AuthzHttp(kv.authz_http_port, kv.grpc_port)
        lat = asyncio.run(_authz_http_load(target, bodies, 4, 4, time.monotonic() + 0.5))
        assert len(lat) > 10 and all(x > 0 for x in lat)
        # the last batch is written before the load returns; kvroute reads it on its own loop
        polling.wait_for(lambda: _released(kv.metrics()) == len(lat), timeout=5.0, what="every slot released")
        assert 'kvroute_authz_access_log_entries_total{result="unknown"} 0.0' in kv.metrics()
        inflight = [line for line in kv.metrics().splitlines() if line.startswith("kvroute_inflight_requests{")]
        assert inflight and all(line.endswith(" 0.0") for line in inflight)


def test_a_run_on_the_http_port_reports_its_decisions_beside_the_ext_proc_runs():
    a = argparse.Namespace(api="ext_authz_http,ext_proc", sharing="relay", workers="1,2", duration=1.0, warmup=0.3,
                           clients=1, connections=2, concurrency=4)  # fmt: skip
    # one worker only on the HTTP port (it serves one process); ext_proc with each count
    assert list(runs(a)) == [(1, "relay", "ext_authz_http"), (1, "relay", "ext_proc"), (2, "relay", "ext_proc")]
    row = run_once(1, "relay", chat_bodies(500, 16), a, "ext_authz_http")
    assert row["router"] == "kvroute (ext_authz_http decisions)"
    assert row["decisions"] > 10 and row["decisions_per_s"] > 0 and row["cpu"] > 0
    with pytest.raises(SystemExit, match="not one of"):
        list(runs(argparse.Namespace(api="ext_authz", sharing="relay", workers="1")))
