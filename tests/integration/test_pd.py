"""Prefill/decode disaggregation through real Envoy: gateway hand-off over a simulated P/D fleet,
sidecar and cluster hand-offs over loopback backends."""

from typing import Any

import httpx
import orjson
import pytest
import yaml

from bench.envoy import CONFIG_DIR, EnvoyProcess
from bench.faults import metric
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from extproc.envoyconfig import command_of, options_from_command
from tests.polling import wait_for

pytestmark = pytest.mark.integration

# Two prefill and two decode simulated pods, without KV events (test_pd_tls.py serves them over TLS).
PD_FLEET = ("--pods", "4", "--roles", "prefill:2,decode:2", "--base-port", "0", "--zmq-base-port", "0",
            "--no-kv-events", "--profile", "fast", "--model", "m")  # fmt: skip


def pd_config(fleet: list[dict[str, Any]], /, **sections: Any) -> dict[str, Any]:
    """kvroute's config for a P/D fleet: gateway hand-offs of prompts past 300 uncached tokens, plus
    ``sections`` (e.g. ``pods``, ``scrape``)."""
    return {
        "pools": {"default": {"endpoints": [{"address": p["address"], "role": p["role"]} for p in fleet]}},
        "pd": {
            "disaggregation": "conditional",
            "threshold_tokens": 300,
            # One request at a time on an idle fleet: nothing to spare, so the stall-priced
            # allowance would keep documents local; these tests are about the hand-off.
            "split_delay_per_stall": 1000,
            "handoff": "gateway",
            # Past the slow-leg test's stall (twice Envoy's message_timeout), with room for a loaded machine.
            "prefill_timeout_s": 10,
        },
        **sections,
    }


def long_doc(i: int) -> str:
    return f"Report {i}. " + " ".join(f"finding{i}x{j} is notable;" for j in range(700))


def by_role(pods: list[dict], role: str, key: str) -> int:
    return sum(httpx.get(p["url"] + "/sim/stats").json()[key] for p in pods if p["role"] == role)


def leg_seconds(k: KVRouteProcess) -> tuple[float, float]:
    """kvroute's gateway prefill legs that returned KV so far: how many, and their seconds in all."""
    text = k.metrics()
    return (metric(text, "kvroute_pd_prefill_seconds_count", result="ok") or 0.0,
            metric(text, "kvroute_pd_prefill_seconds_sum", result="ok") or 0.0)  # fmt: skip


@pytest.fixture(scope="module")
def pd_fleet():
    proc, info = start_with_ready_file(python_module("bench.sim", *PD_FLEET))
    yield info["pods"]
    stop(proc)


@pytest.fixture(scope="module")
def gateway(pd_fleet, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("pd") / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump(pd_config(pd_fleet)))
    addrs = [p["address"] for p in pd_fleet]
    with (
        KVRouteProcess(config=str(cfg)) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=addrs) as env,
        httpx.Client(base_url=env.url, timeout=30) as c,
    ):
        yield c, k


