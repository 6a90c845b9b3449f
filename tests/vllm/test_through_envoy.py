"""Real Envoy + kvroute (precise mode) in front of the two real vLLM pods: kvroute's predictions equal
the cached_tokens vLLM reports, same-document follow-ups land on the pod that has the document,
different documents spread, and tenants (cache_salt) never share hits."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VLLMPod
from tests.polling import wait_for


def kvroute_config(pods: list[VLLMPod], model_dir: str, **extra: object) -> dict:
    """kvroute in precise mode over the real pods (also tests/vllm/test_tenancy.py's)."""
    return {
        "pools": {
            "vllm": {
                "endpoints": [
                    {"address": p.address, "kv_events": p.pub_address, "kv_replay": p.replay_address} for p in pods
                ]
            }
        },
        "models": {MODEL_NAME: {"pool": "vllm", "tokenizer": model_dir, "block_size": BLOCK_SIZE}},
        # Predictions from the pods' events only: no routed-but-unconfirmed guesses.
        "kv_events": {"enabled": True, "speculative_ttl_s": 0},
        "scrape": {"enabled": True},
        "server": {"log_level": "debug"},
        **extra,
    }


@contextmanager
def through_envoy(pods: list[VLLMPod], config: dict, workdir: Path) -> Iterator[tuple]:
    cfg = workdir / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump(config))
    with (
        KVRouteProcess(config=str(cfg), admin=True) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=[p.address for p in pods]) as env,
        httpx.Client(base_url=env.url, timeout=120) as c,
    ):
        time.sleep(1.0)  # ZMQ subscriptions propagate asynchronously
        yield c, k


@pytest.fixture(scope="module")
def routed(pods: list[VLLMPod], model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    with through_envoy(pods, kvroute_config(pods, model_dir), Path(tmp_path_factory.mktemp("kvroute"))) as r:
        yield r


def document(i: int) -> str:
    return f"# Module {i}\n" + "".join(f"def helper_{i}_{j}(value):\n    return value + {j}\n" for j in range(25))


def ask(
    routed: tuple, doc: str, question: str, headers: dict[str, str] | None = None,
    decisions: list[dict] | None = None, **extra: object,
) -> tuple[int, int, str]:  # fmt: skip
    """(predicted, reported cached tokens, pod) for one chat; returns once the blocks it stored have
    reached kvroute as KV events (the next request's prediction depends on them). ``decisions``: gets
    kvroute's logged decision (for a failing assertion's message)."""
    c, k = routed
    rid = uuid.uuid4().hex
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0.0,
        **extra,
    }
    r = c.post("/v1/chat/completions", json=body, headers={"x-request-id": rid, **(headers or {})})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    reported = usage["prompt_tokens_details"]["cached_tokens"] or 0
    d = k.decision(rid)
    if decisions is not None:
        decisions.append(d)
    wait_until_indexed(k, body, headers or {}, d["endpoint"], usage["prompt_tokens"])
    return d["predicted_cached_tokens"], reported, d["endpoint"]


def wait_until_indexed(
    k: KVRouteProcess, body: dict, headers: dict[str, str], pod: str, prompt_tokens: int, path: str = ""
) -> None:
    """Until kvroute's index holds, on ``pod``, every prompt block the request left in its cache (all
    but a last partial block; the last prompt token is never served from cache), asked through
    Explain for the same request. Not a count of stored blocks: kvroute's catch-up on a pod's earlier
    events (its first message from a pod that served other tests) moves that count too."""
    want = (prompt_tokens - 1) // BLOCK_SIZE

    def held() -> int:
        return next(e.matched_blocks for e in k.explain(body, headers, path).endpoints if e.address == pod)

    wait_for(lambda: held() >= want, 30, f"kvroute's index to hold the {want} blocks {pod} stored")


