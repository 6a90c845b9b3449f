"""bench.sim against real vLLM: the same requests give the same cache behaviour, and the
``cpu-tiny`` latency profile, calibrated on this host, reproduces the real pod's hit/miss TTFT ratio
(within 15 %, or within the pod's own spread between two timings where that is larger)."""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest

from bench.harness import wait_quiet
from bench.procs import cpu_snapshot, foreign_cores, python_module, start_with_ready_file, stop
from bench.sim.calibrate import TTFTSample, fit, ratio_errors
from bench.sim.profiles import CPU_TINY
from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import MODEL_NAME, Messages, VLLMPod, chat
from extproc.index.precise import PreciseIndex
from tests.vllm.conftest import KV
from tests.vllm.harness import Outcome, reset_prefix_cache, save_result, send_chat, timed_pairs
from tests.vllm.recorder import RecordingSink, subscriber_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Once calibrated on this host, the sim's hit/miss TTFT ratio must be within 15 % of the real pod's
# at the median length and within 35 % at every length, measured from the nearer of the real pod's two
# timings of the same lengths (one beside the stock simulator, one beside the calibrated one) where the
# pod's own run-to-run spread is larger: as issue 19 puts it, "within 15 %, or within the real pods' own
# run-to-run spread where that is larger". Six calibrations in one session here: the pod's ratio moved
# 0.1-20 % between its two timings (median over lengths up to 17 %); the calibrated simulator was
# 2-7 % from the first at the median length, 12 % at worst; the stock profile 22-39 %. A clean-clone CI
# run read 17 % from the one timing it then had. The stock cpu-tiny numbers are only recorded: the
# real pods' 1.7k-token miss has read 59-242 ms in quiet runs on different hosts.
RATIO_TOLERANCE = 0.15
RATIO_TOLERANCE_ANY = 0.35
TTFT_WORDS = (100, 400, 800)  # ~220, ~870, ~1740 prompt tokens
# Latency ratios are only meaningful without foreign load on the 2 cores (CI runs alone; a shared
# developer box may not be quiet): wait for it, else skip rather than compare noise.
QUIET_MAX_CORES = 0.45  # includes our own uncharged CPU (loopback softirq): 0.12-0.26 in a quiet run
QUIET_BUDGET_S = 120.0  # all waiting for quiet, all lengths together (the stage must stay short)


@dataclass
class Engine:
    """A real or simulated pod with its own event log."""

    url: str
    endpoint: str
    index: PreciseIndex
    sink: RecordingSink
    pid: int | None = None  # the simulator's process

    async def send(self, client: httpx.AsyncClient, tok: HFTokenizer, msgs: Messages) -> Outcome:
        return await send_chat(client, self.url, tok, self.endpoint, msgs, index=self.index, sink=self.sink)


@asynccontextmanager
async def sim_pod(
    model_dir: str, capacity_blocks: int, overrides: dict[str, float] | None = None, flags: tuple[str, ...] = ()
) -> AsyncIterator[Engine]:
    """One simulated pod configured like the real ones (``python -m bench.sim`` in its own process,
    as the real pod has its own; ``flags``: more of its options), with a subscriber on its KV events."""
    args = python_module(
        "bench.sim",
        *("--pods", "1", "--profile", "cpu-tiny", "--block-size", "32", "--capacity-blocks", str(capacity_blocks)),
        *("--model", MODEL_NAME, "--tokenizer", model_dir, "--base-port", "0", "--zmq-base-port", "0", "--quiet"),
        *(f"--set={k}={v!r}" for k, v in (overrides or {}).items()),
        *flags,
    )
    proc, ready = await asyncio.to_thread(start_with_ready_file, args)
    try:
        assert isinstance(ready, dict)
        pod = ready["pods"][0]
        sink = RecordingSink(PreciseIndex(capacity_blocks=1 << 14))
        sub = subscriber_for(pod["address"], pod["kv_events_endpoint"], pod["replay_endpoint"], sink)
        await sub.start()
        await asyncio.sleep(0.3)  # ZMQ subscription propagation
        try:
            yield Engine(pod["url"], pod["address"], sink.index, sink, proc.pid)
        finally:
            await sub.aclose()
    finally:
        stop(proc)


