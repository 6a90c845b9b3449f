"""bench.servicer: kvroute's servicer and the do-nothing one driven in-process, a few requests."""

import time

import pytest

from bench.servicer import (
    ENVOY_H2_NEXT,
    PODS,
    SERVERS,
    TRANSPORTS,
    Evictor,
    H2Driver,
    ProcessDriver,
    answers,
    batch_cpu,
    h2_frames,
    kvroute_processor,
    long_run,
    make_servicers,
    measure,
    new_conversations,
    request_messages,
    routed,
)
from extproc import h2

CHAT = b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_both_servicers_route_the_bench_requests_and_figures_come_per_round(transport):
    servicers = make_servicers(transport)
    messages = request_messages(CHAT)
    for name in SERVERS:
        assert await routed(servicers[name], messages) in PODS
        got = answers(servicers[name], await servicers[name].exchange(messages))
        assert [a.WhichOneof("response") for a in got] == ["request_headers", "request_body"]
    fig = await measure("1k", requests=3, rounds=2, transport=transport)
    assert {k: len(v) for k, v in fig.rounds.items()} == {"kvroute": 2, "noop": 2}
    s = fig.summary()
    assert s["kvroute_min_us"] > 0 and s["noop_min_us"] > 0
    assert s["own_min_us"] == pytest.approx(s["kvroute_min_us"] - s["noop_min_us"])


async def test_an_answer_that_does_not_route_fails_the_bench():
    kvroute = make_servicers()["kvroute"]
    not_json = request_messages(b"{not json")  # kvroute answers 400 at once: no routing to time
    with pytest.raises(RuntimeError, match="expected a headers and a body answer"):
        await routed(kvroute, not_json)


async def test_evicting_the_caches_times_only_the_requests():
    evict = Evictor(1)
    assert evict._dst != evict._src  # nothing copied yet
    evict()
    assert evict._dst == evict._src and len(evict._dst) == 1 << 20

    def burn() -> None:  # an eviction that costs 50 ms of CPU: were it timed, the batch would show it
        t0 = time.process_time()
        while time.process_time() - t0 < 0.05:
            pass

    noop = make_servicers()["noop"]
    messages = request_messages(CHAT)
    assert await batch_cpu(noop, [messages] * 4, burn) < 0.05
    fig = await measure("1k", requests=2, rounds=1, evict_mib=1)
    assert {k: len(v) for k, v in fig.rounds.items()} == {"kvroute": 1, "noop": 1}


async def test_over_h2_each_request_is_a_stream_opened_as_envoy_opens_it():
    """The h2 driver's streams go through extproc/h2.py's connection: the later ones open with the block Envoy
    repeats (decoded once, from then on remembered), and each ends with its trailers (grpc-status 0)."""
    driver = make_servicers("h2")["kvroute"]
    messages = request_messages(CHAT)
    for _ in range(3):
        kind, flags, sid, _ = h2_frames(await driver.exchange(messages))[-1]
        assert (kind, flags, sid) == (h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, driver._sid)  # the trailers end it
    assert ENVOY_H2_NEXT in driver._conn._blocks
    noop = make_servicers("h2")["noop"]
    for _ in range(400):  # ~120 KB of answers: past the 64 KiB an HTTP/2 peer may send before its window grows
        await noop.exchange(messages)


async def test_a_long_run_times_each_window_of_new_conversations():
    kvroute = kvroute_processor()
    driver = ProcessDriver(kvroute)
    for body in new_conversations(10):
        await driver.exchange(request_messages(body))
    ends = kvroute.router.index._ends  # type: ignore[attr-defined]
    assert len(ends) == 10  # every request ends a prompt of its own, as a new conversation's turn does
    figures = await long_run(61, window=20)
    assert [served for served, _ in figures] == [21, 41, 61]
    assert all(us > 0 for _, us in figures)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_exchange_gives_the_loop_the_turn_a_server_gives_it_between_requests(transport):
    """kvroute leaves a decision's record, metrics and demand to the loop once its answer is out
    (Router.settle): an exchange ends after that turn, so the bench times them and nothing piles up."""
    kvroute = kvroute_processor()
    driver = ProcessDriver(kvroute) if transport == "process" else H2Driver(kvroute.h2_call)
    for body in new_conversations(3):
        await driver.exchange(request_messages(body))
        assert not kvroute.router._books  # settled within the exchange
    assert len(kvroute.router.index._ends) == 3  # type: ignore[attr-defined]
