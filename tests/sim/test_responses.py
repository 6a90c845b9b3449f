"""The OpenAI Responses API on a simulated pod (``POST /v1/responses``), as vLLM 0.32 serves it: the chat vLLM
builds for the request underneath, the answer as a response object or its event stream, usage counting the
cached part of the prompt; and the load generator reading its stream."""

from __future__ import annotations

from typing import Any

import httpx

from bench.sim import Fleet
from bench.sim.chat import ChatFront
from bench.sim.tokenizer import SimTokenizer
from extproc import responses
from tests.sim.sse import events

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]  # fmt: skip


def body(**kw: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_output_tokens": 4,
        "instructions": "You are a careful coding agent. " * 20,
        "tools": TOOLS,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the failing test."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Reading it."}]},
            {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path": "tests/x.py"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "def test(): ..."},
        ],
        "store": False,
        "prompt_cache_key": "conversation-1",
        **kw,
    }


async def test_a_response_and_its_usage(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url + "/v1/responses"
    first = (await client.post(url, json=body())).json()
    assert first["object"] == "response" and first["id"].startswith("resp_") and first["model"] == "sim-model"
    assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = first["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": " the quick brown fox", "annotations": []}]
    assert first["instructions"] == body()["instructions"] and first["tools"] == TOOLS
    u1 = first["usage"]
    # The prompt is the chat vLLM builds for the request (function calls written as its conversion builds them).
    want = ChatFront(SimTokenizer()).tokens(responses.to_chat(body()), validated=False)
    details = u1["input_tokens_details"]
    assert u1["input_tokens"] == len(want) and details["cached_tokens"] == 0
    assert details["cache_write_tokens"] == len(want) // 16 * 16  # its full blocks, written to the cache
    assert u1["output_tokens"] == 4 and u1["total_tokens"] == len(want) + 4
    # The same conversation again: every full block is read from the cache.
    u2 = (await client.post(url, json=body())).json()["usage"]
    assert u2["input_tokens"] == len(want) and u2["input_tokens_details"]["cached_tokens"] == (len(want) - 1) // 16 * 16


async def test_the_instructions_tools_and_calls_are_in_the_prompt(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url + "/v1/responses"
    full = (await client.post(url, json=body())).json()["usage"]["input_tokens"]
    bare = (await client.post(url, json=body(tools=[], instructions=None))).json()["usage"]["input_tokens"]
    other = body()
    other["input"][2] = {**other["input"][2], "arguments": '{"path": "tests/y.py"}'}
    moved = (await client.post(url, json=other)).json()["usage"]
    assert bare < full - 100
    assert moved["input_tokens"] == full and moved["input_tokens_details"]["cached_tokens"] < full - 16
    # vLLM builds a Responses request's tool calls name first, where its chat request model gives a chat's back
    # arguments first: the same conversation as a chat request shares the blocks before the call, not after.
    chat = {"model": "sim-model", "max_tokens": 4, **responses.to_chat(body())}
    u = (await client.post(fleet.pods[0].url + "/v1/chat/completions", json=chat)).json()["usage"]
    assert u["prompt_tokens"] == full and 0 < u["prompt_tokens_details"]["cached_tokens"] < full - 16


async def test_a_streamed_response(fleet: Fleet, client: httpx.AsyncClient) -> None:
    r = await client.post(fleet.pods[0].url + "/v1/responses", json=body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["usage"] is None
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == " the quick brown fox"
    assert {e["item_id"] for e in deltas} == {evs[2]["item"]["id"]}
    done = evs[-1]["response"]
    assert done["id"] == evs[0]["response"]["id"] and done["status"] == "incomplete"
    assert done["output"][0]["content"][0]["text"] == " the quick brown fox" and done["usage"]["output_tokens"] == 4


async def test_refusals_in_the_openai_error_shape(fleet: Fleet, client: httpx.AsyncClient) -> None:
    url = fleet.pods[0].url + "/v1/responses"
    cases = [
        (body(previous_response_id="resp_gone"), 404, "resp_gone"),  # vLLM's store is off by default
        (body(model="other"), 404, "does not exist"),
        (body(input=7), 400, "input"),
        (body(max_output_tokens="many"), 400, "max_output_tokens"),
    ]
    for sent, status, words in cases:
        r = await client.post(url, json=sent)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == status and words in err["message"], err
    r = await client.post(url, content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
