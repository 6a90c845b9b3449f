"""Real vLLM KV events → kvroute's decoder → KVEventSubscriber → PreciseIndex: the index predicts
``usage.prompt_tokens_details.cached_tokens`` token-exactly, per pod and per tenant."""

from __future__ import annotations

import httpx
import pytest

from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VLLMPod, chat, document
from tests.vllm.conftest import KV
from tests.vllm.harness import request_keys, send_chat

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_rendering_matches_vllm_tokenize(
    pods: list[VLLMPod], tok: HFTokenizer, aclient: httpx.AsyncClient
) -> None:
    """kvroute-side tokens (HF tokenizers + the chat template in jinja2) equal the pod's /tokenize."""
    cases = [chat(1, 50), chat(2, 300, "and then?"), [{"role": "system", "content": "be terse"}, *chat(3, 20)]]
    for msgs in cases:
        r = await aclient.post(f"{pods[0].url}/tokenize", json={"model": MODEL_NAME, "messages": msgs})
        r.raise_for_status()
        assert r.json()["tokens"] == tok.render_chat([dict(m) for m in msgs], None)
    text = document(4, 80)
    r = await aclient.post(f"{pods[0].url}/tokenize", json={"model": MODEL_NAME, "prompt": text})
    assert r.json()["tokens"] == tok.encode(text)


async def test_index_predicts_cached_tokens(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient
) -> None:
    a, b = pods
    doc, other = 100, 101
    steps = [  # (pod, messages, expectation of a hit)
        (a, chat(doc, 400), False),  # cold
        (a, chat(doc, 400, "summarise it"), True),  # same document, follow-up: hit on A
        (b, chat(doc, 400, "summarise it"), False),  # ... but not on B
        (b, chat(doc, 400, "summarise it"), True),  # now B has it too
        (a, chat(other, 250), False),
        (a, chat(doc, 400, "another question"), True),
        (b, chat(other, 250, "x"), False),
    ]
    for i, (pod, msgs, hit) in enumerate(steps):
        out = await send_chat(aclient, pod.url, tok, pod.address, msgs, index=kv.index, sink=kv.sink)
        assert out.predicted_tokens == out.cached_tokens, f"step {i}: {out}"
        assert (out.cached_tokens > 0) == hit, f"step {i}: {out}"
        assert out.cached_tokens % BLOCK_SIZE == 0
    for s in kv.subscribers:
        st = s.stats()
        assert st["decode_errors"] == 0 and st["sink_errors"] == 0 and st["resyncs"] == 0, st
        assert st["batches_applied"] > 0
    assert kv.index.counters["unknown_parent"] == 0


async def test_cache_salt_isolates_tenants(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient
) -> None:
    a = pods[0]
    msgs = chat(200, 300)
    tokens = tok.render_chat([dict(m) for m in msgs], None)
    assert request_keys(tokens, "tenant-1")[0] != request_keys(tokens, "tenant-2")[0] != request_keys(tokens, None)[0]

    async def send(salt: str | None) -> int:
        out = await send_chat(aclient, a.url, tok, a.address, msgs, index=kv.index, sink=kv.sink, salt=salt)
        assert out.predicted_tokens == out.cached_tokens, (salt, out)
        return out.cached_tokens

    assert await send("tenant-1") == 0
    assert await send("tenant-2") == 0  # same prompt, other tenant: no cross-tenant hit
    assert await send(None) == 0
    assert await send("tenant-1") > 0
    assert await send("tenant-2") > 0
    assert kv.index.counters["skipped_extra_keys"] == 0
