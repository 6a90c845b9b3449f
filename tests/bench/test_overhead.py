"""bench.overhead's variants: what each runs, checked without starting anything."""

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.noop_extproc import _Answers, _Stream
from bench.overhead import (
    KVROUTE,
    NOOP,
    PLAIN,
    PRESETS,
    SIZES,
    Variant,
    _envoy_patch,
    _server_args,
    chat_bodies,
    parse_sizes,
    parse_variants,
)


def test_default_run_keeps_the_three_routers_results_imports():
    assert [v.name for v in parse_variants("noop,kvroute")] == [PLAIN, NOOP, KVROUTE]


def test_presets_expand_and_repeats_collapse():
    names = [v.name for v in parse_variants("product,noop,noop/google_grpc")]
    assert names[0] == PLAIN and len(names) == len(set(names))
    assert f"{KVROUTE}/uvloop" in names and f"{NOOP}/google_grpc" in names
    assert all(parse_variants(p) for p in PRESETS)  # every preset is valid


def test_sizes_parse_in_order_and_bad_ones_are_named():
    assert parse_sizes("32k, 1k,32k") == ("32k", "1k")
    with pytest.raises(ValueError, match=r"unknown size\(s\) \['64k'\]"):
        parse_sizes("1k,64k")
    with pytest.raises(ValueError, match="no size given"):
        parse_sizes(" , ")
    # each size's chats are about that many tokens (≈ 4 characters each)
    for name, tokens in SIZES.items():
        chars = len(chat_bodies(tokens, 1)[0])
        assert 3.5 * tokens < chars < 5 * tokens, name


def test_each_kvroute_variant_sits_on_the_floor_with_its_options():
    v = Variant("kvroute", frozenset({"uvloop", "google_grpc"}))
    assert v.name == f"{KVROUTE}/google_grpc/uvloop" and v.floor == f"{NOOP}/google_grpc/uvloop"


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("nginx", "the server is noop or kvroute"),
        ("noop/fast", "unknown option(s) ['fast']"),
        ("kvroute/sync", "kvroute cannot run with ['sync']"),
        ("kvroute/body-only", "kvroute cannot run with ['body-only']"),
        ("noop/sync/uvloop", "one of ['h2', 'sync', 'uvloop'] at most"),
        ("noop/h2/authz", "authz cannot run with ['h2']"),
        ("kvroute/streamed/duplex", "one of ['duplex', 'partial', 'streamed'] at most"),
        ("kvroute/uds", "kvroute cannot run with ['uds']"),
        ("noop/sync/uds", "uds needs the aio or uvloop server"),
        ("kvroute/authz/streamed", "authz cannot run with ['streamed']"),
        ("noop/authz/sync", "authz cannot run with ['sync']"),
        ("kvroute/authz/google_grpc", "authz cannot run with ['google_grpc']"),
        ("noop/authz/authz_http", "one of ['authz', 'authz_http'] at most"),
    ],
)
def test_bad_variants_are_named(spec, needle):
    with pytest.raises(ValueError, match="variant") as e:
        parse_variants(spec)
    assert needle in str(e.value)


def test_the_authz_preset_sets_each_transport_on_its_floor():
    variants = parse_variants("authz")
    names = [v.name for v in variants]
    assert names == [PLAIN, f"{NOOP}/uvloop", f"{KVROUTE}/uvloop", f"{NOOP}/h2", f"{KVROUTE}/h2",
                     f"{NOOP}/authz/uvloop", f"{KVROUTE}/authz/uvloop", f"{NOOP}/authz_http/uvloop",
                     f"{KVROUTE}/authz_http/uvloop"]  # fmt: skip
    assert variants[4].floor == f"{NOOP}/h2"  # kvroute's own HTTP/2 server over the do-nothing one on it
    assert _server_args(variants[3]) == ["--server", "h2"] and _server_args(variants[4]) == ["--event-loop", "uvloop"]
    assert variants[-1].floor == f"{NOOP}/authz_http/uvloop"
    assert _server_args(variants[-2]) == ["--server", "uvloop", "--authz-http"]
    assert _envoy_patch(variants[-1], 9) == {"processing_mode": {}, "ext_proc": {}}  # its own Envoy config instead


