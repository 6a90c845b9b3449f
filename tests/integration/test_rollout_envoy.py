"""Shadow mode and a 50 % rollout through real Envoy: shadowed conversations are balanced by Envoy
(kvroute steers none), enforced ones stick to their pod; kvroute learns each response's pod, counts
agreement and usage per arm, and clients never see the pod header."""

from __future__ import annotations

from collections import defaultdict

import httpx
import orjson
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from extproc.config import build_config
from extproc.envoyconfig import UPSTREAM_HEADER
from extproc.observability import Metrics
from extproc.rollout import arm_of
from extproc.router import Router
from tests.integration.test_discovery_envoy import metric

pytestmark = pytest.mark.integration
READ_RESPONSES = {"response_header_mode": "SEND", "response_body_mode": "STREAMED"}
N, TURNS = 7, 4  # 7 conversations over 4 pods: round robin moves each one every turn


def chat(doc: str, turn: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": doc}, {"role": "user", "content": f"q{turn}"}]}


def conversations(env: EnvoyProcess, n: int, turns: int) -> dict[str, list[str]]:
    """Each conversation's pods, turn by turn (every turn repeats the document)."""
    pods: dict[str, list[str]] = defaultdict(list)
    with httpx.Client(base_url=env.url, timeout=10) as c:
        for turn in range(turns):
            for i in range(n):
                doc = f"conversation {i}: " + " ".join(f"w{i}-{j}" for j in range(300))
                r = c.post("/v1/chat/completions", json=chat(doc, turn))
                assert r.status_code == 200, r.text
                assert UPSTREAM_HEADER not in r.headers  # kvroute removed it: clients do not learn pod addresses
                pods[doc].append(r.json()["backend"])
    return pods


def run(fleet, tmp_path, config: dict) -> tuple[KVRouteProcess, dict[str, list[str]]]:
    path = tmp_path / "kvroute.yaml"
    path.write_text(
        yaml.safe_dump({"pools": {"p": {"endpoints": [{"address": a} for a in fleet.addresses]}}, **config})
    )
    kv = KVRouteProcess(config=str(path)).start()
    try:
        with EnvoyProcess(
            "epp.yaml", kvroute_port=kv.grpc_port, pods=fleet.addresses, processing_mode=READ_RESPONSES
        ) as env:
            return kv, conversations(env, N, TURNS)
    except BaseException:
        kv.stop()
        raise


def test_shadow_mode_steers_nothing_and_measures(fleet, tmp_path):
    kv, pods = run(fleet, tmp_path, {"mode": "shadow"})
    try:
        # Envoy's round robin: no conversation keeps one pod for all its turns.
        assert all(len(set(p)) > 1 for p in pods.values()), pods
        total = N * TURNS
        assert metric(kv, "kvroute_rollout_decisions_total", arm="shadow") == total
        agreed = {a: metric(kv, "kvroute_rollout_agreement_total", arm="shadow", agreed=a) or 0 for a in ("yes", "no")}
        assert agreed["yes"] + agreed["no"] == total and agreed["no"] > 0
        assert (
            metric(kv, "kvroute_rollout_tokens_total", arm="shadow", kind="prompt") == 100 * total
        )  # the backends' usage
        # kvroute's own history says the later turns would have hit: predicted > 0.
        assert metric(kv, "kvroute_rollout_tokens_total", arm="shadow", kind="predicted_cached") > 0
        assert metric(kv, "kvroute_inflight_requests", endpoint=fleet.addresses[0]) in (None, 0.0)
    finally:
        kv.stop()


def test_half_rolled_out_conversations_stick_or_balance_by_arm(fleet, tmp_path):
    kv, pods = run(fleet, tmp_path, {"rollout": {"enforce_fraction": 0.5}})
    try:
        # Which arm each conversation is in, as any replica computes it.
        r = Router(build_config({"pools": {"p": {"endpoints": [{"address": a} for a in fleet.addresses]}},
                                 "rollout": {"enforce_fraction": 0.5}}), Metrics())  # fmt: skip
        arms = {}
        for doc in pods:
            req = r.parse("/v1/chat/completions", "POST", {}, orjson.dumps(chat(doc, 0)))
            arms[doc] = arm_of(r.config, req, None, r.keys(req, r.registry.pools["p"].endpoints).keys)
        assert set(arms.values()) == {"enforced", "shadow"}, "every conversation fell in one arm"
        for doc, arm in arms.items():
            assert (len(set(pods[doc])) == 1) == (arm == "enforced"), (arm, pods[doc])
        for arm in ("enforced", "shadow"):
            n = TURNS * sum(a == arm for a in arms.values())
            assert metric(kv, "kvroute_rollout_decisions_total", arm=arm) == n
            assert metric(kv, "kvroute_rollout_tokens_total", arm=arm, kind="prompt") == 100 * n
        assert metric(kv, "kvroute_rollout_agreement_total", arm="enforced", agreed="yes") == TURNS * list(
            arms.values()
        ).count("enforced")
    finally:
        kv.stop()
