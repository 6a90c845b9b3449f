"""bench.results: headline JSON → RESULTS.md blocks and plots, and benchmark outputs imported as headlines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import pd_sweep, results

MD = """# results

intro stays

<!-- bench.results: routing-demo -->
old text that goes
<!-- /bench.results: routing-demo -->

## P/D

<!-- bench.results: pd -->
<!-- /bench.results: pd -->

tail stays
"""


def _row(policy: str, hit: float, ttft: float, **extra: Any) -> dict[str, Any]:
    return {"policy": policy, "requests": 10, "errors": 0, "ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft,
            "ttft_p99_s": 3 * ttft, "itl_p50_s": 0.008, "itl_p99_s": 0.02, "e2e_p50_s": 0.5, "output_tok_s": 100.0,
            "hit_rate": hit, "ideal_hit_rate": 0.8, "load_imbalance": 1.05, **extra}  # fmt: skip


def _bench_run_dir(tmp: Path) -> Path:
    """What ``python -m bench run`` leaves in --out: results.json (rows) and run.json (meta)."""
    out = tmp / "out" / "demo"
    out.mkdir(parents=True)
    pods = [{"requests": 5, "busy_s": 1.0}, {"requests": 5, "busy_s": 1.2}]
    rows = [_row("round-robin", 0.4, 0.2, pods=pods, other_cores=0.1, contended=False),
            _row("kvroute-approx", 0.78, 0.05, pods=pods, other_cores=0.9, contended=True, timed_requests=10,
                 pod_wait_p50_s=0.01, pod_ttft_p50_s=0.046, path_ttft_p50_s=0.004, path_ttft_p90_s=0.006,
                 path_ttft_mean_s=0.0045, decision_ms_mean=0.33, ttft_mean_s=0.06),
            _row("sglang-router", 0.79, 0.06, pods=pods, other_cores=0.2, contended=False),
            {"policy": "vllm-router", "scenario": "demo", "failed": "vllm-router: failed to start: boom"}]  # fmt: skip
    (out / "results.json").write_text(json.dumps(rows))
    meta = {"scenario": "demo", "command": "python -m bench run --scenario demo --out bench/out/demo",
            "workload": {"groups": 2}, "machine": "2 CPU cores, no GPU (simulated pods)", "code": "commit abc1234",
            "capacity_rps": 10.0, "load": 0.7, "rate_rps": 7.0, "requests": 10}  # fmt: skip
    (out / "run.json").write_text(json.dumps(meta))
    return out


def _pd(conditional_itl: float = 0.011) -> dict[str, Any]:
    def r(policy: str, layout: str, ttft: float, itl: float) -> dict[str, Any]:
        return {"policy": policy, "label": policy, "layout": layout, "ttft_p50_s": 0.05, "ttft_p99_s": ttft,
                "itl_p50_s": 0.008, "itl_p99_s": itl, "itl_p999_s": 0.2, "output_tok_s": 2000, "errors": 0}  # fmt: skip

    rows = [r("never", "0:0:4", 0.37, 0.0176), r("always", "1:0:3", 1.5, 0.0107),
            r("vllm-router-pd", "1:0:3", 1.4, 0.0167), r("conditional", "1:0:3", 0.46, conditional_itl)]  # fmt: skip
    rows[-1]["ttft_p99_range"] = [0.45, 0.47]
    return {"name": "pd", "kind": "pd", "title": "P/D", "command": "python -m bench.pd_sweep", "rows": rows}


def test_routing_import_renders_rows_findings_and_provenance(tmp_path: Path) -> None:
    path = results.import_run(_bench_run_dir(tmp_path), "routing-demo", results=tmp_path / "results")
    h = results.load(path)
    assert h["kind"] == "routing" and h["stale"] is False and h["code"] == "commit abc1234"
    assert h["command"] == "python -m bench run --scenario demo --out bench/out/demo"
    assert h["rows"][1]["requests_per_pod"] == [5, 5] and "pods" not in h["rows"][1]
    assert "1 of 4 rows contended" in h["machine"] and "7.00 req/s" in h["workload"]
    block = results.render_block(h, tmp_path / "plots", tmp_path)
    assert "| kvroute-approx | 10 | 0 | 0.050 | 0.100 | 0.150 |" in block
    assert "78.0% | 80.0% | 1.05 | 0.90 (contended) |" in block
    assert "| vllm-router | failed to start: vllm-router: failed to start: boom |" in block
    assert "hit rate 78.0% (97.5% of the ideal 80.0%)" in block and "(4.0x lower)" in block
    assert "Best peer, sglang-router: hit rate 79.0%" in block
    assert "![Routing on demo](plots/routing-demo.png)" in block and "Stale" not in block
    # Where the TTFT went, for the rows whose pods reported their own part (kvroute-approx's here)
    assert "| kvroute-approx | 10 | 0.0500 | 0.0100 | 0.0460 | 0.0040 | 0.0060 | 0.0045 | 0.33 |" in block
    assert block.count("| sglang-router |") == 1 and "ttft_mean_s" not in h["rows"][1]  # one line: the main table


def test_stale_and_pending_headlines_say_so() -> None:
    h = {"name": "x", "kind": "table", "title": "X", "command": "make x", "columns": ["a"], "rows": [["1"]]}
    assert "| a |\n|---|\n| 1 |" in results.render_block(h)
    stale = results.render_block({**h, "stale": True, "stale_reason": "older code."})
    assert stale.startswith("> **Stale:** older code.")
    pending = results.render_block({**h, "pending": True, "pending_reason": "run it."})
    assert pending.startswith("> **Not measured yet.** run it.") and "| a |" not in pending
    assert "Reproduce: `make x`" in pending


def test_pd_target_is_checked_from_the_figures() -> None:
    met = results.render_block(_pd())
    assert "Target **met** by conditional (1:0:3): TTFT p99 vs always -69 %, ITL p99 vs never -38 %" in met
    assert "| conditional | 1:0:3 | 0.050 | **0.460 (0.450–0.470)** | 8.0 | **11.0** | 200.0 | 2000 | 0 |" in met
    # Conditional's ITL p99 above vllm-router-pd's: the Pareto target is no longer met.
    missed = results.pd_target(_pd(conditional_itl=0.017))
    assert missed == [("conditional (1:0:3)", False, "TTFT p99 vs always -69 %, ITL p99 vs never -3 %, "
                       "TTFT p99 vs vllm-router-pd -67 %, ITL p99 vs vllm-router-pd +2 %")]  # fmt: skip


def test_pd_import_from_a_sweep(tmp_path: Path) -> None:
    def row(ttft: float, itl: float) -> dict[str, Any]:
        return {"ttft_p50_s": 0.03, "ttft_p99_s": ttft, "itl_p50_s": 0.008, "itl_p99_s": itl, "itl_p999_s": 0.2,
                "output_tok_s": 2000.0, "errors": 0}  # fmt: skip

    points = [pd_sweep.point("never", [row(0.37, 0.0176)]),
              pd_sweep.point("always", [row(1.5, 0.0107), row(1.52, 0.0108)], pd_split="1:0:3"),
              pd_sweep.point("conditional d=0.25 T=0.3", [row(0.46, 0.0114), row(0.47, 0.0115)],
                             pd_split="1:0:3", threshold_tokens=100)]  # fmt: skip
    meta = {"command": "python -m bench.pd_sweep --out bench/out/pd-pareto", "pods": 4, "code": "commit abc1234"}
    (tmp_path / "sweep.json").write_text(json.dumps({"meta": meta, "title": "sweep", "points": points}))
    h = results.import_pd(tmp_path)
    assert [(r["policy"], r["layout"]) for r in h["rows"]] == [
        ("never", "0:0:4"), ("always", "1:0:3"), ("conditional", "1:0:3")]  # fmt: skip
    assert h["rows"][2]["ttft_p99_range"] == [0.46, 0.47] and h["rows"][2]["ttft_p99_s"] == pytest.approx(0.465)
    assert h["command"] == meta["command"] and h["code"] == "commit abc1234"


def test_overhead_import(tmp_path: Path) -> None:
    case = {"rate": 100.0, "body": "1k", "requests_per_router": 600,
            "errors": {"envoy": 0, "envoy+noop-extproc": 0, "envoy+kvroute": 1},
            "envoy": {"p50_ms": 2.0, "p99_ms": 5.0, "envoy_cpu_ms_per_req": 0.5, "extproc_cpu_ms_per_req": 0.0},
            "envoy+noop-extproc": {"p50_ms": 6.0, "p99_ms": 15.0, "envoy_cpu_ms_per_req": 1.2,
                                   "extproc_cpu_ms_per_req": 1.8, "added_p50_ms": 4.0, "added_p99_ms": 10.0},
            "envoy+kvroute": {"p50_ms": 6.5, "p99_ms": 16.0, "envoy_cpu_ms_per_req": 1.2,
                              "extproc_cpu_ms_per_req": 2.3, "added_p50_ms": 4.5, "added_p99_ms": 11.0}}  # fmt: skip
    res = {"rates": [100.0], "duration_s": 6.0, "rounds": 2, "sizes": {"1k@100": case}}
    (tmp_path / "results.json").write_text(json.dumps(res))
    h = results.import_overhead(tmp_path)
    assert h["command"].startswith("python -m bench.overhead --rates 100 --duration 6 --rounds 2 --out ")
    block = results.render_block({"name": "overhead", **h})
    assert "| 100 | 1k-token chat | envoy+kvroute | 6.50 | 16.00 | +4.50 | +11.00 | 1.20 | 2.30 | 1 |" in block
    assert "| 100 | 1k-token chat | envoy | 2.00 | 5.00 | - | - | 0.50 | - | 0 |" in block
    assert "its own CPU over that floor +0.50 ms per request" in block


def test_build_rewrites_blocks_draws_plots_and_is_idempotent(tmp_path: Path) -> None:
    res, plots, md = tmp_path / "results", tmp_path / "plots", tmp_path / "RESULTS.md"
    results.import_run(_bench_run_dir(tmp_path), "routing-demo", results=res)
    (res / "pd.json").write_text(json.dumps(_pd()))
    md.write_text(MD)
    assert results.build(res, md, plots) is True
    text = md.read_text()
    assert "old text that goes" not in text and "intro stays" in text and text.endswith("tail stays\n")
    assert "<!-- bench.results: pd -->\nReproduce: `python -m bench.pd_sweep`" in text
    for name in ("routing-demo", "pd"):
        png = plots / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert results.build(res, md, plots, draw=False) is False  # already up to date


def test_blocks_and_headlines_must_match(tmp_path: Path) -> None:
    res, md = tmp_path / "results", tmp_path / "RESULTS.md"
    res.mkdir()
    (res / "pd.json").write_text(json.dumps(_pd()))
    md.write_text(MD)
    with pytest.raises(results.ResultsError, match=r"no bench/results/routing-demo\.json"):
        results.build(res, md, tmp_path / "plots", draw=False)
    md.write_text("# nothing marked\n")
    with pytest.raises(results.ResultsError, match="has no block for pd"):
        results.build(res, md, tmp_path / "plots", draw=False)
    (res / "bad.json").write_text(json.dumps({"kind": "nope", "title": "t", "command": "c"}))
    with pytest.raises(results.ResultsError, match="kind 'nope' is not one of"):
        results.load_all(res)


def test_import_needs_a_known_kind(tmp_path: Path) -> None:
    src = _bench_run_dir(tmp_path)
    with pytest.raises(results.ResultsError, match="--as replicas: no importer"):
        results.import_run(src, "replicas", results=tmp_path / "r")
    assert (
        results.load(results.import_run(src, "replicas", results=tmp_path / "r", kind="routing"))["kind"] == "routing"
    )
    with pytest.raises(results.ResultsError, match="no such file"):
        results.import_run(tmp_path / "missing", "routing-x", results=tmp_path / "r")


def test_committed_results_md_matches_its_json() -> None:
    """bench/RESULTS.md's blocks are what bench/results/*.json render to (else: `make results`)."""
    text = results.RESULTS_MD.read_text()
    assert results.render_markdown(text, results.load_all()) == text
    for h in results.load_all().values():
        if not h.get("pending") and results.KINDS[h["kind"]].plot is not None:
            assert results.plot_path(h).exists(), h["name"]


