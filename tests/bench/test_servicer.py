"""bench.servicer: kvroute's servicer and the do-nothing one driven in-process, a few requests."""

import time

import pytest

from bench.servicer import (
    PODS,
    SERVERS,
    Evictor,
    StreamContext,
    batch_cpu,
    exchange,
    make_servicers,
    measure,
    request_messages,
    routed,
)


async def test_both_servicers_route_the_bench_requests_and_figures_come_per_round():
    servicers = make_servicers()
    messages = request_messages(b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}]}')
    for name in SERVERS:
        assert await routed(servicers[name], messages) in PODS
        assert await exchange(servicers[name], messages, StreamContext()) == 2  # the headers and the body answers
    fig = await measure("1k", requests=3, rounds=2)
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
    messages = request_messages(b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}]}')
    assert await batch_cpu(noop, [messages] * 4, burn) < 0.05
    fig = await measure("1k", requests=2, rounds=1, evict_mib=1)
    assert {k: len(v) for k, v in fig.rounds.items()} == {"kvroute": 1, "noop": 1}
