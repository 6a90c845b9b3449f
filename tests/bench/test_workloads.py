"""Workloads: exact token sizing, trace parsing and sampling, determinism, ideal reuse, arrivals."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from bench import harness, loadgen, workloads
from bench.sim import Fleet, FleetConfig
from bench.sim.tokenizer import SimTokenizer
from bench.workloads import Item
from tests.backends import serve_loopback

TOK = SimTokenizer()


def test_words_are_exactly_one_sim_token_each() -> None:
    import random

    assert len(TOK.encode(workloads.words(random.Random(1), 777))) == 777


def test_trace_blocks_equal_ids_equal_text_and_exact_length() -> None:
    t = workloads.TraceText()
    assert t.block(7) == workloads.TraceText().block(7) != t.block(8)
    assert len(TOK.encode(t.block(7))) == workloads.TRACE_BLOCK_TOKENS
    p = t.prompt([7, 8, 9], 1100)
    assert len(TOK.encode(p)) == 1100
    assert p.startswith(t.block(7) + t.block(8))
    # The cut last block is a prefix of the full one: requests sharing ids share the prefix.
    assert t.block(9).startswith(p[len(t.block(7) + t.block(8)) :])


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_read_trace_and_replay_items(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 600, "output_length": 500, "hash_ids": [0, 1]},
        {"timestamp": 4000, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    ]
    f = _write_trace(tmp_path / "t.jsonl", rows)
    assert workloads.read_trace(f)[1]["hash_ids"] == [0, 1, 2]
    w = workloads.trace(f, max_output_tokens=64, max_input_tokens=1000)
    assert [it.at for it in w.items] == [0.0, 3.0]  # seconds from the first request
    assert [it.max_tokens for it in w.items] == [64, 3]  # output capped
    second = w.items[1].messages[0]["content"]
    assert len(TOK.encode(second)) == 1000  # input capped, leading blocks kept
    assert second.startswith(w.items[0].messages[0]["content"][: 512 * 3])
    assert len(workloads.trace(f, max_requests=1).items) == 1


def test_read_trace_rejects_bad_rows(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        workloads.read_trace(f)


def test_sample_sessions_keeps_whole_sessions() -> None:
    # id 0 is in every row (a shared system prompt): sessions are keyed by the next id.
    rows = [
        {"timestamp": i, "input_length": 10, "output_length": 1, "hash_ids": [0, 100 + i % 40, i]} for i in range(200)
    ]
    kept = workloads.sample_sessions(rows, 3)
    sessions = {r["hash_ids"][1] for r in kept}
    assert 0 < len(sessions) < 40
    assert all(sum(r["hash_ids"][1] == s for r in kept) == 5 for s in sessions)


def test_scenarios_are_deterministic_and_seeded() -> None:
    for name in workloads.SCENARIOS:
        a = workloads.build(name, None, 20, seed=3)
        b = workloads.build(name, None, 20, seed=3)
        c = workloads.build(name, None, 20, seed=4)
        assert [workloads.request_body(i) for i in a.items] == [workloads.request_body(i) for i in b.items]
        assert a.items != c.items
        assert len(a.items) == 20


def test_multi_turn_resends_history_with_the_pods_answers() -> None:
    w = workloads.multi_turn(conversations=2, turns=3, max_tokens=8)
    convo = [it for it in w.items if it.tag == "c0"]
    assert [len(it.messages) for it in convo] == [2, 4, 6]
    assert convo[1].messages[:2] == convo[0].messages
    assert convo[1].messages[2] == {"role": "assistant", "content": workloads.answer_text(8)}


def test_agentic_sessions_as_claude_code_sends_them() -> None:
    """Every request: the agent's tools and system prompt (shared by all sessions), a new attribution line,
    the session's environment; each turn resends the last with the pods' answer, a tool call and its result."""
    w = workloads.agentic(sessions=2, turns=3, max_tokens=8)
    session = [it for it in w.items if it.tag == "s0"]
    bodies = [json.loads(workloads.request_body(it)) for it in session]
    assert all(it.path == "/v1/messages" for it in w.items) and len(w.items) == 6
    assert all(b["stream"] is True and "stream_options" not in b for b in bodies)
    assert len({json.dumps(b["tools"]) for b in bodies}) == 1
    assert len(bodies[0]["tools"]) == len(workloads.AGENT_TOOLS)
    billing = [b["system"][0]["text"] for b in bodies]
    assert all(t.startswith("x-anthropic-billing-header:") for t in billing) and len(set(billing)) == 3
    assert [len(b["messages"]) for b in bodies] == [1, 3, 5]
    assert bodies[1]["messages"][:1] == bodies[0]["messages"]
    reply, result = bodies[1]["messages"][1:]
    assert reply["content"][0] == {"type": "text", "text": workloads.answer_text(8)}
    assert (
        reply["content"][1]["type"] == "tool_use" and result["content"][0]["tool_use_id"] == reply["content"][1]["id"]
    )
    # The chat kvroute and vLLM run for a request: no attribution line, tools as function tools.
    assert "x-anthropic" not in json.dumps(session[0].messages)
    chat = workloads.agentic(sessions=2, turns=3, max_tokens=8, api="chat")
    assert [it.messages for it in chat.items] == [it.messages for it in w.items]
    assert all(it.path == "/v1/chat/completions" and it.body and it.body["tools"][0]["type"] == "function"
               for it in chat.items)  # fmt: skip
    # Every session shares the tools and system prompt: the ideal reuses them and each session's history.
    assert workloads.ideal_hit_rate(workloads.agentic().items, 16)["hit_rate"] > 0.9
    with pytest.raises(ValueError, match="api"):
        workloads.agentic(api="completions")


def test_agentic_sessions_as_codex_sends_them() -> None:
    """Over the Responses API: the system prompt as instructions, flat function tools, the environment as the
    first input item, each turn resending the last with the pods' answer, a function call (arguments a JSON
    string) and its output; the conversation's id as prompt_cache_key. vLLM runs the same conversation as the
    Messages sessions (less the attribution line, which Codex does not send), the environment a user turn."""
    w = workloads.agentic(sessions=2, turns=3, max_tokens=8, api="responses")
    assert w.name == "agentic-responses" and len(w.items) == 6
    assert all(it.path == "/v1/responses" for it in w.items)
    session = [it for it in w.items if it.tag == "s0"]
    bodies = [json.loads(workloads.request_body(it)) for it in session]
    assert all(b["stream"] is True and "stream_options" not in b and b["store"] is False for b in bodies)
    assert {b["prompt_cache_key"] for b in bodies} == {"s0-0"} and bodies[0]["max_output_tokens"] == 8
    assert len({b["instructions"] for b in bodies}) == 1 and bodies[0]["tools"][0]["type"] == "function"
    assert [[i["type"] for i in b["input"]] for b in bodies][:2] == [
        ["message", "message"],
        ["message", "message", "message", "function_call", "function_call_output"],
    ]
    call, output = bodies[1]["input"][3:]
    assert isinstance(call["arguments"], str) and json.loads(call["arguments"])
    assert output["call_id"] == call["call_id"]
    assert bodies[1]["input"][2]["content"][0] == {"type": "output_text", "text": workloads.answer_text(8)}
    messages = workloads.agentic(sessions=2, turns=3, max_tokens=8)
    for r, m in zip(w.items, messages.items, strict=True):
        system, env, *rest = r.messages
        assert system["role"] == "system" and m.messages[0]["content"].startswith(system["content"])
        assert env["role"] == "user" and m.messages[0]["content"].endswith(env["content"][0]["text"])
        assert [x["role"] for x in rest] == [x["role"] for x in m.messages[1:]]


def test_ideal_hit_rate_by_hand() -> None:
    bs = 16
    item = Item(({"role": "user", "content": workloads.words(__import__("random").Random(0), 100)},), max_tokens=1)
    n = len(TOK.render_chat([dict(m) for m in item.messages], None))
    r = workloads.ideal_hit_rate([item, item], bs)
    assert r["prompt_tokens"] == 2 * n
    assert r["hit_tokens"] == (n - 1) // bs * bs  # the repeat hits all but the last token, in whole blocks
    assert workloads.ideal_hit_rate(workloads.no_reuse(requests=5, prompt_tokens=100).items, bs)["hit_rate"] == 0


async def _sequential(url: str, items: list[Item]) -> None:
    async with aiohttp.ClientSession() as s:
        for it in items:
            async with s.post(url + "/v1/chat/completions", data=workloads.request_body(it, stream=False),
                              headers={"content-type": "application/json"}) as r:  # fmt: skip
                assert r.status == 200, await r.text()
                await r.read()


@pytest.mark.parametrize("name", ["multi-turn", "shared-prefix"])
async def test_ideal_hit_rate_is_what_one_simulated_pod_hits(name: str) -> None:
    """One pod with room for everything, requests one at a time = the infinite cache."""
    if name == "multi-turn":
        w = workloads.multi_turn(conversations=3, turns=3, system_tokens=100, user_tokens=40, max_tokens=20)
    else:
        w = workloads.shared_prefix(groups=2, users=2, questions=2, doc_tokens=300, user_tokens=50)
    async with Fleet(FleetConfig(pods=1, profile="fast", zmq_base_port=None)) as fleet:
        await _sequential(fleet.pods[0].url, w.items)
        stats = fleet.pods[0].stats()
    ideal = workloads.ideal_hit_rate(w.items, fleet.pods[0].block_size)
    assert stats["prefix_queries_tokens"] == ideal["prompt_tokens"]
    assert stats["prefix_hits_tokens"] == ideal["hit_tokens"] > 0


def test_naive_hash_pins_a_document_to_one_pod() -> None:
    w = workloads.shared_prefix(groups=3, users=2, questions=2, doc_tokens=300)
    by_group: dict[str, set[int]] = {}
    for it in w.items:
        by_group.setdefault(it.tag.split("u")[0], set()).add(workloads.naive_hash_pod(it, 4))
    assert all(len(p) == 1 for p in by_group.values())


def test_arrivals_poisson_and_rescaled_trace() -> None:
    items = [Item(({"role": "user", "content": "x"},), 1, at=float(t)) for t in (0, 10, 10, 30)]
    times = harness.arrivals(items, rate=2.0, seed=0, duration=None)
    assert times == [0.0, 2/3, 2/3, 2.0]  # 4 requests at 2 req/s: span 2 s, shape kept  # fmt: skip
    assert harness.arrivals(items, 2.0, 0, duration=1.0) == [0.0, 2/3, 2/3]  # fmt: skip
    plain = [Item(({"role": "user", "content": "x"},), 1)] * 2000
    t = harness.arrivals(plain, rate=50.0, seed=1, duration=None)
    assert t == sorted(t) and 35 < t[-1] < 45


def test_saturation_rate_ignores_ramp_and_drain() -> None:
    recs = [loadgen.Record(tag="", status=200, start=0.0, e2e=0.1 * i) for i in range(1, 101)]
    assert harness.saturation_rate(recs) == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="calibration"):
        harness.saturation_rate(recs[:3])


def test_cli_workload_prints_ideal(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.__main__ import main

    assert main(["workload", "--scenario", "no-reuse", "--max-requests", "5"]) == 0
    assert "ideal hit rate 0.0%" in capsys.readouterr().out


def test_closed_loop_keeps_every_spec() -> None:
    """closed_loop against a tiny aiohttp app: each spec sent exactly once, in-flight bounded."""
    from aiohttp import web

    seen: list[bytes] = []
    inflight = {"now": 0, "max": 0}

    async def handler(request: web.Request) -> web.Response:
        inflight["now"] += 1
        inflight["max"] = max(inflight["max"], inflight["now"])
        seen.append(await request.read())
        await asyncio.sleep(0.01)
        inflight["now"] -= 1
        return web.json_response({"ok": True})

    async def go() -> list[loadgen.Record]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner, port = await serve_loopback(app)
        specs = [loadgen.RequestSpec(body=str(i).encode()) for i in range(30)]
        try:
            return await harness.closed_loop(f"http://127.0.0.1:{port}", specs, 4, 10)
        finally:
            await runner.cleanup()

    recs = asyncio.run(go())
    assert len(recs) == 30 and all(r.ok for r in recs)
    assert sorted(seen, key=int) == [str(i).encode() for i in range(30)]
    assert inflight["max"] <= 4


def test_trace_spread_over_its_clock_step(tmp_path: Path) -> None:
    """Mooncake's traces tick every 3 s: spread, a tick's requests arrive evenly over it, in order."""
    rows = [{"timestamp": t, "input_length": 600, "output_length": 5, "hash_ids": [i, 100 + i]}
            for i, t in enumerate([0, 0, 0, 3000, 6000, 6000, 12000])]  # fmt: skip
    f = _write_trace(tmp_path / "t.jsonl", rows)
    assert workloads.trace_tick([0, 0, 3000, 6000, 6001, 12000]) == 3000.0
    as_written = workloads.trace(f, max_input_tokens=1000)
    assert [it.at for it in as_written.items] == [0.0, 0.0, 0.0, 3.0, 6.0, 6.0, 12.0]
    w = workloads.trace(f, max_input_tokens=1000, spread=True)
    assert [it.at for it in w.items] == pytest.approx([0.0, 1.0, 2.0, 3.0, 6.0, 7.5, 12.0])
    assert w.params["spread_over_tick_s"] == 3.0
    with pytest.raises(ValueError, match="two distinct timestamps"):
        workloads.trace_tick([5, 5])


def test_scenario_params_from_the_command_line() -> None:
    """``--scenario-param NAME=INT`` reaches the scenario's builder; a malformed or unknown one is a clear error."""
    import argparse

    from bench.__main__ import _build_workload, _workload_args

    p = argparse.ArgumentParser()
    _workload_args(p)
    w = _build_workload(p.parse_args(["--scenario", "multi-turn", "--scenario-param", "turns=3",
                                      "--scenario-param", "conversations=5"]))  # fmt: skip
    assert len(w.items) == 15 and w.params["turns"] == 3
    for bad, needle in ((["--scenario-param", "turns"], "use NAME=INT"), (["--scenario-param", "nope=3"], "nope")):
        with pytest.raises(SystemExit, match=needle):
            _build_workload(p.parse_args(["--scenario", "multi-turn", *bad]))
