import orjson
import pytest

from extproc.errors import BodyTooLarge, MalformedBody, MalformedHeader
from extproc.request import parse_request, render_chat

HDRS = {"x-tenant-id": "acme", "x-request-id": "r1"}


def parse(body, path="/v1/chat/completions", headers=HDRS, method="POST", limit=1 << 20, fields=()):
    raw = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    return parse_request(
        path=path,
        method=method,
        headers=headers,
        raw_body=raw,
        max_body_bytes=limit,
        tenant_header="x-tenant-id",
        route_id_headers=["x-route-id", "x-session-id"],
        request_id_header="x-request-id",
        priority_headers=("x-kvroute-priority", "x-gateway-inference-objective"),
        ttft_slo_header="x-slo-ttft-ms",
        route_id_fields=fields,
    )


def test_chat_fields_extracted():
    r = parse(
        {
            "model": "llama",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 7,
            "user": "u",
            "cache_salt": "s",
        }
    )
    assert (r.model, r.stream, r.max_tokens, r.user, r.cache_salt, r.tenant, r.request_id) == (
        "llama",
        True,
        7,
        "u",
        "s",
        "acme",
        "r1",
    )
    assert "hi" in r.prompt_text and r.is_inference


def test_follow_up_turn_extends_prefix():
    turn1 = [{"role": "system", "content": "doc " * 50}, {"role": "user", "content": "q1"}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    t1 = render_chat({"messages": turn1})
    t2 = render_chat({"messages": turn2})
    assert t2.startswith(t1)


def test_content_parts_and_tools():
    r = parse(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
                }
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        }
    )
    assert r.prompt_text.startswith("<|tools|>")
    assert "a<" in r.prompt_text and '"image_url"' in r.prompt_text


def test_a_large_media_part_stands_in_the_prompt_as_its_digest():
    """A base64 image is megabytes: it stands as its type and digest (the same image, the same text), not as
    megabytes of prompt counted as tokens; a small part is its canonical JSON, as before."""
    import base64

    from extproc.keys import estimated_tokens
    from extproc.request import MEDIA_INLINE_BYTES

    def chat(url: str, question: str):
        part = {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}
        content = [part, {"type": "text", "text": question}]
        return parse({"model": "m", "messages": [{"role": "user", "content": content}]})

    image = "data:image/png;base64," + base64.b64encode(bytes(range(256)) * 400).decode()
    other = "data:image/png;base64," + base64.b64encode(bytes(range(255, -1, -1)) * 400).decode()
    a, b, c = chat(image, "what is it?"), chat(image, "and its colour?"), chat(other, "what is it?")
    prefix = "<|user|>\n<image_url#"
    assert a.prompt_text.startswith(prefix)
    head = a.prompt_text[: a.prompt_text.index(">", len(prefix)) + 1]  # the image's stand-in, whole
    assert len(head) < 64 and b.prompt_text.startswith(head) and not c.prompt_text.startswith(head)
    assert estimated_tokens(a) < 20  # not the image's 137k characters of base64
    small = chat("https://example.com/cat.png", "what is it?")
    assert '"url":"https://example.com/cat.png"' in small.prompt_text
    assert (
        len(orjson.dumps({"image_url": {"detail": "auto", "url": image[:400]}, "type": "image_url"}))
        <= MEDIA_INLINE_BYTES
    )
    assert '"url":"' + image[:400] in chat(image[:400], "q").prompt_text  # up to the bound, inline
    huge_type = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "x" * 5000}]}]})
    assert huge_type.prompt_text.startswith("<|user|>\n<media#")  # the client's type, bounded


@pytest.mark.parametrize(
    "prompt,text,ids",
    [("hello", "hello", None), (["a", "b"], "a", None), ([1, 2, 3], "", (1, 2, 3)), ([[4, 5]], "", (4, 5))],
)
def test_completion_prompt_forms(prompt, text, ids):
    r = parse({"model": "m", "prompt": prompt}, path="/v1/completions")
    assert r.prompt_text == text and r.prompt_token_ids == ids


@pytest.mark.parametrize(
    "body,needle",
    [
        (b"{not json", "not valid JSON"),
        (b"[1,2]", "must be a JSON object"),
        (b'{"model": "m", "messages": "x"}', "'messages'"),
        (b'{"messages": [{"role":"user","content":"x"}]}', "'model'"),
        (b'{"model": "m", "messages": [{"role":"user","content":"x"}], "max_tokens": "5"}', "'max_tokens'"),
        (b'{"model": "m", "messages": [{"role":"user","content":"x"}], "stream": 1}', "'stream'"),
        (b'{"model": "m", "messages": [{"role":"user","content":"x"}], "max_tokens": true}', "'max_tokens'"),
        (b'{"model": "m", "messages": [{"role": 5, "content":"x"}]}', "role"),
        (b'{"model": "m", "prompt": [1, -2]}', "token ids"),
        (b'{"model": "m", "prompt": {"a": 1}}', "'prompt'"),
        (b'{"model": "m", "messages": [{"role":"user","content":"\xff\xfe"}]}', "not valid JSON"),
    ],
)
def test_malformed_bodies_get_clear_errors(body, needle):
    path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
    with pytest.raises(MalformedBody) as e:
        parse(body, path=path)
    assert needle in e.value.message
    assert e.value.status == 400


