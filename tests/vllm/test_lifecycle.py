"""Eviction, cache resets and pod restarts on real vLLM, as the precise index sees them."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import VLLMPod, chat
from extproc.endpoints.events import RECONNECT_IVL_MAX_MS
from tests.vllm.conftest import KV
from tests.vllm.harness import request_keys, reset_prefix_cache, send_chat

pytestmark = pytest.mark.asyncio(loop_scope="session")

DOC_WORDS = 300  # ~21 blocks per document: 10 documents overflow the 160-block cache


async def test_eviction_reflected_in_index(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient
) -> None:
    b = pods[1]
    log = kv.sink.log(b.address)
    removed_before = len(log.removed)
    docs = [chat(400 + i, DOC_WORDS) for i in range(10)]
    for msgs in docs:
        out = await send_chat(aclient, b.url, tok, b.address, msgs, index=kv.index, sink=kv.sink)
        assert out.predicted_tokens == out.cached_tokens == 0
    assert len(log.removed) > removed_before, "no BlockRemoved although the documents overflow the cache"
    assert log.removed_unknown == 0
    first = tok.render_chat([dict(m) for m in docs[0]], None)
    assert kv.index.match(request_keys(first, None), [b.address]).get(b.address, 0) < len(request_keys(first, None))
    # Revisit every document: the index must still predict vLLM's hit exactly, evicted or not.
    for msgs in docs:
        out = await send_chat(aclient, b.url, tok, b.address, msgs, index=kv.index, sink=kv.sink)
        assert out.predicted_tokens == out.cached_tokens, out


async def test_reset_prefix_cache_clears_index(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient
) -> None:
    b = pods[1]
    msgs = chat(500, 200)
    await send_chat(aclient, b.url, tok, b.address, msgs, index=kv.index, sink=kv.sink)
    await reset_prefix_cache(aclient, b.url, kv.sink, b.address)
    out = await send_chat(aclient, b.url, tok, b.address, msgs, index=kv.index, sink=kv.sink)
    assert out.predicted_tokens == out.cached_tokens == 0


@pytest.mark.restarts_pods
async def test_pod_restart_purges_index(
    pods: list[VLLMPod], kv: KV, tok: HFTokenizer, aclient: httpx.AsyncClient
) -> None:
    a = pods[0]
    msgs = chat(600, 300)
    await send_chat(aclient, a.url, tok, a.address, msgs, index=kv.index, sink=kv.sink)
    keys = request_keys(tok.render_chat([dict(m) for m in msgs], None), None)
    assert kv.index.match(keys, [a.address]) == {a.address: len(keys)}
    sub = kv.subscriber(a.address)
    restarts = sub.counters.restarts
    a.kill()  # crash: no goodbye events
    a.launch()
    await asyncio.to_thread(a.wait_ready)
    # The SUB socket reconnects with ZMQ's backoff; a batch published before it is back would be
    # dropped by the PUB (lost until a later batch triggers the replay catch-up), so give it the
    # longest backoff interval first.
    await asyncio.sleep(RECONNECT_IVL_MAX_MS / 1000 + 1)
    # The new process numbers its batches from 0 again: its first batch makes the subscriber purge.
    fresh = await send_chat(aclient, a.url, tok, a.address, chat(601, 100), index=kv.index, sink=kv.sink)
    assert fresh.cached_tokens == 0
    assert sub.counters.restarts == restarts + 1
    assert kv.index.match(keys, [a.address]) == {}
    out = await send_chat(aclient, a.url, tok, a.address, msgs, index=kv.index, sink=kv.sink)
    assert out.predicted_tokens == out.cached_tokens == 0