def sequence() -> list[Messages]:
    """Cold documents, follow-ups, repeats, then enough new documents to force evictions, and revisits."""
    docs = [chat(700 + i, 300) for i in range(9)]
    follow = [chat(700 + i, 300, f"question {i}") for i in range(3)]
    return [docs[0], follow[0], docs[1], follow[1], docs[0], *docs[2:], follow[0], docs[1], follow[2], docs[8], docs[3]]


async def test_sim_cache_matches_vllm(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient, model_dir: str
) -> None:
    real_pod = pods[1]
    await reset_prefix_cache(aclient, real_pod.url, kv.sink, real_pod.address)
    real = Engine(real_pod.url, real_pod.address, kv.index, kv.sink)
    rows = []
    async with sim_pod(model_dir, real_pod.kv_cache_blocks - 1) as sim:  # vLLM keeps one null block
        for i, msgs in enumerate(sequence()):
            marks = [e.sink.log(e.endpoint).mark() for e in (real, sim)]
            r = await real.send(aclient, tok, msgs)
            s = await sim.send(aclient, tok, msgs)
            runs = []
            for e, (st, rm) in zip((real, sim), marks, strict=True):
                log = e.sink.log(e.endpoint)
                runs.append((log.stored[st:], sorted(log.removed[rm:])))
            rows.append(
                {
                    "step": i,
                    "prompt_tokens": r.prompt_tokens,
                    "real_cached": r.cached_tokens,
                    "sim_cached": s.cached_tokens,
                    "real_predicted": r.predicted_tokens,
                    "sim_predicted": s.predicted_tokens,
                    "stored_equal": runs[0][0] == runs[1][0],
                    "removed_equal": runs[0][1] == runs[1][1],
                    "real_stored": len(runs[0][0]),
                    "sim_stored": len(runs[1][0]),
                    "real_removed": len(runs[0][1]),
                    "sim_removed": len(runs[1][1]),
                }
            )
    save_result("cache_sequence", rows)
    for row in rows:
        assert row["real_predicted"] == row["real_cached"] and row["sim_predicted"] == row["sim_cached"], row
        assert row["real_cached"] == row["sim_cached"], row
        assert row["stored_equal"] and row["removed_equal"], row
    assert any(row["real_removed"] for row in rows), "the sequence never evicted"


class QuietClock:
    """Latency pairs measured only while the host is quiet, all waiting within one budget."""

    def __init__(self, pods: list[VLLMPod]) -> None:
        self.pgids = [p.pgid for p in pods if p.pgid is not None]
        self.deadline = time.monotonic() + QUIET_BUDGET_S
        self.foreign = 0.0

    async def pairs(
        self, client: httpx.AsyncClient, engines: list[Engine], tok: HFTokenizer, msgs: Messages
    ) -> list[tuple[float, float]]:
        pids = [os.getpid(), *(e.pid for e in engines if e.pid)]
        for attempt in itertools.count():
            left = self.deadline - time.monotonic()
            if left <= 0:
                pytest.skip(f"host busy for {QUIET_BUDGET_S:.0f} s (last: {self.foreign:.2f} cores of other work)")
            busy = await asyncio.to_thread(wait_quiet, left, QUIET_MAX_CORES, True)
            before = cpu_snapshot(self.pgids, pids)
            fresh = [{**m, "content": f"{attempt} {m['content']}"} for m in msgs]
            pairs = await timed_pairs(client, [e.url for e in engines], tok, fresh)
            self.foreign = foreign_cores(before, cpu_snapshot(self.pgids, pids))
            if busy < QUIET_MAX_CORES and self.foreign < QUIET_MAX_CORES:
                return pairs
        raise AssertionError("unreachable")


