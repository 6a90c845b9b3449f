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
