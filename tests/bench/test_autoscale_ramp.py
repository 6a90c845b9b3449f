"""Autoscaling signals under a load ramp: simulated vLLM pods behind real Envoy and kvroute, requests
at a low, then a high, then a low rate. kvroute_desired_replicas rises with the ramp and falls back
after it (extproc/capacity.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import orjson
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import loadgen
from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from bench.workloads import MODEL, words

pytestmark = pytest.mark.integration

PHASES = ((3.0, 4.0), (3.0, 40.0), (2.0, 4.0))  # (seconds, requests/s): low, high, low
PROMPT_TOKENS = 1500  # each prompt new: all of it is prefill demand


def desired(k: KVRouteProcess) -> float:
    fams = text_string_to_metric_families(k.metrics())
    return sum(s.value for f in fams if f.name == "kvroute_desired_replicas" for s in f.samples)


def ramp_specs() -> list[loadgen.RequestSpec]:
    rng, specs, t0 = random.Random(7), [], 0.0
    for seconds, rate in PHASES:
        n = int(seconds * rate)
        for i in range(n):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": words(rng, PROMPT_TOKENS)}],
                "max_tokens": 8,
                "stream": True,
            }
            specs.append(loadgen.RequestSpec(orjson.dumps(body), at=t0 + i / rate, tag=f"{rate:g}"))
        t0 += seconds
    return specs


def test_desired_replicas_follow_a_load_ramp(tmp_path: Path) -> None:
    sim, data = start_with_ready_file(
        python_module(
            "bench.sim",
            "--pods",
            "2",
            "--base-port",
            "0",
            "--no-kv-events",
            "--profile",
            "h100-llama8b",
            "--time-scale",
            "0.2",
            "--quiet",
        )
    )
    try:
        assert isinstance(data, dict)
        pods = [p["address"] for p in data["pods"]]
        cfg = tmp_path / "kvroute.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "pools": {"default": {"endpoints": [{"address": a} for a in pods]}},
                    # A short window and delay so the ramp shows in seconds; capacity from the cost model.
                    "capacity": {"window_s": 1.5, "scale_down_delay_s": 1.0, "target_utilization": 0.7},
                }
            )
        )
        with KVRouteProcess(config=str(cfg)) as k, EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=pods) as env:
            seen: list[tuple[float, float]] = []
            stop_polling = threading.Event()

            def poll() -> None:
                while not stop_polling.is_set():
                    seen.append((time.monotonic(), desired(k)))
                    stop_polling.wait(0.2)

            poller = threading.Thread(target=poll, daemon=True)
            start = time.monotonic()
            poller.start()
            recs = asyncio.run(loadgen.run(env.url, ramp_specs(), timeout=30))
            assert sum(r.ok for r in recs) == len(recs), [r.error for r in recs if not r.ok][:3]
            # After the ramp: the count comes back down once window and delay have passed.
            peak = max(v for _, v in seen)
            deadline = time.monotonic() + 10
            while desired(k) > peak / 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            stop_polling.set()
            poller.join()
            end = desired(k)
    finally:
        stop(sim)
    low_end, high_end = start + PHASES[0][0], start + PHASES[0][0] + PHASES[1][0]
    before = max(v for t, v in seen if 1.0 < t - start < PHASES[0][0])  # the low phase, once measured
    during = max(v for t, v in seen if low_end + 0.5 < t < high_end + 0.5)
    # 40/s x 1500 tokens = 60k tokens/s ≈ 2 pods at 70 %; 4/s ≈ 0.2 of a pod.
    assert during > 1.0 and during > 4 * before, seen
    assert end < peak / 3, seen
