"""Request, prediction and timing helpers shared by the real-vLLM tests (and the simulator runs)."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, Messages
from extproc import hashing
from extproc.index.base import EndpointId
from extproc.index.precise import PreciseIndex, precise_seed
from tests.vllm.recorder import RecordingSink

RESULTS = Path(os.environ.get("KVROUTE_VLLM_RESULTS", "bench/out/vllm-vs-sim.json"))


def save_result(key: str, value: object) -> None:
    """Merge one figure into the results JSON that bench/RESULTS.md quotes."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def request_keys(tokens: Sequence[int], salt: str | None, *, lookup: bool = True) -> list[int]:
    """kvroute's request-side keys; ``lookup`` caps them like vLLM's hit rule ((n - 1) // block)."""
    n = (len(tokens) - 1) // BLOCK_SIZE if lookup else len(tokens) // BLOCK_SIZE
    return hashing.chain_tokens(precise_seed(salt), tokens, BLOCK_SIZE, n)


@dataclass
class Outcome:
    prompt_tokens: int
    cached_tokens: int
    predicted_tokens: int
    latency_s: float


async def send_chat(
    client: httpx.AsyncClient,
    url: str,
    tok: HFTokenizer,
    endpoint: EndpointId,
    messages: Messages,
    *,
    index: PreciseIndex | None = None,
    sink: RecordingSink | None = None,
    salt: str | None = None,
    max_tokens: int = 1,
) -> Outcome:
    """Predict from ``index``, send one greedy chat request, then wait until the pod's events for the
    prompt's full blocks have reached the index (so the next prediction sees them)."""
    tokens = tok.render_chat([dict(m) for m in messages], None)
    predicted = 0
    if index is not None:
        predicted = index.match(request_keys(tokens, salt), [endpoint]).get(endpoint, 0) * BLOCK_SIZE
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    latency = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(tokens), "kvroute's rendering differs from the pod's"
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if index is not None and sink is not None:
        full = request_keys(tokens, salt, lookup=False)
        await sink.wait_for(lambda: index.match(full, [endpoint]).get(endpoint, 0) == len(full))
    return Outcome(len(tokens), cached, predicted, latency)


async def timed_pairs(
    client: httpx.AsyncClient, urls: Sequence[str], tok: HFTokenizer, messages: Messages, repeats: int = 7
) -> list[tuple[float, float]]:
    """(miss, hit) latency of a max_tokens=1 request per server: medians over ``repeats`` fresh
    documents, each sent twice (a full miss, then a full-prefix hit). Servers take turns within each
    repeat, so a burst of load from elsewhere on the machine hits them alike. (Minima were tried:
    the real pods' fastest samples swing far more between runs than their medians.)"""
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in urls]
    for i in range(repeats):
        msgs = [{**m, "content": f"{i} {m['content']}"} if j == 0 else m for j, m in enumerate(messages)]
        for url, (misses, hits) in zip(urls, samples, strict=True):
            miss = await send_chat(client, url, tok, "", msgs)
            hit = await send_chat(client, url, tok, "", msgs)
            assert miss.cached_tokens == 0 and hit.cached_tokens > 0, (url, miss, hit)
            misses.append(miss.latency_s)
            hits.append(hit.latency_s)
    return [(statistics.median(m), statistics.median(h)) for m, h in samples]


async def reset_prefix_cache(client: httpx.AsyncClient, url: str, sink: RecordingSink, endpoint: EndpointId) -> None:
    """Empty a real pod's prefix cache and wait for its AllBlocksCleared. vLLM publishes events once
    per engine step, so a one-block-short request makes the step that carries it."""
    cleared = sink.log(endpoint).cleared
    (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()
    body = {"model": MODEL_NAME, "prompt": "ping", "max_tokens": 1}
    (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()
    await sink.wait_for(lambda: sink.log(endpoint).cleared > cleared)
