"""``noop-extproc``: Envoy + the do-nothing ext_proc server as a routing policy (the path floor of any
Python ext_proc router, beside kvroute's in ``python -m bench run``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench import loadgen, workloads
from bench.noop_extproc import _RoundRobin

pytestmark = pytest.mark.integration


def test_round_robin_answers_route_each_request_to_the_next_target() -> None:
    rr = _RoundRobin("10.0.0.1:8000, 10.0.0.2:8000")
    dest = [rr().route_headers.request_headers.response.header_mutation.set_headers[0].header.raw_value
            for _ in range(4)]  # fmt: skip
    assert dest == [b"10.0.0.1:8000", b"10.0.0.2:8000", b"10.0.0.1:8000", b"10.0.0.2:8000"]
    with pytest.raises(ValueError, match="empty address"):
        _RoundRobin("10.0.0.1:8000,")


def test_noop_extproc_policy_routes_through_envoy_and_the_noop_server(open_policy: Any) -> None:
    fleet, router = open_policy("noop-extproc")
    assert set(router.pids) == {"envoy", "noop-extproc"}  # both on the path, their CPU counted
    items = workloads.build("no-reuse", None, 4).items
    recs = asyncio.run(loadgen.run(router.url, workloads.specs(items, [0.0] * len(items)), timeout=30))
    assert all(r.ok for r in recs), [r.error for r in recs]
    # The noop server's route, round robin: each pod served half (Envoy's own balancing is not used).
    assert [p["finished"] for p in fleet.stats()] == [2, 2]
