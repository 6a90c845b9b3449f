"""Hot reload end to end: real Envoy + ``kvroute serve --config FILE`` + loopback pods while load runs.
The file changes several times (a pod added, routing and models changed, an invalid file, a change
that needs a restart, a pod removed) and SIGHUP arrives; no client request fails, and each change
shows: the new pod takes requests, unknown models are refused, the removed pod gets nothing new,
and the reloads are counted by result."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from tests.backends import BackendFleet
from tests.integration.test_discovery_envoy import SENT, Load, arrivals_after, wait_for

pytestmark = pytest.mark.integration


def sample(kv: KVRouteProcess, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(kv.metrics()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def running_hash(kv: KVRouteProcess) -> str:
    (h,) = [s.labels["hash"] for f in text_string_to_metric_families(kv.metrics()) for s in f.samples
            if s.name == "kvroute_config_info"]  # fmt: skip
    return h


def config(pods: list[str], **extra: Any) -> dict[str, Any]:
    return {"pools": {"default": {"endpoints": [{"address": a} for a in pods]}}, **extra}


def test_reloads_under_load_through_envoy(fleet: BackendFleet, tmp_path: Path) -> None:
    p0, p1, p2, _ = fleet.addresses
    path = tmp_path / "kvroute.yaml"

    def write(data: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(data))
        tmp.replace(path)  # atomic, as a ConfigMap update is

    write(config([p0, p1]))
    with (
        KVRouteProcess(config=str(path)) as kv,
        EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=fleet.addresses) as env,
        Load(env.url) as load,
        httpx.Client(base_url=env.url, timeout=10) as client,
    ):

        def reloads(result: str) -> float | None:
            return sample(kv, "kvroute_config_reloads_total", result=result)

        def chat(model: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
            return client.post("/v1/chat/completions", json=body, headers={SENT: repr(time.monotonic())}).status_code

        load.settle()
        first_hash = running_hash(kv)
        assert reloads("applied") == 0

        # A pod added: the file's next poll applies it and it takes requests.
        write(config([p0, p1, p2]))
        wait_for(lambda: reloads("applied") == 1, what="the reload adding p2")
        wait_for(lambda: len(fleet.by_address(p2).seen) > 0, 20, "a request on the new pod")

        # Routing, P/D and models: the weights and thresholds apply, and now only model m is served.
        routing = {"scoring": "weighted", "weights": {"prefix": 5, "queue": 0}, "saturation": {"queue_threshold": 4}}
        applied = config([p0, p1, p2], routing=routing, pd={"threshold_tokens": 500},
                         models={"m": {"pool": "default"}}, unknown_model="reject")  # fmt: skip
        assert chat("other") == 200
        write(applied)
        wait_for(lambda: reloads("applied") == 2, what="the routing change")
        assert chat("other") == 404 and chat("m") == 200
        assert running_hash(kv) != first_hash

        # SIGHUP reloads at once; the file is what runs already.
        kv.signal(signal.SIGHUP)
        wait_for(lambda: reloads("unchanged") == 1, what="the SIGHUP reload")

        # An invalid file is refused: the running config stays, the field is named.
        write({**applied, "routing": {**routing, "weights": {"prefix": -1}}})
        wait_for(lambda: reloads("invalid") == 1, what="the invalid config refused")
        assert sample(kv, "kvroute_config_valid") == 0
        assert sample(kv, "kvroute_config_refused_fields", field="routing.weights.prefix", reason="invalid") == 1
        assert "config invalid, keeping the running one" in kv.log() and "routing.weights.prefix" in kv.log()
        load.settle()
        assert chat("other") == 404

        # A setting only a restart applies: refused whole (the pool change in it does not apply either).
        write({**config([p1, p2]), **{k: v for k, v in applied.items() if k != "pools"}, "mode": "cluster"})
        wait_for(lambda: reloads("restart_required") == 1, what="the restart-only change refused")
        assert sample(kv, "kvroute_config_refused_fields", field="mode", reason="restart_required") == 1
        assert sample(kv, "kvroute_config_valid") == 1
        load.settle()

        # p0 removed: nothing sent after kvroute applied it reaches p0; what was in flight there finishes.
        write({**applied, **config([p1, p2])})
        wait_for(lambda: reloads("applied") == 3, what="the reload removing p0")
        removed_at = time.monotonic()
        assert sample(kv, "kvroute_endpoints", pool="default", state="ready") == 2
        load.settle(40)
        assert arrivals_after(fleet, p0, removed_at) == 0

    failed = [r for r in load.results if r[0] != 200]
    assert not failed, f"{len(failed)} of {len(load.results)} requests failed: {failed[:5]}"
    assert len(load.results) >= 100
    assert {p0, p1, p2} <= {r[1] for r in load.results}
