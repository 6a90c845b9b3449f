"""bench.servicer: kvroute's servicer and the do-nothing one driven in-process, a few requests."""

import pytest

from bench.servicer import PODS, SERVERS, StreamContext, exchange, make_servicers, measure, request_messages, routed


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
