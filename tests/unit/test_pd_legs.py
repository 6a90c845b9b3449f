"""Gateway prefill legs paced per prefill pod (pd.prefill_step_tokens), against a loopback HTTP pod
that records which legs it was serving at once."""

import asyncio

import pytest
from aiohttp import web

from extproc.pd import PrefillClient
from tests.backends import serve_loopback

STEP = 8192


class RecordingPod:
    """Answers prefill legs after ``hold_s`` with kv_transfer_params; keeps, per leg, the set of
    legs in flight when it arrived, and the arrival order."""

    def __init__(self, hold_s: float = 0.05) -> None:
        self.hold_s = hold_s
        self.inflight: set[str] = set()
        self.seen_with: dict[str, set[str]] = {}
        self.order: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        rid = request.headers["x-request-id"]
        body = await request.json()
        assert body["max_tokens"] == 1 and body["stream"] is False
        self.order.append(rid)
        self.inflight.add(rid)
        for other in self.inflight:
            self.seen_with.setdefault(other, set()).update(self.inflight - {other})
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.inflight.discard(rid)
        return web.json_response({"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": rid}})


@pytest.fixture
async def pods():
    started = []

    async def start(hold_s: float = 0.05) -> tuple[str, RecordingPod]:
        pod = RecordingPod(hold_s)
        app = web.Application()
        app.router.add_post("/v1/completions", pod.handle)
        runner, port = await serve_loopback(app)
        started.append(runner)
        return f"127.0.0.1:{port}", pod

    yield start
    for r in started:
        await r.cleanup()


async def send_in_order(client: PrefillClient, legs: list[tuple[str, str, int]], step: int = STEP, timeout_s=5.0):
    """Start the legs one after the other (each queued before the next starts), then wait for all."""
    tasks = []
    for pod, rid, tokens in legs:
        tasks.append(
            asyncio.create_task(
                client.prefill(pod, "/v1/completions", {"prompt": "x"}, rid, timeout_s, tokens, step_tokens=step)
            )
        )
        await asyncio.sleep(0.005)
    return await asyncio.gather(*tasks)


async def test_documents_take_a_prefill_pod_one_at_a_time_and_short_prompts_join_them(pods) -> None:
    address, pod = await pods()
    client = PrefillClient()
    try:
        legs = await send_in_order(
            client,
            [(address, "doc-a", 6000), (address, "doc-b", 6000), (address, "chat-c", 300), (address, "chat-d", 300)],
        )
    finally:
        await client.aclose()
    assert [leg.why for leg in legs] == ["ok"] * 4
    # The chats share doc-a's step (they stretch it by their own few tokens) instead of queueing
    # behind doc-b, which waits for doc-a: two documents never share a step they do not fit.
    assert pod.order == ["doc-a", "chat-c", "chat-d", "doc-b"]
    assert pod.seen_with["doc-a"] == {"chat-c", "chat-d"}
    assert legs[0].wait_s < 0.02 and legs[1].wait_s >= 0.04 and legs[2].wait_s < 0.02


async def test_a_stream_of_short_prompts_cannot_starve_a_waiting_document(pods) -> None:
    address, pod = await pods()
    client = PrefillClient()
    try:
        await send_in_order(client, [(address, "chat-1", 1000), (address, "doc", 7500), (address, "chat-2", 300)])
    finally:
        await client.aclose()
    # doc does not fit beside chat-1 and waits; behind legs that are all short, chat-2 queues after it.
    assert pod.order == ["chat-1", "doc", "chat-2"]
    assert "doc" not in pod.seen_with.get("chat-1", set())


async def test_each_prefill_pod_is_paced_on_its_own_and_zero_turns_pacing_off(pods) -> None:
    (a, pod_a), (b, pod_b) = await pods(), await pods()
    client = PrefillClient()
    try:
        await send_in_order(client, [(a, "a1", 6000), (b, "b1", 6000)])
        await send_in_order(client, [(a, "a2", 6000), (a, "a3", 6000)], step=0)
    finally:
        await client.aclose()
    assert pod_a.order == ["a1", "a2", "a3"] and pod_b.order == ["b1"]
    assert pod_a.seen_with["a2"] == {"a3"}, "pacing off: both legs at once"
    assert not client.pacer._lanes


async def test_a_leg_that_gets_no_turn_in_time_falls_back_and_frees_nothing_it_did_not_hold(pods) -> None:
    address, pod = await pods(hold_s=0.4)
    client = PrefillClient()
    try:
        first = asyncio.create_task(
            client.prefill(address, "/v1/completions", {"prompt": "x"}, "long", 5.0, 6000, STEP)
        )
        await asyncio.sleep(0.02)
        late = await client.prefill(address, "/v1/completions", {"prompt": "x"}, "late", 0.1, 6000, STEP)
        assert late.params is None and late.why == "timeout" and late.wait_s >= 0.1
        assert (await first).why == "ok"
        # The pod's turn came back: a new leg goes at once.
        pod.hold_s = 0.01
        again = await client.prefill(address, "/v1/completions", {"prompt": "x"}, "again", 1.0, 6000, STEP)
    finally:
        await client.aclose()
    assert again.why == "ok" and again.wait_s < 0.05
    assert pod.order == ["long", "again"], "the timed-out leg never reached the pod"
    assert not client.pacer._lanes


async def test_a_cancelled_wait_leaves_the_queue_behind_it_moving(pods) -> None:
    address, pod = await pods(hold_s=0.2)
    client = PrefillClient()
    try:
        first = asyncio.create_task(client.prefill(address, "/v1/completions", {"prompt": "x"}, "a", 5.0, 6000, STEP))
        await asyncio.sleep(0.02)
        gone = asyncio.create_task(client.prefill(address, "/v1/completions", {"prompt": "x"}, "gone", 5.0, 6000, STEP))
        await asyncio.sleep(0.01)
        behind = asyncio.create_task(client.prefill(address, "/v1/completions", {"prompt": "x"}, "c", 5.0, 6000, STEP))
        await asyncio.sleep(0.01)
        gone.cancel()  # the client hung up while its leg waited
        results = await asyncio.gather(first, behind)
    finally:
        await client.aclose()
    assert [r.why for r in results] == ["ok", "ok"]
    assert pod.order == ["a", "c"] and pod.seen_with.get("a", set()) == set()
    assert not client.pacer._lanes
    assert results[1].params == {"do_remote_prefill": True, "remote_engine_id": "c"}
