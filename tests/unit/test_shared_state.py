"""Shared state without a server: the protocol's local pieces, peers' load on a pod, the redis config
and flag, and how a replica applies log entries (tests/integration/test_redis_state.py runs Redis)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from extproc.cli import _parser, build, main
from extproc.config import ConfigError, build_config
from extproc.endpoints.pool import EndpointState, PrefillQueue
from extproc.index.approx import ApproxPrefixIndex
from extproc.observability import Metrics
from extproc.router import Router
from extproc.state import LocalRouteTable, LocalState, make_state
from extproc.state.redis_state import RedisState
from extproc.state.replicated import IDLE_FLUSH_S

POOL = {"pools": {"p": {"endpoints": [{"address": "127.0.0.1:8001"}, {"address": "127.0.0.1:8002"}]}}}
A, B = "127.0.0.1:8001", "127.0.0.1:8002"


def test_local_route_table_is_a_bounded_lru():
    t = LocalRouteTable(2)
    t.put(1, A)
    t.put(2, B)
    assert t.get(1) == A  # used: 2 is now the oldest
    t.put(3, A)
    assert (t.get(1), t.get(2), t.get(3)) == (A, None, A)
    t.forget_endpoint(A)
    assert len(t) == 0


def test_without_redis_the_router_keeps_its_state_in_process():
    r = Router(build_config(POOL), Metrics())
    assert isinstance(r.state, LocalState) and isinstance(r.index, ApproxPrefixIndex)


def test_peers_prefills_queue_ahead_of_a_new_one_and_the_pod_runs_all_at_one_second_per_second():
    q = PrefillQueue()
    now = 100.0
    q.add(0.2, now)
    q.set_peer("b", 0.5, now)
    q.set_peer("c", 0.3, now)
    assert q.wait(now) == pytest.approx(1.0)  # a new prefill starts after this replica's and the peers'
    # The pod shares its time in proportion (0.2 : 0.5 : 0.3): 0.5 s later half of everything ran.
    assert q.wait(now + 0.5) == pytest.approx(0.5)  # counting each part down at full speed read 0.0
    assert q.own_wait(now + 0.5) == pytest.approx(0.1)  # what this replica reports: its own part only
    assert q.served == pytest.approx(0.1)
    q.set_peer("b", 0.0, now + 0.5)  # b's prefills are done
    assert q.wait(now + 0.5) == pytest.approx(0.25)
    q.add(0.1, now + 0.5)  # behind its own 0.1 s
    assert q.own_wait(now + 0.5) == pytest.approx(0.2)
    assert q.wait(now + 0.85) == pytest.approx(0.0)  # all of it, 0.35 s, ran by now
    assert q.served == pytest.approx(0.3)


def test_a_queue_fed_by_three_replicas_drains_once_not_three_times():
    """Three replicas each queue 1 s of prefill on one pod: every replica's view of the wait drops at
    one second per second, and each replica's own part at the pace its peers count it down."""
    views = {r: PrefillQueue() for r in "abc"}
    for r, q in views.items():
        q.add(1.0, 0.0)
        for peer in "abc".replace(r, ""):
            q.set_peer(peer, 1.0, 0.0)
    for t in (0.6, 1.5, 2.4):
        assert all(q.wait(t) == pytest.approx(3.0 - t) for q in views.values())
        # what each reports is what the others hold for it: no message needed while it only drains
        assert all(q.own_wait(t) == pytest.approx((3.0 - t) / 3) for q in views.values())
    assert all(q.wait(3.1) == 0.0 for q in views.values())


def test_a_leg_past_its_estimate_holds_this_replicas_queue_while_the_peers_part_runs():
    q = PrefillQueue()
    q.add(0.4, 0.0, reports_within=10.0)  # a gateway leg: it reports its end
    q.add(0.5, 0.0)
    q.set_peer("b", 1.0, 0.0)
    assert q.wait(0.0) == pytest.approx(1.9)
    # The leg's 0.4 s ran by 1.4/... at 0.4/1.4 of the pod; then it is late: ours wait, b's part runs.
    assert q.own_wait(2.0) == pytest.approx(0.5)
    assert q.wait(2.0) == pytest.approx(0.5)  # b's part ran out meanwhile
    q.finished(1, 2.0)
    assert q.wait(2.5) == pytest.approx(0.0)


def test_a_pods_load_is_its_own_plus_the_peers():
    e = EndpointState(address=A, role="both", cluster="c", pool="p")
    e.inflight = 2  # this replica's
    e.set_peer_load("b", 3, 0.0, 0.0)
    assert (e.inflight, e.own_load(0.0)) == (5, (2, 0.0, 0.0))
    e.set_peer_load("c", 1, 0.0, 0.0)
    assert (e.inflight, e.peer_inflight) == (6, 4)
    e.set_peer_load("b", 1, 0.0, 0.0)
    assert (e.inflight, e.own_load(0.0)) == (4, (2, 0.0, 0.0))
    e.set_peer_load("b", 0, 0.0, 0.0)
    e.set_peer_load("c", 0, 0.0, 0.0)
    assert (e.inflight, e.peer_inflight, e.peers_inflight) == (2, 0, {})


