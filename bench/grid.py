"""``python -m bench grid`` (``make bench-routing``): issue 20's routing grid, resumable.

Every workload (shared-prefix, multi-turn, no-reuse, both Mooncake traces twice: one session in
10 over the whole trace, and the unsampled first N requests; and coding-agent sessions over the
Anthropic Messages API, ``agentic``, the same conversations as chat requests, ``agentic-chat``, and as
Codex sends them over the OpenAI Responses API, ``agentic-responses``)
at every load (0.5, 0.7, 0.9 of the
capacity calibrated once per workload and pod count) on 4 and 8 simulated pods, with kvroute in both
modes beside the peer routers (sglang-router, vllm-router cache_aware and consistent_hash; on
no-reuse also Envoy least-request and round robin, the references there). A cell (workload, pods,
load) runs every policy on the same arrivals, each on a fresh fleet (``python -m bench run``'s
harness), into ``OUT/<workload>/pods<P>/load<L>/run-1/``.

Resumable: a run whose ``results.json`` exists is kept (``--force`` redoes the selected cells).
After the single runs, every cell where a kvroute mode and the best peer are within ``--close``
(10 %) of each other on TTFT p50 or p90, or a kvroute mode's hit rate is less than half a point from
the hit target (the best peer's less half a point, below the best peer's own: one run's spread there
decides the verdict), is run again up to ``--confirm-runs`` (3) times, and its
figures become medians with their min-max.

Output: ``OUT/summary.md`` (one row per cell: best peer, whether each kvroute mode leads and on
what it trails, the infinite-cache ideal hit rate, a capacity-bounded one from one LRU cache of the
whole fleet's KV blocks, and a TTFT floor from each request alone on an idle pod prefilling what the
cell's best run left uncached; then every policy's TTFT p50/p90/p99 and hit rate per cell),
``OUT/summary.json`` (what ``--results NAME`` imports for bench/RESULTS.md) and
``OUT/plots/<workload>.png`` (TTFT p50 and p90 against load, a line per router, a panel per pod count).

Bounds for a 2-core host: each cell runs the pods ``--time-scale-per-pod × pods`` times slower (at
least 1: 4 pods at 1, 8 at 2), so the host handles the same requests per second at 8 pods as at 4;
request counts per workload are in ``WORKLOADS`` (``--max-requests`` overrides them). ``--quick``
is a smoke subset (two workloads, 4 pods, load 0.7, few requests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import workloads
from bench.grid_report import (
    CLOSE,
    LOADS,
    PODS,
    QUICK_REQUESTS,
    QUICK_WORKLOADS,
    cell_dir,
    close,
    done_runs,
    findings,
    plot,
    policies_for,
    summarize_cell,
    summary_tables,
    time_scale,
)
from bench.sim.profiles import PROFILES, get_profile

SIM_PROCS_HELP = ("one simulator process per pod (as vLLM pods each have their own API server) instead of one "
                  "for the fleet, whose event loop reads and tokenizes a burst's prompts one after another; "
                  "not for the P/D policies")  # fmt: skip


@dataclass(frozen=True)
class GridWorkload:
    name: str
    scenario: str | None = None
    trace: str | None = None  # a file under --traces
    sample: int = 1  # traces: one session in N (1: the first N requests as they come)
    requests: int = 250


CONVERSATION, SYNTHETIC = "mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"
WORKLOADS: dict[str, GridWorkload] = {
    w.name: w
    for w in (
        GridWorkload("shared-prefix", scenario="shared-prefix", requests=300),
        GridWorkload("multi-turn", scenario="multi-turn", requests=288),
        GridWorkload("no-reuse", scenario="no-reuse", requests=300),
        GridWorkload("mooncake-conversation", trace=CONVERSATION, sample=10),
        GridWorkload("mooncake-conversation-head", trace=CONVERSATION),
        GridWorkload("mooncake-synthetic", trace=SYNTHETIC, sample=10),
        GridWorkload("mooncake-synthetic-head", trace=SYNTHETIC),
        GridWorkload("agentic", scenario="agentic", requests=256),
        GridWorkload("agentic-chat", scenario="agentic-chat", requests=256),
        GridWorkload("agentic-responses", scenario="agentic-responses", requests=256),
    )
}


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class Grid:
    out: Path
    workloads: list[str]
    pods: list[int]
    loads: list[float]
    policies: list[str] | None = None
    max_requests: int | None = None
    traces: Path = Path("../shared/traces")
    profile: str = "h100-llama8b"
    time_scale_per_pod: float = 0.25
    calib_requests: int = 160
    quiet_wait: float = 30.0
    confirm_runs: int = 3
    close_within: float = CLOSE
    force: bool = False
    seed: int = 0
    kvroute_config: str | None = None
    sim_procs: bool = False
    command: str = ""

    def cells(self) -> list[tuple[str, int, float]]:
        return [(w, n, load) for w in self.workloads for n in self.pods for load in self.loads]


def build_workload(g: Grid, name: str) -> workloads.Workload:
    spec = WORKLOADS[name]
    n = g.max_requests or spec.requests
    if spec.trace is None:
        return workloads.build(spec.scenario, None, n, seed=g.seed)
    out_tokens = 64
    kw = {"sample": spec.sample, "max_output_tokens": out_tokens,
          "max_input_tokens": workloads.max_input_tokens(get_profile(g.profile).max_model_len, out_tokens)}  # fmt: skip
    w = workloads.build(None, str(g.traces / spec.trace), n, seed=g.seed, **kw)
    return replace(w, name=name)


def _config(g: Grid, name: str, pods: int, **kw: Any) -> Any:
    from bench import harness

    return harness.RunConfig(
        policies=policies_for(name, g.policies), pods=pods, profile=g.profile,
        time_scale=time_scale(pods, g.time_scale_per_pod), seed=g.seed, calib_requests=g.calib_requests,
        quiet_wait=g.quiet_wait, chars_per_token="auto", kvroute_config=g.kvroute_config, sim_procs=g.sim_procs,
        command=g.command, **kw,
    )  # fmt: skip


def workload_info(g: Grid, name: str, pods: int, w: workloads.Workload) -> dict[str, Any]:
    """Capacity (calibrated once per workload and pod count, kept in OUT/<workload>/pods<P>/workload.json)
    and the two ideal hit rates; reused by every load and every later (resumed) grid."""
    from bench import harness

    path = g.out / name / f"pods{pods}" / "workload.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    prof = get_profile(g.profile)
    info: dict[str, Any] = {"workload": name, "params": w.params, "requests": len(w.items), "profile": g.profile}
    info.update(harness.calibrate(_config(g, name, pods), w.items))
    info["ideal_hit_rate"] = workloads.ideal_hit_rate(w.items, prof.block_size)["hit_rate"]
    bounded = workloads.ideal_hit_rate(w.items, prof.block_size, capacity_blocks=pods * prof.capacity_blocks)
    info["bounded_ideal_hit_rate"] = bounded["hit_rate"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1))
    return info


def run_cell(g: Grid, name: str, pods: int, load: float, w: workloads.Workload, info: Mapping[str, Any],
             k: int) -> None:  # fmt: skip
    """Run ``k`` of a cell: every policy at ``load`` × the calibrated capacity, fresh fleets."""
    from bench import harness

    out = harness.run_dir(cell_dir(g.out, name, pods, load), k)
    cfg = _config(g, name, pods, rate=load * info["capacity_rps"], out=out)
    harness.run(cfg, w)


def grid_run(g: Grid) -> list[dict[str, Any]]:
    """Single runs of every missing cell, then the close cells up to ``confirm_runs``; the summaries."""
    from tqdm import tqdm

    cells = g.cells()
    if g.force:
        for name, pods, load in cells:
            shutil.rmtree(cell_dir(g.out, name, pods, load), ignore_errors=True)
    built: dict[str, workloads.Workload] = {}
    infos: dict[tuple[str, int], dict[str, Any]] = {}

    def prepare(name: str, pods: int) -> tuple[workloads.Workload, dict[str, Any]]:
        if name not in built:
            built[name] = build_workload(g, name)
        if (name, pods) not in infos:
            infos[name, pods] = workload_info(g, name, pods, built[name])
        return built[name], infos[name, pods]

    todo = [c for c in cells if 1 not in done_runs(cell_dir(g.out, *c))]
    bar = tqdm(total=len(todo), desc="grid: single runs", unit="cell", position=0)
    for name, pods, load in todo:
        bar.set_postfix_str(f"{name} {pods} pods load {load:g}")
        w, info = prepare(name, pods)
        run_cell(g, name, pods, load, w, info, 1)
        bar.update()
    bar.close()
    # Close cells: medians of confirm_runs (the rows of every finished run count).
    again: list[tuple[str, int, float, int]] = []
    for name, pods, load in cells:
        cell = cell_dir(g.out, name, pods, load)
        have = done_runs(cell)
        if have and len(have) < g.confirm_runs and close(_single_rows(cell, have[0]), g.close_within):
            again += [(name, pods, load, k) for k in range(1, g.confirm_runs + 1) if k not in have]
    bar = tqdm(total=len(again), desc=f"grid: close cells to {g.confirm_runs} runs", unit="run", position=0)
    for name, pods, load, k in again:
        bar.set_postfix_str(f"{name} {pods} pods load {load:g} run {k}")
        w, info = prepare(name, pods)
        run_cell(g, name, pods, load, w, info, k)
        bar.update()
    bar.close()
    return [summarize_cell(cell_dir(g.out, n, p, load), infos.get((n, p)) or _info(g, n, p), n, p, load)
            for n, p, load in cells if done_runs(cell_dir(g.out, n, p, load))]  # fmt: skip


def _single_rows(cell: Path, k: int) -> list[dict[str, Any]]:
    return list(json.loads((cell / f"run-{k}" / "results.json").read_text()))


def _info(g: Grid, name: str, pods: int) -> dict[str, Any]:
    path = g.out / name / f"pods{pods}" / "workload.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def write_summary(g: Grid, cells: Sequence[Mapping[str, Any]]) -> Path:
    """summary.json, summary.md and the plots; ``elapsed_s`` adds up every run's own time (resumed
    or not; calibrations, a few minutes in all, not included)."""
    from bench import results

    meta = {"command": g.command, "code": results.code_version(), "profile": g.profile,
            "time_scale_per_pod": g.time_scale_per_pod, "confirm_runs": g.confirm_runs,
            "close_within": g.close_within, "elapsed_s": round(sum(c["elapsed_s"] for c in cells), 1)}  # fmt: skip
    (g.out / "summary.json").write_text(json.dumps({"meta": meta, "cells": list(cells)}, indent=1))
    lines = [f"# Routing grid ({len(cells)} cells)", "", f"Reproduce: `{g.command}`", ""]
    lines += [f"- {f}" for f in findings(cells)] + ["", summary_tables(cells), ""]
    lines += [f"![{w}](plots/{w}.png)" for w in dict.fromkeys(c["workload"] for c in cells)]
    path = g.out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    plot(cells, g.out / "plots")
    return path


def _floats(spec: str) -> list[float]:
    try:
        return [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bench grid: {spec!r} is not a comma-separated list of numbers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench grid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of: " + ", ".join(WORKLOADS))
    ap.add_argument("--pods", default=",".join(map(str, PODS)), help="comma list of pod counts")
    ap.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="comma list of loads")
    ap.add_argument("--policies", default=None, help="comma list instead of each workload's own (see the description)")
    ap.add_argument("--max-requests", type=int, default=None, help="requests per workload (default: WORKLOADS')")
    ap.add_argument(
        "--kvroute-config",
        default=None,
        metavar="YAML",
        help="kvroute YAML (routing...) for the kvroute policies; the run's pods and scrape are added",
    )
    ap.add_argument("--calib-requests", type=int, default=160, help="requests in each capacity calibration")
    ap.add_argument("--traces", type=Path, default=Path("../shared/traces"), help="the Mooncake trace files")
    ap.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES), help="simulated pod profile")
    ap.add_argument("--time-scale-per-pod", type=float, default=0.25,
                    help="pods run max(1, this x pods) times slower (figures in pod time)")  # fmt: skip
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="s to wait for a quiet host before each policy")
    ap.add_argument("--confirm-runs", type=int, default=3, help="runs of a close cell (medians)")
    ap.add_argument("--close", type=float, default=CLOSE, help="relative TTFT p50/p90 gap that counts as close")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke subset: {', '.join(QUICK_WORKLOADS)} (unless --workloads), 4 pods, load 0.7, "
                    f"{QUICK_REQUESTS} requests unless --max-requests, at most 40 calibration requests")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="redo the selected cells (their calibration is kept)")
    ap.add_argument("--sim-procs", action="store_true", help=SIM_PROCS_HELP)
    ap.add_argument("--summary-only", action="store_true", help="only rewrite the summary and plots from OUT")
    ap.add_argument("--results", default=None, metavar="NAME",
                    help="then import the summary as bench/results/NAME.json (kind grid)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("bench/out/grid"), help="output directory")
    return ap


def grid_from_args(a: argparse.Namespace, argv: Sequence[str]) -> Grid:
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    pods = [int(x) for x in _floats(a.pods)]
    loads = _floats(a.loads)
    n = a.max_requests
    if a.quick:
        names = list(QUICK_WORKLOADS) if a.workloads == build_parser().get_default("workloads") else names
        pods, loads = [4], [0.7]
        n = n or QUICK_REQUESTS
        a.calib_requests = min(a.calib_requests, 40)
    unknown = [x for x in names if x not in WORKLOADS]
    if unknown:
        raise SystemExit(f"bench grid: unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    if not names or not pods or not loads or a.confirm_runs < 1:
        raise SystemExit("bench grid: workloads, pods and loads must not be empty; --confirm-runs >= 1")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()] if a.policies else None
    return Grid(out=a.out, workloads=names, pods=pods, loads=loads, policies=policies, max_requests=n,
                traces=a.traces, profile=a.profile, time_scale_per_pod=a.time_scale_per_pod,
                calib_requests=a.calib_requests, quiet_wait=a.quiet_wait, confirm_runs=a.confirm_runs,
                close_within=a.close, force=a.force, kvroute_config=a.kvroute_config, sim_procs=a.sim_procs,
                command="python -m bench grid " + " ".join(argv))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    g = grid_from_args(a, argv)
    t0 = time.monotonic()
    if a.summary_only:
        old = g.out / "summary.json"
        if old.exists():  # the command that ran the cells, not this rerendering
            g.command = json.loads(old.read_text()).get("meta", {}).get("command") or g.command
        cells = [summarize_cell(cell_dir(g.out, n, p, load), _info(g, n, p), n, p, load)
                 for n, p, load in g.cells() if done_runs(cell_dir(g.out, n, p, load))]  # fmt: skip
    else:
        from bench import harness

        harness.stop_on_sigterm()
        try:
            cells = grid_run(g)
        except KeyboardInterrupt:
            print("\nbench grid: interrupted; finished runs are kept, the same command resumes", file=sys.stderr)
            return 130
    if not cells:
        print("bench grid: no finished cells under " + str(g.out), file=sys.stderr)
        return 2
    path = write_summary(g, cells)
    print(path.read_text())
    print(f"wrote {path}, {g.out / 'summary.json'}, {g.out / 'plots'}/ in {time.monotonic() - t0:.0f} s")
    if a.results:
        from bench import results

        dest = results.import_run(g.out, a.results, kind="grid")
        print(
            f"wrote {dest}; bench/RESULTS.md shows it once it has the block "
            f"'<!-- bench.results: {a.results} -->' ... '<!-- /bench.results: {a.results} -->': "
            "then run `python -m bench.results` (make results)"
        )
    return 0
