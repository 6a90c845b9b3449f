"""The routing grid's pure parts: medians of repeated runs, the fleet-sized LRU ideal, the within-10 %
rule, the targets, the TTFT floor, resuming, and the summary imported for RESULTS.md."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench import grid, grid_report, report, results, workloads
from bench.pd_floor import floor_seconds
from bench.sim.profiles import get_profile
from bench.sim.tokenizer import SimTokenizer
from bench.workloads import Item


def _row(policy: str, p50: float, p90: float | None = None, hit: float = 0.5, **kw: Any) -> dict[str, Any]:
    p90 = 2 * p50 if p90 is None else p90
    return {"policy": policy, "requests": 10, "errors": 0, "ttft_p50_s": p50, "ttft_p90_s": p90,
            "ttft_p99_s": 2 * p90, "hit_rate": hit, "output_tok_s": 1000.0, "ideal_hit_rate": 0.8, **kw}  # fmt: skip


# --- medians of repeated runs ---------------------------------------------------------------------


def test_median_row_takes_each_figures_median_and_spread() -> None:
    runs = [_row("kvroute-approx", 0.30, 0.9, 0.60, pods=["a"], contended=False),
            _row("kvroute-approx", 0.10, 0.5, 0.70, pods=["b"], contended=True),
            _row("kvroute-approx", 0.20, 0.7, 0.65, pods=["c"], contended=False)]  # fmt: skip
    m = report.median_row(runs)
    assert (m["ttft_p50_s"], m["ttft_p90_s"], m["hit_rate"]) == (0.20, 0.7, 0.65)
    assert m["spread"]["ttft_p50_s"] == [0.10, 0.30] and m["spread"]["hit_rate"] == [0.60, 0.70]
    assert m["requests"] == 10 and isinstance(m["requests"], int)
    assert m["repeats"] == 3 and m["pods"] == ["c"]  # non-figures from the run whose p50 is the median
    assert m["contended"] is True  # any run disturbed by other work flags the median
    assert report.cell_spread(m, "ttft_p50_s", "{:.2f}") == "0.20 (0.10–0.30)"
    assert report.cell_spread(runs[0], "ttft_p50_s", "{:.2f}") == "0.30"  # a single run: no spread
    assert report.cell_spread(m, "requests", "{}") == "10"  # equal in every run: none either


def test_median_row_leaves_out_failed_runs() -> None:
    failed = {"policy": "sglang-router", "failed": "exited 1"}
    m = report.median_row([failed, _row("sglang-router", 0.2), _row("sglang-router", 0.4)])
    assert m["ttft_p50_s"] == pytest.approx(0.3) and m["repeats"] == 2 and m["failed_runs"] == 1
    assert "failed" not in m
    assert report.median_row([failed, failed])["failed"] == "exited 1"


def test_median_runs_keeps_the_middle_runs_samples() -> None:
    per_run = [[report.PolicyRun(_row("p", t), [t])] for t in (0.5, 0.1, 0.3)]
    (m,) = report.median_runs(per_run)
    assert m.row["ttft_p50_s"] == 0.3 and m.ttfts == [0.3]


def test_routing_headline_renders_spreads_and_old_rows_unchanged(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    median = report.median_row([_row("kvroute-approx", t) for t in (0.1, 0.2, 0.3)])
    (out / "results.json").write_text(json.dumps([median, _row("sglang-router", 0.25)]))
    (out / "run.json").write_text(json.dumps({"scenario": "demo", "command": "c", "rate_rps": 5.0, "repeat": 3}))
    h = results.import_run(out, "routing-demo", results=tmp_path / "results")
    block = results.render_block(results.load(h), tmp_path / "plots", tmp_path)
    assert "| kvroute-approx | 10 | 0 | 0.200 (0.100–0.300) | 0.400 (0.200–0.600) |" in block
    assert "| sglang-router | 10 | 0 | 0.250 | 0.500 |" in block
    assert "medians of 3 runs" in block


# --- the capacity-bounded ideal -------------------------------------------------------------------


def test_bounded_ideal_is_one_lru_cache_by_hand() -> None:
    bs = 16
    rng = random.Random(1)
    a, b, c = (Item(({"role": "user", "content": workloads.words(rng, 100)},), max_tokens=1) for _ in range(3))
    n = len(SimTokenizer().render_chat([dict(m) for m in a.messages], None))
    blocks, hit = n // bs, (n - 1) // bs  # a repeat hits all but the last token, in whole blocks
    assert n % bs and hit == blocks  # a partial tail: every full block of a repeat hits
    seq = [a, b, a, c, a, b]
    infinite = workloads.ideal_hit_rate(seq, bs)
    assert infinite["hit_tokens"] == 3 * hit * bs  # a, a, b again
    # Room for two prompts: c evicts b (least recently used; a was used since), not a (the oldest in).
    two = workloads.ideal_hit_rate(seq, bs, capacity_blocks=2 * blocks)
    assert two["hit_tokens"] == 2 * hit * bs and two["prompt_tokens"] == infinite["prompt_tokens"]
    # One block short after b: the block a's second request misses is its last one (freed tail first).
    short = workloads.ideal_hit_rate([a, b, a], bs, capacity_blocks=2 * blocks - 1)
    assert short["hit_tokens"] == (hit - 1) * bs
    assert workloads.ideal_hit_rate([a, a], bs, capacity_blocks=1)["hit_tokens"] == bs


# --- the within-10 % rule and the targets ---------------------------------------------------------


def test_close_compares_kvroute_with_the_best_peer_on_p50_and_p90() -> None:
    peers = [_row("sglang-router", 0.100, 0.300), _row("vllm-router", 0.120, 0.250)]
    assert grid.close([_row("kvroute-approx", 0.109, 0.5), *peers])  # p50 within 10 % of 0.100
    assert grid.close([_row("kvroute-approx", 0.091, 0.1), *peers])  # ahead by under 10 % counts too
    assert grid.close([_row("kvroute-precise", 0.5, 0.27), *peers])  # p90 within 10 % of vllm-router's 0.250
    assert not grid.close([_row("kvroute-approx", 0.08, 0.2), *peers])
    assert not grid.close([_row("kvroute-approx", 0.111, 0.5), *peers])
    assert not grid.close([_row("kvroute-approx", 0.1), _row("round-robin", 0.1)])  # no peer
    assert not grid.close([_row("kvroute-approx", 0.1), {"policy": "sglang-router", "failed": "boom"}])


def test_a_peer_failing_requests_is_not_the_best_peer() -> None:
    """A peer that answered errors to more than 1 % of a cell's requests (sglang-router to a Codex session's
    later turns) has figures for what it served alone: it is not the one kvroute is judged against."""
    refusing = _row("sglang-router", 0.030, 0.10, hit=0.9, requests=256, errors=224)
    serving = _row("vllm-router:consistent_hash", 0.035, 0.05, hit=0.93, requests=256, errors=2)
    assert grid_report.best_peer([refusing, serving]) is serving
    assert grid_report.best_peer([refusing]) is None
    ours = _row("kvroute-approx", 0.036, 0.048, hit=0.934, requests=256)
    assert grid_report.shortfalls(ours, [ours, refusing, serving], load=0.7) == [
        "p50 +3 % vs vllm-router:consistent_hash"
    ]


def test_close_counts_a_hit_rate_near_the_target_line() -> None:
    # TTFT far apart (kvroute leads by 20 %): only the hit rate can make the cell close. The target line is
    # the best peer's 31.9 % less 0.5 points; a single run's ±0.3 points decide nothing within 0.5 of it.
    peers = [_row("sglang-router", 0.250, 1.00, hit=0.315), _row("vllm-router:consistent_hash", 0.280, 1.30, hit=0.319)]
    near = lambda hit: grid.close([_row("kvroute-precise", 0.200, 0.80, hit=hit), *peers])  # noqa: E731
    assert near(0.313)  # -0.6 pt: a shortfall by one run
    assert near(0.317)  # -0.2 pt: a pass by one run
    assert near(0.3095)  # -0.95 pt
    assert not near(0.305)  # -1.4 pt: a shortfall no run-to-run spread here explains
    assert not near(0.319)  # level with the best peer (every router at the ideal): nothing to confirm
    assert not near(0.325)  # ahead


def test_shortfalls_name_each_missed_target() -> None:
    peers = [_row("sglang-router", 0.100, 0.300, hit=0.80), _row("vllm-router", 0.120, 0.250, hit=0.70)]
    lead = _row("kvroute-approx", 0.090, 0.240, hit=0.796)
    assert grid_report.shortfalls(lead, [lead, *peers], load=0.7) == []
    # At load 0.9 the tail must be 0.8x the best peer's p99 (vllm-router's 0.5): 0.48 is not.
    assert grid_report.shortfalls(lead, [lead, *peers], load=0.9) == ["p99 0.96x vllm-router (target 0.8x)"]
    trail = _row("kvroute-precise", 0.110, 0.240, hit=0.78)
    assert grid_report.shortfalls(trail, [trail, *peers], load=0.5) == ["p50 +10 % vs sglang-router",
                                                                 "hit -2.0 pt vs sglang-router"]  # fmt: skip
    assert grid_report.shortfalls(trail, [trail, _row("round-robin", 0.1)], load=0.5) is None
    # no-reuse: within 3 % of least-request on TTFT and throughput.
    ll = _row("least-request", 0.100, 0.200, output_tok_s=1000.0)
    slow = _row("kvroute-approx", 0.102, 0.210, output_tok_s=960.0)
    assert grid_report.shortfalls(slow, [slow, ll], load=0.5) == [
        "p90 +5 % vs least-request",
        "tok/s -4 % vs least-request",
    ]


def test_a_trailing_percentile_is_split_into_the_pods_part_and_the_path() -> None:
    """With the pods' per-request figures on both rows, a p50 or p90 that trails says whether the pods (the
    routing) or the path (the router's hop and decision) lost it; without them, the verdict alone."""
    parts = {"pod_ttft_p50_s": 0.030, "path_ttft_p50_s": 0.004, "pod_ttft_p90_s": 0.040, "path_ttft_p90_s": 0.006}
    peer = _row("sglang-router", 0.032, 0.050, **{**parts, "path_ttft_p50_s": 0.002})
    ours = _row("kvroute-approx", 0.034, 0.060, **{**parts, "pod_ttft_p90_s": 0.047})
    assert grid_report.shortfalls(ours, [ours, peer], load=0.7) == [
        "p50 +6 % vs sglang-router (pods +0.0 ms, path +2.0 ms)",
        "p90 +20 % vs sglang-router (pods +7.0 ms, path +0.0 ms)",
    ]
    untimed = _row("sglang-router", 0.032, 0.050)
    assert grid_report.shortfalls(ours, [ours, untimed], load=0.7) == [
        "p50 +6 % vs sglang-router", "p90 +20 % vs sglang-router"]  # fmt: skip
    # The detail table shows the two parts only where a run has them.
    cell = {"workload": "multi-turn", "pods": 4, "load": 0.7, "runs": 1, "best_peer": "sglang-router",
            "shortfalls": {"kvroute-approx": []}, "rows": [ours, untimed]}  # fmt: skip
    md = grid_report.summary_tables([cell])
    assert "| pods' TTFT p50 s | path p50 s |" in md
    assert "| kvroute-approx | 0.034 | 0.060 | 0.120 | 50.0% | 1000 | 0 | 0.0300 | 0.0040 |" in md
    assert md.rstrip().endswith("| sglang-router | 0.032 | 0.050 | 0.100 | 50.0% | 1000 | 0 | - | - |")
    assert "pods' TTFT" not in grid_report.summary_tables([{**cell, "rows": [untimed]}])


def test_floor_is_each_request_alone_prefilling_what_was_not_cached() -> None:
    prof = get_profile("h100-llama8b")
    reqs = [{"status": 200, "prompt_tokens": 9000, "cached_tokens": 8000},
            {"status": 200, "prompt_tokens": 9000, "cached_tokens": 0},
            {"status": 503, "prompt_tokens": None, "cached_tokens": None}]  # fmt: skip
    f = grid_report.floor(reqs, "h100-llama8b")
    hit, miss = floor_seconds(prof, 9000, 8000), floor_seconds(prof, 9000, 0)
    assert hit < miss  # two steps for the miss (8192-token budget), with the attention of 9k tokens
    assert f["floor_p50_s"] == pytest.approx((hit + miss) / 2) and f["floor_p99_s"] == pytest.approx(miss, rel=0.01)


# --- resuming, the close cells' reruns, the summary -----------------------------------------------


def _fake_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows_for: dict[float, list[dict[str, Any]]],
               **kw: Any) -> tuple[grid.Grid, list[tuple[float, int]]]:  # fmt: skip
    """A grid over multi-turn at the given loads whose runs write ``rows_for[load]`` (no processes)."""
    g = grid.Grid(out=tmp_path / "grid", workloads=["multi-turn"], pods=[4], loads=sorted(rows_for),
                  max_requests=6, **kw)  # fmt: skip
    calls: list[tuple[float, int]] = []

    def info(_g: grid.Grid, name: str, pods: int, w: workloads.Workload) -> dict[str, Any]:
        return {"capacity_rps": 10.0, "ideal_hit_rate": 0.8, "bounded_ideal_hit_rate": 0.6, "profile": "h100-llama8b"}

    def run(g: grid.Grid, name: str, pods: int, load: float, w: Any, inf: Any, k: int) -> None:
        calls.append((load, k))
        _write_run(grid.cell_dir(g.out, name, pods, load) / f"run-{k}", rows_for[load], load * inf["capacity_rps"])

    monkeypatch.setattr(grid, "workload_info", info)
    monkeypatch.setattr(grid, "run_cell", run)
    return g, calls