def chat(content: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


def test_long_prompt_is_split_and_streams_back(gateway, pd_fleet):
    c, k = gateway
    transfers0, prefill0 = by_role(pd_fleet, "decode", "transfers"), by_role(pd_fleet, "prefill", "requests")
    with c.stream("POST", "/v1/chat/completions", json=chat(long_doc(1), stream=True)) as r:
        text = r.read().decode()
    assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    assert text.count("data: ") >= 8  # the decode pod streamed the answer
    assert by_role(pd_fleet, "prefill", "requests") == prefill0 + 1  # the prefill leg ran on a prefill pod
    assert by_role(pd_fleet, "decode", "transfers") == transfers0 + 1  # the decode pod pulled the KV
    assert by_role(pd_fleet, "decode", "external_hits_tokens") > 500  # ... instead of prefilling it
    assert 'kvroute_pd_decisions_total{outcome="split",reason="uncached"}' in k.metrics()


def test_cached_or_short_prompts_stay_local(gateway, pd_fleet):
    c, k = gateway
    c.post("/v1/chat/completions", json=chat(long_doc(2)))  # split: the decode pod now holds doc 2
    prefill0 = by_role(pd_fleet, "prefill", "requests")
    r = c.post("/v1/chat/completions", json=chat(long_doc(2) + " And a follow-up?"))
    assert r.status_code == 200
    r = c.post("/v1/chat/completions", json=chat("short question"))
    assert r.status_code == 200
    assert by_role(pd_fleet, "prefill", "requests") == prefill0  # neither went through a prefill pod
    m = k.metrics()
    assert 'kvroute_pd_decisions_total{outcome="local",reason="cached"}' in m


def test_dead_prefill_pods_degrade_to_local_prefill(gateway, pd_fleet):
    c, k = gateway
    for p in pd_fleet:
        if p["role"] == "prefill":
            httpx.post(p["url"] + "/sim/fault", json={"restart": True, "down_s": 3}).raise_for_status()
    statuses = [c.post("/v1/chat/completions", json=chat(long_doc(10 + i))).status_code for i in range(4)]
    assert statuses == [200] * 4
    assert 'kvroute_pd_decisions_total{outcome="fallback-local"' in k.metrics()
    # The prefill pods serve again before the next test needs them.
    wait_for(lambda: all(httpx.get(p["url"] + "/sim/info").json()["faults"]["down_s"] == 0
                         for p in pd_fleet if p["role"] == "prefill"), 10, "the prefill pods to be back")  # fmt: skip


def test_slow_prefill_leg_outlasting_envoys_message_timeout_still_hands_off(gateway, pd_fleet):
    """A queued prefill takes longer than Envoy's message_timeout: kvroute asks Envoy to wait
    (override_message_timeout) instead of Envoy failing open to a pod that then prefills the prompt."""
    c, k = gateway
    patience_s = options_from_command(command_of((CONFIG_DIR / "epp.yaml").read_text())).message_timeout_s
    transfers0, prefill0 = by_role(pd_fleet, "decode", "transfers"), by_role(pd_fleet, "prefill", "requests")
    legs0 = leg_seconds(k)
    # Stalled for twice Envoy's patience: the leg outlasts it even if it reaches its pod a while after
    # the stall began (a loaded machine), and ends well within pd.prefill_timeout_s.
    for p in pd_fleet:
        if p["role"] == "prefill":
            httpx.post(p["url"] + "/sim/fault", json={"stall_s": 2 * patience_s}).raise_for_status()
    r = c.post("/v1/chat/completions", json=chat(long_doc(30)))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    legs, took_s = leg_seconds(k)
    assert legs == legs0[0] + 1 and took_s - legs0[1] > patience_s  # the leg really outlasted message_timeout
    assert by_role(pd_fleet, "prefill", "requests") == prefill0 + 1
    assert by_role(pd_fleet, "decode", "transfers") == transfers0 + 1  # handed off, not failed open


def test_client_kv_transfer_params_rejected(gateway):
    c, _ = gateway
    body = chat("x", kv_transfer_params={"do_remote_prefill": True, "remote_host": "169.254.169.254"})
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]


def test_a_malformed_ttft_objective_is_a_clear_client_error(gateway):
    c, _ = gateway
    r = c.post("/v1/chat/completions", json=chat(long_doc(40)), headers={"x-slo-ttft-ms": "soon"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "x-slo-ttft-ms" and "positive number of milliseconds" in err["message"]
    r = c.post("/v1/chat/completions", json=chat(long_doc(40)), headers={"x-slo-ttft-ms": "5000"})
    assert r.status_code == 200


def test_sidecar_handoff_names_the_prefill_pod(fleet, tmp_path):
    prefill, decode = fleet.addresses[:2], fleet.addresses[2:]
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "pools": {
                    "default": {
                        "endpoints": [{"address": a, "role": "prefill"} for a in prefill]
                        + [{"address": a, "role": "decode"} for a in decode]
                    }
                },
                "pd": {"disaggregation": "always", "handoff": "sidecar"},
            }
        )
    )
    with (
        KVRouteProcess(config=str(cfg)) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=fleet.addresses) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
    ):
        got = c.post("/v1/chat/completions", json=chat(long_doc(3))).json()
        spoof = c.post("/v1/chat/completions", json=chat("y"), headers={"x-prefiller-host-port": "6.6.6.6:1"}).json()
    assert got["backend"] in decode and got["headers"]["x-prefiller-host-port"] in prefill
    assert spoof["headers"]["x-prefiller-host-port"] in prefill  # the client's value never survives


def test_cluster_handoff_steers_two_stage_clients(fleet, tmp_path):
    prefill, decode = fleet.addresses[:2], fleet.addresses[2:]
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "mode": "cluster",
                "pools": {
                    "default": {
                        "endpoints": [{"address": a, "role": "prefill"} for a in prefill]
                        + [{"address": a, "role": "decode"} for a in decode]
                    }
                },
                "pd": {"disaggregation": "always", "handoff": "cluster", "client_kv_transfer_params": "allow"},
            }
        )
    )
    with (
        KVRouteProcess(config=str(cfg)) as k,
        EnvoyProcess(
            "pd-cluster.yaml",
            kvroute_port=k.grpc_port,
            pods=fleet.addresses,
            cluster_endpoints={"prefill": prefill, "decode": decode},
        ) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
    ):
        leg1 = c.post(
            "/v1/completions",
            content=orjson.dumps(
                {"model": "m", "prompt": "p" * 400, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            ),
        )
        leg2 = c.post(
            "/v1/completions",
            content=orjson.dumps(
                {"model": "m", "prompt": "p" * 400, "kv_transfer_params": {"do_remote_prefill": True}}
            ),
        )
    assert leg1.json()["backend"] in prefill and leg1.json()["headers"]["x-kvroute-cluster"] == "prefill"
    assert leg2.json()["backend"] in decode and leg2.json()["headers"]["x-kvroute-cluster"] == "decode"
