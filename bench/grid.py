"""``python -m bench grid`` (``make bench-routing``): issue 20's routing grid, resumable.

Every workload (shared-prefix, multi-turn, no-reuse, and both Mooncake traces twice: one session in
10 over the whole trace, and the unsampled first N requests) at every load (0.5, 0.7, 0.9 of the
capacity calibrated once per workload and pod count) on 4 and 8 simulated pods, with kvroute in both
modes beside the peer routers (sglang-router, vllm-router cache_aware and consistent_hash; on
no-reuse also Envoy least-request and round robin, the references there). A cell (workload, pods,
load) runs every policy on the same arrivals, each on a fresh fleet (``python -m bench run``'s
harness), into ``OUT/<workload>/pods<P>/load<L>/run-1/``.

Resumable: a run whose ``results.json`` exists is kept (``--force`` redoes the selected cells).
After the single runs, every cell where a kvroute mode and the best peer are within ``--close``
(10 %) of each other on TTFT p50 or p90 is run again up to ``--confirm-runs`` (3) times, and its
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import report, workloads
from bench.loadgen import percentile
from bench.pd_floor import floor_seconds
from bench.sim.profiles import PROFILES, get_profile


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
    )
}
KVROUTE = ("kvroute-approx", "kvroute-precise")
PEERS = ("sglang-router", "vllm-router", "vllm-router:consistent_hash")
LEAST_LOADED = "least-request"
REFERENCES: dict[str, tuple[str, ...]] = {"no-reuse": (LEAST_LOADED, "round-robin")}
LOADS, PODS = (0.5, 0.7, 0.9), (4, 8)
QUICK_WORKLOADS, QUICK_REQUESTS = ("multi-turn", "mooncake-conversation"), 40  # --quick: 4 pods, load 0.7
CLOSE = 0.10  # a kvroute mode and the best peer this close (TTFT p50 or p90): medians of several runs

# Issue 20's targets.
HIT_SLACK = 0.005  # hit rate ≥ the best peer's − 0.5 points
TAIL_LOAD, TAIL_RATIO = 0.9, 0.8  # at load 0.9, TTFT p99 ≤ 0.8 × the best peer's
LEAST_LOADED_SLACK = 0.03  # no-reuse: within 3 % of least-loaded on throughput and TTFT


def is_peer(policy: str) -> bool:
    return policy.partition(":")[0] in ("sglang-router", "vllm-router")


def is_kvroute(policy: str) -> bool:
    return policy.startswith("kvroute-")


def policies_for(workload: str, policies: Sequence[str] | None = None) -> list[str]:
    """What a cell of ``workload`` runs: kvroute's modes, the peers and the workload's references."""
    return list(policies) if policies else [*KVROUTE, *PEERS, *REFERENCES.get(workload, ())]


def time_scale(pods: int, per_pod: float) -> float:
    return max(1.0, per_pod * pods)


def cell_dir(out: Path, workload: str, pods: int, load: float) -> Path:
    return out / workload / f"pods{pods}" / f"load{load:g}"


def done_runs(cell: Path) -> list[int]:
    """The runs (1, 2, ...) of a cell that finished: their results.json exists."""
    return sorted(int(p.parent.name.removeprefix("run-")) for p in cell.glob("run-*/results.json")
                  if p.parent.name.removeprefix("run-").isdigit())  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Pure judgement of a cell's rows (median rows, one per policy)


def _ok(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if not r.get("failed") and r.get("ttft_p50_s") is not None]


def best_peer(rows: Sequence[Mapping[str, Any]], key: str = "ttft_p50_s") -> Mapping[str, Any] | None:
    """The peer with the lowest ``key`` (the highest for hit_rate and output_tok_s)."""
    peers = [r for r in _ok(rows) if is_peer(r["policy"]) and r.get(key) is not None]
    if not peers:
        return None
    higher_better = key in ("hit_rate", "output_tok_s")
    return (max if higher_better else min)(peers, key=lambda r: r[key])


def close(rows: Sequence[Mapping[str, Any]], within: float = 0.10) -> bool:
    """A kvroute mode and the best peer within ``within`` (relative to the peer) on TTFT p50 or p90:
    too close for one run to say which leads, so the cell gets medians of several."""
    for key in ("ttft_p50_s", "ttft_p90_s"):
        peer = best_peer(rows, key)
        if peer is None or not peer[key]:
            continue
        for r in _ok(rows):
            if is_kvroute(r["policy"]) and r.get(key) is not None and abs(r[key] - peer[key]) <= within * peer[key]:
                return True
    return False


def _pct(ours: float, theirs: float) -> str:
    return f"{100 * (ours / theirs - 1):+.0f} %" if theirs else "-"


def shortfalls(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], load: float) -> list[str] | None:
    """Where kvroute's ``row`` misses issue 20's targets against the best peer in ``rows`` (and, with
    least-request among them, against least-loaded): empty when it leads, None without a peer."""
    if row.get("failed") or row.get("ttft_p50_s") is None:
        return ["failed"]
    out: list[str] = []
    compared = False
    for key, name in (("ttft_p50_s", "p50"), ("ttft_p90_s", "p90")):
        peer = best_peer(rows, key)
        if peer is not None and row.get(key) is not None:
            compared = True
            if row[key] > peer[key]:
                out.append(f"{name} {_pct(row[key], peer[key])} vs {peer['policy']}")
    peer = best_peer(rows, "ttft_p99_s")
    p99 = row.get("ttft_p99_s")
    if load >= TAIL_LOAD and peer is not None and p99 is not None and p99 > TAIL_RATIO * peer["ttft_p99_s"]:
        out.append(f"p99 {p99 / peer['ttft_p99_s']:.2f}x {peer['policy']} (target {TAIL_RATIO:g}x)")
    peer = best_peer(rows, "hit_rate")
    if peer is not None and row.get("hit_rate") is not None and row["hit_rate"] < peer["hit_rate"] - HIT_SLACK:
        out.append(f"hit {100 * (row['hit_rate'] - peer['hit_rate']):+.1f} pt vs {peer['policy']}")
    ll = next((r for r in _ok(rows) if r["policy"] == LEAST_LOADED), None)
    if ll is not None:
        compared = True
        for key, name in (("ttft_p50_s", "p50"), ("ttft_p90_s", "p90")):
            if row.get(key) is not None and ll.get(key) and row[key] > (1 + LEAST_LOADED_SLACK) * ll[key]:
                out.append(f"{name} {_pct(row[key], ll[key])} vs {LEAST_LOADED}")
        tput, ll_tput = row.get("output_tok_s"), ll.get("output_tok_s")
        if tput is not None and ll_tput and tput < (1 - LEAST_LOADED_SLACK) * ll_tput:
            out.append(f"tok/s {_pct(tput, ll_tput)} vs {LEAST_LOADED}")
    return out if compared else None


def floor(requests: Iterable[Mapping[str, Any]], profile: str) -> dict[str, float | None]:
    """TTFT floor percentiles: each successful request alone on an idle pod, prefilling what it did
    not find cached in these (a run's per-request) records (bench.pd_floor's model, pod seconds)."""
    prof = get_profile(profile)
    floors = [floor_seconds(prof, int(q["prompt_tokens"]), int(q.get("cached_tokens") or 0))
              for q in requests if q.get("status") == 200 and q.get("prompt_tokens")]  # fmt: skip
    return {f"floor_{k}_s": percentile(floors, q) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


# ---------------------------------------------------------------------------------------------
# A cell from its files


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_cell(cell: Path, info: Mapping[str, Any], workload: str, pods: int, load: float) -> dict[str, Any]:
    """A cell's runs as one record: median rows per policy, the target checks, ideals and floor.
    ``info`` is the workload's calibration record (``capacity_rps``, ideal hit rates, profile)."""
    runs = done_runs(cell)
    per_run = [json.loads((cell / f"run-{k}" / "results.json").read_text()) for k in runs]
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for rows in per_run:
        for r in rows:
            by_policy.setdefault(r["policy"], []).append(r)
    rows = [report.median_row(v) if len(v) > 1 else v[0] for v in by_policy.values()]
    metas = [json.loads((cell / f"run-{k}" / "run.json").read_text()) for k in runs]
    meta = metas[0] if metas else {}
    out: dict[str, Any] = {
        "workload": workload, "pods": pods, "load": load, "runs": len(runs),
        "rate_rps": meta.get("rate_rps"), "requests": meta.get("requests"), "time_scale": meta.get("time_scale"),
        "ideal_hit_rate": info.get("ideal_hit_rate"), "bounded_ideal_hit_rate": info.get("bounded_ideal_hit_rate"),
        "close": close(rows), "elapsed_s": sum(m.get("elapsed_s") or 0.0 for m in metas),
    }  # fmt: skip
    peer = best_peer(rows)
    out["best_peer"] = None if peer is None else peer["policy"]
    out["shortfalls"] = {r["policy"]: shortfalls(r, rows, load) for r in rows if is_kvroute(r["policy"])}
    # The floor from the cell's best run (highest hit rate) and its per-request records.
    best: tuple[float, int, str] | None = None
    for k, run_rows in zip(runs, per_run, strict=True):
        for r in _ok(run_rows):
            if r.get("hit_rate") is not None and (best is None or r["hit_rate"] > best[0]):
                best = (r["hit_rate"], k, r["policy"])
    out["floor_from"] = None
    if best is not None:
        path = cell / f"run-{best[1]}" / f"{best[2]}.requests.jsonl"
        if path.exists():
            out.update(floor(_read_jsonl(path), info.get("profile", "h100-llama8b")))
            out["floor_from"] = f"{best[2]} run {best[1]}"
    keep = {k for k, _, _ in report.COLUMNS} | {"failed", "repeats", "spread", "contended", "other_cores"}
    out["rows"] = [{k: v for k, v in r.items() if k in keep} for r in rows]
    return out


