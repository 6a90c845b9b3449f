"""The ext_proc state machine, driven message by message (no network): every body mode."""

import asyncio
import itertools
import time

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.config import build_config
from extproc.envoy import MAX_STREAMED_CHUNK
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor, Stream

PODS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
DEST = "x-gateway-destination-endpoint"


def make(models=None, **extra):
    cfg = {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, **extra}
    if models:
        cfg["models"] = {m: {"pool": "p"} for m in models}
    router = Router(build_config(cfg), Metrics())
    return ExternalProcessor(router), router


def headers_msg(
    path="/v1/chat/completions", method="POST", extra=None, eos=False, mode=None, no_wait=False, subset=None
):
    hs = [(":path", path), (":method", method), ("x-request-id", "rid"), *(extra or {}).items()]
    m = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
            end_of_stream=eos,
        )
    )
    if mode is not None or no_wait:
        m.protocol_config.request_body_mode = mode or pm.ProcessingMode.STREAMED
        m.protocol_config.send_body_without_waiting_for_header_response = no_wait
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        m.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return m


def body_msgs(raw: bytes, cuts=()):
    bounds = [0, *cuts, len(raw)]
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[a:b], end_of_stream=(i == len(bounds) - 2)))
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


async def run(proc, msgs):
    async def it():
        for m in msgs:
            yield m

    return [r async for r in proc.Process(it(), None)]


def chat(text="hello " * 100, model="m", **kw):
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}], **kw})


def set_headers(common):
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


async def test_buffered_override_on_body_response_and_strip():
    proc, router = make()
    out = await run(proc, [headers_msg(extra={DEST: "6.6.6.6:1", "x-prefiller-host-port": "evil"}), *body_msgs(chat())])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert set(out[0].request_headers.response.header_mutation.remove_headers) == {DEST, "x-prefiller-host-port"}
    common = out[1].request_body.response
    picked = set_headers(common)[DEST]
    assert picked in PODS and common.clear_route_cache
    md = out[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert md.split(",")[0] == picked and len(md.split(",")) == 3
    # The stream ended without a response: the in-flight slot is released.
    assert all(e.inflight == 0 for e in router.registry.by_address.values())


async def test_the_answer_is_given_before_the_index_records_the_pick():
    """The decision's bookkeeping comes after its answer: answered (the messages handled on the event loop,
    as a transport does), the index holds nothing of the prompt and no metric counts the decision until the
    loop turns; then the index holds it where the answer sent it, and the decision is counted there."""
    proc, router = make()
    st = Stream()
    decisions = lambda: sum(  # noqa: E731
        s.value for m in router.metrics.decisions.collect() for s in m.samples if s.name.endswith("_total")
    )
    assert proc.answer(st, headers_msg()) and not router.index.block_counts()
    (out,) = proc.answer(st, body_msgs(chat())[0])
    picked = set_headers(out.request_body.response)[DEST]
    assert not router.index.block_counts() and decisions() == 0
    await asyncio.sleep(0)
    assert set(router.index.block_counts()) == {picked}
    get = router.metrics.registry.get_sample_value
    assert decisions() == 1 and get("kvroute_decision_seconds_count") == 1
    assert get("kvroute_inflight_requests", {"endpoint": picked}) == 1


def test_a_decision_outside_an_event_loop_is_routed_and_recorded_at_once():
    proc, router = make()
    st = Stream()
    proc.answer(st, headers_msg())
    (out,) = proc.answer(st, body_msgs(chat())[0])
    assert set(router.index.block_counts()) == {set_headers(out.request_body.response)[DEST]}
    assert not router.metrics.registry.get_sample_value("kvroute_errors_total", {"kind": "internal"})


async def test_streamed_no_wait_holds_headers_until_end():
    proc, _ = make()
    raw = chat("ü" * 5000)
    msgs = [headers_msg(no_wait=True), *body_msgs(raw, cuts=(1001, 1002, 7000))]  # 1001 splits a 2-byte char
    out = await run(proc, msgs)
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers"] + ["request_body"] * 4
    assert set_headers(out[0].request_headers.response)[DEST] in PODS


async def test_full_duplex_streams_body_back_exactly():
    proc, _ = make()
    raw = chat("€" * 60_000)  # ~180 KB: several 62,000-byte chunks back
    cuts = tuple(range(1, len(raw), 65_537))
    out = await run(proc, [headers_msg(mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED), *body_msgs(raw, cuts)])
    assert out[0].WhichOneof("response") == "request_headers"
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert all(len(c.body) <= MAX_STREAMED_CHUNK for c in chunks)
    assert b"".join(c.body for c in chunks) == raw
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_full_duplex_with_trailers():
    proc, _ = make()
    raw = chat()
    msgs = [headers_msg(mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED)]
    msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=False)))
    msgs.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    out = await run(proc, msgs)
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    sr = out[1].request_body.response.body_mutation.streamed_response
    assert sr.body == raw and not sr.end_of_stream


