"""The only module that builds or reads Envoy's protos: ext_proc's, and ext_authz's and the gRPC access
log's for the ext_authz transport (extproc/authz.py).

Everything else in kvroute speaks plain Python: dicts of headers, bytes, Decision objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.auth.v3 import external_auth_pb2 as authz_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse
CheckRequest = authz_pb.CheckRequest
CheckResponse = authz_pb.CheckResponse
AccessLogs = als_pb2.StreamAccessLogsMessage
AccessLogsResponse = als_pb2.StreamAccessLogsResponse

# Envoy rejects a streamed body chunk over 64 KiB in full-duplex mode; stay well under it.
MAX_STREAMED_CHUNK = 62_000
LB_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def read_headers(msg: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased header map. Envoy ≥ 1.30 sends raw_value; older ones value."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        raw = h.raw_value  # read once: each read of a upb field builds a new Python object
        out[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def body_modes(req: pb.ProcessingRequest) -> tuple[bool, bool]:
    """(full duplex, ``send_body_without_waiting_for_header_response``): the filter's protocol_config,
    read once (each read of a upb field builds a Python object)."""
    if not req.HasField("protocol_config"):
        return False, False
    pc = req.protocol_config
    return pc.request_body_mode == FULL_DUPLEX, pc.send_body_without_waiting_for_header_response


def subset_hint(req: pb.ProcessingRequest | authz_pb.AttributeContext) -> set[str] | None:
    """The proxy's candidate subset (EPP protocol), or None when it sent none."""
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if ns is None or SUBSET_HINT_KEY not in ns.fields:
        return None
    v = ns.fields[SUBSET_HINT_KEY]
    if v.HasField("list_value"):
        return {x.string_value for x in v.list_value.values if x.string_value}
    return {a.strip() for a in v.string_value.split(",") if a.strip()}


def _fill_mutation(m: pb.HeaderMutation, set_headers: Mapping[str, str] | None, remove: list[str] | None) -> None:
    # Filled in place: a field at a time is several times cheaper than keyword constructors and
    # Struct.update (this runs once per request on the decision's answer).
    for k, v in (set_headers or {}).items():
        h = m.set_headers.add()
        h.header.key = k
        h.header.raw_value = v.encode()
        h.append_action = _OVERWRITE
    if remove:
        m.remove_headers.extend(remove)


def _mutation(set_headers: Mapping[str, str] | None, remove: list[str] | None) -> pb.HeaderMutation:
    m = pb.HeaderMutation()
    _fill_mutation(m, set_headers, remove)
    return m


def _fill_common(
    common: pb.CommonResponse,
    set_headers: Mapping[str, str] | None = None,
    remove: list[str] | None = None,
    clear_route_cache: bool = False,
    body: bytes | None = None,
    clear_body: bool = False,
) -> None:
    common.SetInParent()  # present even when empty: it marks which answer this is
    if clear_route_cache:
        common.clear_route_cache = True
    if set_headers or remove:
        _fill_mutation(common.header_mutation, set_headers, remove)
    if body is not None:
        common.body_mutation.body = body
    elif clear_body:
        common.body_mutation.clear_body = True


def lb_metadata(values: Mapping[str, str]) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    _fill_lb_metadata(md, values)
    return md


def _fill_lb_metadata(md: struct_pb2.Struct, values: Mapping[str, str] | None) -> None:
    if values:
        fields = md.fields[LB_NAMESPACE].struct_value.fields
        for k, v in values.items():
            fields[k].string_value = v


# Routing answers by what they hold, serialized: an EPP answer names a pod and its fallbacks, so a fleet
# gives few distinct ones, and parsing one back is several times cheaper than filling it field by field.
_ANSWERS: dict[tuple[Any, ...], bytes] = {}
_ANSWERS_MAX = 4096  # past this many (a large fleet's fallback orders), start over: bounded memory


def _answer(
    kind: str,
    set_headers: Mapping[str, str] | None,
    remove: list[str] | None,
    clear_route_cache: bool,
    metadata: Mapping[str, str] | None,
) -> pb.ProcessingResponse:
    """A headers or body answer without a body mutation; a new message each time (callers may change it)."""
    key = (kind, tuple(set_headers.items()) if set_headers else (), tuple(remove) if remove else (),
           clear_route_cache, tuple(metadata.items()) if metadata else ())  # fmt: skip

    def build() -> bytes:
        resp = pb.ProcessingResponse()
        _fill_common(getattr(resp, kind).response, set_headers, remove, clear_route_cache)
        _fill_lb_metadata(resp.dynamic_metadata, metadata)
        return resp.SerializeToString()

    return pb.ProcessingResponse.FromString(_memo(_ANSWERS, key, build))


