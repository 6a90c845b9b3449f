"""Prefill/decode disaggregation through kv_transfer_params, NixlConnector-style."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from bench.sim import Fleet, FleetConfig
from extproc.pd import PREFILL_PARAMS

PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks + 4


async def prefill(client: httpx.AsyncClient, url: str, rid: str) -> dict[str, Any]:
    r = await client.post(
        url + "/v1/completions",
        headers={"X-Request-Id": rid},
        json={"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS},
    )
    assert r.status_code == 200, r.text
    return r.json()


async def decode(client: httpx.AsyncClient, url: str, rid: str, kvp: Any) -> dict[str, Any]:
    r = await client.post(
        url + "/v1/completions",
        headers={"X-Request-Id": rid},
        json={"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": kvp},
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_prefill_then_decode_pulls_kv(client: httpx.AsyncClient) -> None:
    async with Fleet(FleetConfig(pods=2, roles="prefill:1,decode:1")) as fleet:
        p, d = fleet.pods
        assert (p.role, d.role) == ("prefill", "decode")
        r = await prefill(client, p.url, "pd-1")
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 1
        kvp = r["kv_transfer_params"]
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["remote_engine_id"] == p.engine_id and kvp["remote_request_id"] == "pd-1"
        assert kvp["remote_host"] == "127.0.0.1" and kvp["remote_port"] == p.kv_side_port
        assert kvp["tp_size"] == 1 and len(kvp["remote_block_ids"]) == 6
        # Pinned on the prefill pod until pulled.
        assert p.cache.pinned == 6 and p.stats()["pending_pulls"] == 1
        out = await decode(client, d.url, "pd-1", kvp)
        assert out["usage"]["completion_tokens"] == 5 and out["kv_transfer_params"] is None
        # As vLLM: the decode leg reports the prefill leg's own hits (none), not the 96 pulled tokens.
        assert kvp["remote_prefill_cached_tokens"] == 0
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ds = d.stats()
        assert ds["transfers"] == 1 and ds["external_hits_tokens"] == 96 and ds["prefix_hits_tokens"] == 0
        assert p.cache.pinned == 0 and p.stats()["pending_pulls"] == 0
        # The pulled blocks are now cached on the decode pod: a local repeat hits them.
        again = await client.post(d.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        metrics = (await client.get(d.url + "/metrics")).text
        assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="sim-model"} 96.0' in metrics


async def test_bad_or_stale_params_prefill_locally(client: httpx.AsyncClient) -> None:
    async with Fleet(FleetConfig(pods=2, roles="prefill:1,decode:1", pull_timeout_s=0.2)) as fleet:
        p, d = fleet.pods
        kvp = (await prefill(client, p.url, "pd-2"))["kv_transfer_params"]
        bad = {**kvp, "remote_engine_id": "no-such-engine"}
        out = await decode(client, d.url, "x", bad)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d.stats()["transfers"] == 0
        # Past the pull timeout the prefill pod has released the blocks: local prefill again.
        await asyncio.sleep(0.4)
        assert p.cache.pinned == 0 and p.stats()["pending_pulls"] == 0
        hits = p.stats()["prefix_hits_tokens"]
        out = await decode(client, fleet.pods[0].url, "y", kvp)  # same pod: local hit, no pull
        assert p.stats()["prefix_hits_tokens"] - hits == 96 and p.stats()["transfers"] == 0
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prefill leg's, as vLLM


async def test_transfer_time_scales_with_prompt(client: httpx.AsyncClient) -> None:
    async with Fleet(FleetConfig(pods=2, profile="cpu-tiny", time_scale=0.05)) as fleet:
        p = fleet.pods[0]
        assert p.profile.transfer_seconds(1000) > p.profile.transfer_seconds(100) > 0
        kvp = (await prefill(client, p.url, "pd-3"))["kv_transfer_params"]
        assert len(kvp["remote_block_ids"]) == 3  # block size 32
        out = await decode(client, fleet.pods[1].url, "pd-3", kvp)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert fleet.pods[1].stats()["external_hits_tokens"] == 96


async def test_decode_leg_reports_the_prefill_legs_hits(client: httpx.AsyncClient) -> None:
    """vLLM 0.32: the prefill leg returns its own hits in kv_transfer_params and the decode leg reports
    those; without them (a proxy that drops the field) it reports local + pulled tokens."""
    async with Fleet(FleetConfig(pods=2, roles="prefill:1,decode:1")) as fleet:
        p, d = fleet.pods
        warm = await client.post(p.url + "/v1/completions", json={"prompt": PROMPT[:70], "max_tokens": 1})
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        kvp = (await prefill(client, p.url, "pd-4"))["kv_transfer_params"]
        assert kvp["remote_prefill_cached_tokens"] == 64  # 4 blocks of the 70-token warm-up
        out = await decode(client, d.url, "pd-4", kvp)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert d.stats()["external_hits_tokens"] == 96
        kvp = (await prefill(client, p.url, "pd-5"))["kv_transfer_params"]
        del kvp["remote_prefill_cached_tokens"]
        out = await decode(client, d.url, "pd-5", kvp)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # local hits on d now
