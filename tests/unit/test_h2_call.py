"""``H2Call``: the ext_proc state machine over extproc/h2.py's streams (a fake stream here, no network)."""

import asyncio
import time

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import h2
from extproc.rollout import ROLLOUT_METADATA
from tests.unit.test_server_stream import DEST, PODS, body_msgs, chat, headers_msg, inflight, make, make_pd, set_headers


class FakeStream:
    """What H2Call answers through: each message sent, and the status it finished with."""

    def __init__(self, headers=None):
        self.headers = headers or {}
        self.sent: list[pb.ProcessingResponse] = []
        self.status: tuple[int, str] | None = None

    def send(self, data: bytes) -> None:
        assert self.status is None, "sent after finish"
        self.sent.append(pb.ProcessingResponse.FromString(data))

    def finish(self, status: int = h2.OK, message: str = "") -> None:
        assert self.status is None, "finished twice"
        self.status = (status, message)

    def kinds(self):
        return [r.WhichOneof("response") for r in self.sent]


def feed(call, msgs):
    for m in msgs:
        call.on_message(m.SerializeToString())


async def test_buffered_request_answered_in_the_read_callback_and_released_at_the_end():
    proc, router = make()
    stream = FakeStream()
    call = proc.h2_call(stream)
    feed(call, [headers_msg(), *body_msgs(chat(), cuts=(100,))])
    assert stream.kinds() == ["request_headers", "request_body", "request_body"]  # no task was needed
    assert set_headers(stream.sent[-1].request_body.response)[DEST] in PODS
    assert inflight(router) == 1 and proc._open == 1
    call.on_end()
    assert stream.status == (h2.OK, "")
    assert inflight(router) == 0 and proc._open == 0


async def test_a_reset_releases_the_pod_slot():
    proc, router = make()
    stream = FakeStream()
    call = proc.h2_call(stream)
    feed(call, [headers_msg(), *body_msgs(chat())])
    assert inflight(router) == 1
    call.on_reset()  # Envoy's RST_STREAM (the client went away), or the connection lost
    assert inflight(router) == 0 and proc._open == 0 and stream.status is None
    call.on_reset()  # twice: nothing more released
    assert inflight(router) == 0 and proc._open == 0


async def test_messages_behind_a_waiting_answer_keep_their_order():
    """A prefill leg (st.after) runs as a task; the trailers that came meanwhile are answered after it,
    and the stream's end waits for both."""
    proc, _ = make_pd()
    stream = FakeStream()
    call = proc.h2_call(stream)
    feed(call, [headers_msg(mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=chat(), end_of_stream=False)),
                pb.ProcessingRequest(request_trailers=pb.HttpTrailers())])  # fmt: skip
    call.on_end()
    assert stream.status is None  # the leg is still running
    for _ in range(100):
        if stream.status is not None:
            break
        await asyncio.sleep(0.01)
    assert stream.kinds() == [None, "request_headers", "request_body", "request_trailers"]
    assert stream.sent[2].request_body.response.body_mutation.streamed_response.body == b'{"handed": "off"}'
    assert stream.status == (h2.OK, "") and proc._open == 0


async def test_over_max_streams_is_refused_and_holds_nothing():
    proc, _ = make(server={"max_streams": 1})
    first = proc.h2_call(FakeStream())
    second_stream = FakeStream()
    second = proc.h2_call(second_stream)
    assert second_stream.status is not None and second_stream.status[0] == h2.RESOURCE_EXHAUSTED
    feed(second, [headers_msg()])  # ignored: the refused call has no state
    assert second_stream.sent == [] and proc._open == 1
    assert proc.metrics.registry.get_sample_value("kvroute_streams_limited_total", {"reason": "max_streams"}) == 1
    first.on_end()
    assert proc._open == 0


async def test_an_idle_stream_is_ended_and_released():
    proc, router = make(server={"stream_idle_timeout_s": 0.05})
    stream = FakeStream()
    call = proc.h2_call(stream)
    feed(call, [headers_msg(), *body_msgs(chat())])
    assert inflight(router) == 1
    for _ in range(200):
        if stream.status is not None:
            break
        await asyncio.sleep(0.01)
    assert stream.status is not None and stream.status[0] == h2.CANCELLED
    assert inflight(router) == 0 and proc._open == 0
    assert proc.metrics.registry.get_sample_value("kvroute_streams_limited_total", {"reason": "idle"}) == 1


async def test_a_failing_message_ends_the_stream_and_counts_it(monkeypatch):
    proc, router = make()
    stream = FakeStream()
    call = proc.h2_call(stream)

    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(proc, "answer", boom)
    feed(call, [headers_msg()])
    assert stream.status is not None and stream.status[0] == h2.INTERNAL  # Envoy fails open on it
    assert router.metrics.registry.get_sample_value("kvroute_errors_total", {"kind": "internal"}) == 1
    assert proc._open == 0
    call.on_end()  # the client's end after that: nothing more
    assert proc._open == 0


async def test_the_route_shadow_metadata_is_read_from_the_stream_headers():
    proc, _ = make()
    call = proc.h2_call(FakeStream({ROLLOUT_METADATA: "shadow"}))
    assert call.st is not None and call.st.shadow
    plain = proc.h2_call(FakeStream())
    assert plain.st is not None and not plain.st.shadow


async def test_a_reset_before_the_prefill_leg_starts_gives_the_leg_up():
    """A gateway split answered its timeout override and reset before its leg ran (the reset in the same
    read): the prefill pod's queue is not held back for a leg that will never report (it would be until
    the leg's timeout), and the decode pod expects no KV."""
    proc, legs = make_pd()
    router = proc.router
    prefill, decode = router.registry.pools["p"].endpoints
    stream = FakeStream()
    call = proc.h2_call(stream)
    feed(call, [headers_msg(), *body_msgs(chat("lorem ipsum " * 3000))])
    now = time.monotonic()
    assert prefill.prefills.wait(now) > 0 and decode.handoffs.pending(now) == 1  # the split, queued
    call.on_reset()  # before the task that runs the leg got a turn
    await asyncio.sleep(0)
    assert legs == [] and inflight(router) == 0
    now = time.monotonic()
    assert prefill.prefills.wait(now) == 0 and decode.handoffs.pending(now) == 0