async def test_sim_ttft_ratio_matches_vllm(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient, model_dir: str
) -> None:
    """Calibrate cpu-tiny against the real pod on this host, then check the calibrated simulator's
    hit/miss TTFT ratio at every length. Step 1 times the real pod and the stock profile side by side
    (turn by turn); step 2 times the real pod again beside a simulator started with the fitted
    overrides. The error at a length is from the nearer of the pod's two timings."""
    real_pod = pods[1]
    await reset_prefix_cache(aclient, real_pod.url, kv.sink, real_pod.address)
    real = Engine(real_pod.url, real_pod.address, kv.index, kv.sink)
    clock = QuietClock(pods)
    prompts = [chat(800 + n, words) for n, words in enumerate(TTFT_WORDS)]
    lengths = [len(tok.render_chat([dict(m) for m in msgs], None)) for msgs in prompts]
    samples: list[TTFTSample] = []
    async with sim_pod(model_dir, real_pod.kv_cache_blocks - 1) as stock:
        for n, msgs in zip(lengths, prompts, strict=True):
            (rm, rh), (sm, sh) = await clock.pairs(aclient, [real, stock], tok, msgs)
            samples.append(TTFTSample(n, rm, rh, sm, sh))
    overrides = fit(CPU_TINY, samples, block_size=32)
    retimed: list[tuple[tuple[float, float], tuple[float, float]]] = []
    async with sim_pod(model_dir, real_pod.kv_cache_blocks - 1, overrides=overrides) as tuned:
        for msgs in prompts:
            again, sim = await clock.pairs(aclient, [real, tuned], tok, msgs)
            retimed.append((again, sim))
    first = [(s.real_miss, s.real_hit) for s in samples]
    second = [again for again, _ in retimed]
    calibrated = [sim for _, sim in retimed]
    stock_errors = ratio_errors(first, [(s.sim_miss, s.sim_hit) for s in samples])
    spread = ratio_errors(first, second)  # the real pod against itself
    errors = [min(a, b) for a, b in zip(ratio_errors(first, calibrated), ratio_errors(second, calibrated), strict=True)]
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731
    rows = [
        {
            "prompt_tokens": s.prompt_tokens,
            "real_miss_ms": ms(s.real_miss),
            "real_hit_ms": ms(s.real_hit),
            "real_ratio": round(s.real_hit / s.real_miss, 3),
            "real_again_miss_ms": ms(a[0]),
            "real_again_hit_ms": ms(a[1]),
            "real_spread": round(sp, 3),
            "stock_sim_miss_ms": ms(s.sim_miss),
            "stock_sim_hit_ms": ms(s.sim_hit),
            "stock_sim_ratio": round(s.sim_hit / s.sim_miss, 3),
            "stock_error": round(se, 3),
            "sim_miss_ms": ms(c[0]),
            "sim_hit_ms": ms(c[1]),
            "sim_ratio": round(c[1] / c[0], 3),
            "error": round(e, 3),
        }
        for s, a, sp, c, se, e in zip(samples, second, spread, calibrated, stock_errors, errors, strict=True)
    ]
    save_result("ttft", {"fitted": {k: round(v, 5) for k, v in overrides.items()}, "rows": rows})
    # One line per length, so a failure shows every figure (pytest folds a long dict).
    table = "\n".join(
        f"{r['prompt_tokens']} tokens: real {r['real_miss_ms']}/{r['real_hit_ms']} then "
        f"{r['real_again_miss_ms']}/{r['real_again_hit_ms']} ms (spread {r['real_spread']}), calibrated sim "
        f"{r['sim_miss_ms']}/{r['sim_hit_ms']} ms (error {r['error']}), stock {r['stock_sim_miss_ms']}/"
        f"{r['stock_sim_hit_ms']} ms"
        for r in rows
    )
    detail = f"fitted {overrides}\n{table}"
    assert statistics.median(errors) <= RATIO_TOLERANCE, detail
    assert max(errors) <= RATIO_TOLERANCE_ANY, detail


