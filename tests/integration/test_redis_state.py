"""Shared state through a real redis-server: two (or three) Router replicas in one process, each
with its own Redis clients, exactly as separate kvroute processes would share."""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import orjson
import pytest
from prometheus_client import generate_latest

from extproc.config import EndpointConfig, build_config
from extproc.keys import route_id_key
from extproc.observability import Metrics
from extproc.request import InferenceRequest
from extproc.router import Router
from tests.certs import make_certs
from tests.redis_server import RedisCluster, RedisSentinel, RedisServer, all_entries

pytestmark = pytest.mark.integration

PODS = [f"127.0.0.{i}:8000" for i in range(1, 5)]  # never dialed: these tests call route() directly
# Quick timings so faults show within a test's patience; the defaults are in RedisConfig.
FAST = {"flush_interval_s": 0.002, "heartbeat_s": 0.2, "peer_timeout_s": 1.0, "retry_max_s": 0.2, "timeout_s": 0.2}
MARKER = "PROMPT-TEXT-MARKER-91c2"


def make_router(url: str, pods: list[str] = PODS, routing: dict[str, Any] | None = None, **redis: Any) -> Router:
    cfg = build_config({"pools": {"p": {"endpoints": [{"address": a} for a in pods]}},
                        "redis": {"url": url, **FAST, **redis}, "routing": routing or {}})  # fmt: skip
    return Router(cfg, Metrics())


def chat(r: Router, doc: str, q: str, route_id: str | None = None) -> InferenceRequest:
    msgs = [{"role": "system", "content": doc}, {"role": "user", "content": q}]
    body = orjson.dumps({"model": "m", "messages": msgs})
    headers = {"x-route-id": route_id} if route_id else {}
    return r.parse("/v1/chat/completions", "POST", headers, body)


def doc(i: int) -> str:
    return f"Document {i} {MARKER}: " + " ".join(f"w{i}-{j}" for j in range(400))


def knows(r: Router, d: str) -> str | None:
    """The pod ``r``'s own index holds ``d``'s prefix on, if any."""
    k = r.keys(chat(r, d, "?"), r.registry.pools["p"].endpoints)
    m = r.index.match(k.keys, r.registry.by_address)
    return max(m, key=m.__getitem__) if m else None


