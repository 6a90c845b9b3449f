"""bench.sim against real vLLM under load: one short open-loop run of the mixed long/short workload on
one real pod and on one host-calibrated simulated pod (bench/fidelity_load.py does the runs; its
full comparison, several rates and the Mooncake-style trace, is ``python -m bench.fidelity_load``).
One pod, not both: two busy pods on two cores starve their own API servers (bench/sim/README.md).

The cache outcome is compared request by request: the same requests must hit, for the same number of
tokens. Latencies are recorded for the report, not asserted here (see the end of the test)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from bench.fidelity_load import Setup, calibrate, compare_at, mixed, pressure
from bench.harness import wait_quiet
from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import VLLMPod
from tests.vllm.harness import save_result

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUESTS = 24
RATE = 2.0  # req/s: requests overlap, nothing is preempted
# KV pressure: a burst of distinct documents with long answers; at their ends five would need ~205 of the
# pod's 159 blocks, so both pods must preempt (how often depends on step timing: recorded, compared in
# bench.fidelity_load's table).
PRESSURE_REQUESTS = 8
PRESSURE_RATE = 20.0
PRESSURE_ATTEMPTS = 2
QUIET_MAX_CORES = 0.45
QUIET_WAIT_S = 30.0


async def test_sim_matches_vllm_under_load(pods: list[VLLMPod], tok: HFTokenizer, model_dir: str) -> None:
    # One wait for a quiet host, then no more (the stage must stay short): the recorded latencies say
    # how much other work there was (foreign_cores).
    await asyncio.to_thread(wait_quiet, QUIET_WAIT_S, QUIET_MAX_CORES, True)
    one = pods[1:]  # the pod test_sim_fidelity compares
    setup = Setup.of(one, model_dir, {}, quiet_wait_s=0.0)
    cal = await calibrate(setup.real_urls, model_dir, tok, setup.capacity_blocks, itl_repeats=2, ttft_repeats=3)
    setup = replace(setup, overrides=cal["overrides"])
    c = await compare_at(setup, "mixed", mixed(REQUESTS, 1, seed=1), RATE, repeats=1)
    row = c.row()
    save_result("load", {"calibration": cal, **row})
    real, sim = row["real"], row["sim"]
    assert real["failed"] == sim["failed"] == 0, row
    # The cache, request by request: the same requests hit, for the same tokens (a document's repeat
    # arrives after its first prefill ends at this rate), and nothing is preempted on either side.
    assert real["hit_requests"] > 0 and row["same_cached_sim"] == REQUESTS, row
    assert real["preemptions"] == sim["preemptions"] == 0, row
    # Latencies are recorded (save_result), not asserted: on a shared 2-core host a calibration taken
    # beside other work moved the TTFT ratio to 0.33 with under 0.45 cores of it measured, and a test
    # that fails one run in ten keeps good work from landing. ``python -m bench.fidelity_load`` on a
    # quiet machine is where the ratios are judged (several rates, the real pods' own spread beside).

    # KV pressure, on the same calibration: both pods run out of blocks and preempt, every request still
    # completes, and none reports a cached prefix (vLLM counts cached_tokens at the first scheduling
    # only, not when a preempted request recomputes from its own freed blocks; the simulator likewise).
    # Whether the real pod gets its burst at once depends on its API server keeping up: when it lags (its
    # TTFT p50 seen at 1.6 s against 0.04 s), the requests reach the engine spread out and none is preempted.
    # One more burst then, on the same pods; the simulator must preempt in each.
    for attempt in range(PRESSURE_ATTEMPTS):
        p = (await compare_at(setup, "pressure", pressure(PRESSURE_REQUESTS, 1, seed=1 + attempt), PRESSURE_RATE,
                              repeats=1)).row()  # fmt: skip
        save_result("load-pressure", {**p, "attempt": attempt + 1})
        real, sim = p["real"], p["sim"]
        assert real["failed"] == sim["failed"] == 0, p
        assert sim["preemptions"] > 0, p
        if real["preemptions"] > 0:
            break
    assert real["preemptions"] > 0, p
    assert real["hit_requests"] == sim["hit_requests"] == 0 and p["same_cached_sim"] == PRESSURE_REQUESTS, p