def agent_requests(nonce: str) -> dict[str, dict]:
    """One turn of a coding agent's session over each agent API, a tool call and its result in its history."""
    tools = [{"name": "read_file", "description": "Read a file from the workspace.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]  # fmt: skip
    responses = {
        "model": MODEL_NAME, "instructions": f"{nonce} You are a careful coding agent.", "max_output_tokens": 4,
        "ignore_eos": True, "store": False, "prompt_cache_key": nonce,
        "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                   "parameters": t["input_schema"]} for t in tools],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the failing test."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Reading it."}]},
            {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path": "tests/x.py"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "def test(): assert 1 == 2"},
        ],
    }  # fmt: skip
    # Without tools: vLLM answers a Messages request that has some with 400 unless the pod runs with
    # --enable-auto-tool-choice and a tool-call parser (the test pods do not); the history's calls still count.
    messages = {
        "model": MODEL_NAME, "max_tokens": 4,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=0a1b2c;"},
                   {"type": "text", "text": f"{nonce} You are a careful coding agent."}],
        "messages": [
            {"role": "user", "content": "Fix the failing test."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "tests/x.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "def test(): ..."}]},
        ],
    }  # fmt: skip
    chat = {"model": MODEL_NAME, "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "system", "content": f"{nonce} You are a careful coding agent."},
                         {"role": "user", "content": "Fix the failing test."}]}  # fmt: skip
    return {"/v1/responses": responses, "/v1/messages": messages, "/v1/chat/completions": chat}


def event_types(text: str) -> list[str]:
    """A stream's ``event:`` names, a run of one (the text deltas) as one."""
    names = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]


def prompt_and_cache(path: str, usage: dict) -> tuple[int, int, int]:
    """The prompt's tokens, those read from the cache and those written to it, from each API's usage."""
    if path == "/v1/responses":
        d = usage["input_tokens_details"]
        return usage["input_tokens"], d["cached_tokens"], d["cache_write_tokens"]
    if path == "/v1/chat/completions":
        d = usage["prompt_tokens_details"]
        return usage["prompt_tokens"], d["cached_tokens"], d["created_cache_tokens"]
    read, written = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
    return usage["input_tokens"] + read + written, read, written


