"""The ext_authz transport's pieces: ext_proc answers as Check answers, the access log's finished
requests, and the slots held between a Check and its log entry."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import orjson
import pytest

from extproc import envoy
from extproc.authz import Pending

DEST = "x-gateway-destination-endpoint"


def test_a_routing_answer_becomes_ok_headers_and_the_filters_metadata():
    fallbacks = {DEST: "10.0.0.1:8000,10.0.0.2:8000"}
    resp = envoy.request_body_response(set_headers={DEST: "10.0.0.1:8000"}, remove=["x-kvroute-cluster"],
                                       clear_route_cache=True, metadata=fallbacks)  # fmt: skip
    out = envoy.check_answer([resp])
    assert out.status.code == 0 and out.HasField("ok_response")
    (h,) = out.ok_response.headers
    assert (h.header.key, h.header.value) == (DEST, "10.0.0.1:8000")
    assert list(out.ok_response.headers_to_remove) == ["x-kvroute-cluster"]
    assert out.dynamic_metadata.fields[DEST].string_value == "10.0.0.1:8000,10.0.0.2:8000"


def test_an_unrouted_answer_is_a_plain_ok():
    out = envoy.check_answer([envoy.request_body_response()])
    assert out.status.code == 0 and not out.ok_response.headers and not out.dynamic_metadata.fields


def test_a_refusal_is_the_denied_answer_with_the_same_body():
    out = envoy.check_answer([envoy.immediate(404, "model 'x' does not exist", "model_not_found", "model")])
    assert out.status.code != 0 and out.WhichOneof("http_response") == "denied_response"
    denied = out.denied_response
    assert denied.status.code == 404
    assert orjson.loads(denied.body)["error"]["message"] == "model 'x' does not exist"
    headers = {h.header.key: h.header.value for h in denied.headers}
    assert headers["content-type"] == "application/json" and headers["x-kvroute-error"] == "model_not_found"


def test_a_body_rewrite_cannot_be_carried():
    with pytest.raises(envoy.BodyRewriteNeeded):
        envoy.check_answer([envoy.request_body_response(set_headers={DEST: "a:1"}, body=b"{}")])
    with pytest.raises(envoy.BodyRewriteNeeded):
        envoy.check_answer([envoy.request_body_response(clear_body=True)])


def test_timeout_overrides_and_trailers_answers_are_skipped():
    resp = envoy.request_body_response(set_headers={DEST: "a:1"})
    out = envoy.check_answer([envoy.message_timeout_override(3.0), resp, envoy.request_trailers_response()])
    assert [h.header.value for h in out.ok_response.headers] == ["a:1"]


ROUTINGS = [
    {"set_headers": {DEST: "10.0.0.1:8000"}, "remove": ["x-kvroute-cluster"], "clear_route_cache": False,
     "metadata": {DEST: "10.0.0.1:8000,10.0.0.2:8000"}},
    {"set_headers": {"x-kvroute-cluster": "decode"}, "remove": [], "clear_route_cache": True, "metadata": None},
    {"remove": ["x-gateway-destination-endpoint"]},  # an unrouted request: only the client's header removed
]  # fmt: skip


@pytest.mark.parametrize("routing", ROUTINGS)
def test_a_routing_override_translates_as_its_answer_does(routing):
    # the transports read a routed request's override as is (Stream.routing) rather than its answer back:
    # both must give Envoy the same answer
    answers = [envoy.request_body_response(**routing)]
    assert envoy.check_answer(answers, routing) == envoy.check_answer(answers)
    assert envoy.http_answer(answers, routing) == envoy.http_answer(answers)


def test_read_check_takes_raw_bytes_or_the_text_body():
    req = envoy.CheckRequest()
    http = req.attributes.request.http
    http.headers[":path"] = "/v1/chat/completions"
    http.raw_body = b'{"a": "\xc3\xa9"}'
    assert envoy.read_check(req) == ({":path": "/v1/chat/completions"}, b'{"a": "\xc3\xa9"}')
    req2 = envoy.CheckRequest()
    req2.attributes.request.http.body = '{"a": "é"}'
    assert envoy.read_check(req2)[1] == '{"a": "é"}'.encode()


def test_finished_request_ids_skip_intermediate_entries():
    msg = envoy.AccessLogs()
    for rid, intermediate in (("r1", False), ("", False), ("r2", True), ("r3", False)):
        e = msg.http_logs.log_entry.add()
        e.request.request_id = rid
        e.common_properties.intermediate_log_entry = intermediate
    assert envoy.finished_request_ids(msg) == ["r1", "r3"]


class _Ep:
    """What Pending needs of ExternalProcessor: release, the timeout, a counter."""

    def __init__(self, timeout_s: float) -> None:
        self.released: list[object] = []
        self.router = SimpleNamespace(config=SimpleNamespace(server=SimpleNamespace(stream_idle_timeout_s=timeout_s)))
        counter = SimpleNamespace(inc=lambda: None)
        self.metrics = SimpleNamespace(streams_limited=SimpleNamespace(labels=lambda _kind: counter))

    def release(self, st: object) -> None:
        self.released.append(st)


def test_pending_releases_on_the_log_entry_and_after_the_timeout():
    async def go() -> None:
        ep = _Ep(timeout_s=0.2)
        pending = Pending(ep)  # type: ignore[arg-type]
        pending.hold("a", "stream-a")  # type: ignore[arg-type]
        pending.hold("b", "stream-b")  # type: ignore[arg-type]
        assert pending.done("a") and not pending.done("a") and not pending.done("unknown")
        assert ep.released == ["stream-a"]
        t0 = time.monotonic()
        while len(pending):  # b's entry never comes: released by the sweep
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.01)
        assert ep.released == ["stream-a", "stream-b"] and time.monotonic() - t0 >= 0.1
        pending.hold("c", "stream-c")  # type: ignore[arg-type]
        pending.hold("c", "stream-c2")  # type: ignore[arg-type]  # the same id again: the first is over
        assert ep.released[-1] == "stream-c"
        pending.release_all()
        assert ep.released[-1] == "stream-c2" and not len(pending)

    asyncio.run(go())
