"""Property-based tests (Hypothesis) of everything a client or a pod can send kvroute: requests
(JSON, UTF-8, types, nesting, huge numbers and arrays), chat templates, KV-event payloads and
ext_proc message sequences. The properties are bench/fuzz.py's (``make fuzz`` runs them for 1 M
cases); here they run derandomized and bounded, a few seconds in all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from pathlib import Path

import msgpack
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import (
    DEEP,
    FUZZ_HEADERS,
    PATHS,
    PODS,
    Gen,
    System,
    body_msg,
    check_kv_payload,
    check_request,
    check_stream,
    headers_msg,
)
from bench.vllm_model import build as build_model
from extproc import anthropic, responses, tokenize
from extproc.conversation import ChatError
from extproc.tokenize import ModelTokenizer

ROOT = Path(__file__).resolve().parents[2]
CI = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def system():
    s = System(build_model(ROOT / ".cache" / "tiny-llama"))
    yield s
    s.close()


scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # past 64 bits too: orjson refuses those, as a 400
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["m", "user", "text", "<|user|>", "{{ x }}", "\x00", "\ud800"])
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12
)
# Content blocks and input items of the three chat APIs (OpenAI parts, Anthropic blocks, Responses items).
KINDS = ["text", "image_url", "input_text", "refusal", "thinking", "tool_use", "tool_result", "image", "tool_addition",
         "message", "function_call", "function_call_output", "reasoning", "custom_tool_call", "hologram"]  # fmt: skip
BLOCK_FIELDS = ("text", "input", "content", "tool_use_id", "thinking", "source", "id", "name", "role", "call_id",
                "arguments", "output", "status", "summary", "tool", "image_url")  # fmt: skip
blocks = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(KINDS) | values},
        optional=dict.fromkeys(BLOCK_FIELDS, values),
    ),
    max_size=4,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | values},
        optional={"content": st.text(max_size=300) | blocks | values, "tool_calls": values, "name": values},
    ),
    max_size=4,
)
FIELDS = (
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "user",
    "cache_salt",
    "tools",
    "kv_transfer_params",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "reasoning_effort",
    "documents",
    "tool_choice",
    "system",
    "instructions",
    "thinking",
    "output_config",
    "reasoning",
    "max_output_tokens",
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("m") | st.just("other") | values,
        "messages": messages | values,
        "input": st.text(max_size=200) | blocks | messages | values,
        "prompt": st.text(max_size=400)
        | st.lists(st.integers(), max_size=80)
        | st.lists(st.lists(st.integers()))
        | values,
        **dict.fromkeys(FIELDS, values),
        "x": st.sampled_from([10, 254, 255, 1023, 1025]).map(DEEP.format),  # arrays nested that deep
    },
)
headers = st.dictionaries(
    st.sampled_from(FUZZ_HEADERS),
    st.text(max_size=12) | st.sampled_from(["1e400", "nan", "-5", "sheddable", "99999999999999999999"]),
    max_size=3,
)


def encode(body: dict, cut: int | None, junk: bytes) -> bytes:
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    for depth in (10, 254, 255, 1023, 1025):
        raw = raw.replace(json.dumps(DEEP.format(depth)).encode(), b"[" * depth + b"]" * depth)
    return raw if cut is None else raw[:cut] + junk


@CI
@given(
    path=st.sampled_from(PATHS),
    hs=headers,
    body=bodies,
    cut=st.none() | st.integers(0, 400),
    junk=st.binary(max_size=8),
)
def test_any_request_is_routed_passed_or_refused_cleanly(system, path, hs, body, cut, junk):
    asyncio.run(check_request(system.approx, path, hs, encode(body, cut, junk)))


@CI
@given(raw=st.binary(max_size=300))
def test_any_bytes_as_a_body(system, raw):
    asyncio.run(check_request(system.approx, "/v1/chat/completions", {}, raw))


@CI
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/responses"]))
def test_chat_template_failures_fall_back_to_approximate_keys(system, body, path):
    body = {**body, "model": "m"}
    asyncio.run(check_request(system.precise, path, {"x-tenant-id": "t"}, encode(body, None, b"")))


@settings(CI, max_examples=600)
@given(
    body=bodies,
    messages=messages,
    thinking=values | st.fixed_dictionaries({"type": st.sampled_from(["disabled", "enabled"]) | values}),
)
def test_the_chat_api_converters_refuse_only_with_a_chat_error(body, messages, thinking):
    """Any Anthropic Messages or Responses body (extproc/anthropic.py, responses.py): its chat, or ChatError (a
    400 for Messages, the input's JSON as approximate keys for Responses), never another exception."""
    for convert, extra in ((anthropic.to_chat, {"messages": messages}), (responses.to_chat, {"input": messages})):
        for b in (body, {**body, **extra, "thinking": thinking, "reasoning": thinking, "output_config": thinking}):
            with contextlib.suppress(ChatError):
                convert(b)


mp_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=12)
)
mp_values = st.recursive(
    mp_scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(mp_scalars, c, max_size=4), max_leaves=20
)