def test_body_limit():
    with pytest.raises(BodyTooLarge) as e:
        parse(b"x" * 2000, limit=1024)
    assert e.value.status == 413


def test_passthrough_path_never_fails():
    r = parse(b"\x00garbage", path="/v1/embeddings")
    assert r.model is None and not r.is_inference
    r = parse({"model": "emb", "input": "x"}, path="/v1/embeddings?x=1")
    assert r.model == "emb" and r.path == "/v1/embeddings"


def test_no_body_get_and_missing_body_post():
    r = parse(None, path="/v1/models", method="GET")
    assert r.model is None
    with pytest.raises(MalformedBody):
        parse(None, path="/v1/chat/completions")


def test_route_id_from_a_body_field():
    """headers.route_id_fields: a body field names the route where no route-id header does (Codex's
    prompt_cache_key, on Responses and chat requests alike); a header wins; off by default."""
    keyed = {"model": "m", "input": "hi", "prompt_cache_key": "conv-7"}
    fields = ("prompt_cache_key",)
    assert parse(keyed, path="/v1/responses", headers={}, fields=fields).route_id == "conv-7"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "conv-8"}
    assert parse(chat, headers={}, fields=fields).route_id == "conv-8"
    assert parse(keyed, path="/v1/responses", headers={"x-session-id": "s1"}, fields=fields).route_id == "s1"
    assert parse(keyed, path="/v1/responses", headers={}).route_id is None
    for bad in ("", 7, None, ["conv"]):  # not a non-empty string: no route id (nor an error: it is vLLM's to judge)
        body = {**keyed, "prompt_cache_key": bad}
        assert parse(body, path="/v1/responses", headers={}, fields=fields).route_id is None


def test_route_id_tenant_default_and_priority():
    r = parse({"model": "m", "prompt": "x"}, path="/v1/completions", headers={"x-session-id": "s9"})
    assert r.route_id == "s9" and r.tenant == "default" and r.priority == 0
    # The first route-id header with a value wins; empty ones count as absent.
    both = {"x-route-id": "r1", "x-session-id": "s9"}
    assert parse({"model": "m", "prompt": "x"}, path="/v1/completions", headers=both).route_id == "r1"
    empty = {"x-route-id": "", "x-session-id": "s9"}
    assert parse({"model": "m", "prompt": "x"}, path="/v1/completions", headers=empty).route_id == "s9"
    none = {"x-route-id": "", "x-session-id": ""}
    assert parse({"model": "m", "prompt": "x"}, path="/v1/completions", headers=none).route_id is None
    r = parse(
        {"model": "m", "prompt": "x"}, path="/v1/completions", headers={"x-gateway-inference-objective": "sheddable"}
    )
    assert r.priority < 0
    r = parse({"model": "m", "prompt": "x"}, path="/v1/completions", headers={"x-kvroute-priority": "-3"})
    assert r.priority == -3


def test_ttft_objective_header_in_milliseconds():
    body = {"model": "m", "prompt": "x"}
    assert parse(body, path="/v1/completions").ttft_slo_s is None
    assert parse(body, path="/v1/completions", headers={"x-slo-ttft-ms": " 250 "}).ttft_slo_s == 0.25
    assert parse(body, path="/v1/completions", headers={"x-slo-ttft-ms": "1.5"}).ttft_slo_s == 0.0015
    for bad in ("soon", "0", "-100", "inf", "nan", "1e999", "x" * 500):
        with pytest.raises(MalformedHeader, match="x-slo-ttft-ms must be a positive number of milliseconds") as e:
            parse(body, path="/v1/completions", headers={"x-slo-ttft-ms": bad})
        assert e.value.param == "x-slo-ttft-ms" and len(e.value.message) < 120  # the value is cut short


def test_utf8_multibyte_prompt_is_kept_exact():
    text = "ü€😀" * 100
    r = parse({"model": "m", "prompt": text}, path="/v1/completions")
    assert r.prompt_text == text


@pytest.mark.parametrize(
    "body,param",
    [
        # orjson parses 1024 levels but serializes 254: hashing such a value was an internal error
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "x": [[[[]]]]}]}]}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [[[[]]]]}, "tools"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [[[[]]]]}]}, "messages"),
    ],
)
def test_values_nested_too_deeply_to_hash_are_a_400(body, param):
    raw = orjson.dumps(body).replace(b"[[[[]]]]", b"[" * 300 + b"]" * 300)
    with pytest.raises(MalformedBody, match="nested too deeply") as e:
        parse(raw)
    assert e.value.param == param


@pytest.mark.parametrize(
    "prompt", [[1, 2**32], [[2**32 + 5]], [-1], [1, True], [[7, False]], [1, 2.0], [1, "2"], [1, None], [[1, [2]]]]
)
def test_token_ids_outside_u32_or_not_ints_are_a_400(prompt):
    """Token ids are hashed as u32: a larger one was an OverflowError (internal error, unrouted); a bool,
    a float, a string or a list among them is not an id either."""
    with pytest.raises(MalformedBody, match=r"0\.\.2\^32-1"):
        parse({"model": "m", "prompt": prompt}, path="/v1/completions")
    assert parse({"model": "m", "prompt": [0, 2**32 - 1]}, path="/v1/completions").prompt_token_ids == (0, 2**32 - 1)
