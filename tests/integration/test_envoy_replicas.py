"""Two kvroute replicas behind one real Envoy (ext_proc streams spread round robin over them), sharing
state through a real redis-server that is killed -9 and restarted empty under load."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.replicas import KVRouteReplicas, ReplicatedEnvoy
from tests.backends import BackendFleet
from tests.redis_server import require_redis_server

pytestmark = pytest.mark.integration

# Quick fault timings (RedisConfig has the defaults): a test cannot wait out production's patience.
REDIS_SETTINGS = {"flush_interval_s": 0.002, "heartbeat_s": 0.2, "peer_timeout_s": 1.0, "retry_max_s": 0.2,
                  "timeout_s": 0.2}  # fmt: skip


def chat(conv: int, turns: int) -> dict:
    msgs: list[dict] = [{"role": "system", "content": f"Conversation {conv}: " + " ".join(
        f"c{conv}-{j}" for j in range(300))}]  # fmt: skip
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t} " * 30}, {"role": "assistant", "content": f"ans {t} " * 30}]
    msgs.append({"role": "user", "content": f"question {turns}"})
    return {"model": "m", "messages": msgs}


def redis_up(k: KVRouteProcess) -> float:
    m = re.search(r"^kvroute_redis_up (\S+)$", k.metrics(), re.M)
    return float(m.group(1)) if m else -1.0


def outbox(k: KVRouteProcess) -> float:
    """Records the replica has not written to Redis yet."""
    m = re.search(r'^kvroute_redis\{stat="outbox"\} (\S+)$', k.metrics(), re.M)
    return float(m.group(1)) if m else -1.0


def decided_by(replicas: Sequence[KVRouteProcess], rid: str) -> tuple[int, dict[str, Any]]:
    """Which replica logged the decision for request ``rid`` (debug log), and that decision."""
    needle = f'"request_id":"{rid}"'
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for i, k in enumerate(replicas):
            for line in k.log_path.read_text(errors="replace").splitlines():
                if needle in line and '"msg":"routed"' in line:
                    return i, json.loads(line)
        time.sleep(0.02)
    raise LookupError(f"no replica logged request {rid}")


async def wait_until(cond, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_redis_server()
    fleet = BackendFleet(4)
    config = Path(tmp_path_factory.mktemp("kvroute")) / "kvroute.yaml"
    config.write_text(yaml.safe_dump({"redis": REDIS_SETTINGS}))  # --redis-url comes with each replica
    args = ["--model", "m", "--log-level", "debug"]
    with (
        KVRouteReplicas(2, fleet.addresses, args, config=str(config), redis=True) as kv,
        ReplicatedEnvoy("epp.yaml", kv.ports, pods=fleet.addresses) as envoy,
    ):
        assert kv.redis is not None
        yield envoy, kv.replicas, kv.redis
    fleet.close()


async def conversations(envoy: EnvoyProcess, replicas, convs: range, turns: int, tag: str) -> None:  # type: ignore[no-untyped-def]
    """Each conversation's turns one after another: every turn lands on the conversation's pod
    whichever replica decides, and a turn decided by another replica than the first found the
    prefix there (what only sharing gives)."""
    async with httpx.AsyncClient(base_url=envoy.url, timeout=10) as c:

        async def one(conv: int) -> list[tuple[str, str]]:
            out = []
            for t in range(turns):
                rid = f"{tag}-{conv}-{t}"
                r = await c.post("/v1/chat/completions", json=chat(conv, t), headers={"x-request-id": rid})
                assert r.status_code == 200, r.text
                out.append((rid, r.json()["backend"]))
                # The user reads and types: seconds in life; these pods answer at once, and a record
                # takes a few ms to reach the other replica.
                await asyncio.sleep(0.05)
            return out

        # One request at a time: Envoy's round robin then alternates the replicas request by request,
        # so every conversation's turns are decided by both.
        results = [await one(conv) for conv in convs]
    crossed = 0
    for turns_seen in results:
        assert len({backend for _, backend in turns_seen}) == 1, turns_seen
        first, _ = decided_by(replicas, turns_seen[0][0])
        for rid, _backend in turns_seen[1:]:
            who, d = decided_by(replicas, rid)
            if who != first:
                crossed += 1
                assert d["reason"] == "prefix" and d["matched_blocks"] > 0, d
    assert crossed >= len(convs), f"Envoy should spread turns over both replicas ({crossed} crossed)"


async def test_turns_keep_their_pod_across_replicas_and_a_redis_restart_loses_no_request(setup):
    envoy, replicas, redis = setup
    await wait_until(lambda: all(redis_up(k) == 1 for k in replicas), "both replicas connected to Redis")
    await conversations(envoy, replicas, range(0, 6), 4, "before")

    statuses: Counter = Counter()
    stop = asyncio.Event()

    async def background_load() -> None:
        async with httpx.AsyncClient(base_url=envoy.url, timeout=10) as c:
            for i in itertools.count():
                if stop.is_set():
                    return
                r = await c.post("/v1/chat/completions", json=chat(100 + i % 20, i % 3))
                statuses[r.status_code] += 1

    load = [asyncio.create_task(background_load()) for _ in range(4)]
    try:
        await asyncio.sleep(0.5)
        redis.kill()  # SIGKILL under load
        await wait_until(lambda: all(redis_up(k) == 0 for k in replicas), "both replicas to notice")
        await asyncio.sleep(0.5)  # routing on local state meanwhile
        redis.start(same_port=True)  # back, empty
        t_back = time.monotonic()
        await wait_until(lambda: all(redis_up(k) == 1 for k in replicas), "sharing to resume", timeout=10)
        assert time.monotonic() - t_back < 10
        await asyncio.sleep(0.3)  # still under load with sharing back
    finally:
        stop.set()
        await asyncio.gather(*load)
    assert set(statuses) == {200} and statuses[200] > 50, statuses  # no client request failed
    for k in replicas:
        assert "redis unavailable" in k.log_path.read_text() and "sharing resumed" in k.log_path.read_text()
    # Sharing works again: new conversations keep their pods whichever replica decides (once the
    # backlog of the outage, and each replica's records written again to the emptied Redis, is out).
    await wait_until(lambda: all(outbox(k) == 0 for k in replicas), "the outage's backlog to be written")
    await conversations(envoy, replicas, range(20, 26), 4, "after")