# ---------------------------------------------------------------------------------------------
# Rendering


def _leads_cell(short: list[str] | None) -> str:
    if short is None:
        return "no peer ran"
    if short == ["failed"]:
        return "failed to run"
    return "**leads**" if not short else "trails: " + "; ".join(short)


def summary_tables(cells: Sequence[Mapping[str, Any]]) -> str:
    """The cell table (judgement, ideals, floor) and the policy table (every policy's figures)."""
    modes = sorted({p for c in cells for p in c["shortfalls"]}, key=lambda p: (p not in KVROUTE, p))
    head = ["workload", "pods", "load", "runs", "req/s", "ideal hit", "bounded ideal hit",
            "TTFT floor p50 / p90 s", "best peer (p50 / p90 s, hit)", *modes]  # fmt: skip
    body = []
    for c in cells:
        peer = next((r for r in c["rows"] if r["policy"] == c["best_peer"]), None)
        peer_s = "-" if peer is None else (
            f"{peer['policy']} ({report.cell(peer, 'ttft_p50_s', '{:.3f}')} / "
            f"{report.cell(peer, 'ttft_p90_s', '{:.3f}')}, {report.cell(peer, 'hit_rate', '{:.1%}')})")  # fmt: skip
        body.append([c["workload"], str(c["pods"]), f"{c['load']:g}", str(c["runs"]),
                     report.cell(c, "rate_rps", "{:.2f}"), report.cell(c, "ideal_hit_rate", "{:.1%}"),
                     report.cell(c, "bounded_ideal_hit_rate", "{:.1%}"),
                     f"{report.cell(c, 'floor_p50_s', '{:.3f}')} / {report.cell(c, 'floor_p90_s', '{:.3f}')}",
                     peer_s, *[_leads_cell(c["shortfalls"].get(m, ["not run"])) for m in modes]])  # fmt: skip
    cols = (("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
            ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("hit_rate", "hit rate", "{:.1%}"),
            ("output_tok_s", "output tok/s", "{:.0f}"), ("errors", "errors", "{}"))  # fmt: skip
    detail = []
    for c in cells:
        for r in c["rows"]:
            figures = ([f"failed to start: {r['failed']}"] + [""] * (len(cols) - 1) if r.get("failed")
                       else [report.cell_spread(r, k, f) for k, _, f in cols])  # fmt: skip
            detail.append([c["workload"], str(c["pods"]), f"{c['load']:g}", r["policy"], *figures])
    return "\n\n".join([_md(head, body), _md(["workload", "pods", "load", "policy", *[h for _, h, _ in cols]], detail)])


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def findings(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """How many cells each kvroute mode leads, and where the cells were too close for one run."""
    out = []
    for mode in sorted({p for c in cells for p in c["shortfalls"]}):
        judged = [c for c in cells if c["shortfalls"].get(mode) is not None]
        led = [c for c in judged if not c["shortfalls"][mode]]
        out.append(f"{mode} leads in {len(led)} of {len(judged)} cells with a peer.")
    medians = [c for c in cells if c["runs"] > 1]
    if medians:
        out.append(f"Cells where kvroute and the best peer were within {CLOSE:.0%} on TTFT p50 or p90 after one "
                   f"run: {len(medians)}, shown as medians of their runs (min–max).")  # fmt: skip
    return out


def plot_workload(ax_row: Sequence[Any], cells: Sequence[Mapping[str, Any]], pods: Sequence[int]) -> None:
    """TTFT p50 (solid) and p90 (dashed) against load, a line per router, one axis per pod count."""
    for ax, n in zip(ax_row, pods, strict=True):
        mine = sorted((c for c in cells if c["pods"] == n), key=lambda c: c["load"])
        policies = list(dict.fromkeys(r["policy"] for c in mine for r in c["rows"]))
        for i, policy in enumerate(policies):
            color = f"C{i % 10}"
            for key, style in (("ttft_p50_s", "-"), ("ttft_p90_s", "--")):
                pts = [(c["load"], r) for c in mine for r in c["rows"] if r["policy"] == policy and r.get(key)]
                if not pts:
                    continue
                xs, ys = [x for x, _ in pts], [r[key] for _, r in pts]
                label = f"{policy} p50" if key == "ttft_p50_s" else None
                ax.plot(xs, ys, style, marker="o", color=color, label=label, markersize=4)
                spread = [(r.get("spread") or {}).get(key) for _, r in pts]
                if any(spread):
                    lo = [y - (s[0] if s else y) for y, s in zip(ys, spread, strict=True)]
                    hi = [(s[1] if s else y) - y for y, s in zip(ys, spread, strict=True)]
                    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=color, alpha=0.5, capsize=2)
        floors = [(c["load"], c.get("floor_p50_s")) for c in mine if c.get("floor_p50_s") is not None]
        if floors:
            ax.plot([x for x, _ in floors], [y for _, y in floors], ":", marker="x", color="k", label="floor p50")
        ax.set(xlabel="load (fraction of calibrated capacity)", ylabel="TTFT s (solid p50, dashed p90)",
               title=f"{mine[0]['workload'] if mine else ''}, {n} pods", yscale="log")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)


def plot(cells: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """One PNG per workload under ``out``."""
    from bench.results import _plt, _save  # the project's Agg backend and save settings

    plt = _plt()
    paths = []
    for w in dict.fromkeys(c["workload"] for c in cells):
        mine = [c for c in cells if c["workload"] == w]
        pods = sorted({c["pods"] for c in mine})
        fig, axes = plt.subplots(1, len(pods), figsize=(6.5 * len(pods), 4.5), squeeze=False)
        plot_workload(axes[0], mine, pods)
        path = out / f"{w}.png"
        _save(fig, path)
        paths.append(path)
    return paths


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
        quiet_wait=g.quiet_wait, chars_per_token="auto", command=g.command, **kw,
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
                close_within=a.close, force=a.force, command="python -m bench grid " + " ".join(argv))  # fmt: skip


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