def _side(ttft: float, itl: float, hits: int) -> dict[str, Any]:
    return {"requests": 10, "ttft_p50": ttft, "ttft_p90": 2 * ttft, "itl_p50": itl, "itl_p90": 2 * itl,
            "engine_itl_mean": itl, "hit_requests": hits, "preemptions": 0.0, "waiting_peak": 3.0}  # fmt: skip


def test_fidelity_load_import_copies_its_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "PLOTS_DIR", tmp_path / "plots")
    row = {"workload": "mixed", "rate": 3.0, "real": _side(0.020, 0.0046, 2), "sim": _side(0.022, 0.0035, 2),
           "sim_vs_real": {"ttft_p50": 1.1, "ttft_p90": 1.1, "itl_p50": 0.76, "itl_p90": 0.76, "engine_itl_mean": 0.76},
           "real2_vs_real": {"ttft_p50": 0.98}, "same_cached_sim": 10}  # fmt: skip
    # Two runs' output directories (the tiny model's and another's): each one's plots under its own name.
    for name, body in (("fidelity-load", b"\x89PNG fake"), ("fidelity-load-small", b"\x89PNG small")):
        src = tmp_path / name
        src.mkdir()
        png = src / "mixed-3-cdf.png"
        png.write_bytes(body)
        (src / "fidelity-load.json").write_text(json.dumps(
            {"command": "python -m bench.fidelity_load --rates 3", "rows": [row], "plots": [str(png)],
             "overrides": {"base_ms": 2.0}}))  # fmt: skip
    h = results.import_fidelity_load(tmp_path / "fidelity-load")
    assert h["kind"] == "table" and h["command"] == "python -m bench.fidelity_load --rates 3"
    assert h["rows"][0][:3] == ["mixed", "3", "20.0 / 22.0 (1.10, 0.98)"]
    assert h["rows"][0][4] == "4.6 / 3.5 (0.76, -)"
    small = results.import_fidelity_load(tmp_path / "fidelity-load-small")
    assert (tmp_path / "plots" / "fidelity-load-mixed-3-cdf.png").read_bytes() == b"\x89PNG fake"
    assert (tmp_path / "plots" / "fidelity-load-small-mixed-3-cdf.png").read_bytes() == b"\x89PNG small"
    block = results.render_block({"name": "fidelity-load", **h}, plots=tmp_path / "plots", md_dir=tmp_path)
    assert "![mixed-3: TTFT and ITL CDFs, real vs simulated](plots/fidelity-load-mixed-3-cdf.png)" in block
    assert small["images"][0]["file"] == "fidelity-load-small-mixed-3-cdf.png"


