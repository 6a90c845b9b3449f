"""The OpenAI-compatible surface of a simulated pod, as a router or client sees it."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.sim import Fleet

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body strictly: every event is one `data: ` line followed by a blank line."""
    assert text.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return out


async def test_completion_usage_and_cached_tokens(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url + "/v1/completions"
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 5}
    r1 = (await client.post(url, json=body)).json()
    r2 = (await client.post(url, json=body)).json()
    assert r1["object"] == "text_completion" and r1["id"].startswith("cmpl-")
    assert r1["choices"][0]["finish_reason"] == "length"
    assert r1["choices"][0]["text"] == " the quick brown fox jumps"
    u1, u2 = r1["usage"], r2["usage"]
    assert u1["completion_tokens"] == 5 and u1["total_tokens"] == u1["prompt_tokens"] + 5
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    plen = u1["prompt_tokens"]
    assert u2["prompt_tokens_details"]["cached_tokens"] == (plen - 1) // 16 * 16
    # The other pod has nothing cached.
    r3 = (await client.post(fleet.pods[1].url + "/v1/completions", json=body)).json()
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fleet.pods[0].stats()["prefix_hits_tokens"] == (plen - 1) // 16 * 16


async def test_prompt_forms_and_request_id(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url + "/v1/completions"
    r = await client.post(url, json={"prompt": [5, 6, 7, 8], "max_tokens": 2}, headers={"X-Request-Id": "req-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-123"
    assert r.json()["id"] == "cmpl-req-123" and r.json()["usage"]["prompt_tokens"] == 4
    r = await client.post(url, json={"prompt": ["just one"], "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16  # default
    r = await client.post(url, json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_chat_stream_sse_with_usage(fleet: Fleet, client: httpx.AsyncClient) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await client.post(fleet.pods[0].url + "/v1/chat/completions", json=body, headers={"x-request-id": "s1"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"] == "s1"
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert [c["choices"][0]["delta"]["content"] for c in tokens] == [" the", " quick", " brown"]
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, "length"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-s1" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]


async def test_completion_stream_without_usage(fleet: Fleet, client: httpx.AsyncClient) -> None:
    r = await client.post(
        fleet.pods[0].url + "/v1/completions", json={"prompt": "x y z", "max_tokens": 2, "stream": True}
    )
    ev = sse_events(r.text)
    assert len(ev) == 3 and all("usage" not in e for e in ev[:-1])
    assert ev[1]["choices"][0]["finish_reason"] == "length"


async def test_error_shapes(fleet: Fleet, client: httpx.AsyncClient) -> None:
    """vLLM 0.32's refusals (tests/vllm/test_sim_fidelity.py holds them to a real pod's): what its request model
    refuses typed "Bad Request" with the field's place in the body as param, its own checks BadRequestError with
    (parameter=..., value=...) where vLLM names them."""
    base = fleet.pods[0].url
    limit = fleet.pods[0].max_model_len

    def check(r: httpx.Response, code: int, err_type: str, param: str | None = None, message: str = "") -> None:
        assert r.status_code == code, r.text[:300]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == code and err["type"] == err_type and err["param"] == param, err
        assert message in err["message"], err

    async def post(path: str, body: object) -> httpx.Response:
        sent = {"content": body} if isinstance(body, bytes) else {"json": body}
        return await client.post(base + path, **sent)

    chat, done = "/v1/chat/completions", "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    check(await post(done, b"{not json"), 400, "Bad Request", "body.1", "'ctx': {'error': 'Expecting property name")
    check(await post(done, b""), 400, "Bad Request", "body", "'type': 'missing'")
    check(await post(done, [1, 2]), 400, "Bad Request", "body", "1 validation error:\n  {'type': 'model_attributes_"
          "type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from', "
          "'input': '<list of 2 items>'}")  # fmt: skip
    check(await post(done, {"model": "nope", "prompt": "x"}), 404, "NotFoundError", "model")
    check(await post(chat, {}), 400, "Bad Request", "body.messages", "'type': 'missing'")
    check(await post(chat, {"messages": "hi"}), 400, "Bad Request", "body.messages", "valid list")
    check(await post(chat, {"messages": [{"content": "hi"}]}), 400, "Bad Request",
          "body.messages.0.ChatCompletionDeveloperMessageParam.role")  # fmt: skip
    check(await post(chat, {"messages": msgs, "tools": 5}), 400, "Bad Request", "body.tools")
    check(await post(chat, {"messages": msgs, "max_tokens": 3.5}), 400, "Bad Request", "body.max_tokens",
          "fractional part")  # fmt: skip
    check(await post(chat, {"messages": msgs, "stream": True, "stream_options": 5}), 400, "Bad Request",
          "body.stream_options")  # fmt: skip
    check(await post(done, {"prompt": "x", "kv_transfer_params": []}), 400, "Bad Request", "body.kv_transfer_params")
    check(await post(done, {"prompt": 5}), 400, "Bad Request", "body.prompt")
    check(await post(done, {"prompt": [1, -1]}), 400, "Bad Request", "body.prompt.1", "greater than or equal to 0")
    check(await post(chat, {"messages": []}), 400, "BadRequestError", None,
          "Cannot apply chat template to an empty conversation. Provide at least one message.")  # fmt: skip
    for prompt in ("", None):
        check(await post(done, {"prompt": prompt}), 400, "BadRequestError", "prompt",
              "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)")  # fmt: skip
    check(await post(done, {"prompt": []}), 400, "BadRequestError", None, "You must pass at least one prompt")
    check(await post(done, {"prompt": [10**9]}), 400, "BadRequestError", None, "Token id 1000000000 is out of")
    check(await post(done, {"prompt": "x", "max_tokens": 0}), 400, "BadRequestError", "max_tokens",
          "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")  # fmt: skip
    too_many = f"max_completion_tokens={limit + 1} cannot be greater than max_model_len={limit}"
    check(await post(chat, {"messages": msgs, "max_completion_tokens": limit + 1}), 400, "BadRequestError",
          "max_completion_tokens", too_many)  # fmt: skip
    check(await post(done, {"prompt": "x", "min_tokens": -1}), 400, "BadRequestError", None,
          "min_tokens must be greater than or equal to 0, got -1.")  # fmt: skip
    check(await post(done, {"prompt": "x", "cache_salt": ""}), 400, "BadRequestError", "cache_salt",
          "(parameter=cache_salt)")  # fmt: skip
    opts = {"prompt": "x", "stream_options": {"include_usage": True}}  # without stream
    check(await post(done, opts), 400, "BadRequestError", "stream_options", "`stream=True`. (parameter=stream_options)")
    check(await post(done, {"prompt": [5] * (limit + 1), "max_tokens": 1}), 400, "BadRequestError", "input_tokens",
          f"your prompt contains at least {limit + 1} input tokens, which exceeds this limit")  # fmt: skip
    check(await post(done, {"prompt": [5] * limit}), 400, "BadRequestError", "max_tokens", "at least 1, got 0.")
    # What the context has room for is generated: the request's max_tokens cut to it, not refused.
    r = await post(done, {"prompt": [5] * (limit - 3), "max_tokens": 10, "min_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text[:300]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["prompt_tokens_details"]["created_cache_tokens"] is None  # (a chat's only)
    check(await post(done, {"prompt": [5] * (limit - 3), "max_tokens": 10, "min_tokens": 4}), 400, "BadRequestError",
          None, "min_tokens must be less than or equal to max_tokens=3, got 4.")  # fmt: skip
    r = await post(chat, {"messages": msgs, "max_tokens": "2", "stream": "no"})  # (pydantic reads "2" as 2, "no" false)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text[:300]
    check(await post(chat, {"messages": msgs, "stream": "maybe"}), 400, "Bad Request", "body.stream", "bool_parsing")
    r = await client.get(base + "/no/such/path")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert (await client.get(base + "/v1/completions")).status_code == 405


async def test_models_health_tokenize_render(fleet: Fleet, client: httpx.AsyncClient) -> None:
    base = fleet.pods[0].url
    assert (await client.get(base + "/health")).status_code == 200
    models = (await client.get(base + "/v1/models")).json()
    assert models["data"][0]["id"] == "sim-model" and models["data"][0]["owned_by"] == "vllm"
    tok = (await client.post(base + "/tokenize", json={"prompt": PROMPT})).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    rend = (await client.post(base + "/v1/completions/render", json={"prompt": PROMPT})).json()
    assert rend[0]["token_ids"] == tok["tokens"]
    msgs = [{"role": "user", "content": "hello"}]
    chat_tok = (await client.post(base + "/tokenize", json={"messages": msgs})).json()["tokens"]
    chat_rend = (await client.post(base + "/v1/chat/completions/render", json={"messages": msgs})).json()
    assert chat_rend["token_ids"] == chat_tok
    # The rendered ids are exactly what generation sees: usage.prompt_tokens agrees.
    r = (await client.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})).json()
    assert r["usage"]["prompt_tokens"] == len(chat_tok)


async def test_chat_turns_are_prefix_stable(fleet: Fleet, client: httpx.AsyncClient) -> None:
    base = fleet.pods[0].url
    turn1 = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " a story"}]},
    ]
    body = {
        "messages": turn1,
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    r1 = (await client.post(base + "/v1/chat/completions", json=body)).json()
    t1 = (await client.post(base + "/tokenize", json=body)).json()["tokens"]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "more"},
    ]
    t2 = (await client.post(base + "/tokenize", json={**body, "messages": turn2})).json()["tokens"]
    assert t2[: len(t1)] == t1
    r2 = (await client.post(base + "/v1/chat/completions", json={**body, "messages": turn2})).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(t1) // 16 * 16


async def test_metrics_parse_with_vllm_names(fleet: Fleet, client: httpx.AsyncClient) -> None:
    base = fleet.pods[0].url
    await client.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    await client.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    text = (await client.get(base + "/metrics")).text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[s.name] = s
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
    ):
        assert name in samples, name
        assert samples[name].labels["model_name"] == "sim-model" and samples[name].labels["engine"] == "0"
    info = samples["vllm:cache_config_info"].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "28000"
    assert samples["vllm:generation_tokens_total"].value == 6
    assert samples["vllm:request_success_total"].labels["finished_reason"] == "length"
    assert samples["vllm:prefix_cache_hits_total"].value > 0
    assert samples["vllm:e2e_request_latency_seconds_count"].value == 2


async def test_sim_info_and_stats(fleet: Fleet, client: httpx.AsyncClient) -> None:
    info = (await client.get(fleet.pods[1].url + "/sim/info")).json()
    assert info["role"] == "both" and info["index"] == 1 and info["address"] == fleet.pods[1].address
    assert info["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
    t0 = time.monotonic()
    await client.post(fleet.pods[1].url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
    took = time.monotonic() - t0
    st = (await client.get(fleet.pods[1].url + "/sim/stats")).json()
    assert st["finished"] == 1 and st["busy_s"] > 0 and st["generation_tokens"] == 2
    # The pod's own time to first token: the first step at least, inside the client's round trip.
    assert st["ttft_count"] == 1 and 0 < st["ttft_sum_s"] < took
    total = fleet.stats()["total"]
    assert total["finished"] == 1 and total["prefix_queries_tokens"] == st["prefix_queries_tokens"]
