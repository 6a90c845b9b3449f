"""Precise mode through real Envoy: kvroute tokenizes like vLLM, follows the simulated pods' KV
events, and predicts exactly the cached_tokens each pod then reports."""

import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from bench.vllm_model import build as build_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_model(ROOT / ".cache" / "tiny-llama")


@pytest.fixture(scope="module")
def sim(model_dir):
    proc, info = start_with_ready_file(
        python_module(
            "bench.sim",
            "--pods",
            "3",
            "--base-port",
            "0",
            "--zmq-base-port",
            "0",
            "--profile",
            "fast",
            "--tokenizer",
            str(model_dir),
            "--block-size",
            str(BLOCK),
            "--capacity-blocks",
            "400",
            "--model",
            "m",
        )
    )
    yield info["pods"]
    stop(proc)


@pytest.fixture(scope="module")
def precise(sim, model_dir, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("precise") / "kvroute.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "pools": {
                    "default": {
                        "endpoints": [
                            {
                                "address": p["address"],
                                "kv_events": p["kv_events_endpoint"],
                                "kv_replay": p["replay_endpoint"],
                            }
                            for p in sim
                        ]
                    }
                },
                "models": {"m": {"pool": "default", "tokenizer": str(model_dir), "block_size": BLOCK}},
                "kv_events": {"enabled": True},
                "scrape": {"enabled": True},
                "server": {"log_level": "debug"},
            }
        )
    )
    with (
        KVRouteProcess(config=str(cfg)) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=[p["address"] for p in sim]) as env,
        httpx.Client(base_url=env.url, timeout=20) as c,
    ):
        time.sleep(0.3)  # subscribers connected
        yield c, k


def doc(i: int) -> str:
    return f"# Document {i}\n" + "".join(f"def function_{i}_{j}(x):\n    return x * {j}\n" for j in range(60))


def ask(c: httpx.Client, k: KVRouteProcess, messages: list, **extra) -> tuple[int, int, str]:
    """Send one chat; returns (kvroute's predicted cached tokens, the pod's reported ones, pod)."""
    rid = uuid.uuid4().hex
    stored = k.precise_stat("blocks_stored")
    r = c.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 4, **extra},
        headers={"x-request-id": rid},
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    reported = usage["prompt_tokens_details"]["cached_tokens"]
    d = k.decision(rid)
    k.wait_precise_stat("blocks_stored", stored + new_blocks(usage["prompt_tokens"], reported))
    return d["predicted_cached_tokens"], reported, d["endpoint"]


def new_blocks(prompt_tokens: int, cached_tokens: int, block: int = BLOCK) -> int:
    """Full prompt blocks a request stored: its BlockStored events reach kvroute after the response,
    and the next request is predicted right only once they have. The last prompt token is never
    served from cache, so a fully cached prompt recomputes (and does not store) its last block."""
    return max(0, (prompt_tokens - 1) // block - cached_tokens // block)


def test_predictions_match_reported_cached_tokens(precise):
    c, k = precise
    checked = hits = 0
    homes: dict[int, set[str]] = {}
    docs = 8  # new documents go where their keys hash (equal loads): 8 over 3 pods all land on one 1 in 2187 runs
    for turn in range(3):
        for d in range(docs):
            msgs = [{"role": "system", "content": doc(d)}, {"role": "user", "content": f"question {turn} on {d}"}]
            predicted, reported, pod = ask(c, k, msgs)
            assert predicted == reported, (turn, d, predicted, reported)
            homes.setdefault(d, set()).add(pod)
            checked += 1
            hits += reported > 0
    assert hits >= 2 * docs  # every follow-up hit its document's pod
    assert all(len(h) == 1 for h in homes.values())
    assert len({next(iter(h)) for h in homes.values()}) >= 2


def test_cache_salt_isolates_tenants(precise):
    c, k = precise
    msgs = [{"role": "system", "content": doc(42)}, {"role": "user", "content": "same prompt"}]
    assert ask(c, k, msgs, cache_salt="tenant-a")[1] == 0
    p, r, _ = ask(c, k, msgs, cache_salt="tenant-a")
    assert p == r > 0
    p, r, _ = ask(c, k, msgs, cache_salt="tenant-b")
    assert p == r == 0  # same tokens, other salt: no cross-tenant hit, and kvroute knew it


def test_restart_and_eviction_are_followed(precise, sim):
    c, k = precise
    msgs = [{"role": "system", "content": doc(7)}, {"role": "user", "content": "q"}]
    ask(c, k, msgs)
    _, reported, pod = ask(c, k, msgs)
    assert reported > 0
    url = next(p["url"] for p in sim if p["address"] == pod)
    clears = k.precise_stat("clears")
    httpx.post(url + "/sim/fault", json={"restart": True}).raise_for_status()
    k.wait_precise_stat("clears", clears + 1)  # AllBlocksCleared reached the index
    predicted, reported, _ = ask(c, k, msgs)
    assert predicted == reported == 0  # AllBlocksCleared reached the index
    # Eviction: 400-block pods; flood them with other documents, then come back to doc 7.
    for d in range(100, 112):
        ask(c, k, [{"role": "system", "content": doc(d) * 2}, {"role": "user", "content": "x"}])
    predicted, reported, _ = ask(c, k, msgs)
    assert predicted == reported
    m = k.metrics()
    removed = re.search(r'kvroute_precise_index\{stat="blocks_removed"\} (\d+)', m)
    assert removed and int(removed.group(1)) > 0