def metric(r: Router, name: str) -> float:
    for line in generate_latest(r.metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


async def eventually(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def finished(r: Router, req: InferenceRequest) -> str:
    """Route ``req`` and end its exchange at once; the pod it went to."""
    out = r.route(req)
    r.release(out.endpoint, out.local_prefill)
    return out.endpoint


async def started(*routers: Router) -> tuple[Router, ...]:
    for r in routers:
        await r.start()
    return routers


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


async def connected_pair(url: str, **kw: Any) -> AsyncIterator[tuple[Router, Router]]:
    a, b = await started(make_router(url, **kw), make_router(url, **kw))
    try:
        await eventually(lambda: a.state.up and b.state.up, "both replicas connected")
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


@pytest.fixture
async def pair(server):
    async for p in connected_pair(server.url):
        yield p


# Prefill estimates of a minute per document (the defaults give milliseconds): a queue that B is told
# of cannot have run out, on A's clock or B's, before the test looks at it, however loaded the machine.
SLOW_PREFILL = {"cost": {"per_token_s": 0.1}}
# How far B's view of A's queue may be from A's own: the moments between A reading its clock for a
# report and stamping it (B counts the report's age from the stamp).
REPORT_SKEW_S = 0.25


@pytest.fixture
async def slow_prefill_pair(server):
    async for p in connected_pair(server.url, routing=SLOW_PREFILL):
        yield p


async def test_a_conversation_keeps_its_pod_whichever_replica_decides(pair):
    a, b = pair
    homes = {i: finished(a, chat(a, doc(i), "turn 1")) for i in range(6)}  # each turn ends before the next
    assert len(set(homes.values())) >= 2
    for i, home in homes.items():
        assert await eventually(lambda i=i: knows(b, doc(i)), f"replica B to learn doc {i}") == home
        out = b.route(chat(b, doc(i), "turn 2"))
        assert (out.endpoint, out.decision.reason) == (home, "prefix")
    # And back: what B recorded (turn 2's longer prefix) reaches A.
    out = b.route(chat(b, doc(0) + " more", "turn 3"))
    await eventually(lambda: knows(a, doc(0) + " more") == out.endpoint, "replica A to learn B's record")


async def test_route_id_pins_are_shared(pair):
    a, b = pair
    first = a.route(chat(a, doc(1), "q", route_id="conv-7")).endpoint
    key = route_id_key(chat(b, doc(2), "q", route_id="conv-7"))
    assert key is not None
    await eventually(lambda: b.scheduler.routes.get(key) == first, "the pin to reach B")
    out = b.route(chat(b, doc(2), "another document, same conversation", route_id="conv-7"))
    assert (out.endpoint, out.decision.reason) == (first, "route-id")


async def test_inflight_and_prefill_estimates_are_shared(slow_prefill_pair):
    a, b = slow_prefill_pair
    outs = [a.route(chat(a, doc(i), "q")) for i in range(3)]
    busy = {o.endpoint for o in outs}
    for o in outs:
        await eventually(lambda o=o: b.registry.by_address[o.endpoint].peer_inflight
                         == a.registry.by_address[o.endpoint].inflight, "B to count A's requests")  # fmt: skip
    now = time.monotonic()
    for ep in busy:
        pod, at_a = b.registry.by_address[ep], a.registry.by_address[ep].prefills.own_wait(now)
        assert pod.own_load(now)[:2] == (0, 0.0)  # nothing of B's own
        assert at_a > 30  # A's prefills queue there (a minute each, counting down) ...
        # ... and B sees them: the seconds A reported, counted down since, as A's own queue stands now.
        assert pod.prefills.wait(now) == pytest.approx(at_a, abs=REPORT_SKEW_S)
    # B sends a new prefix to a pod A is not loading, rather than double-booking one.
    fresh = b.route(chat(b, doc(50), "q"))
    assert fresh.endpoint not in busy or len(busy) == len(PODS)
    # Each replica's metrics count its own requests (so replicas add up), not the pod's total.
    ep = outs[0].endpoint
    follow_up = b.route(chat(b, doc(0), "q"))  # where A's request on doc 0 is still in flight
    assert follow_up.endpoint == ep and b.registry.by_address[ep].inflight >= 2
    assert metric(b, f'kvroute_inflight_requests{{endpoint="{ep}"}}') == 1
    b.release(follow_up.endpoint, follow_up.local_prefill)
    for o in outs:
        a.release(o.endpoint, o.local_prefill)
    await eventually(lambda: all(p.peer_inflight == 0 for p in b.registry.by_address.values()), "A's releases on B")
    assert sum(p.inflight for p in b.registry.by_address.values()) == 1  # B's own request only


async def test_keys_are_namespaced_bounded_and_hold_hashes_and_numbers_only(server):
    a, b = await started(make_router(server.url, key_prefix="teamA:", log_maxlen=100),
                         make_router(server.url, key_prefix="teamB:"))  # fmt: skip
    try:
        await eventually(lambda: a.state.up and b.state.up, "connected")
        for i in range(300):  # entries well past log_maxlen
            out = a.route(chat(a, doc(i % 40), f"question {i}", route_id=f"conv-{i}"))
            a.release(out.endpoint, out.local_prefill)
            if i % 10 == 0:
                await asyncio.sleep(0.005)
        await eventually(lambda: a.state.stats()["outbox"] == 0, "A's outbox sent")
        assert knows(b, doc(1)) is None  # another prefix: nothing of teamA's reaches teamB
        everything = all_entries([server])
        assert everything and all(k.startswith((b"teamA:", b"teamB:")) for k in everything)
        with server.client() as c:
            for key in everything:
                assert 0 < c.ttl(key) <= 3600, key  # nothing lives forever
            # XADD MAXLEN ~ trims whole stream nodes (stream-node-max-entries, 100 by default).
            assert c.xlen("teamA:{log}") <= 100 + 100
        for key, (kind, value) in everything.items():
            if kind == "string":  # a replica's marker: a count
                assert int(value) > 0
                continue
            assert kind == "stream", key
            for _id, fields in value:
                assert set(fields) == {b"r", b"m"} and int(fields[b"r"], 16) >= 0
                assert MARKER.encode() not in fields[b"m"]
                _assert_hashes_and_numbers(msgpack.unpackb(fields[b"m"]))
    finally:
        await a.aclose()
        await b.aclose()


def _assert_hashes_and_numbers(entry: dict) -> None:
    assert set(entry) <= {"o", "l", "t"} and isinstance(entry["t"], float)
    for op in entry.get("o", ()):
        if op[0] == "x":
            assert op[1] in ("approx", "precise") and op[2] in PODS
            assert isinstance(op[3], bytes) and len(op[3]) % 8 == 0  # packed u64 block hashes
            assert len(array("Q", op[3])) > 0
        elif op[0] == "p":
            assert isinstance(op[1], int) and op[2] in PODS
        else:
            assert op[0] == "d" and op[2] in PODS
    for ep, n, s in entry.get("l", ()):
        assert ep in PODS and isinstance(n, int) and isinstance(s, int | float)


async def test_removed_endpoint_is_purged_for_peers_and_replicas_that_start_later(pair, server):
    a, b = pair
    doomed = a.route(chat(a, doc(3), "q")).endpoint
    a.release(doomed)
    await eventually(lambda: knows(b, doc(3)) == doomed, "B to learn doc 3")
    a.registry.apply("p", [EndpointConfig(address=x) for x in PODS if x != doomed])  # discovery: the pod is gone
    assert knows(a, doc(3)) is None
    await eventually(lambda: b.index.blocks(doomed) == 0, "B to drop the removed pod's records")
    c = make_router(server.url)  # starts later: replays the log, the purge included
    await c.start()
    try:
        await eventually(lambda: c.state.stats()["received_records"] > 0, "C to replay the log")
        await eventually(lambda: c.state._last_id != "0-0" and not c.state._outbox, "C caught up")
        assert c.index.blocks(doomed) == 0
    finally:
        await c.aclose()


async def test_a_replica_that_starts_later_routes_ongoing_conversations_like_the_others(pair, server):
    a, _b = pair
    homes = {i: a.route(chat(a, doc(i), "turn 1")).endpoint for i in range(5)}
    await eventually(lambda: a.state.stats()["outbox"] == 0 and a.state.counters["sent_records"] >= 5, "A's writes")
    c = make_router(server.url)
    await c.start()
    try:
        for i, home in homes.items():
            assert await eventually(lambda i=i: knows(c, doc(i)), f"C to replay doc {i}") == home
    finally:
        await c.aclose()


async def test_redis_down_at_start_routes_locally_then_shares_once_it_is_up(caplog):
    srv = RedisServer()  # its port is chosen, nothing listens yet
    caplog.set_level(logging.INFO, logger="kvroute.state")
    a, b = await started(make_router(srv.url), make_router(srv.url))
    try:
        await eventually(lambda: "redis unavailable" in caplog.text, "the warning")
        assert metric(a, "kvroute_redis_up") == 0 and a.state.counters["errors"] > 0
        t0 = time.perf_counter()
        home = a.route(chat(a, doc(7), "q")).endpoint  # routed on local state alone
        assert time.perf_counter() - t0 < FAST["timeout_s"]
        srv.start(same_port=True)
        t_up = time.monotonic()
        await eventually(lambda: a.state.up and b.state.up, "both replicas to connect", timeout=10)
        # What A routed while Redis was down reaches B now (the outbox was kept).
        assert await eventually(lambda: knows(b, doc(7)), "B to learn A's record made during the outage") == home
        assert time.monotonic() - t_up < 10
        assert metric(a, "kvroute_redis_up") == 1
    finally:
        await a.aclose()
        await b.aclose()
        srv.stop()


async def test_redis_killed_and_restarted_empty_under_routing(pair, server, caplog):
    a, b = pair
    caplog.set_level(logging.INFO, logger="kvroute.state")
    before = {i: finished(a, chat(a, doc(i), "turn 1")) for i in range(4)}
    await eventually(lambda: all(knows(b, doc(i)) == before[i] for i in before), "B to learn A's records")
    held = a.route(chat(a, doc(20), "q"))  # in flight on A while Redis dies, and after
    await eventually(lambda: b.registry.by_address[held.endpoint].peer_inflight == 1, "B to count it")
    server.kill()
    during = {}
    for i in range(10, 14):  # routing goes on, on local state
        t0 = time.perf_counter()
        during[i] = finished(a, chat(a, doc(i), "turn 1"))
        assert time.perf_counter() - t0 < FAST["timeout_s"]
        await asyncio.sleep(0.02)
    await eventually(lambda: not a.state.up and not b.state.up, "both to notice")
    assert metric(a, "kvroute_redis_up") == 0 and "redis unavailable" in caplog.text
    # A silent peer's load stops counting (B cannot hear A: its request on A is released or not).
    await eventually(lambda: b.registry.by_address[held.endpoint].peer_inflight == 0, "A's load to expire on B")
    server.start(same_port=True)  # empty: no persistence
    t_back = time.monotonic()
    await eventually(lambda: a.state.up and b.state.up, "both to reconnect", timeout=10)
    for i, home in during.items():  # made during the outage, delivered after
        assert await eventually(lambda i=i: knows(b, doc(i)), f"B to learn doc {i}", timeout=10) == home
    await eventually(lambda: a.state.counters["resyncs"] >= 1, "A to notice Redis lost its data")
    await eventually(lambda: b.registry.by_address[held.endpoint].peer_inflight == 1, "A's load on B again")
    assert time.monotonic() - t_back < 10
    assert "sharing resumed" in caplog.text
    # The log is rebuilt: a replica that starts now learns conversations from before the restart.
    c = make_router(server.url)
    await c.start()
    try:
        for i, home in before.items():
            assert await eventually(lambda i=i: knows(c, doc(i)), f"C to learn doc {i}") == home
    finally:
        await c.aclose()


async def test_slow_redis_never_holds_a_decision(pair, server, caplog):
    a, b = pair
    caplog.set_level(logging.INFO, logger="kvroute.state")
    timeout = FAST["timeout_s"]
    with server.client() as c:
        c.execute_command("CLIENT", "PAUSE", "1500", "ALL")  # Redis answers nothing for 1.5 s
    t_pause = time.monotonic()
    worst_decision, worst_lag = 0.0, 0.0
    i = 0
    while time.monotonic() - t_pause < 1.4:
        t0 = time.perf_counter()
        out = a.route(chat(a, doc(i % 7), f"q{i}"))
        worst_decision = max(worst_decision, time.perf_counter() - t0)
        a.release(out.endpoint, out.local_prefill)
        t1 = time.perf_counter()
        await asyncio.sleep(0.005)  # the loop stays free for the next request: nothing blocks it
        worst_lag = max(worst_lag, time.perf_counter() - t1 - 0.005)
        i += 1
    assert worst_decision < timeout and worst_lag < timeout, (worst_decision, worst_lag)
    assert a.state.counters["timeouts"] >= 1 and not a.state.up
    assert metric(a, "kvroute_redis_up") == 0 and "redis unavailable" in caplog.text
    await eventually(lambda: a.state.up and b.state.up, "sharing to resume after the pause")
    out = a.route(chat(a, doc(99), "q"))
    assert await eventually(lambda: knows(b, doc(99)), "B to learn a record made after the pause") == out.endpoint


async def test_auth_password_from_the_environment_and_acl_user(monkeypatch, caplog):
    with RedisServer(password="s3cret-pw") as srv:
        monkeypatch.setenv("KVROUTE_REDIS_PASSWORD", "s3cret-pw")
        with srv.client() as c:  # an ACL user that may touch its own prefix only
            c.execute_command("ACL", "SETUSER", "kvroute", "on", ">user-pw", "~acl:*", "+@all")
        a = make_router(srv.url)  # password from KVROUTE_REDIS_PASSWORD
        b = make_router(srv.url, username="kvroute", password="user-pw", key_prefix="acl:")
        wrong = make_router(srv.url, password="nope")
        await started(a, b, wrong)
        try:
            await eventually(lambda: a.state.up and b.state.up, "both authenticated")
            out = a.route(chat(a, doc(1), "q"))
            await eventually(lambda: a.state.counters["sent_records"] >= 1, "A's write")
            out_b = b.route(chat(b, doc(2), "q"))
            await eventually(lambda: b.state.counters["sent_records"] >= 1, "B's write under its ACL")
            assert out.endpoint and out_b.endpoint
            caplog.set_level(logging.INFO, logger="kvroute.state")
            await eventually(lambda: wrong.state.counters["errors"] >= 1, "the wrong password to fail")
            assert not wrong.state.up and wrong.route(chat(wrong, doc(3), "q")).endpoint in PODS
        finally:
            for r in (a, b, wrong):
                await r.aclose()


async def test_tls_with_client_certificates(tmp_path):
    certs = make_certs(tmp_path, {"redis": "IP:127.0.0.1", "client": "DNS:kvroute"})
    tls = {"cert": certs / "redis.crt", "key": certs / "redis.key", "ca": certs / "ca.crt"}
    with RedisServer(tls=tls) as srv:
        client_tls = {"ca_file": str(certs / "ca.crt"), "cert_file": str(certs / "client.crt"),
                      "key_file": str(certs / "client.key")}  # fmt: skip
        a, b = await started(make_router(srv.url, tls=client_tls), make_router(srv.url, tls=client_tls))
        no_ca = make_router(srv.url)  # the system CAs do not know the test CA
        await no_ca.start()
        try:
            await _assert_shared(a, b)
            await eventually(lambda: no_ca.state.counters["errors"] >= 1, "an untrusted server to be refused")
            assert not no_ca.state.up
        finally:
            for r in (a, b, no_ca):
                await r.aclose()


async def test_redis_cluster():
    with RedisCluster() as cluster:
        a, b = await started(make_router(cluster.url, mode="cluster"), make_router(cluster.url, mode="cluster"))
        try:
            await _assert_shared(a, b)
        finally:
            await a.aclose()
            await b.aclose()


async def test_redis_sentinel():
    with RedisSentinel() as s:
        kw = {"mode": "sentinel", "sentinel_master": RedisSentinel.MASTER}
        a, b = await started(make_router(s.url, **kw), make_router(s.url, **kw))
        try:
            await _assert_shared(a, b)
            with s.master.client() as c:  # the data is on the master the sentinel named
                assert c.exists("kvroute:{log}")
        finally:
            await a.aclose()
            await b.aclose()


async def _assert_shared(a: Router, b: Router) -> None:
    await eventually(lambda: a.state.up and b.state.up, "both replicas connected")
    home = a.route(chat(a, doc(11), "q")).endpoint
    assert await eventually(lambda: knows(b, doc(11)), "B to learn A's record") == home
    out = b.route(chat(b, doc(11), "turn 2"))
    assert (out.endpoint, out.decision.reason) == (home, "prefix")