def _memo(cache: dict[tuple[Any, ...], bytes], key: tuple[Any, ...], build: Callable[[], bytes]) -> bytes:
    """``cache[key]``, built on a miss; past _ANSWERS_MAX entries the cache starts over (bounded memory)."""
    raw = cache.get(key)
    if raw is None:
        if len(cache) >= _ANSWERS_MAX:
            cache.clear()
        raw = cache[key] = build()
    return raw


def request_headers_response(
    set_headers: Mapping[str, str] | None = None,
    remove: list[str] | None = None,
    clear_route_cache: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> pb.ProcessingResponse:
    return _answer("request_headers", set_headers, remove, clear_route_cache, metadata)


def request_body_response(
    set_headers: Mapping[str, str] | None = None,
    remove: list[str] | None = None,
    clear_route_cache: bool = False,
    metadata: Mapping[str, str] | None = None,
    body: bytes | None = None,
    clear_body: bool = False,
) -> pb.ProcessingResponse:
    if body is None and not clear_body:
        return _answer("request_body", set_headers, remove, clear_route_cache, metadata)
    resp = pb.ProcessingResponse()
    _fill_common(resp.request_body.response, set_headers, remove, clear_route_cache, body, clear_body)
    _fill_lb_metadata(resp.dynamic_metadata, metadata)
    return resp


def streamed_body(body: bytes, end_of_stream: bool = True) -> Iterator[pb.ProcessingResponse]:
    """Full-duplex: the processor owns the body and streams it back in chunks; the last one ends the
    body unless trailers follow."""
    n = max(1, -(-len(body) // MAX_STREAMED_CHUNK))
    for i in range(n):
        chunk = body[i * MAX_STREAMED_CHUNK : (i + 1) * MAX_STREAMED_CHUNK]
        common = pb.CommonResponse()
        common.body_mutation.streamed_response.body = chunk
        common.body_mutation.streamed_response.end_of_stream = end_of_stream and i == n - 1
        yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


# Envoy waits this much longer than an answer that waits may take (a prefill leg, a hold): kvroute answers
# (a prefill leg falling back to a local prefill) before Envoy gives up on it.
WAIT_MARGIN_S = 1.0


def message_timeout_override(seconds: float) -> pb.ProcessingResponse:
    """Ask Envoy to wait ``seconds`` for this message's answer instead of its ``message_timeout``
    (honoured up to the filter's ``max_message_timeout``; the answer itself follows later)."""
    resp = pb.ProcessingResponse()
    resp.override_message_timeout.FromNanoseconds(round(seconds * 1e9))
    return resp


def request_trailers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_headers_response(remove: list[str] | None = None) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    _fill_common(resp.response_headers.response, remove=remove)
    return resp


def response_body_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))


def response_trailers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(status: int, message: str, error_type: str, param: str | None = None) -> pb.ProcessingResponse:
    """An OpenAI-shaped JSON error sent straight to the client; the request never reaches a pod."""
    body = orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}})
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation({"content-type": "application/json", "x-kvroute-error": error_type}, None),
            body=body,
            details=f"kvroute_{error_type}",
        )
    )


# --- the ext_authz transport -------------------------------------------------------------------------


class BodyRewriteNeeded(Exception):
    """The decision replaces the request's body, which an ext_authz answer cannot carry."""


def read_check(req: authz_pb.CheckRequest) -> tuple[dict[str, str], bytes]:
    """A Check's request headers (lower-cased by Envoy, pseudo-headers included) and whole body
    (``with_request_body.pack_as_bytes``: raw_body; else the body as text)."""
    http = req.attributes.request.http
    body = http.raw_body
    return dict(http.headers), body if body else http.body.encode()


class _Decided:
    """One decision's answer as both ext_authz transports carry it: a refusal, or the headers set and
    removed and the EPP fallback list. Read from the ext_proc answers, or, for a routed request, from
    the routing override they were built from (``routing``: ExternalProcessor's ``Stream.routing``, the
    keyword arguments of ``request_body_response``), which skips reading the protos back.
    BodyRewriteNeeded when an answer replaces the body."""

    __slots__ = ("fallbacks", "refusal", "remove", "set")

    def __init__(self, answers: list[pb.ProcessingResponse], routing: Mapping[str, Any] | None = None) -> None:
        self.refusal: pb.ImmediateResponse | None = None
        self.fallbacks: Mapping[str, str] | None = None
        if routing is not None:  # read as it is (never changed here): no copies on the hot path
            self.set: Mapping[str, str] = routing.get("set_headers") or {}
            self.remove: Sequence[str] = routing.get("remove") or ()
            self.fallbacks = routing.get("metadata") or None
            return
        self.set = headers = {}
        self.remove = removed = []
        for resp in answers:
            kind = resp.WhichOneof("response")
            if kind == "immediate_response":
                self.refusal = resp.immediate_response
                return
            if kind not in ("request_headers", "request_body"):
                continue  # a timeout override, a trailers answer: nothing for Envoy here
            common = getattr(resp, kind).response
            if common.HasField("body_mutation") and common.body_mutation.WhichOneof("mutation") is not None:
                raise BodyRewriteNeeded
            for h in common.header_mutation.set_headers:
                headers[h.header.key] = _value(h)
            removed.extend(common.header_mutation.remove_headers)
            lb = resp.dynamic_metadata.fields.get(LB_NAMESPACE)
            if lb is not None:
                self.fallbacks = {k: v.string_value for k, v in lb.struct_value.fields.items()}