async def refusals_match(client: httpx.AsyncClient, real: str, sim: str) -> None:
    """The refusals: the same status, error shape and type, and where the words are the server's own or its request
    validation's one error (not one per branch of a union), the same message; on the OpenAI paths the same param."""
    ok = agent_requests("refusals")
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    limit = (await client.get(real + "/v1/models")).json()["data"][0]["max_model_len"]
    assert (await client.get(sim + "/v1/models")).json()["data"][0]["max_model_len"] == limit
    chat, done, msg, resp = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
    msgs = [{"role": "user", "content": "hi"}]

    def c(**fields: object) -> dict:
        return {"model": MODEL_NAME, "messages": msgs, **fields}

    def p(prompt: object, **fields: object) -> dict:
        return {"model": MODEL_NAME, "prompt": prompt, **fields}

    def m(**fields: object) -> dict:
        return {"model": MODEL_NAME, "max_tokens": 5, "messages": msgs, **fields}

    def r_(**fields: object) -> dict:
        return {"model": MODEL_NAME, "max_output_tokens": 5, "input": "hi", **fields}

    cases: list[tuple[str, object, bool]] = [
        ("/v1/messages", {**ok["/v1/messages"], "tools": tools}, True),  # needs a tool-call parser
        ("/v1/messages", {**ok["/v1/messages"], "model": "other"}, True),
        ("/v1/messages", {k: v for k, v in ok["/v1/messages"].items() if k != "max_tokens"}, False),
        ("/v1/responses", {**ok["/v1/responses"], "model": "other"}, True),
        ("/v1/responses", {**ok["/v1/responses"], "previous_response_id": "resp_gone"}, True),
        ("/v1/messages", b"{not json", True),
        (chat, b"{not json", True),
        (done, b"", True),
        (done, b"[1,", True),
        (chat, b'{"a": 1} x', True),
        # The request model's refusals.
        (done, [1, 2], True),
        (chat, {"model": MODEL_NAME}, True),
        (chat, c(messages="hi"), True),
        (chat, c(messages=[{"content": "hi"}]), False),
        (chat, c(messages=[{"role": "user", "content": 5}]), False),
        (chat, c(messages=[5]), False),
        (chat, c(tools=5), True),
        (chat, c(max_tokens="x"), True),
        (chat, c(max_tokens=3.5), True),
        (chat, c(stream=True, stream_options=5), True),
        (chat, c(kv_transfer_params=5), True),
        (chat, c(stream="maybe"), True),
        (done, p(5), False),
        (done, p([1, -1]), False),
        (done, p([5, "a"]), False),
        # vLLM's own.
        (chat, c(messages=[]), True),
        (done, {"model": MODEL_NAME}, True),
        (done, p(""), True),
        (done, p([]), True),
        (done, p([10**9]), True),
        (chat, c(max_tokens=0), True),
        (chat, c(max_completion_tokens=0), True),
        (chat, c(max_tokens=limit + 1), True),
        (chat, c(max_completion_tokens=limit + 1), True),
        (done, p("hi", max_tokens=-1), True),
        (chat, c(min_tokens=-1), True),
        (chat, c(min_tokens=5, max_tokens=2), True),
        (chat, c(cache_salt=""), True),
        (done, p("hi", stream_options={"include_usage": True}), True),
        (done, p([5] * (limit + 1), max_tokens=10), True),
        (done, p([5] * (limit + 100), max_tokens=10), True),
        (done, p([5] * limit, max_tokens=10), True),
        (done, p([5] * (limit - 48), min_tokens=60, max_tokens=100), True),
        # The agent APIs' request models and their conversions' names for the output limit.
        (msg, m(max_tokens=limit + 1), True),
        (msg, m(max_tokens=0), True),
        (msg, m(max_tokens="x"), True),
        (msg, m(messages=[]), True),
        (msg, {"model": MODEL_NAME, "max_tokens": 5}, True),
        (msg, m(system=5), False),
        (msg, m(messages=[{"role": "user", "content": "hi " * (limit + 50)}]), True),
        (resp, r_(max_output_tokens=limit + 1), True),
        (resp, r_(max_output_tokens=0), True),
        (resp, r_(max_output_tokens="x"), True),
        (resp, r_(input=5), False),
        (resp, {"model": MODEL_NAME}, False),  # (vLLM counts a field of its own in the body it shows)
        (resp, r_(input=[]), True),
        (resp, r_(input="hi " * (limit + 50)), True),
    ]
    for path, body, same_words in cases:
        sent = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
            "json": body}  # fmt: skip
        r = await client.post(real + path, timeout=60, **sent)
        s = await client.post(sim + path, timeout=60, **sent)
        rj, sj = r.json(), s.json()
        assert (s.status_code, sorted(sj), sj.get("type")) == (r.status_code, sorted(rj), rj.get("type")), (rj, sj)
        assert sj["error"]["type"] == rj["error"]["type"], (path, rj, sj)
        if path != msg or "type" not in rj:  # (the Messages API's own shape has no param)
            assert sj["error"].get("param") == rj["error"].get("param"), (path, rj, sj)
        if same_words:
            assert sj["error"]["message"] == rj["error"]["message"], (path, rj, sj)
    # Served where vLLM serves: max_tokens cut to what the context has left, an integer or a boolean written as
    # pydantic reads one.
    served = ((done, p([5] * (limit - 3), max_tokens=10)), (chat, c(max_tokens="3")), (chat, c(max_tokens=True)),
              (chat, c(max_tokens=2, stream="no")))  # fmt: skip
    for path, body in served:
        r = await client.post(real + path, json=body, timeout=60)
        s = await client.post(sim + path, json=body, timeout=60)
        assert r.status_code == s.status_code == 200, (r.text[:300], s.text[:300])
        ru, su = r.json()["usage"], s.json()["usage"]
        counts = [(u["prompt_tokens"], u["completion_tokens"]) for u in (ru, su)]
        assert counts[0] == counts[1], (ru, su)
        assert su["prompt_tokens_details"].keys() == ru["prompt_tokens_details"].keys()
        assert s.json()["choices"][0]["finish_reason"] == r.json()["choices"][0]["finish_reason"] == "length"
        details = su["prompt_tokens_details"], ru["prompt_tokens_details"]
        assert (details[0]["created_cache_tokens"] is None) == (details[1]["created_cache_tokens"] is None), details


