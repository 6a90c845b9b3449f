"""``PEER+envoy``: a peer router behind the same Envoy as kvroute (as behind a gateway)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench import loadgen, workloads
from bench.peers import PEERS_VENV

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not (PEERS_VENV / "bin" / "python").exists(), reason="the peers are not installed (make peers)")
def test_sglang_router_behind_envoy_serves_through_envoy(open_policy: Any) -> None:
    fleet, router = open_policy("sglang-router+envoy")
    assert set(router.pids) == {"envoy", "sglang-router"}  # both on the path, their CPU counted
    items = workloads.build("multi-turn", None, 1).items[:3]
    recs = asyncio.run(loadgen.run(router.url, workloads.specs(items, [0.0] * len(items)), timeout=30))
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert sum(p["finished"] for p in fleet.stats()) == len(items)  # the pods served them, through both hops