def test_release_never_takes_a_peers_request():
    r = Router(build_config(POOL), Metrics())
    e = r.registry.by_address[A]
    r.registry.acquire(A)
    e.set_peer_load("b", 2, 0.0, 0.0)
    r.registry.release(A)
    r.registry.release(A)  # one too many: the peers' two stay
    assert (e.inflight, e.peer_inflight) == (2, 2)


@pytest.mark.parametrize(
    "redis,needle",
    [
        ({"url": "http://h:1"}, "redis.url: 'http://h:1': use redis://host:port/db or rediss:// (TLS)"),
        ({"url": "redis://h/x"}, "the database is a number"),
        ({"mode": "cluster"}, "redis: mode cluster: needs url"),
        ({"url": "redis://h", "mode": "sentinel"}, "needs sentinel_master"),
        ({"url": "redis://h/2", "mode": "cluster"}, "Redis Cluster has database 0 only"),
        ({"url": "redis://h", "tls": {}}, "tls: needs a rediss:// url"),
        ({"url": "rediss://h", "tls": {"ca_file": "/nonexistent/ca.crt"}}, "ca_file: /nonexistent/ca.crt does not"),
        ({"url": "redis://h", "key_prefix": "a b"}, "redis.key_prefix: 'a b': a non-empty prefix without spaces"),
        ({"url": "redis://h", "heartbeat_s": 5}, "heartbeat_s must be shorter than peer_timeout_s"),
        ({"url": "redis://h", "mode": "sentinel", "sentinel_master": "m", "sentinels": ["h:x"]}, "is not host:port"),
    ],
)
def test_redis_config_errors_name_the_field(redis, needle):
    with pytest.raises(ConfigError) as e:
        build_config({**POOL, "redis": redis})
    assert needle in str(e.value)