def test_fidelity_within_counts_the_bound_of_the_nearest_real_run() -> None:
    ratios = {"ttft_p50": 1.14, "ttft_p90": 0.70, "itl_p50": 1.30, "itl_p90": 0.84, "engine_itl_mean": 1.3}
    # 15 %: only TTFT p50 is within (0.84 is just outside).
    assert results.fidelity_within({"sim_vs_real": ratios}) == "1/4"
    # Real run 2 read TTFT p90 0.65x and ITL p50 1.35x run 1: the sim is within 15 % of run 2 on those two. It
    # read ITL p90 1.02x: the range 1.00-1.02 widened by 15 % starts at 0.85, above the sim's 0.84.
    spread = {"ttft_p50": 1.0, "ttft_p90": 0.65, "itl_p50": 1.35, "itl_p90": 1.02}
    assert results.fidelity_within({"sim_vs_real": ratios, "real2_vs_real": spread}) == "3/4"
    # A spread on the other side does not widen it: run 2 at 1.40x run 1 leaves the sim's 0.70 out of reach.
    other_side = {**spread, "ttft_p90": 1.40}
    assert results.fidelity_within({"sim_vs_real": ratios, "real2_vs_real": other_side}) == "2/4"
    row = {"workload": "mooncake", "rate": 2.0, "real": _side(0.100, 0.010, 5), "sim": _side(0.080, 0.008, 5),
           "sim_vs_real": ratios, "real2_vs_real": spread, "same_cached_sim": 10}  # fmt: skip
    cells = results.fidelity_load_rows([row])[0]
    assert len(cells) == len(results.FIDELITY_LOAD_COLUMNS) and cells[-1] == "3/4"
    # An anchored run: the decode factor beside the host step, and the fit-as-is run's count beside its own.
    anchored = {**row, "probe_calibrated_s": 0.010, "real2": {**row["real"], "probe_s": 0.009},
                "real": {**row["real"], "probe_s": 0.012}, "decode_anchor": 1.18,
                "sim_fit_vs_real": {**ratios, "ttft_p50": 1.5}}  # fmt: skip
    cells = results.fidelity_load_rows([anchored])[0]
    assert cells[-2:] == ["1.20 / 0.90 (x1.18)", "3/4 (2/4)"]