async def test_headers_only_request_routed_by_route_id():
    proc, _ = make()
    a = await run(proc, [headers_msg(path="/v1/models", method="GET", eos=True, extra={"x-route-id": "conv"})])
    b = await run(proc, [headers_msg(path="/v1/models", method="GET", eos=True, extra={"x-route-id": "conv"})])
    pick = set_headers(a[0].request_headers.response)[DEST]
    assert pick in PODS and set_headers(b[0].request_headers.response)[DEST] == pick


@pytest.mark.parametrize(
    "raw,status,needle",
    [
        (b'{"model": "m", "messages": [', 400, "not valid JSON"),
        (chat(model="nope"), 404, "does not exist"),
        (b"x" * 5000, 413, "exceeds"),
    ],
)
async def test_errors_are_immediate_openai_json(raw, status, needle):
    proc, router = make(models=["m"], server={"max_body_bytes": 4096})
    out = await run(proc, [headers_msg(no_wait=True), *body_msgs(raw, cuts=(len(raw) // 2,))])
    imm = out[-1].immediate_response
    assert imm.status.code == status
    err = orjson.loads(imm.body)["error"]
    assert needle in err["message"] and err["code"] == status
    assert all(e.inflight == 0 for e in router.registry.by_address.values())


async def test_subset_hint_restricts_and_empty_subset_is_503():
    proc, _ = make()
    out = await run(proc, [headers_msg(subset=[PODS[2]]), *body_msgs(chat())])
    assert set_headers(out[1].request_body.response)[DEST] == PODS[2]
    out = await run(proc, [headers_msg(subset=["1.2.3.4:5"]), *body_msgs(chat())])
    assert out[-1].immediate_response.status.code == 503


async def test_response_path_releases_and_counts_usage():
    proc, router = make()
    usage = (
        b'data: {"usage": {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}}}\n\ndata: [DONE]\n\n'
    )
    msgs = [headers_msg(), *body_msgs(chat())]
    inflight_seen = []

    async def it():
        for m in msgs:
            yield m
        inflight_seen.append(sum(e.inflight for e in router.registry.by_address.values()))
        yield pb.ProcessingRequest(response_headers=pb.HttpHeaders())
        yield pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n" + usage[:30]))
        yield pb.ProcessingRequest(response_body=pb.HttpBody(body=usage[30:], end_of_stream=True))
        inflight_seen.append(sum(e.inflight for e in router.registry.by_address.values()))

    out = [r async for r in proc.Process(it(), None)]
    assert inflight_seen == [1, 0]
    assert [r.WhichOneof("response") for r in out][-3:] == ["response_headers", "response_body", "response_body"]
    reg = router.metrics.registry
    assert reg.get_sample_value("kvroute_reported_cached_tokens_total", {"pool": "p"}) == 96
    assert reg.get_sample_value("kvroute_reported_prompt_tokens_total", {"pool": "p"}) == 120


async def test_internal_error_passes_request_on_unrouted(monkeypatch):
    proc, router = make()

    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(router, "route", boom)
    out = await run(proc, [headers_msg(), *body_msgs(chat())])
    assert out[-1].WhichOneof("response") == "request_body"
    assert DEST not in set_headers(out[-1].request_body.response)
    assert router.metrics.registry.get_sample_value("kvroute_errors_total", {"kind": "internal"}) == 1


async def test_cluster_mode_names_pod_cluster():
    proc, _ = make(mode="cluster")
    out = await run(proc, [headers_msg(), *body_msgs(chat())])
    common = out[1].request_body.response
    assert set_headers(common)["x-kvroute-cluster"].startswith("ep_10_0_0_") and common.clear_route_cache


async def test_spoofed_header_that_kvroute_also_sets_is_overwritten_not_removed():
    """Envoy applies removals after sets: the answer must not remove the header it sets."""
    proc, _ = make(mode="cluster")
    out = await run(proc, [headers_msg(no_wait=True, extra={"x-kvroute-cluster": "evil"}), *body_msgs(chat())])
    common = out[0].request_headers.response
    assert "x-kvroute-cluster" in set_headers(common)
    assert "x-kvroute-cluster" not in common.header_mutation.remove_headers


def make_pd():
    eps = [{"address": PODS[0], "role": "prefill"}, {"address": PODS[1], "role": "decode"}]
    pd = {"disaggregation": "always", "handoff": "gateway", "prefill_timeout_s": 5}
    router = Router(build_config({"pools": {"p": {"endpoints": eps}}, "pd": pd}), Metrics())
    legs = []

    async def prefill(outcome):  # the prefill leg's result, without a network
        legs.append(outcome.pd.prefill.address)
        return b'{"handed": "off"}'

    router.prefill = prefill
    return ExternalProcessor(router), legs


async def test_a_decode_pod_busied_during_the_prefill_leg_is_not_the_one_named():
    """The destination goes out only after the leg: if the decode pod took a local prefill
    meanwhile, the answer names a quieter decode pod, and the stream's end frees that pod's slot."""
    eps = [{"address": PODS[0], "role": "prefill"}, *({"address": a, "role": "decode"} for a in PODS[1:])]
    pd = {"disaggregation": "always", "handoff": "gateway", "prefill_timeout_s": 5}
    router = Router(build_config({"pools": {"p": {"endpoints": eps}}, "pd": pd}), Metrics())
    chosen = []

    async def prefill(outcome):
        chosen.append(outcome.decision.primary)
        # A local document lands there (a minute of prefill: still queued when kvroute looks, however slow the machine).
        outcome.decision.primary.prefills.add(60.0, time.monotonic())
        return b'{"handed": "off"}'

    router.prefill = prefill
    out = await run(ExternalProcessor(router), [headers_msg(), *body_msgs(chat())])
    named = set_headers(out[-1].request_body.response)[DEST]
    assert named in PODS[1:] and named != chosen[0].address
    assert all(e.inflight == 0 for e in router.registry.pools["p"].endpoints)


async def test_gateway_prefill_asks_envoy_to_wait_then_answers_in_order():
    """The prefill leg can outlast Envoy's message_timeout: the first answer to the body is the
    timeout override (no response of its own), then the real answer with the decode pod's body."""
    proc, legs = make_pd()
    out = await run(proc, [headers_msg(), *body_msgs(chat())])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", None, "request_body"]
    assert out[1].override_message_timeout.ToTimedelta().total_seconds() == pytest.approx(6.0)  # timeout + margin
    common = out[2].request_body.response
    assert common.body_mutation.body == b'{"handed": "off"}' and set_headers(common)[DEST] == PODS[1]
    assert legs == [PODS[0]]

    # Full duplex with trailers: override, then headers, the body streamed back, and the trailers last.
    proc, legs = make_pd()
    msgs = [headers_msg(mode=pm.ProcessingMode.FULL_DUPLEX_STREAMED)]
    msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=chat(), end_of_stream=False)))
    msgs.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    out = await run(proc, msgs)
    assert [r.WhichOneof("response") for r in out] == [None, "request_headers", "request_body", "request_trailers"]
    assert out[2].request_body.response.body_mutation.streamed_response.body == b'{"handed": "off"}'


def inflight(router):
    return sum(e.inflight for e in router.registry.by_address.values())


async def test_messages_out_of_order_never_decide_twice():
    """Sequences Envoy never sends (found by tests/unit/test_properties.py): a second headers
    message, body after end_of_stream, body or trailers after an error. Each used to route the
    request again and leak the first decision's in-flight slot."""
    proc, router = make(models=["m"])
    streamed = {"no_wait": True}
    trailers = pb.HttpTrailers()
    seen = []

    async def it(msgs):
        for m in msgs:
            yield m
        seen.append(inflight(router))

    cases = [
        [headers_msg(path="/v1/models", method="GET", eos=True)] * 2,
        [headers_msg(), *body_msgs(chat()), *body_msgs(chat())],  # body after end_of_stream
        [headers_msg(**streamed), *body_msgs(chat(model="nope")), *body_msgs(chat())],  # body after a 404
        [headers_msg(**streamed), *body_msgs(chat(model="nope")), pb.ProcessingRequest(request_trailers=trailers)],
    ]
    for msgs in cases:
        out = [r async for r in proc.Process(it(msgs), None)]
        kinds = ("request_headers", "request_body")
        answers = [getattr(r, k).response for r in out if (k := r.WhichOneof("response")) in kinds]
        routed = [a for a in answers if DEST in set_headers(a)]
        assert len(routed) <= 1, out
    assert seen == [1, 1, 0, 0]  # held until each stream ended (one decision each at most)...
    assert inflight(router) == 0  # ...and released with it
    assert router.metrics.registry.get_sample_value("kvroute_errors_total", {"kind": "internal"}) is None


def test_metric_children_are_remembered_until_their_endpoint_goes():
    """The per-request path's labelled metrics are looked up once (Metrics.child); a pod that leaves
    takes its series with it, and one that comes back starts a new series."""
    m = Metrics()
    c = m.child(m.inflight, PODS[0])
    assert m.child(m.inflight, PODS[0]) is c
    c.set(3)
    m.forget_endpoint(PODS[0])
    assert m.registry.get_sample_value("kvroute_inflight_requests", {"endpoint": PODS[0]}) is None
    m.child(m.inflight, PODS[0]).set(1)
    assert m.registry.get_sample_value("kvroute_inflight_requests", {"endpoint": PODS[0]}) == 1
