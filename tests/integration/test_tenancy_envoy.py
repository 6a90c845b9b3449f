"""tenancy.cache_salt: inject through real Envoy to the simulated pods (which mix cache_salt into
the first block's hash and its KV events, as vLLM does). Identical prompts from two tenants share
no cached tokens, each tenant hits its own, and the precise index predicts both."""

from __future__ import annotations

import uuid

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from tests.integration.test_precise import BLOCK, doc, model_dir, new_blocks, sim  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration
SECRET = "integration-secret-0123456789"


@pytest.fixture(scope="module")
def salted(sim, model_dir, tmp_path_factory):  # noqa: F811
    cfg = tmp_path_factory.mktemp("tenancy") / "kvroute.yaml"
    (cfg.parent / "secret").write_text(SECRET)
    eps = [
        {"address": p["address"], "kv_events": p["kv_events_endpoint"], "kv_replay": p["replay_endpoint"]} for p in sim
    ]
    cfg.write_text(
        yaml.safe_dump(
            {
                "pools": {"default": {"endpoints": eps}},
                "models": {"m": {"pool": "default", "tokenizer": str(model_dir), "block_size": BLOCK}},
                "kv_events": {"enabled": True},
                "server": {"log_level": "debug"},
                "tenancy": {
                    "cache_salt": "inject",
                    "secret_file": str(cfg.parent / "secret"),
                    "client_cache_salt": "replace",
                },
            }
        )
    )
    with (
        KVRouteProcess(config=str(cfg)) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=[p["address"] for p in sim]) as env,
        httpx.Client(base_url=env.url, timeout=20) as c,
    ):
        yield c, k


def ask(c: httpx.Client, k: KVRouteProcess, tenant: str, messages: list, **extra) -> tuple[int, int]:
    """(kvroute's predicted cached tokens, the pod's reported ones) for one chat as ``tenant``; returns
    once the blocks it stored reached kvroute (KV events with the salt in their extra keys)."""
    rid = uuid.uuid4().hex
    stored = k.precise_stat("blocks_stored")
    r = c.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 4, **extra},
        headers={"x-request-id": rid, "x-tenant-id": tenant},
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    k.wait_precise_stat("blocks_stored", stored + new_blocks(usage["prompt_tokens"], cached))
    return k.decision(rid)["predicted_cached_tokens"], cached


def test_tenants_never_share_cached_blocks(salted):
    c, k = salted
    msgs = [{"role": "system", "content": doc(77)}, {"role": "user", "content": "the same question"}]
    assert ask(c, k, "tenant-a", msgs) == (0, 0)
    predicted, reported = ask(c, k, "tenant-a", msgs)
    assert predicted == reported > 0  # a full hit within the tenant, predicted exactly
    # Tenant b, same prompt, even sending a salt of its own (replaced): nothing cached, and kvroute knew.
    assert ask(c, k, "tenant-b", msgs, cache_salt="guess") == (0, 0)
    predicted, reported = ask(c, k, "tenant-b", msgs)
    assert predicted == reported > 0
    assert SECRET not in k.log()
