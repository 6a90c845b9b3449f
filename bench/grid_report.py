"""Issue 20's routing grid judged and drawn: which policies a cell runs, its rows summarized (medians
of its runs), whether each kvroute mode leads the best peer and on what it trails, the tables and the
plots. Pure functions over the cells' files and summaries: ``bench.grid`` runs the cells,
``bench.results`` renders an imported grid with these."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import report
from bench.loadgen import percentile
from bench.pd_floor import floor_seconds
from bench.plots import _plt, _save
from bench.sim.profiles import get_profile

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
# The detail table's columns from the pods' per-request figures (``report.ttft_parts``), where a run has them.
PARTS = (("pod_ttft_p50_s", "pods' TTFT p50 s", "{:.4f}"), ("path_ttft_p50_s", "path p50 s", "{:.4f}"))
ERROR_SLACK = 0.01  # a peer failing more of a cell's requests than this is not compared (``serves``)


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


def serves(row: Mapping[str, Any]) -> bool:
    """A router that answered (nearly) every request: one refusing more than ``ERROR_SLACK`` of them is not
    a best peer, its figures being those of the requests it took (sglang-router refuses a Codex session's
    later turns: its TTFT is then the first turns' alone)."""
    return (row.get("errors") or 0) <= ERROR_SLACK * (row.get("requests") or 0)


def best_peer(rows: Sequence[Mapping[str, Any]], key: str = "ttft_p50_s") -> Mapping[str, Any] | None:
    """The peer with the lowest ``key`` (the highest for hit_rate and output_tok_s) among those that served
    the workload."""
    peers = [r for r in _ok(rows) if is_peer(r["policy"]) and r.get(key) is not None and serves(r)]
    if not peers:
        return None
    higher_better = key in ("hit_rate", "output_tok_s")
    return (max if higher_better else min)(peers, key=lambda r: r[key])


def close(rows: Sequence[Mapping[str, Any]], within: float = 0.10) -> bool:
    """A kvroute mode and the best peer within ``within`` (relative to the peer) on TTFT p50 or p90,
    or a kvroute hit rate less than ``HIT_SLACK`` from the target line (the best peer's less ``HIT_SLACK``;
    one at the best peer's own, as when every router reaches the ideal, is not): too close for one run to
    say which leads or whether the target holds, so the cell gets medians of several."""
    for key in ("ttft_p50_s", "ttft_p90_s"):
        peer = best_peer(rows, key)
        if peer is None or not peer[key]:
            continue
        for r in _ok(rows):
            if is_kvroute(r["policy"]) and r.get(key) is not None and abs(r[key] - peer[key]) <= within * peer[key]:
                return True
    peer = best_peer(rows, "hit_rate")
    if peer is not None:
        line = peer["hit_rate"] - HIT_SLACK
        for r in _ok(rows):
            if is_kvroute(r["policy"]) and r.get("hit_rate") is not None and abs(r["hit_rate"] - line) < HIT_SLACK:
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
                out.append(f"{name} {_pct(row[key], peer[key])} vs {peer['policy']}{_where(row, peer, name)}")
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


def _where(row: Mapping[str, Any], peer: Mapping[str, Any], name: str) -> str:
    """Where a TTFT percentile's gap went, from the per-request records (``report.ttft_parts``) of both
    rows: the pods' own TTFT and the path (client, proxy, router hop and decision), each at that
    percentile over requests (medians of the cell's runs). Percentiles do not add, so the two need not sum
    to the gap; the one that carries it shows whether the pods (routing) or the path lost it."""
    gaps = []
    for label, key in (("pods", "pod_ttft"), ("path", "path_ttft")):
        ours, theirs = row.get(f"{key}_{name}_s"), peer.get(f"{key}_{name}_s")
        if ours is None or theirs is None:
            return ""
        gaps.append(f"{label} {1e3 * (ours - theirs):+.1f} ms")
    return " (" + ", ".join(gaps) + ")"


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
    keep = {k for k, _, _ in (*report.COLUMNS, *PARTS)} | {"failed", "repeats", "spread", "contended", "other_cores"}
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
    cols: tuple[tuple[str, str, str], ...] = (
        ("ttft_p50_s", "TTFT p50 s", "{:.3f}"), ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
        ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("hit_rate", "hit rate", "{:.1%}"),
        ("output_tok_s", "output tok/s", "{:.0f}"), ("errors", "errors", "{}"))  # fmt: skip
    if any(r.get(k) is not None for c in cells for r in c["rows"] for k, _, _ in PARTS):
        cols = (*cols, *PARTS)  # runs with the pods' per-request figures: where each TTFT went
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


def plot_workload(
    ax_row: Sequence[Any], cells: Sequence[Mapping[str, Any]], pods: Sequence[int], order: Sequence[str] = ()
) -> None:
    """TTFT p50 (solid) and p90 (dashed) against load, a line per router, one axis per pod count; a router
    keeps its colour (its place in ``order``, then in the cells) from one axis to the next. A cell where a
    router refused requests (``serves``) is not drawn for it: its figures are those of what it served."""
    colors = {
        p: f"C{i % 10}" for i, p in enumerate(dict.fromkeys([*order, *(r["policy"] for c in cells for r in c["rows"])]))
    }
    for ax, n in zip(ax_row, pods, strict=True):
        mine = sorted((c for c in cells if c["pods"] == n), key=lambda c: c["load"])
        if not mine:  # a grid that ran this workload on fewer pod counts than others
            ax.set_axis_off()
            continue
        policies = list(dict.fromkeys(r["policy"] for c in mine for r in c["rows"]))
        for policy in policies:
            color = colors[policy]
            refused = any(r["policy"] == policy and not serves(r) for c in mine for r in c["rows"])
            for key, style in (("ttft_p50_s", "-"), ("ttft_p90_s", "--")):
                pts = [(c["load"], r) for c in mine for r in c["rows"]
                       if r["policy"] == policy and r.get(key) and serves(r)]  # fmt: skip
                if not pts:
                    if refused and key == "ttft_p50_s":
                        ax.plot([], [], style, color=color, label=f"{policy}: refused requests, not drawn")
                    continue
                xs, ys = [x for x, _ in pts], [r[key] for _, r in pts]
                label = None if key != "ttft_p50_s" else f"{policy} p50" + (" (refusing cells not drawn)" * refused)
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
               title=f"{mine[0]['workload']}, {n} pods", yscale="log")  # fmt: skip
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)


def plot(cells: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """One PNG per workload under ``out``."""

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