def test_a_third_real_run_widens_the_spread_and_pairs_show_per_request_error() -> None:
    """Every further real run widens the real pod's range (the sim is within 15 % of the nearest run); the
    per-request TTFT ratios are shown beside real run 2's."""
    ratios = {"ttft_p50": 1.16, "ttft_p90": 0.90, "itl_p50": 1.04, "itl_p90": 0.98, "engine_itl_mean": 1.0}
    run2, run3 = {"ttft_p50": 1.11, "ttft_p90": 1.06}, {"ttft_p50": 0.82, "ttft_p90": 1.02}
    row = {"workload": "mooncake", "rate": 3.0, "real": _side(0.228, 0.0147, 59), "sim": _side(0.264, 0.0154, 59),
           "sim_vs_real": ratios, "real2_vs_real": run2, "same_cached_sim": 60,
           "paired_ttft": {"p10": 0.9, "p50": 1.03, "p90": 1.2},
           "paired_ttft_real2": {"p10": 0.85, "p50": 1.04},
           "paired_itl": {"p10": 0.8, "p50": 0.92, "p90": 1.1}}  # fmt: skip
    assert results.fidelity_within(row) == "4/4"  # TTFT p50 1.16: outside 15 % of run 1, within of run 2 (1.11)
    far = {**row, "sim_vs_real": {**ratios, "ttft_p50": 1.30}}
    assert results.fidelity_within(far) == "3/4"  # 1.30 / 1.11: 17 % over the nearest run
    wider = {**far, "more_real": [_side(0.187, 0.0150, 59)], "more_real_vs_real": [{**run3, "ttft_p50": 1.14}]}
    assert results.fidelity_within(wider) == "4/4"  # run 3 read 1.14 of run 1: the sim 14 % over it
    cells = results.fidelity_load_rows([{**row, "more_real": wider["more_real"], "more_real_vs_real": [run3]}])[0]
    assert cells[2] == "228.0 / 264.0 (1.16, 1.11/0.82)"
    assert cells[4] == "14.7 / 15.4 (1.04, -/-)"
    assert cells[7] == "0.90 / 1.03 / 1.20 (0.85 / 1.04 / -)"
    assert cells[8] == "0.80 / 0.92 / 1.10"  # no real run 2 figures: none beside
    assert results.fidelity_load_rows([{k: v for k, v in row.items() if k != "paired_ttft"}])[0][7] == "-"