def test_the_noop_check_routes_as_the_noop_stream_does():
    answers = _Answers("10.0.0.1:8000")
    (h,) = answers.check.ok_response.headers
    assert (h.header.key, h.header.value) == ("x-gateway-destination-endpoint", "10.0.0.1:8000")
    assert answers.http.startswith(b"HTTP/1.1 200 OK")
    assert b"x-gateway-destination-endpoint: 10.0.0.1:8000" in answers.http


def test_options_reach_envoy_and_the_servers():
    body_only = _envoy_patch(Variant("noop", frozenset({"body-only", "partial"})), 9)
    assert body_only["processing_mode"] == {"request_header_mode": "SKIP", "request_body_mode": "BUFFERED_PARTIAL"}
    google = _envoy_patch(Variant("kvroute", frozenset({"google_grpc"})), 9)["ext_proc"]["grpc_service"]
    assert google["google_grpc"]["target_uri"] == "127.0.0.1:9"
    assert _envoy_patch(Variant("kvroute"), 9) == {"processing_mode": {}, "ext_proc": {}}
    streamed = _envoy_patch(Variant("kvroute", frozenset({"streamed"})), 9)
    assert streamed == {"processing_mode": {"request_body_mode": "STREAMED", "response_trailer_mode": "SEND"},
                        "ext_proc": {"send_body_without_waiting_for_header_response": True}}  # fmt: skip
    duplex = _envoy_patch(Variant("noop", frozenset({"duplex"})), 9)
    assert duplex["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert duplex["processing_mode"]["response_trailer_mode"] == "SEND"  # the stream lasts the exchange
    assert duplex["ext_proc"] == {"failure_mode_allow": False}  # Envoy refuses full duplex failing open
    assert _server_args(Variant("noop", frozenset({"sync", "nobdp"}))) == [
        "--server", "sync", "--grpc-arg", "grpc.http2.bdp_probe=0"]  # fmt: skip
    assert _server_args(Variant("kvroute")) == ["--event-loop", "asyncio"]  # the old default, named
    assert _server_args(Variant("noop", frozenset({"uvloop", "uds"})), "/tmp/x.sock") == [
        "--server", "uvloop", "--unix", "/tmp/x.sock"]  # fmt: skip
    assert _server_args(Variant("kvroute", frozenset({"uvloop"}))) == ["--event-loop", "uvloop"]


def _msgs(body: bytes, chunks: int, mode: int | None, no_wait: bool = False) -> list[pb.ProcessingRequest]:
    h = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=False))
    if mode is not None:
        h.protocol_config.request_body_mode = mode
        h.protocol_config.send_body_without_waiting_for_header_response = no_wait
    step = -(-len(body) // chunks)
    parts = [body[i : i + step] for i in range(0, len(body), step)]
    return [h, *(pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
                 for i, p in enumerate(parts))]  # fmt: skip


@pytest.mark.parametrize("mode", ["buffered", "streamed", "duplex"])
def test_the_noop_server_answers_each_body_mode_as_kvroute_does(mode):
    """BUFFERED: headers answered at once, the route on the body's answer; STREAMED without waiting and
    full duplex: the headers' answer held to the body's end and routing, then one answer per chunk or
    the body streamed back whole."""
    answers, body = _Answers("10.0.0.1:8000"), b"x" * 100_000
    pm_mode = {
        "buffered": None,
        "streamed": pm.ProcessingMode.STREAMED,
        "duplex": pm.ProcessingMode.FULL_DUPLEX_STREAMED,
    }
    st = _Stream(answers)
    out = [[r.WhichOneof("response") for r in st.answer(m)]
           for m in _msgs(body, 1 if mode == "buffered" else 3, pm_mode[mode], no_wait=mode == "streamed")]  # fmt: skip
    plain = _Stream(answers)
    routed = [r for m in _msgs(body, 1, None) for r in plain.answer(m)]
    assert routed[1].request_body.response.clear_route_cache  # the body's answer routes when buffered
    if mode == "buffered":
        assert out == [["request_headers"], ["request_body"]]
    elif mode == "streamed":
        assert out == [[], [], [], ["request_headers", "request_body", "request_body", "request_body"]]
    else:
        again = _Stream(answers)
        streamed_back = [r for m in _msgs(body, 3, pm_mode[mode]) for r in again.answer(m)][1:]
        assert out[:3] == [[], [], []] and out[3][0] == "request_headers"
        back = b"".join(r.request_body.response.body_mutation.streamed_response.body for r in streamed_back)
        assert back == body
