"""The benchmark's simulated fleet: one process for all pods, or one per pod (``--sim-procs``)."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from pathlib import Path

import pytest

from bench import harness


def _chat(url: str, content: str = "hello there", request_id: str | None = None) -> dict[str, object]:
    body = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": content}],
                       "max_tokens": 2}).encode()  # fmt: skip
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_process_per_pod(tmp_path: Path) -> None:
    cfg = harness.RunConfig([], pods=3, profile="fast", out=tmp_path, quiet=True, sim_procs=True)
    with harness.SimFleet(cfg) as fleet:
        pids = fleet.pids()
        assert sorted(pids) == ["sim", "sim-2", "sim-3"]
        assert len(set(pids.values())) == 3 and all(_alive(p) for p in pids.values())
        assert len(set(fleet.addresses)) == 3
        for url in fleet.urls("both"):
            assert _chat(url)["usage"]["completion_tokens"] == 2  # type: ignore[index]
        stats = fleet.stats()
        assert [s["address"] for s in stats] == fleet.addresses
        assert [s["finished"] for s in stats] == [1, 1, 1]
    assert not any(_alive(p) for p in pids.values())


def test_one_process_by_default(tmp_path: Path) -> None:
    cfg = harness.RunConfig([], pods=3, profile="fast", out=tmp_path, quiet=True)
    with harness.SimFleet(cfg) as fleet:
        assert list(fleet.pids()) == ["sim"] and len(fleet.addresses) == 3
        assert fleet.pids()["sim"] == fleet.procs[0].pid


def test_the_pods_own_timings_by_request_id(tmp_path: Path) -> None:
    """Each pod's wait-before-first-step and TTFT per request, joined over the fleet by the client's X-Request-Id;
    an id two pods served (a mirror, a retry) is left out; a P/D fleet gives none (a request has two legs)."""
    cfg = harness.RunConfig([], pods=2, profile="fast", out=tmp_path, quiet=True)
    with harness.SimFleet(cfg) as fleet:
        a, b = fleet.urls("both")
        _chat(a, request_id="r-1")
        _chat(b, "another prompt", request_id="r-2")
        _chat(a, request_id="twice")
        _chat(b, request_id="twice")
        got = fleet.request_timings()
        assert sorted(got) == ["r-1", "r-2"]
        for wait, ttft in got.values():
            assert 0.0 <= wait < ttft < 5.0
        stats = fleet.stats()  # the same first tokens the pods sum for the mean split
        assert sum(s["ttft_count"] for s in stats) == 4
    pd = harness.RunConfig([], pods=2, profile="fast", out=tmp_path, quiet=True)
    with harness.SimFleet(pd, "prefill:1,decode:1") as fleet:
        assert fleet.request_timings() == {}


def test_a_process_per_pod_refuses_pd_roles(tmp_path: Path) -> None:
    cfg = harness.RunConfig([], pods=4, profile="fast", out=tmp_path, quiet=True, sim_procs=True)
    with pytest.raises(ValueError, match="P/D roles need the fleet's pods in one process"):
        harness.SimFleet(cfg, "prefill:1,decode:3")


def test_kvroute_routes_over_a_process_per_pod(tmp_path: Path) -> None:
    """A router in front of such a fleet reaches every pod: kvroute-approx spreads new prompts."""
    cfg = harness.RunConfig(["kvroute-approx"], pods=2, profile="fast", out=tmp_path, quiet=True, sim_procs=True)
    with harness.SimFleet(cfg) as fleet, contextlib.ExitStack() as stack:
        router = harness.open_router("kvroute-approx", fleet, stack, cfg)
        for i in range(8):
            assert _chat(router.url, f"new prompt {i} " * 40)["usage"]["completion_tokens"] == 2  # type: ignore[index]
        assert sum(s["finished"] for s in fleet.stats()) == 8
        assert all(s["finished"] > 0 for s in fleet.stats())