def test_ramp_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "PLOTS_DIR", tmp_path / "plots")
    role = {"role": "both", "ready": 2.0, "peak_desired": 5.02, "rise_s": 10.3, "break_s": 12.3, "lead_s": 2.0,
            "load_at_rise": 0.83, "load_at_break": 1.03, "prefill_capacity_ratio": 1.17, "window_fell_s": 31.3,
            "fell_s": 41.3}  # fmt: skip
    (tmp_path / "ramp.json").write_text(json.dumps({"meta": {"command": "python -m bench ramp --pods 2"},
                                                    "failed": 0, "roles": [role]}))  # fmt: skip
    h = results.import_ramp(tmp_path)
    assert h["rows"] == [["both", "10.3", "0.83", "12.3", "1.03", "+2.0", "1.17", "31.3", "41.3", "5.02", "2"]]
    assert h["images"] == [] and h["failed_requests"] == 0  # no ramp.png: nothing to show
    assert "| both | 10.3 | 0.83 |" in results.render_block({"name": "ramp", **h})


def test_timeline_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``bench timeline`` output as a table: steady TTFT is the median of the windows in the 30 s
    before the event, the worst p90 and lowest hit rate are taken from the event on."""
    monkeypatch.setattr(results, "PLOTS_DIR", tmp_path / "plots")
    wins = [{"start_s": s, "requests": 5, "failed": 0, "hit_rate": h, "ttft_p50_s": p50, "ttft_p90_s": p90}
            for s, h, p50, p90 in [(0, 0.1, 9.0, 9.0), (30, 0.5, 0.02, 0.05), (40, 0.6, 0.04, 0.07),
                                   (50, 0.5, 0.03, 0.06), (60, 0.2, 0.1, 0.4), (70, 0.55, 0.03, 0.06)]]  # fmt: skip
    res = {"policy": "kvroute-approx-buckets", "event": "scale-in", "requests": 30, "failed": 1,
           "failed_after_event": 0, "event_start_s": 60.0, "event_end_s": 64.0, "windows": wins,
           "keys_moved": {"sessions": 10, "moved": 2, "share": 0.2}, "minimal_share": 1 / 3,
           "steady_hit_rate": 0.533, "recovered_s": 16.0,
           "targets": {"no_failures": True, "keys_moved": None, "recovered": True}}  # fmt: skip
    meta = {"event": "scale-in", "command": "python -m bench timeline --event scale-in", "window_s": 10.0,
            "workload": "multi-turn", "rate_rps": 8.0, "pods": 4, "delta": 2}  # fmt: skip
    (tmp_path / "timeline.json").write_text(json.dumps({"meta": meta, "results": [res, {
        "policy": "sglang-router", "event": "scale-in", "error": "RuntimeError: no start"}]}))  # fmt: skip
    (tmp_path / "timeline-scale-in.png").write_bytes(b"\x89PNG fake")
    h = results.import_timeline(tmp_path)
    assert h["title"] == "Fleet event: scale-in" and h["workload"]["pods"] == 4
    assert h["rows"][0] == ["kvroute-approx-buckets", "30", "1 (0)", "20.0% (33.3%)", "53.3%", "20.0%", "16 s",
                            "0.030 / 0.060", "0.400", "met"]  # fmt: skip
    assert h["rows"][1][:2] == ["sglang-router", "error: RuntimeError: no start"]
    assert (tmp_path / "plots" / "timeline-scale-in.png").read_bytes() == b"\x89PNG fake"
    assert "| kvroute-approx-buckets | 30 | 1 (0) |" in results.render_block(
        {"name": "timeline-scale-in", **h}, plots=tmp_path / "plots", md_dir=tmp_path
    )


def _grid_out(tmp: Path, name: str, cells: list[tuple[str, int, float]], code: str) -> Path:
    """What ``python -m bench grid`` leaves in --out for these (workload, pods, load) cells."""
    out = tmp / name
    out.mkdir()
    made = [{"workload": w, "pods": p, "load": x, "runs": 1, "from": code} for w, p, x in cells]
    meta = {"command": f"python -m bench grid --out {name}", "code": code, "profile": "h100-llama8b"}
    (out / "summary.json").write_text(json.dumps({"meta": meta, "cells": made}))
    return out


def test_a_grid_rerun_of_some_cells_merges_into_the_headline(tmp_path: Path) -> None:
    res = tmp_path / "r"
    whole = [(w, p, x) for w in ("shared-prefix", "mooncake") for p in (4, 8) for x in (0.5, 0.9)]
    results.import_run(_grid_out(tmp_path, "all", whole, "commit old"), "grid", results=res)
    h = results.load(res / "grid.json")
    h["notes"] = ["a note on the Mooncake cells"]
    (res / "grid.json").write_text(json.dumps(h))

    rerun = [("shared-prefix", 4, 0.5), ("shared-prefix", 4, 0.9), ("multi-turn", 4, 0.7)]
    merged = results.load(results.import_run(_grid_out(tmp_path, "some", rerun, "commit new"), "grid",
                                             results=res, merge=True))  # fmt: skip
    got = [(c["workload"], c["pods"], c["load"], c["from"]) for c in merged["cells"]]
    assert got == [("shared-prefix", 4, 0.5, "commit new"), ("shared-prefix", 4, 0.9, "commit new"),
                   ("shared-prefix", 8, 0.5, "commit old"), ("shared-prefix", 8, 0.9, "commit old"),
                   ("mooncake", 4, 0.5, "commit old"), ("mooncake", 4, 0.9, "commit old"),
                   ("mooncake", 8, 0.5, "commit old"), ("mooncake", 8, 0.9, "commit old"),
                   ("multi-turn", 4, 0.7, "commit new")]  # fmt: skip
    assert merged["notes"] == ["a note on the Mooncake cells"]
    assert merged["command"] == "python -m bench grid --out all"
    scope = "multi-turn, shared-prefix on 4 pods at 0.5, 0.7, 0.9"
    assert merged["code"] == f"{scope}: commit new; the other cells: commit old"

    with pytest.raises(results.ResultsError, match="only a grid"):
        results.import_run(_bench_run_dir(tmp_path), "grid", results=res, kind="routing", merge=True)
    with pytest.raises(results.ResultsError, match="import without --merge first"):
        results.import_run(_grid_out(tmp_path, "first", rerun, "c"), "grid", results=tmp_path / "empty", merge=True)


def test_best_row_is_the_fastest_of_those_level_on_hit_rate() -> None:
    """A hit rate a hundredth of a point higher does not make a router three times slower the best peer."""
    rows = [
        {"policy": "sglang-router", "hit_rate": 0.7516, "ttft_p50_s": 0.035, "ttft_p99_s": 0.8},
        {"policy": "vllm-router", "hit_rate": 0.7518, "ttft_p50_s": 0.065, "ttft_p99_s": 0.8},
        {"policy": "vllm-router:consistent_hash", "hit_rate": 0.40, "ttft_p50_s": 0.020, "ttft_p99_s": 2.0},
        {"policy": "kvroute-approx", "hit_rate": 0.752, "ttft_p50_s": 0.038, "ttft_p99_s": 0.6},
    ]
    (ours, peer) = results.routing_findings({"rows": rows})
    assert ours.startswith("Best kvroute row, kvroute-approx")
    assert peer.startswith("Best peer, sglang-router: hit rate 75.2%, TTFT p50 0.035 s")
    rows[0]["hit_rate"] = 0.74  # a point below: the higher hit rate wins
    assert results.routing_findings({"rows": rows})[1].startswith("Best peer, vllm-router:")