def test_predictions_equal_vllm_cached_tokens_and_documents_stick(routed: tuple) -> None:
    """Eight documents' first questions arrive together, so kvroute's in-flight counts spread them over
    both pods (one at a time, both pods idle at each, each would go where rendezvous hashing of its first
    block puts it: all eight on one pod about once in 128 runs); each second question goes to its
    document's pod and hits."""
    docs = [document(1000 + i) for i in range(8)]
    with ThreadPoolExecutor(len(docs)) as pool:
        first = list(pool.map(lambda doc: ask(routed, doc, "What does helper 0 do?"), docs))
    second = [ask(routed, doc, "What does helper 1 do?") for doc in docs]
    for turn, answers in enumerate((first, second)):
        for i, (predicted, reported, _) in enumerate(answers):
            assert predicted == reported, (turn, i, predicted, reported)
    assert all(reported > 0 for _, reported, _ in second)  # every follow-up hit its document's pod
    homes = {i: {first[i][2], second[i][2]} for i in range(len(docs))}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({pod for _, _, pod in first}) == 2, homes  # 8 documents use both pods


def test_cache_salt_per_tenant_through_envoy(routed: tuple) -> None:
    doc = document(2000)
    assert ask(routed, doc, "q", cache_salt="tenant-a")[1] == 0
    predicted, reported, _ = ask(routed, doc, "q", cache_salt="tenant-a")
    assert predicted == reported > 0
    predicted, reported, _ = ask(routed, doc, "q", cache_salt="tenant-b")
    assert predicted == reported == 0


def stick_and_predict(routed: tuple, path: str, body_for: Callable[[str, list[str]], dict], seed: int) -> None:
    """Four conversations over ``path``, each sent a second time with one more turn: kvroute's prediction is the
    pod's reported hit on every request, each second turn hits, on its conversation's pod."""
    c, k = routed

    def turn(doc: str, questions: list[str]) -> tuple[int, int, str]:
        rid = uuid.uuid4().hex
        body = body_for(doc, questions)
        r = c.post(path, json=body, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        if path == "/v1/messages":
            cached = usage.get("cache_read_input_tokens") or 0
            prompt = usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0)
        else:
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
            prompt = usage["input_tokens"]
        d = k.decision(rid)
        wait_until_indexed(k, body, {}, d["endpoint"], prompt, path=path)
        return d["predicted_cached_tokens"], cached, d["endpoint"]

    docs = [document(seed + i) for i in range(4)]
    first = [turn(doc, ["What does helper 0 do?"]) for doc in docs]
    second = [turn(doc, ["What does helper 0 do?", "And helper 1?"]) for doc in docs]
    for answers in (first, second):
        assert all(predicted == reported for predicted, reported, _ in answers), answers
    assert all(reported > 0 for _, reported, _ in second)
    assert all(a[2] == b[2] for a, b in zip(first, second, strict=True)), (first, second)


def test_anthropic_messages_keep_their_pod_and_predict_their_hits(routed: tuple) -> None:
    """Claude Code's API (/v1/messages, which vLLM serves) through Envoy: kvroute keys it as vLLM renders it
    (it was a pass-through path, routed by load alone)."""

    def body(doc: str, questions: list[str]) -> dict:
        history: list[dict] = []
        for i, q in enumerate(questions):
            history += [{"role": "user", "content": [{"type": "text", "text": q}]}]
            if i < len(questions) - 1:
                history += [{"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]
        header = {"type": "text", "text": "x-anthropic-billing-header: cch=" + uuid.uuid4().hex[:6]}
        return {"model": MODEL_NAME, "max_tokens": 1, "system": [header, {"type": "text", "text": doc}],
                "messages": history}  # fmt: skip

    stick_and_predict(routed, "/v1/messages", body, 3000)


def test_responses_api_requests_keep_their_pod_and_predict_their_hits(routed: tuple) -> None:
    """Codex's API (/v1/responses, which vLLM serves) through Envoy, each turn's whole input sent again (store
    off): kvroute keys it as vLLM renders it (it was a pass-through path)."""

    def body(doc: str, questions: list[str]) -> dict:
        items: list[dict] = []
        for i, q in enumerate(questions):
            items.append({"role": "user", "content": [{"type": "input_text", "text": q}]})
            if i < len(questions) - 1:
                items.append({"type": "function_call", "call_id": f"c{i}", "name": "read", "arguments": "{}"})
                items.append({"type": "function_call_output", "call_id": f"c{i}", "output": f"result {i}"})
        return {"model": MODEL_NAME, "max_output_tokens": 1, "instructions": doc, "input": items, "store": False}

    stick_and_predict(routed, "/v1/responses", body, 4000)
