"""kvroute-precise's tokenizer (bench.harness.precise_tokenizer: bench.sim's built-in tokenizer as a
Hugging Face directory): kvroute loads it and keys every bench request with the token ids the
simulated pods give it, so its precise keys are the pods' blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bench import harness, workloads
from bench.sim import Fleet, FleetConfig
from bench.sim.chat import ChatFront
from bench.sim.tokenizer import HFTokenizer, SimTokenizer, export_tokenizer
from extproc import responses
from extproc.config import build_config
from extproc.observability import Metrics
from extproc.router import Router
from extproc.tokenize import ModelTokenizer


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness.precise_tokenizer(tmp_path_factory.mktemp("sim-tokenizer"))


def bench_bodies() -> list[tuple[str, dict[str, Any]]]:
    """The chat bodies the harness sends, a few of every scenario and of a Mooncake-style trace (the agent
    sessions, with tools and other APIs: the next test)."""
    out = [(name, orjson.loads(workloads.request_body(it)))
           for name in workloads.SCENARIOS if not name.startswith("agentic")
           for it in workloads.build(name, None, 6).items]  # fmt: skip
    later = workloads.build("multi-turn", None, None).items[-4:]  # late turns: the pods' answers in them
    out += [("multi-turn", orjson.loads(workloads.request_body(it))) for it in later]
    text = workloads.TraceText()
    trace = workloads.Item(({"role": "user", "content": text.prompt([3, 1, 4], 1300)},), 8)
    return [*out, ("trace", orjson.loads(workloads.request_body(trace)))]


def test_kvroute_tokenizes_every_bench_request_as_the_pods_do(exported: Path) -> None:
    kv, pods, hf = ModelTokenizer.from_dir(exported), SimTokenizer(), HFTokenizer(str(exported))
    assert kv.split_ok  # the piece cache applies (a follow-up turn encodes only its new text)
    answers = 0
    for name, body in bench_bodies():
        want = pods.render_chat([dict(m) for m in body["messages"]], None)
        assert kv.chat_ids(body).tolist() == want, name
        assert hf.render_chat([dict(m) for m in body["messages"]], None) == want, name  # a pod given --tokenizer
        answers += sum(m["role"] == "assistant" for m in body["messages"])
    assert answers  # the pods' answers (their filler tokens) were in prompts too


def test_kvroute_tokenizes_agent_sessions_as_the_pods_do(exported: Path) -> None:
    """The agentic workloads' requests (tools, tool calls and results, system blocks; over the Messages and
    Responses APIs and as chats): kvroute's precise ids are the pods' (vLLM's conversation, then the template),
    built-in tokenizer and the exported one loaded with --tokenizer alike, every turn of a session."""
    kv = ModelTokenizer.from_dir(exported)
    pods, hf = ChatFront(SimTokenizer()), ChatFront(HFTokenizer(str(exported)))
    paths = {"agentic": "/v1/messages", "agentic-chat": "/v1/chat/completions", "agentic-responses": "/v1/responses"}
    for name, path in paths.items():
        items = workloads.build(name, None, None, sessions=2, turns=4).items
        assert {it.path for it in items} == {path}
        for it in items:
            body = orjson.loads(workloads.request_body(it))
            if path == "/v1/responses":
                text = kv.render_chat(responses.to_chat(body), validated=False)
            else:
                text = kv.render_chat(kv.anthropic_chat(body) if path == "/v1/messages" else body)
            ids = kv.encode(text, add_special_tokens=False).tolist()
            want = workloads.prompt_ids(pods, it)
            assert ids == want == workloads.prompt_ids(hf, it), name
        assert len(want) > 4000  # the tools and system prompt (~5k tokens), then the session's turns


def test_unknown_text_agrees_between_kvroute_and_pods_loading_it(exported: Path) -> None:
    """Text outside the bench's vocabulary gets other ids than the built-in tokenizer's hashes, but a
    pod loading the directory and kvroute still agree, and distinct words never share ids."""
    kv, hf = ModelTokenizer.from_dir(exported), HFTokenizer(str(exported))
    msgs = [{"role": "system", "content": "Ünïcödé 数字 😀\tcode: x = [1, 2]"},
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
            {"role": "tool", "content": "a\n\nb  <|end|> c"}]  # fmt: skip
    body = {"messages": msgs}
    assert kv.chat_ids(body).tolist() == ChatFront(hf).tokens(body)
    for text in ("hello world", "hello there", "zzzz qqqq", "naïve café"):
        assert kv.encode(text, add_special_tokens=True).tolist() == hf.encode(text)
    ids = [kv.encode(w, add_special_tokens=False) for w in (" alpha", " alphb", " Alpha")]
    assert len({tuple(i) for i in ids}) == 3 and all(0 not in i for i in ids)  # bytes, never an unknown token


def test_export_is_written_once_and_again_when_its_inputs_change(tmp_path: Path) -> None:
    d = export_tokenizer(tmp_path, [" ka", " lo"])
    tj = d / "tokenizer.json"
    first = tj.stat().st_mtime_ns
    assert export_tokenizer(tmp_path, [" lo", " ka"]) == d and tj.stat().st_mtime_ns == first
    export_tokenizer(tmp_path, [" ka", " lo", " mi"])
    assert ModelTokenizer.from_dir(d).encode(" mi", add_special_tokens=False).tolist() == SimTokenizer().encode(" mi")


async def test_a_pod_renders_a_chat_to_kvroutes_token_ids(exported: Path) -> None:
    """The same multi-turn chat through a simulated pod's render endpoint (built-in tokenizer, and
    the exported one loaded with --tokenizer) and through kvroute's precise keying."""
    item = next(it for it in workloads.build("multi-turn", None, None).items if len(it.messages) > 2)
    body = orjson.loads(workloads.request_body(item, stream=False))
    kv = ModelTokenizer.from_dir(exported).chat_ids(body).tolist()
    for tokenizer in (None, str(exported)):
        pod = Fleet(FleetConfig(pods=1, profile="fast", tokenizer=tokenizer))
        async with pod as fleet, httpx.AsyncClient(timeout=10.0) as client:
            r = await client.post(fleet.pods[0].url + "/v1/chat/completions/render", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == kv, tokenizer


def test_kvroute_counts_its_precise_decisions(exported: Path) -> None:
    """kvroute_index_decisions_total: precise with the tokenizer (and the pods' events), approx without."""
    item = workloads.build("multi-turn", None, 1).items[0]
    for tokenizer, index in ((str(exported), "precise"), (None, "approx")):
        model: dict[str, Any] = {"pool": "p", "block_size": 16}
        if tokenizer is not None:
            model["tokenizer"] = tokenizer
        cfg = build_config({"pools": {"p": {"endpoints": [{"address": "127.0.0.1:9"}]}}, "kv_events": {"enabled": True},
                            "models": {workloads.MODEL: model}})  # fmt: skip
        metrics = Metrics()
        router = Router(cfg, metrics)
        out = router.route(router.parse("/v1/chat/completions", "POST", {}, workloads.request_body(item)))
        router.release(out.endpoint)
        counts = {s.labels["index"]: s.value for s in metrics.index_decisions.collect()[0].samples
                  if s.name.endswith("_total")}  # fmt: skip
        assert counts == {"precise": float(index == "precise"), "approx": float(index == "approx")}
