"""``PEER+envoy``: a peer router behind the same Envoy as kvroute (as behind a gateway)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from bench import harness, loadgen, workloads
from bench.peers import PEERS_VENV

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not (PEERS_VENV / "bin" / "python").exists(), reason="the peers are not installed (make peers)")
def test_sglang_router_behind_envoy_serves_through_envoy(tmp_path: Path) -> None:
    cfg = harness.RunConfig(["sglang-router+envoy"], pods=2, profile="fast", out=tmp_path, quiet=True)
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(harness.SimFleet(cfg))
        router = harness.open_router("sglang-router+envoy", fleet, stack, cfg)
        assert set(router.pids) == {"envoy", "sglang-router"}  # both on the path, their CPU counted
        items = workloads.build("multi-turn", None, 1).items[:3]
        recs = asyncio.run(loadgen.run(router.url, workloads.specs(items, [0.0] * len(items)), timeout=30))
        assert all(r.ok for r in recs), [r.error for r in recs]
        assert sum(p["finished"] for p in fleet.stats()) == len(items)  # the pods served them, through both hops
