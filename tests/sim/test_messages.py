"""The Anthropic Messages API on a simulated pod (``POST /v1/messages``), as vLLM 0.32 serves it: a chat
underneath, the answer in the API's shapes, usage counting cache reads, Claude Code's attribution line kept
out of the prompt; and the load generator reading its stream and the Responses API's."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from bench import loadgen, workloads
from bench.sim import Fleet, FleetConfig
from bench.sim.chat import ChatFront
from bench.sim.tokenizer import SimTokenizer
from extproc import anthropic
from tests.sim.sse import events

TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]  # fmt: skip


def body(billing: str = "cch=1", **kw: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": 4,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; {billing};"},
            {"type": "text", "text": "You are a careful coding agent. " * 20},
        ],
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Fix the failing test."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "tests/test_x.py"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "def test(): ..."}]},
        ],
        **kw,
    }


async def test_a_message_and_its_usage(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url
    first = (await client.post(url + "/v1/messages", json=body())).json()
    assert first["type"] == "message" and first["role"] == "assistant" and first["model"] == "sim-model"
    assert first["content"] == [{"type": "text", "text": " the quick brown fox"}]
    assert first["stop_reason"] == "max_tokens" and "stop_sequence" not in first  # null fields left out
    u1 = first["usage"]
    assert u1["output_tokens"] == 4 and u1["cache_read_input_tokens"] == 0
    # The prompt is the chat vLLM runs for the request: the same tokens as that chat rendered. As vLLM counts
    # them: its full blocks written to the cache, the rest input.
    chat = {"model": "sim-model", "max_tokens": 4, **anthropic.to_chat(body())}
    rendered = (await client.post(url + "/v1/chat/completions/render", json=chat)).json()["token_ids"]
    n = len(rendered)
    assert (u1["cache_creation_input_tokens"], u1["input_tokens"]) == (n // 16 * 16, n % 16)
    # The next request differs only in the attribution line, which vLLM cuts: every full block is a hit.
    second = (await client.post(url + "/v1/messages", json=body(billing="cch=2"))).json()
    u2 = second["usage"]
    assert u2["cache_read_input_tokens"] == (n - 1) // 16 * 16
    assert u2["input_tokens"] + u2["cache_read_input_tokens"] + u2["cache_creation_input_tokens"] == n


async def test_the_tools_and_tool_calls_are_in_the_prompt(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url + "/v1/messages"

    def prompt(u: dict[str, int]) -> int:
        return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]

    full = prompt((await client.post(url, json=body())).json()["usage"])
    no_tools = (await client.post(url, json={k: v for k, v in body().items() if k != "tools"})).json()
    other_path = body()
    other_path["messages"][1]["content"][1]["input"] = {"path": "tests/test_y.py"}
    moved = (await client.post(url, json=other_path)).json()["usage"]
    assert prompt(no_tools["usage"]) < full
    assert prompt(moved) == full
    assert moved["cache_read_input_tokens"] < full - 16  # the call's arguments changed a block before the end


async def test_a_streamed_message(fleet: Fleet, client: httpx.AsyncClient) -> None:
    r = await client.post(fleet.pods[0].url + "/v1/messages", json=body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    names = [e["type"] for e in evs]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 4, "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    start = evs[0]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["usage"]["input_tokens"] > 0
    assert "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta") == " the quick brown fox"
    delta = evs[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


async def test_refusals_as_vllm_writes_them(fleet: Fleet, client: httpx.AsyncClient) -> None:
    """vLLM 0.32's Messages errors: the API's shape with the OpenAI error's type where its handler refuses (an
    unknown model), the OpenAI shape where its request validation does (no max_tokens, malformed messages, not
    JSON): tests/vllm/test_sim_fidelity.py checks them against a real pod."""
    url = fleet.pods[0].url + "/v1/messages"
    r = await client.post(url, json=body(model="other"))
    unknown = "The model `other` does not exist. Valid aliases: sim-model."
    assert r.status_code == 404 and r.json() == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": unknown},
    }
    for sent in ({k: v for k, v in body().items() if k != "max_tokens"}, {**body(), "messages": "hi"}):
        r = await client.post(url, json=sent)
        assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request" and "type" not in r.json()
    r = await client.post(url, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"


async def test_tools_without_a_tool_call_parser_are_refused_as_vllm_does(client: httpx.AsyncClient) -> None:
    """A pod started as vLLM is by default (no --enable-auto-tool-choice, no --tool-call-parser): a chat or
    Messages request with tools and an automatic tool choice (the default with tools), or one needing a parser,
    gets 400; tool choice none is served. The default simulated pod serves them all, as an agent deployment's."""
    async with Fleet(FleetConfig(pods=1, profile="fast", auto_tool_choice=False)) as plain:
        url = plain.pods[0].url
        r = await client.post(url + "/v1/messages", json=body())
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {"type": "BadRequestError", "message":
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'}}  # fmt: skip
        r = await client.post(url + "/v1/messages", json=body(tool_choice={"type": "tool", "name": "read_file"}))
        assert r.status_code == 400 and 'tool_choice=function "read_file" requires' in r.json()["error"]["message"]
        assert (await client.post(url + "/v1/messages", json=body(tool_choice={"type": "none"}))).status_code == 200
        chat = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}  # fmt: skip
        r = await client.post(url + "/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = await client.post(url + "/v1/chat/completions", json={**chat, "tool_choice": "required"})
        assert r.status_code == 400 and 'tool_choice="required" requires' in r.json()["error"]["message"]
        assert (
            await client.post(url + "/v1/chat/completions", json={**chat, "tool_choice": "none"})
        ).status_code == 200
    async with Fleet(FleetConfig(pods=1, profile="fast")) as agents:
        assert (await client.post(agents.pods[0].url + "/v1/messages", json=body())).status_code == 200


@pytest.mark.parametrize(("api", "path"), [("messages", "/v1/messages"), ("responses", "/v1/responses")])
async def test_the_load_generator_reads_an_agent_apis_stream(fleet: Fleet, api: str, path: str) -> None:
    """TTFT at the first text delta; the prompt and its cached tokens from the usage events (Messages:
    message_start and message_delta; Responses: response.completed)."""
    items = workloads.agentic(sessions=1, turns=2, system_tokens=200, tool_tokens=20, result_tokens=40,
                              api=api).items  # fmt: skip
    specs = workloads.specs(items, [0.0, 0.5])
    assert [s.path for s in specs] == [path] * 2
    recs = await loadgen.run(fleet.pods[0].url, specs, timeout=30)
    assert all(r.ok and r.ttft is not None for r in recs), [r.error for r in recs]
    assert all(r.output_chunks == items[0].max_tokens for r in recs)
    first, second = recs
    assert first.cached_tokens == 0 and first.prompt_tokens == len(workloads.prompt_ids(ChatFront(SimTokenizer()),
                                                                                         items[0]))  # fmt: skip
    assert second.prompt_tokens is not None and second.prompt_tokens > first.prompt_tokens
    # The second turn resends the first whole (the pod's reply with it): its blocks are hits.
    assert second.cached_tokens is not None and second.cached_tokens >= first.prompt_tokens // 16 * 16