def _value(h: base_pb2.HeaderValueOption) -> str:
    raw = h.header.raw_value
    return raw.decode("utf-8", "replace") if raw else h.header.value


def _fill_headers(into: Any, headers: Mapping[str, str]) -> None:
    """Headers as ext_authz's options: Envoy's ext_authz reads ``value`` (not ``raw_value``)."""
    for k, v in headers.items():
        o = into.add()
        o.header.key = k
        o.header.value = v
        o.append_action = _OVERWRITE


def _refusal_headers(refusal: pb.ImmediateResponse) -> dict[str, str]:
    return {h.header.key: _value(h) for h in refusal.headers.set_headers}


def check_answer(
    answers: list[pb.ProcessingResponse], routing: Mapping[str, Any] | None = None
) -> authz_pb.CheckResponse:
    """ext_proc answers of one decision (or its ``routing`` override: ``_Decided``) as the ext_authz
    answer Envoy acts on alike: the routing headers added (and the client's removed), the EPP fallback
    list as the filter's dynamic metadata (the pool's override_host reads it there), an immediate
    response as the denied one. Raises BodyRewriteNeeded when an answer replaces the body."""
    d = _Decided(answers, routing)
    out = authz_pb.CheckResponse()
    if d.refusal is not None:
        out.status.code = 7  # PERMISSION_DENIED: Envoy answers the client with the denied response
        out.denied_response.status.code = d.refusal.status.code
        out.denied_response.body = d.refusal.body.decode("utf-8", "replace")
        _fill_headers(out.denied_response.headers, _refusal_headers(d.refusal))
        return out
    out.status.code = 0  # google.rpc OK
    out.ok_response.SetInParent()
    _fill_headers(out.ok_response.headers, d.set)
    out.ok_response.headers_to_remove.extend(d.remove)
    if d.fallbacks is not None:
        for k, v in d.fallbacks.items():
            out.dynamic_metadata.fields[k].string_value = v
    return out


# ext_authz over HTTP: the EPP fallback list rides in this response header, which Envoy turns into the
# filter's dynamic metadata (dynamic_metadata_from_headers); the pick itself is the routing header.
HTTP_FALLBACKS_HEADER = "x-kvroute-endpoints"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 501: "Not Implemented",
            503: "Service Unavailable"}  # fmt: skip
# Routed HTTP answers by what they hold, as bytes: like _ANSWERS, a fleet gives few distinct ones.
_HTTP_ROUTED: dict[tuple[Any, ...], bytes] = {}


def http_response(status: int, headers: Mapping[str, str], body: bytes = b"") -> bytes:
    """An HTTP/1.1 response as bytes (keep-alive: Envoy reuses the connection)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def http_answer(answers: list[pb.ProcessingResponse], routing: Mapping[str, Any] | None = None) -> bytes:
    """ext_proc answers of one decision (or its ``routing`` override: ``_Decided``) as the HTTP ext_authz
    answer: 200 with the routing headers (and the EPP fallback list in HTTP_FALLBACKS_HEADER), or the
    refusal's status, headers and body. Raises BodyRewriteNeeded when an answer replaces the body."""
    d = _Decided(answers, routing)
    if d.refusal is not None:
        return http_response(d.refusal.status.code, _refusal_headers(d.refusal), d.refusal.body)
    fallbacks = d.fallbacks

    def build() -> bytes:
        headers = dict(d.set)
        for v in (fallbacks or {}).values():
            headers[HTTP_FALLBACKS_HEADER] = v
        return http_response(200, headers)

    return _memo(_HTTP_ROUTED, (tuple(d.set.items()), tuple(fallbacks.items()) if fallbacks else ()), build)


def finished_request_ids(msg: als_pb2.StreamAccessLogsMessage) -> list[str]:
    """The x-request-id of every HTTP request an access log message reports finished."""
    return [e.request.request_id for e in msg.http_logs.log_entry
            if e.request.request_id and not e.common_properties.intermediate_log_entry]  # fmt: skip