@CI
@given(obj=mp_values, frames=st.booleans())
def test_any_msgpack_is_a_batch_or_a_decode_error(system, obj, frames):
    check_kv_payload(system.index, msgpack.packb(obj), frames=frames)


@CI
@given(seed=st.integers(0, 2**32), raw=st.binary(max_size=200))
def test_mutated_vllm_batches_and_garbage(system, seed, raw):
    payload = Gen(random.Random(seed)).kv_payload()
    check_kv_payload(system.index, payload)
    check_kv_payload(system.index, raw)


kinds = st.sampled_from(
    [
        "headers",
        "headers-eos",
        "body",
        "body-eos",
        "trailers",
        "resp-headers",
        "resp-body",
        "resp-body-eos",
        "resp-trailers",
        "empty",
    ]
)


def message(kind: str, path: str, hs: dict[str, str], mode, chunk: bytes) -> pb.ProcessingRequest:
    if kind.startswith("headers"):
        return headers_msg(path, extra=hs, eos=kind.endswith("eos"), mode=mode)
    if kind.startswith("body"):
        return body_msg(chunk, kind.endswith("eos"))
    if kind == "trailers":
        return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    if kind == "resp-headers":
        return pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    if kind.startswith("resp-body"):
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=kind.endswith("eos")))
    if kind == "resp-trailers":
        return pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    return pb.ProcessingRequest()


@CI
@given(
    seq=st.lists(st.tuples(kinds, st.integers(0, 3)), min_size=1, max_size=8),
    path=st.sampled_from(PATHS),
    hs=headers,
    mode=st.sampled_from([None, pm.ProcessingMode.STREAMED, pm.ProcessingMode.FULL_DUPLEX_STREAMED]),
    body=bodies,
)
def test_any_message_sequence(system, seq, path, hs, mode, body):
    """Out of order, duplicate headers, body after end_of_stream, trailers only, responses first."""
    raw = encode(body, None, b"")
    chunks = [raw[: len(raw) // 2], raw[len(raw) // 2 :], raw, b""]
    msgs = [message(k, path, hs, mode, chunks[i]) for k, i in seq]
    asyncio.run(check_stream(system.approx, msgs))


def test_properties_can_fail(system):
    """The checks are not vacuous: an in-flight slot left behind, or an internal error, is caught."""
    router = system.approx
    router.registry.acquire(PODS[0])
    try:
        with pytest.raises(AssertionError, match="in-flight"):
            asyncio.run(check_stream(router, [headers_msg("/v1/models", "GET", eos=True)]))
    finally:
        router.release(PODS[0])

    def boom(*a, **k):
        raise RuntimeError("bug")

    router.route, route = boom, router.route
    try:
        with pytest.raises(AssertionError, match="internal error"):
            asyncio.run(check_request(router, "/v1/completions", {}, b'{"model": "m", "prompt": "x"}'))
    finally:
        router.route = route


def test_tokenizer_piece_cache_is_bounded_in_bytes(system, monkeypatch):
    """The piece cache's bound is in bytes: it counted characters, and ids as tuples of Python ints
    (~16 bytes a character of English, more for 4-byte characters) made 64 M characters over 1 GB."""
    monkeypatch.setattr(tokenize, "CACHE_BYTES", 2 << 20)
    tok = ModelTokenizer.from_dir(system.model_dir)
    r = random.Random(0)
    alphabets = ["abc def 123 ", "ü€数字 ", "\U0001f600\U0010ffff "]
    texts = [" ".join("".join(r.choices(alphabets[i % 3], k=8)) for _ in range(100)) for i in range(3000)]
    for t in texts:
        tok.encode(t, add_special_tokens=False)
    held = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in tok._cache.items())
    assert len(tok._cache) > 10 and held < 1.05 * (2 << 20)
    assert tok.encode(texts[-1], False).tolist() == tok._tok.encode(texts[-1], add_special_tokens=False).ids
