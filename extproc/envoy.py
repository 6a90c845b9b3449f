"""The only module that builds or reads Envoy ext_proc protos.

Everything else in kvroute speaks plain Python: dicts of headers, bytes, Decision objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse

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
        v = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = v
    return out


def is_full_duplex(req: pb.ProcessingRequest) -> bool:
    return req.HasField("protocol_config") and req.protocol_config.request_body_mode == FULL_DUPLEX


def subset_hint(req: pb.ProcessingRequest) -> set[str] | None:
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


def _mutation(set_headers: Mapping[str, str] | None, remove: list[str] | None) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in (set_headers or {}).items()
        ],
        remove_headers=list(remove or ()),
    )


def _common(
    set_headers: Mapping[str, str] | None = None,
    remove: list[str] | None = None,
    clear_route_cache: bool = False,
    body: bytes | None = None,
    clear_body: bool = False,
) -> pb.CommonResponse:
    common = pb.CommonResponse(clear_route_cache=clear_route_cache)
    if set_headers or remove:
        common.header_mutation.CopyFrom(_mutation(set_headers, remove))
    if body is not None:
        common.body_mutation.body = body
    elif clear_body:
        common.body_mutation.clear_body = True
    return common


def lb_metadata(values: Mapping[str, str]) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: dict(values)})
    return md


def _with_metadata(resp: pb.ProcessingResponse, metadata: Mapping[str, str] | None) -> pb.ProcessingResponse:
    if metadata:
        resp.dynamic_metadata.CopyFrom(lb_metadata(metadata))
    return resp


def request_headers_response(
    set_headers: Mapping[str, str] | None = None,
    remove: list[str] | None = None,
    clear_route_cache: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> pb.ProcessingResponse:
    common = _common(set_headers, remove, clear_route_cache)
    return _with_metadata(pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common)), metadata)


def request_body_response(
    set_headers: Mapping[str, str] | None = None,
    remove: list[str] | None = None,
    clear_route_cache: bool = False,
    metadata: Mapping[str, str] | None = None,
    body: bytes | None = None,
    clear_body: bool = False,
) -> pb.ProcessingResponse:
    common = _common(set_headers, remove, clear_route_cache, body, clear_body)
    return _with_metadata(pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)), metadata)


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


def message_timeout_override(seconds: float) -> pb.ProcessingResponse:
    """Ask Envoy to wait ``seconds`` for this message's answer instead of its ``message_timeout``
    (honoured up to the filter's ``max_message_timeout``; the answer itself follows later)."""
    resp = pb.ProcessingResponse()
    resp.override_message_timeout.FromNanoseconds(round(seconds * 1e9))
    return resp


def request_trailers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_headers_response(remove: list[str] | None = None) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=_common(remove=remove)))


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
