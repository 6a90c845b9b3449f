"""bench.decision --workload: a routing scenario replayed in order through each index, as the grid runs
kvroute (4 pods; precise with the simulated pods' tokenizer), a decision's CPU and wall time each."""

from __future__ import annotations

from bench import workloads
from bench.decision import run_workload


def test_a_scenario_is_replayed_through_each_index() -> None:
    expected = len(workloads.build("multi-turn", None, None).items)
    rows = [run_workload("multi-turn", precise) for precise in (False, True)]
    assert [r["index"] for r in rows] == ["approx", "precise"]
    for r in rows:
        assert r["workload"] == "multi-turn" and r["requests"] == expected
        assert 0 < r["cpu_p50_ms"] <= r["cpu_p99_ms"] and r["cpu_mean_ms"] > 0 and r["wall_p50_ms"] > 0
        # The process's CPU over the replay holds each decision's own thread's, and the tokenizer's threads.
        assert r["all_cpu_ms"] >= 0.999 * r["cpu_mean_ms"]


async def test_a_grid_workload_is_replayed_through_the_servicer_with_its_rests() -> None:
    """--servicer: each request as Envoy sends it; precise prompts decided on a head or a probe have their
    rest encoded after the answer, counted in the CPU per request over the replay, not in the exchange's."""
    from bench.decision import run_workload_servicer
    from bench.grid import WORKLOADS

    approx, precise = [await run_workload_servicer("no-reuse", p) for p in (False, True)]
    for r in (approx, precise):
        assert r["workload"] == "no-reuse" and r["requests"] == WORKLOADS["no-reuse"].requests
        assert 0 < r["cpu_p50_ms"] <= r["cpu_p99_ms"] and r["wall_p50_ms"] > 0
        assert r["all_cpu_ms"] >= r["cpu_mean_ms"]
    # No-reuse prompts are new: precise decides on a probe and encodes each whole prompt after the answer.
    assert precise["all_cpu_ms"] > 2 * precise["cpu_mean_ms"]