def _write_run(d: Path, rows: list[dict[str, Any]], rate: float) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(rows))
    (d / "run.json").write_text(json.dumps({"rate_rps": rate, "requests": 6, "time_scale": 1.0, "elapsed_s": 60.0}))
    for r in rows:
        (d / f"{r['policy']}.requests.jsonl").write_text(
            json.dumps({"status": 200, "prompt_tokens": 2000, "cached_tokens": int(2000 * r["hit_rate"])}) + "\n"
        )


FAR = [_row("kvroute-approx", 0.05, hit=0.8), _row("sglang-router", 0.10, hit=0.7)]
NEAR = [_row("kvroute-approx", 0.099, hit=0.7), _row("sglang-router", 0.10, hit=0.8)]


def test_grid_resumes_and_reruns_close_cells_to_three(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g, calls = _fake_grid(tmp_path, monkeypatch, {0.5: FAR, 0.7: NEAR})
    _write_run(grid.cell_dir(g.out, "multi-turn", 4, 0.5) / "run-1", FAR, 5.0)  # finished before
    cells = grid.grid_run(g)
    assert calls == [(0.7, 1), (0.7, 2), (0.7, 3)]  # 0.5 skipped; 0.9 is close: two more runs
    far, near = cells
    assert (far["runs"], far["close"], far["shortfalls"]) == (1, False, {"kvroute-approx": []})
    assert near["runs"] == 3 and near["close"] and near["best_peer"] == "sglang-router"
    assert near["shortfalls"]["kvroute-approx"] == ["hit -10.0 pt vs sglang-router"]
    assert near["rows"][0]["repeats"] == 3 and near["rows"][0]["spread"]["ttft_p50_s"] == [0.099, 0.099]
    assert near["floor_from"] == "sglang-router run 1" and near["bounded_ideal_hit_rate"] == 0.6
    prof = get_profile("h100-llama8b")
    assert near["floor_p50_s"] == pytest.approx(floor_seconds(prof, 2000, 1600))
    calls.clear()
    assert len(grid.grid_run(g)) == 2 and calls == []  # everything done: nothing reruns
    g.force = True
    grid.grid_run(g)
    assert calls == [(0.5, 1), (0.7, 1), (0.7, 2), (0.7, 3)]


def test_summary_markdown_plots_and_results_headline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g, _ = _fake_grid(tmp_path, monkeypatch, {0.5: FAR, 0.7: NEAR}, command="python -m bench grid --quick")
    cells = grid.grid_run(g)
    md = grid.write_summary(g, cells).read_text()
    assert "| multi-turn | 4 | 0.5 | 1 | 5.00 | 80.0% | 60.0% |" in md and "**leads**" in md
    assert "trails: hit -10.0 pt vs sglang-router" in md
    assert "| multi-turn | 4 | 0.7 | kvroute-approx | 0.099 | 0.198 |" in md  # equal runs: no spread shown
    assert "kvroute-approx leads in 1 of 2 cells with a peer." in md
    assert (g.out / "plots" / "multi-turn.png").stat().st_size > 0
    path = results.import_run(g.out, "grid", results=tmp_path / "results", kind="grid")
    h = results.load(path)
    assert h["kind"] == "grid" and h["command"] == "python -m bench grid --quick" and len(h["cells"]) == 2
    assert "the grid took 4 min" in h["machine"]  # 1 + 3 runs of 60 s
    block = results.render_block(h, tmp_path / "plots", tmp_path)
    assert "trails: hit -10.0 pt vs sglang-router" in block and "![" in block
    results.KINDS["grid"].plot(h, tmp_path / "grid.png")  # type: ignore[misc]
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_quick_selects_the_smoke_subset() -> None:
    a = grid.build_parser().parse_args(["--quick"])
    g = grid.grid_from_args(a, ["--quick"])
    assert (g.workloads, g.pods, g.loads, g.max_requests) == (list(grid.QUICK_WORKLOADS), [4], [0.7], 40)
    assert grid.policies_for("no-reuse")[-2:] == ["least-request", "round-robin"]
    assert grid.time_scale(4, 0.25) == 1.0 and grid.time_scale(8, 0.25) == 2.0
    with pytest.raises(SystemExit, match="unknown workloads"):
        grid.grid_from_args(grid.build_parser().parse_args(["--workloads", "nope"]), [])


def test_kvroute_config_reaches_every_cells_run_config(tmp_path: Path) -> None:
    argv = ["--kvroute-config", str(tmp_path / "k.yaml"), "--out", str(tmp_path)]
    g = grid.grid_from_args(grid.build_parser().parse_args(argv), argv)
    cfg = grid._config(g, "multi-turn", 8, rate=1.0, out=tmp_path)
    assert cfg.kvroute_config == str(tmp_path / "k.yaml") and cfg.time_scale == 2.0