def test_redis_url_flag_and_the_password_stays_hidden(tmp_path, capsys):
    args = _parser().parse_args(["serve", "--endpoints", A, "--redis-url", "redis://127.0.0.1:6390/2"])
    assert build(args).redis.url == "redis://127.0.0.1:6390/2"
    p = tmp_path / "k.yaml"
    p.write_text(f"pools: {{p: {{endpoints: [{{address: '{A}'}}]}}}}\nredis: {{url: 'redis://h:1/0', password: hush}}")
    assert main(["check-config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "hush" not in out and '"password": "**********"' in out


def _state() -> RedisState:
    cfg = build_config({**POOL, "redis": {"url": "redis://127.0.0.1:1/0", "outbox_records": 100}})
    state = make_state(cfg)
    assert isinstance(state, RedisState)
    return state


def test_the_outbox_is_bounded_and_counts_what_it_drops():
    s = _state()
    routes = s.route_table(10)
    for i in range(150):
        routes.put(i, A)
    assert s.stats()["outbox"] == 100 and s.counters["dropped_records"] == 50


def test_applying_entries_own_peers_and_replayed_history():
    s = _state()
    index = ApproxPrefixIndex(100)
    s.share_index("approx", index)
    pod = EndpointState(address=A, role="both", cluster="c", pool="p")
    s.bind_pods({A: pod})
    keys = (1 << 64) - 1, 7, 8  # u64 block hashes, the largest included

    def entry(replica: str, age_s: float, load: int) -> dict[bytes, bytes]:
        import array

        packed = array.array("Q", keys).tobytes()
        body = {"o": [["x", "approx", A, packed], ["x", "approx", "10.9.9.9:1", packed]], "l": [[A, load, 0.5]]}
        return {b"r": replica.encode(), b"m": msgpack.packb({**body, "t": time.time() - age_s})}

    s.apply(entry(s.replica, 0, 9))  # its own entry, read back: ignored
    assert index.match(keys, [A]) == {} and pod.inflight == 0
    s.apply(entry("peer1", 60, 4))  # history: the record counts, the load is long over
    assert index.match(keys, [A]) == {A: 3} and pod.inflight == 0
    assert index.blocks("10.9.9.9:1") == 0  # a pod this replica does not know is not recorded
    s.apply(entry("peer1", 0, 4))
    s.apply(entry("peer2", 0, 1))
    assert (pod.inflight, pod.peer_inflight) == (5, 5) and pod.prefills.wait(time.monotonic()) > 0.9
    s._expire_peers(time.monotonic() + 10)  # both silent since: their load no longer counts
    assert (pod.inflight, pod.peer_inflight) == (0, 0)


def test_a_peer_learns_where_a_recorded_prompt_ended_but_not_from_a_head():
    """Whether a request continues a conversation (index/ends.py) is read from the index's records, so
    a replica routing a conversation's next turn knows its previous turn ended there whichever replica
    routed it; a record of a prompt's head (decided before the rest was tokenized) is no prompt end."""
    writer, reader = _state(), _state()
    shared = writer.share_index("approx", ApproxPrefixIndex(100))
    peer_index = ApproxPrefixIndex(100)
    reader.share_index("approx", peer_index)
    reader.bind_pods({A: EndpointState(address=A, role="both", cluster="c", pool="p")})
    shared.record([1, 2, 3], A)
    shared.record([5, 6], A, False)
    ops = [writer._pack(op) for op in writer._outbox]
    assert [len(op) for op in ops] == [4, 5]  # the head's record carries the flag; a whole prompt's, as before
    reader.apply({b"r": b"peer", b"m": msgpack.packb({"o": ops, "t": time.time()})})
    assert peer_index.match([1, 2, 3], [A]) == {A: 3} and peer_index.match([5, 6], [A]) == {A: 2}
    assert peer_index.continues([1, 2, 3, 4], 3) and not peer_index.continues([5, 6, 7], 2)
    assert shared.continues([1, 2, 3, 4], 3) and not shared.continues([5, 6, 7], 2)


def test_a_purged_pod_is_not_written_again_after_redis_loses_its_data():
    s = _state()
    index = s.share_index("approx", ApproxPrefixIndex(100))
    routes = s.route_table(10)
    s._ring.extend([["x", "approx", A, b"k"], ["x", "approx", B, b"k"], ["p", 1, A]])  # sent before
    routes.forget_endpoint(A)
    assert list(s._ring) == [["x", "approx", A, b"k"], ["x", "approx", B, b"k"]]
    index.remove_endpoint(A)
    assert list(s._ring) == [["x", "approx", B, b"k"]]


def test_a_load_is_sent_again_only_when_it_changes():
    """Requests in flight with nothing queued, or a queue draining as announced, are no news: the
    writer would otherwise send every busy pod's load at every flush (5 ms) to every replica."""
    s = _state()
    pod = EndpointState(address=A, role="both", cluster="c", pool="p")
    s.bind_pods({A: pod})
    pod.inflight = 1
    now = time.monotonic()

    def sent(at: float) -> None:  # as _delivered records it
        loads = s._own_loads(at, force=True)
        assert loads is not None
        s._sent_loads = {ep: (n, q, ran) for ep, n, q, ran in loads}

    assert s._own_loads(now, force=False) == [(A, 1, 0.0, 0.0)]
    sent(now)
    assert s._own_loads(now + 0.5, force=False) is None  # still one in flight, nothing queued
    assert s._own_loads(now + 0.5, force=True) is not None  # the heartbeat
    pod.prefills.add(1.0, now + 0.5)
    assert s._own_loads(now + 0.5, force=False) == [(A, 1, 1.0, 0.0)]  # a prefill queued
    sent(now + 0.5)
    assert s._own_loads(now + 1.0, force=False) is None  # draining as announced
    pod.prefills.set_peer("peer", 1.0, now + 1.0)  # now it drains at half speed, as the peers see it too
    assert s._own_loads(now + 1.2, force=False) is None
    pod.inflight = 2
    # it ran at a third of the pod (0.5 : 1.0) since +1.0
    assert s._own_loads(now + 1.2, force=False) == [(A, 2, 0.4333, pytest.approx(0.5 + 0.2 / 3))]
    sent(now + 1.2)
    pod.prefills.add(0.3, now + 1.2)  # more queued: news
    assert s._own_loads(now + 1.2, force=False) is not None
    pod.inflight = 0
    pod.prefills = type(pod.prefills)()
    assert s._own_loads(now + 2.0, force=False) == []  # idle now: the peers must hear it


async def test_an_idle_writer_waits_for_a_record_instead_of_polling():
    s = _state()
    s._wake = asyncio.Event()  # as _start_loops makes it
    t = time.monotonic()
    assert await s._idle()  # nothing in flight, nothing to send: it waited out IDLE_FLUSH_S
    assert time.monotonic() - t >= IDLE_FLUSH_S * 0.9
    waiter = asyncio.create_task(s._idle())
    await asyncio.sleep(0)
    s.emit(["p", 1, A])  # a record wakes it at once
    assert await asyncio.wait_for(waiter, IDLE_FLUSH_S / 2)
    assert not await s._idle()  # the record is unsent: no waiting
    s._outbox.clear()
    s._sent_loads = {A: (1, 0.0)}
    assert not await s._idle()  # a request in flight: the writer keeps its flush interval