async def test_sim_serves_the_agent_apis_as_vllm_does(
    pods: list[VLLMPod], aclient: httpx.AsyncClient, model_dir: str
) -> None:
    """The Responses and Messages APIs (Codex's, Claude Code's), and a chat, on a simulated pod and on vLLM, the
    same tokenizer and template: the same prompt tokens (the conversion), the same answer shapes, usage fields
    and stream events, the same tokens read from and written to the cache."""
    real = pods[1]
    # As the test pods run: without --enable-auto-tool-choice and a tool-call parser.
    async with sim_pod(model_dir, real.kv_cache_blocks - 1, flags=("--no-auto-tool-choice",)) as sim:
        await refusals_match(aclient, real.url, sim.url)
        for path, body in agent_requests(f"nonce-{time.time_ns()}").items():
            got = {}
            for name, url in (("real", real.url), ("sim", sim.url)):
                sent = (body, body, {**body, "stream": True})  # a first answer, a repeat's, a stream
                answers = [await aclient.post(url + path, json=b, timeout=120) for b in sent]
                for a in answers:
                    assert a.status_code == 200, (name, path, a.text[:300])
                got[name] = (answers[0].json(), answers[1].json(), event_types(answers[2].text))
            (r1, r2, r_events), (s1, s2, s_events) = got["real"], got["sim"]
            # The first: on the real pod the first blocks may be cached from earlier tests (the same template).
            real_first, sim_first = prompt_and_cache(path, r1["usage"]), prompt_and_cache(path, s1["usage"])
            assert sim_first[0] == real_first[0], (path, r1["usage"], s1["usage"])
            assert prompt_and_cache(path, s2["usage"]) == prompt_and_cache(path, r2["usage"]), (path, r2, s2)
            assert s_events == r_events, path
            if path == "/v1/responses":
                assert (s1["object"], s1["status"]) == (r1["object"], r1["status"]) == ("response", "incomplete")
                assert s1["incomplete_details"] == r1["incomplete_details"]
                shape = lambda o: (o["type"], o["role"], [c["type"] for c in o["content"]])  # noqa: E731
                assert [shape(o) for o in s1["output"]] == [shape(o) for o in r1["output"]]
                assert s1["id"].startswith("resp_") and r1["id"].startswith("resp_")
                for part in ("input_tokens_details", "output_tokens_details"):
                    assert set(s1["usage"][part]) == set(r1["usage"][part]), part
            elif path == "/v1/messages":
                assert (s1["type"], s1["role"]) == (r1["type"], r1["role"]) == ("message", "assistant")
            else:
                assert s1["usage"]["prompt_tokens_details"].keys() == r1["usage"]["prompt_tokens_details"].keys()
            assert set(s1["usage"]) == set(r1["usage"]), path
