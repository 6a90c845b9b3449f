"""``python -m bench.results``: bench/RESULTS.md's headline tables and plots, built from JSON.

Every headline lives in ``bench/results/<name>.json``: the command that produced it, the code it
ran on, the machine's load, and the figures. RESULTS.md holds a marked block per headline::

    <!-- bench.results: routing-multi-turn -->  ...rendered...  <!-- /bench.results: routing-multi-turn -->

``python -m bench.results`` rewrites every block from its JSON and redraws the plots in
``bench/plots/``; ``--check`` only says whether RESULTS.md is up to date. A benchmark's own output
drops in with one command (it rerenders too)::

    python -m bench.results import bench/out/multi-turn --as routing-multi-turn   # python -m bench run
    python -m bench.results import bench/out/pd-pareto --as pd                     # python -m bench.pd_sweep
    python -m bench.results import bench/out/overhead --as overhead                # python -m bench.overhead
    python -m bench.results import bench/out/index-memory.json --as index-memory   # bench.index_memory --json
    python -m bench.results import bench/out/replicas --as replicas --kind routing   # a name that doesn't say

    python -m bench.results import bench/out/grid --as grid                       # python -m bench grid
    python -m bench.results import bench/out/faults/faults.json --as faults       # python -m bench.faults

Kinds of headline (the JSON's ``kind``): routing, grid, pd, overhead, decision, index-memory,
sim-fidelity, real-vllm, gpu-check, and ``table`` (plain columns and rows, for anything else).
Routing rows from repeated runs (``bench run --repeat N``) are medians with ``repeats`` and a
``spread`` of [min, max] per figure, shown beside each figure; rows without them render as before.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import grid_report as grid
from bench import report
from bench.loadgen import percentile
from bench.plots import _plt, _save

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
PLOTS_DIR = ROOT / "bench" / "plots"
BLOCK = re.compile(r"<!-- bench\.results: (?P<name>[\w.-]+) -->\n.*?<!-- /bench\.results: (?P=name) -->", re.S)

Headline = dict[str, Any]


class ResultsError(Exception):
    """A headline JSON or RESULTS.md block that cannot be rendered; the message names it."""


# ---------------------------------------------------------------------------------------------
# Loading and the shared frame of every block


def load(path: Path) -> Headline:
    try:
        h = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ResultsError(f"{path}: {e}") from None
    for key in ("kind", "title", "command"):
        if key not in h:
            raise ResultsError(f"{path}: missing {key!r}")
    if h["kind"] not in KINDS:
        raise ResultsError(f"{path}: kind {h['kind']!r} is not one of {', '.join(sorted(KINDS))}")
    h.setdefault("name", path.stem)
    return h


def code_version(root: Path = ROOT) -> str:
    """The commit checked out (``+ uncommitted changes`` when tracked files differ), or ``unknown``."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"commit {commit}" + (" + uncommitted changes" if dirty else "")


def plot_path(h: Headline, plots: Path = PLOTS_DIR) -> Path:
    return plots / f"{h['name']}.png"


def render_block(h: Headline, plots: Path = PLOTS_DIR, md_dir: Path = RESULTS_MD.parent) -> str:
    """The markdown between a headline's markers: status, command, table, findings, plot, provenance."""
    kind = KINDS[h["kind"]]
    out: list[str] = []
    if h.get("pending"):
        out.append(f"> **Not measured yet.** {h.get('pending_reason', '')}".rstrip())
    elif h.get("stale"):
        out.append(f"> **Stale:** {h.get('stale_reason', 'measured on older code; rerun before quoting it.')}")
    if out:
        out.append("")
    out += [f"Reproduce: `{h['command']}`", ""]
    if not h.get("pending"):
        out += [kind.table(h), ""]
        findings = [*kind.findings(h), *h.get("notes", [])]
        if findings:
            out += [f"- {f}" for f in findings] + [""]
        if kind.plot is not None:
            rel = Path(os.path.relpath(plot_path(h, plots), md_dir)).as_posix()
            out += [f"![{h['title']}]({rel})", ""]
        for image in h.get("images", ()):  # PNGs a benchmark drew itself, copied beside the plots
            rel = Path(os.path.relpath(plots / image["file"], md_dir)).as_posix()
            out += [f"![{image['caption']}]({rel})", ""]
    prov = [f"{k}: {h[k]}" for k in ("code", "machine", "source") if h.get(k)]
    prov.append(f"figures: `bench/results/{h['name']}.json`")
    out.append("<sub>" + "; ".join(prov) + "</sub>")
    return "\n".join(out)


def _under(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
    except ValueError:
        return False
    return True


def render_markdown(
    text: str, headlines: Mapping[str, Headline], plots: Path = PLOTS_DIR, md_dir: Path = RESULTS_MD.parent
) -> str:
    """``text`` with every marked block rewritten from its headline; a block without one is an error."""

    def sub(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in headlines:
            raise ResultsError(f"RESULTS.md has a block for {name!r} but there is no bench/results/{name}.json")
        body = render_block(headlines[name], plots, md_dir)
        return f"<!-- bench.results: {name} -->\n{body}\n<!-- /bench.results: {name} -->"

    return BLOCK.sub(sub, text)


def fmt(v: Any, f: str) -> str:
    return "-" if v is None else f.format(v)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# routing: one workload, every policy side by side (``python -m bench run``)

ROUTING_COLUMNS = (*report.COLUMNS[:-1], ("load_imbalance", "imbalance", "{:.2f}"))


def routing_table(h: Headline) -> str:
    rows = h["rows"]
    runs = h.get("runs") or {}
    header = [c for _, c, _ in ROUTING_COLUMNS] + ["other work, cores"] + (["run"] if len(runs) > 1 else [])
    body = []
    for r in rows:
        if r.get("failed"):
            body.append([r["policy"], f"failed to start: {r['failed']}"] + [""] * (len(header) - 2))
            continue
        other = fmt(r.get("other_cores"), "{:.2f}") + (" (contended)" if r.get("contended") else "")
        cells = [report.cell_spread(r, k, f) for k, _, f in ROUTING_COLUMNS] + [other]
        body.append(cells + ([r.get("run", "")] if len(runs) > 1 else []))
    table = md_table(header, body)
    if parts := report.ttft_parts_table(rows):
        # Where each request's TTFT went (the simulated pods report their own part): medians over requests.
        table += f"\n\nWhere the TTFT went, medians over requests (path: the client's TTFT less the pod's):\n\n{parts}"
    if h.get("workload"):
        table = f"Workload: {h['workload']}\n\n{table}"
    if len(runs) > 1:
        table += "\n\nRuns:\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in runs.items())
    return table


HIT_TIE = 0.005  # hit rates this close are level (issue 20's tolerance): the lower TTFT p50 is then the best


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The row with the lowest TTFT p50 among those within ``HIT_TIE`` of the highest hit rate (the third
    decimal of a hit rate is noise, a millisecond at the median is not)."""
    top = max(r["hit_rate"] for r in rows)
    return min((r for r in rows if r["hit_rate"] >= top - HIT_TIE), key=lambda r: r.get("ttft_p50_s") or 1e9)


def routing_findings(h: Headline) -> list[str]:
    """kvroute against round robin and the best peer on hit rate and TTFT p50, computed from the rows."""
    ok = {r["policy"]: r for r in h["rows"] if not r.get("failed") and r.get("hit_rate") is not None}
    ours = [r for p, r in ok.items() if p.startswith("kvroute")]
    peers = [r for p, r in ok.items() if p.startswith(("sglang-router", "vllm-router"))]
    if not ours:
        return []
    best = _best(ours)
    ideal = best.get("ideal_hit_rate") or 0.0
    line = f"Best kvroute row, {best['policy']}: hit rate {best['hit_rate']:.1%}"
    line += f" ({best['hit_rate'] / ideal:.1%} of the ideal {ideal:.1%})" if ideal > 0 else ""
    rr = ok.get("round-robin")
    if rr is not None and rr.get("ttft_p50_s") and best.get("ttft_p50_s"):
        line += f"; TTFT p50 {best['ttft_p50_s']:.3f} s against round robin's {rr['ttft_p50_s']:.3f} s"
        line += (
            f" ({rr['ttft_p50_s'] / best['ttft_p50_s']:.1f}x lower)" if best["ttft_p50_s"] < rr["ttft_p50_s"] else ""
        )
    out = [line + "."]
    if peers:
        peer = _best(peers)
        out.append(
            f"Best peer, {peer['policy']}: hit rate {peer['hit_rate']:.1%}, TTFT p50 "
            f"{fmt(peer.get('ttft_p50_s'), '{:.3f}')} s, p99 {fmt(peer.get('ttft_p99_s'), '{:.3f}')} s "
            f"(kvroute's p99 {fmt(best.get('ttft_p99_s'), '{:.3f}')} s)."
        )
    return out


def routing_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    rows = [r for r in h["rows"] if not r.get("failed") and r.get("hit_rate") is not None]
    names = [r["policy"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.bar(names, [r["hit_rate"] for r in rows], color="tab:blue", label="measured (pods' counters)")
    if rows and rows[0].get("ideal_hit_rate") is not None:
        a1.axhline(rows[0]["ideal_hit_rate"], color="k", ls="--", label="ideal (one infinite cache)")
    a1.set(ylabel="prefix cache hit rate (tokens)", ylim=(0, 1), title="hit rate")
    a1.tick_params(axis="x", rotation=35, labelsize=8)
    a1.legend(fontsize=8)
    width = 0.27
    for i, (key, label) in enumerate((("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99"))):
        a2.bar([j + (i - 1) * width for j in range(len(rows))], [r.get(key) or 0 for r in rows], width, label=label)
    a2.set_xticks(range(len(rows)), names, rotation=35, fontsize=8)
    a2.set(yscale="log", ylabel="time to first token (s, log)", title="TTFT")
    a2.legend(fontsize=8)
    fig.suptitle(h["title"] + (" (stale)" if h.get("stale") else ""), fontsize=10)
    _save(fig, path)


def import_routing(src: Path) -> Headline:
    """A ``python -m bench run`` output directory (results.json + run.json) as a routing headline."""
    rows_in = json.loads((src / "results.json").read_text())
    meta = json.loads((src / "run.json").read_text()) if (src / "run.json").exists() else {}
    keep = {k for k, _, _ in (*report.COLUMNS, *report.TTFT_PARTS)} | {"failed", "other_cores", "contended", "repeats"}
    rows = []
    for r in rows_in:
        row = {k: v for k, v in r.items() if k in keep}
        if r.get("spread"):  # medians of repeated runs: each kept figure's [min, max]
            row["spread"] = {k: v for k, v in r["spread"].items() if k in keep}
        if r.get("pods"):
            row["requests_per_pod"] = [int(p["requests"]) for p in r["pods"]]
        rows.append(row)
    workload = ", ".join(f"{k}={v}" for k, v in (meta.get("workload") or {}).items())
    rate = meta.get("rate_rps")
    if rate is not None:
        how = (
            f"load {meta['load']} of a calibrated {meta['capacity_rps']:.1f} req/s"
            if "capacity_rps" in meta
            else "--rate"
        )
        workload += f"; {meta.get('requests', len(rows))} requests at {rate:.2f} req/s ({how})"
    if (meta.get("repeat") or 1) > 1:
        workload += f"; medians of {meta['repeat']} runs on the same arrivals, fresh fleets (min–max)"
    others = [r["other_cores"] for r in rows if r.get("other_cores") is not None]
    machine = meta.get("machine", "")
    if others:
        n = sum(bool(r.get("contended")) for r in rows)
        machine += (
            f"; other work on the host {min(others):.2f}–{max(others):.2f} cores, {n} of {len(rows)} rows contended"
        )
    return {
        "kind": "routing",
        "title": f"Routing on {meta.get('scenario', src.name)}",
        "command": meta.get("command") or "",
        "code": meta.get("code") or code_version(),
        "machine": machine.lstrip("; "),
        "source": f"imported from {_rel(src)}/results.json",
        "stale": False,
        "workload": workload.lstrip(", "),
        "rows": rows,
    }


def _rel(p: Path) -> str:
    p = p.resolve()
    return p.relative_to(ROOT).as_posix() if _under(p, ROOT) else p.name


# ---------------------------------------------------------------------------------------------
# grid: issue 20's routing grid, one row per cell (``python -m bench grid``)


def grid_table(h: Headline) -> str:
    return grid.summary_tables(h["cells"])


def grid_findings(h: Headline) -> list[str]:
    return grid.findings(h["cells"])


def grid_plot(h: Headline, path: Path) -> None:
    """A row of panels per workload (one per pod count): TTFT p50/p90 against load, a line per router."""
    plt = _plt()
    names = list(dict.fromkeys(c["workload"] for c in h["cells"]))
    pods = sorted({c["pods"] for c in h["cells"]})
    fig, axes = plt.subplots(len(names), len(pods), figsize=(6.5 * len(pods), 4.2 * len(names)), squeeze=False)
    order = list(dict.fromkeys(r["policy"] for c in h["cells"] for r in c["rows"]))  # one colour per router
    for row, name in zip(axes, names, strict=True):
        grid.plot_workload(row, [c for c in h["cells"] if c["workload"] == name], pods, order)
    fig.suptitle(h["title"] + (" (stale)" if h.get("stale") else ""), fontsize=10)
    _save(fig, path)


def import_grid(src: Path) -> Headline:
    """A ``python -m bench grid`` output (its summary.json) as one headline."""
    saved = json.loads((src / "summary.json").read_text() if src.is_dir() else src.read_text())
    meta = saved.get("meta", {})
    took = f"; the grid took {meta['elapsed_s'] / 60:.0f} min" if meta.get("elapsed_s") else ""
    return {
        "kind": "grid",
        "title": "Routing grid: every workload, load and pod count",
        "command": meta.get("command") or "",
        "code": meta.get("code") or code_version(),
        "machine": f"{os.cpu_count()} CPU cores, no GPU (simulated {meta.get('profile', '')} pods){took}",
        "source": f"imported from {_rel(src)}",
        "stale": False,
        "cells": saved["cells"],
    }


def _cell_key(c: Mapping[str, Any]) -> tuple[str, int, float]:
    return (c["workload"], int(c["pods"]), float(c["load"]))


def merge_grid(old: Headline, new: Headline) -> Headline:
    """``old``'s grid with ``new``'s cells in place of its cells of the same workload, pods and load
    (cells ``old`` lacks are added), in order of workload (as ``old`` lists them), pods and load. Title, notes and the
    kept cells' provenance stay; ``code``, ``machine`` and ``source`` say which cells came from where."""
    fresh = {_cell_key(c): c for c in new["cells"]}
    cells = [c for c in old["cells"] if _cell_key(c) not in fresh] + list(fresh.values())
    order: dict[str, int] = {}
    for c in (*old["cells"], *new["cells"]):  # workloads as the old grid lists them, new ones after
        order.setdefault(c["workload"], len(order))
    cells.sort(key=lambda c: (order[c["workload"]], *_cell_key(c)[1:]))
    if len(cells) == len(fresh):  # nothing of the old grid is left
        return {**new, "title": old.get("title", new["title"]), "notes": old.get("notes", [])}
    which = ", ".join(sorted({c["workload"] for c in fresh.values()}))
    pods = "/".join(str(p) for p in sorted({int(c["pods"]) for c in fresh.values()}))
    loads = ", ".join(f"{x:g}" for x in sorted({float(c["load"]) for c in fresh.values()}))
    scope = f"{which} on {pods} pods at {loads}"

    def both(key: str) -> str:
        return f"{scope}: {new[key]}; the other cells: {old[key]}"

    return {**old, "code": both("code"), "machine": both("machine"), "source": both("source"),
            "command": old["command"], "stale": False, "cells": cells}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# pd: never / always / conditional / vllm-router's P/D mode on the same pods, a Pareto target

PD_COLUMNS = (
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("itl_p50_s", "ITL p50 ms", "{:.1f}"),
    ("itl_p99_s", "ITL p99 ms", "{:.1f}"),
    ("itl_p999_s", "ITL p99.9 ms", "{:.1f}"),
    ("output_tok_s", "out tok/s", "{:.0f}"),
    ("errors", "errors", "{}"),
)
MS = {"itl_p50_s", "itl_p99_s", "itl_p999_s"}


def _pd_cell(r: Mapping[str, Any], key: str, f: str) -> str:
    v = r.get(key)
    scale = 1e3 if key in MS else 1.0
    text = fmt(v * scale if v is not None and key in MS else v, f)
    rng = r.get(key.removesuffix("_s") + "_range")
    if rng:
        text += f" ({f.format(rng[0] * scale)}–{f.format(rng[1] * scale)})"
    return f"**{text}**" if r.get("policy") == "conditional" and key in ("ttft_p99_s", "itl_p99_s") else text


def pd_table(h: Headline) -> str:
    header = ["policy", "pods (P:D:both)", *[c for _, c, _ in PD_COLUMNS]]
    body = [[r["label"], r["layout"], *[_pd_cell(r, k, f) for k, _, f in PD_COLUMNS]] for r in h["rows"]]
    return md_table(header, body)


def pd_target(h: Headline) -> list[tuple[str, bool, str]]:
    """Each conditional row against the Pareto target: (label, met, how), per pod layout.

    Met when, on the same pods, it beats always-split on TTFT p99, never-split on ITL p99 and
    vllm-router's P/D mode on both.
    """
    rows = h["rows"]
    never = next((r for r in rows if r["policy"] == "never"), None)
    out = []
    for c in (r for r in rows if r["policy"] == "conditional"):
        same = {r["policy"]: r for r in rows if r["layout"] == c["layout"]}
        checks: list[tuple[str, float, float]] = []  # (what, conditional, other): conditional must be lower
        if "always" in same:
            checks.append(("TTFT p99 vs always", c["ttft_p99_s"], same["always"]["ttft_p99_s"]))
        if never is not None:
            checks.append(("ITL p99 vs never", c["itl_p99_s"], never["itl_p99_s"]))
        if "vllm-router-pd" in same:
            v = same["vllm-router-pd"]
            checks += [
                ("TTFT p99 vs vllm-router-pd", c["ttft_p99_s"], v["ttft_p99_s"]),
                ("ITL p99 vs vllm-router-pd", c["itl_p99_s"], v["itl_p99_s"]),
            ]
        if not checks:
            continue
        how = ", ".join(f"{w} {100 * (a / b - 1):+.0f} %" for w, a, b in checks)
        out.append((f"{c['label']} ({c['layout']})", len(checks) == 4 and all(a < b for _, a, b in checks), how))
    return out


def pd_findings(h: Headline) -> list[str]:
    lines = []
    for label, met, how in pd_target(h):
        lines.append(f"Target {'**met**' if met else '**not met**'} by {label}: {how}.")
    return lines


def pd_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    markers = {"never": "s", "always": "^", "conditional": "o", "vllm-router-pd": "x"}
    layouts = sorted({r["layout"] for r in h["rows"]})
    colors = dict(zip(layouts, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for r in h["rows"]:
        x, y = r["itl_p99_s"] * 1e3, r["ttft_p99_s"]
        ax.plot(
            x,
            y,
            markers.get(r["policy"], "o"),
            color=colors[r["layout"]],
            markersize=9,
            label=f"{r['label']} ({r['layout']})",
        )
        xr, yr = r.get("itl_p99_range"), r.get("ttft_p99_range")
        if xr and yr:  # min-max over repeats
            ax.errorbar(
                x,
                y,
                xerr=[[x - xr[0] * 1e3], [xr[1] * 1e3 - x]],
                yerr=[[y - yr[0]], [yr[1] - y]],
                fmt="none",
                ecolor="grey",
                alpha=0.6,
                capsize=2,
            )
    ax.set(xlabel="ITL p99 (ms)", ylabel="TTFT p99 (s)")
    ax.set_title(
        "TTFT p99 against ITL p99 (lower left is better)" + (" (stale)" if h.get("stale") else ""), fontsize=10
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    _save(fig, path)


def import_pd(src: Path) -> Headline:
    """A ``python -m bench.pd_sweep`` output (its sweep.json) as P/D Pareto points."""
    saved = json.loads((src / "sweep.json").read_text() if src.is_dir() else src.read_text())
    meta = saved.get("meta", {})
    rows = []
    for p in saved["points"]:
        policy = p["label"].split()[0]
        split = p.get("pd_split") if policy != "never" else None
        row: dict[str, Any] = {
            "policy": policy,
            "label": p["label"].removesuffix(f" {split}") if split else p["label"],
            "layout": split or f"0:0:{meta.get('pods', 4)}",
        }
        for k, _, _ in PD_COLUMNS:
            row[k] = p.get(k)
        for k in ("ttft_p99_s", "itl_p99_s"):
            if k in p.get("spread", {}):
                row[k.removesuffix("_s") + "_range"] = list(p["spread"][k])
        rows.append(row)
    return {
        "kind": "pd",
        "title": saved.get("title", "P/D"),
        "command": meta.get("command") or "",
        "code": meta.get("code") or code_version(),
        "machine": meta.get("machine", ""),
        "source": f"imported from {_rel(src)}",
        "stale": False,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# overhead: Envoy alone vs + a no-op ext_proc vs + kvroute (``python -m bench.overhead``)


def overhead_table(h: Headline) -> str:
    own = any("own_cpu_ms_per_req" in r for r in h["rows"])  # variant runs: kvroute over its own floor
    header = [
        "req/s",
        "body",
        "router",
        "p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
        "proxy CPU ms/req",
        "ext_proc CPU ms/req",
        *(["own CPU ms/req", "own p50 ms"] if own else []),
        "errors",
    ]
    body = [
        [
            f"{r['rate']:.0f}",
            f"{r['body']}-token chat",
            r["router"],
            fmt(r["p50_ms"], "{:.2f}"),
            fmt(r["p99_ms"], "{:.2f}"),
            fmt(r.get("added_p50_ms"), "{:+.2f}"),
            fmt(r.get("added_p99_ms"), "{:+.2f}"),
            fmt(r["envoy_cpu_ms_per_req"], "{:.2f}"),
            fmt(r.get("extproc_cpu_ms_per_req"), "{:.2f}"),
            *([fmt(r.get("own_cpu_ms_per_req"), "{:+.2f}"), fmt(r.get("own_p50_ms"), "{:+.2f}")] if own else []),
            str(r["errors"]),
        ]
        for r in h["rows"]
    ]
    return md_table(header, body)


def overhead_floor(router: str) -> str:
    """The do-nothing server with a kvroute variant's options (``envoy+kvroute/uvloop`` → ``…noop-extproc/uvloop``)."""
    return OVERHEAD_NOOP + router.removeprefix(OVERHEAD_KVROUTE)


def overhead_findings(h: Headline) -> list[str]:
    by = {(r["rate"], r["body"], r["router"]): r for r in h["rows"]}
    out = []
    for (rate, body, router), r in by.items():
        noop = by.get((rate, body, overhead_floor(router))) or by.get((rate, body, OVERHEAD_NOOP))
        if router.startswith(OVERHEAD_KVROUTE) and noop and r.get("extproc_cpu_ms_per_req") is not None:
            extra = r["extproc_cpu_ms_per_req"] - noop["extproc_cpu_ms_per_req"]
            variant = "" if router == OVERHEAD_KVROUTE else f" ({router}, over {noop['router']})"
            out.append(
                f"{rate:.0f} req/s, {body}-token chat{variant}: kvroute adds {r['added_p50_ms']:+.2f} ms p50 / "
                f"{r['added_p99_ms']:+.2f} ms p99 over Envoy alone (a do-nothing grpcio processor: "
                f"{noop['added_p50_ms']:+.2f} / {noop['added_p99_ms']:+.2f} ms); "
                f"its own CPU over that floor {extra:+.2f} ms per request."
            )
    return out


def overhead_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    cases = sorted({(r["rate"], r["body"]) for r in h["rows"]})
    routers = list(dict.fromkeys(r["router"] for r in h["rows"] if r["router"] != OVERHEAD_PLAIN))
    by = {(r["rate"], r["body"], r["router"]): r for r in h["rows"]}
    width = 0.8 / max(1, len(routers))
    fig, axes = plt.subplots(1, 2, figsize=(11 + 0.6 * max(0, len(routers) - 2) * len(cases), 4))
    for ax, key, name in ((axes[0], "added_p50_ms", "added p50"), (axes[1], "added_p99_ms", "added p99")):
        for i, router in enumerate(routers):
            ax.bar(
                [j + (i - (len(routers) - 1) / 2) * width for j in range(len(cases))],
                [(by.get((rate, body, router)) or {}).get(key) or 0 for rate, body in cases],
                width,
                label=router,
            )
        ax.set_xticks(range(len(cases)), [f"{rate:.0f} req/s\n{body}-token" for rate, body in cases], fontsize=8)
        ax.set(ylabel="ms over Envoy alone", title=name)
        ax.legend(fontsize=8)
    fig.suptitle(h["title"] + (" (stale)" if h.get("stale") else ""), fontsize=10)
    _save(fig, path)


# bench.overhead's router names (``ROUTERS`` there: the three every run has), and its variants'.
OVERHEAD_PLAIN, OVERHEAD_NOOP, OVERHEAD_KVROUTE = "envoy", "envoy+noop-extproc", "envoy+kvroute"


def import_overhead(src: Path) -> Headline:
    """``bench.overhead``'s results.json: every router it ran (``--variants``: each ext_proc server and
    option, with kvroute's own CPU and p50 over the do-nothing server with the same options)."""
    res = json.loads((src / "results.json").read_text() if src.is_dir() else src.read_text())
    routers = res.get("routers") or [OVERHEAD_PLAIN, OVERHEAD_NOOP, OVERHEAD_KVROUTE]
    peers = res.get("peers") or []  # peer routers as full proxies (``--peers``): no ext_proc server
    rows = []
    for case in res["sizes"].values():
        for router in routers:
            r = case[router]
            row = {
                "rate": case["rate"],
                "body": case["body"],
                "router": router,
                "p50_ms": r["p50_ms"],
                "p99_ms": r["p99_ms"],
                "added_p50_ms": r.get("added_p50_ms"),
                "added_p99_ms": r.get("added_p99_ms"),
                "envoy_cpu_ms_per_req": r["envoy_cpu_ms_per_req"],
                "extproc_cpu_ms_per_req": (
                    r["extproc_cpu_ms_per_req"] if router != OVERHEAD_PLAIN and router not in peers else None
                ),
                "errors": case["errors"][router],
            }
            row.update({k: r[k] for k in ("own_cpu_ms_per_req", "own_p50_ms") if k in r})
            rows.append(row)
    # The variants as bench.overhead takes them (``envoy+kvroute/uvloop`` → ``kvroute/uvloop``).
    names = {OVERHEAD_NOOP: "noop", OVERHEAD_KVROUTE: "kvroute"}
    variants = [names[n.split("/")[0]] + n[len(n.split("/")[0]) :] for n in routers
                if n != OVERHEAD_PLAIN and n not in peers]  # fmt: skip
    cmd = (
        f"python -m bench.overhead --rates {','.join(f'{x:g}' for x in res['rates'])} "
        f"--duration {res['duration_s']:g} --rounds {res['rounds']}"
        + (f" --variants {','.join(variants)}" if "routers" in res else "")  # runs from before --variants: none
        + (f" --peers {','.join(peers)}" if peers else "")
        + f" --out {_rel(src)}"
    )
    return {
        "kind": "overhead",
        "title": "Router overhead through Envoy",
        "command": cmd,
        "code": code_version(),
        "machine": "",
        "source": f"imported from {_rel(src)}",
        "stale": False,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# decision: in-process decision latency (``python -m bench.decision``)


def decision_table(h: Headline) -> str:
    states = any(r.get("state") for r in h["rows"])
    pods = any("pods" in r for r in h["rows"])  # ``bench.decision --scale``: one row per pool size
    header = ["chats", "index", *(["state"] if states else []), *(["pods"] if pods else []), "cold p50 ms",
              "warm p50 ms", "warm p99 ms"]  # fmt: skip
    body = [
        [
            r["chats"],
            r["index"],
            *([r.get("state", "")] if states else []),
            *([str(r.get("pods", ""))] if pods else []),
            fmt(r["cold_p50_ms"], "{:.2f}"),
            fmt(r["warm_p50_ms"], "{:.2f}"),
            fmt(r["warm_p99_ms"], "{:.2f}"),
        ]
        for r in h["rows"]
    ]
    return md_table(header, body)


def decision_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    rows = h["rows"]
    names = [f"{r['chats']}\n{r['index']}" + (f"\n{r['state']}" if r.get("state") else "")
             + (f"\n{r['pods']} pods" if "pods" in r else "") for r in rows]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    for i, (key, label) in enumerate(
        (("cold_p50_ms", "cold p50"), ("warm_p50_ms", "warm p50"), ("warm_p99_ms", "warm p99"))
    ):
        ax.bar([j + (i - 1) * 0.27 for j in range(len(rows))], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set(yscale="log", ylabel="ms per decision (log)", title=h["title"])
    ax.legend(fontsize=8)
    _save(fig, path)


# ---------------------------------------------------------------------------------------------
# index-memory: the precise index's bytes per block and lookup cost (``python -m bench.index_memory``)


def index_memory_table(h: Headline) -> str:
    cap = md_table(
        [
            "capacity (blocks)",
            "resident",
            "arrays B/block",
            "RSS growth B/block",
            "match 512 blocks µs (hit / miss)",
            "record 512 blocks µs",
            "apply BlockStored blocks/s",
        ],
        [
            [
                f"{r['capacity']:,}",
                f"{r['resident']:,}",
                fmt(r["array_bytes_per_block"], "{:.1f}"),
                fmt(r["rss_bytes_per_block"], "{:.1f}"),
                f"{r['match_hit_us']:.1f} / {r['match_miss_us']:.1f}",
                fmt(r["record_us"], "{:.1f}"),
                fmt(r["apply_blocks_per_s"], "{:,.0f}"),
            ]
            for r in h["rows"]
        ],
    )
    pods = md_table(
        ["pods holding the prefix", "match 512 blocks µs"],
        [[str(r["pods"]), f"{r['match_us']:.1f}"] for r in h.get("pods", [])],
    )
    return cap + ("\n\n" + pods if h.get("pods") else "")


def index_memory_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    caps = [f"{r['capacity']:,}" for r in h["rows"]]
    a1.bar(caps, [r["array_bytes_per_block"] for r in h["rows"]], label="arrays")
    a1.plot(caps, [r["rss_bytes_per_block"] for r in h["rows"]], "ko-", label="RSS growth")
    a1.set(xlabel="capacity (blocks)", ylabel="bytes per resident block", title="memory")
    a1.legend(fontsize=8)
    pods = h.get("pods", [])
    a2.plot([p["pods"] for p in pods], [p["match_us"] for p in pods], "o-")
    a2.set(xscale="log", xlabel="pods holding the prefix", ylabel="µs per 512-block match", title="match cost")
    _save(fig, path)


def import_index_memory(src: Path) -> Headline:
    res = json.loads(src.read_text())
    return {
        "kind": "index-memory",
        "title": "Precise index: memory and lookup cost",
        "command": res["command"],
        "code": code_version(),
        "machine": res.get("machine", ""),
        "source": f"imported from {_rel(src)}",
        "stale": False,
        "rows": res["capacity"],
        "pods": res["pods"],
    }


# ---------------------------------------------------------------------------------------------
# sim-fidelity: real vLLM (CPU) against bench.sim calibrated to it (``make test-vllm``)


def sim_fidelity_table(h: Headline) -> str:
    lens = " / ".join(str(n) for n in h["lengths"])
    header = [
        "run",
        "real miss ms (longest)",
        "fitted API ms + ms/token, prefill ms/token, attention",
        f"calibrated error at {lens} tokens",
        "real pod against itself",
        "stock cpu-tiny error",
    ]
    body = [
        [
            r["run"],
            f"{r['real_miss_ms']:.1f}",
            r["fit"],
            _pcts(r["calibrated_error_pct"]),
            _pcts(r.get("real_spread_pct")),
            _pcts(r["stock_error_pct"]),
        ]
        for r in h["rows"]
    ]
    return md_table(header, body)


def _pcts(values: list[float] | None) -> str:
    """Per-length percentages, or a dash where a run did not measure (or print) them."""
    return " / ".join(f"{e:.1f}" for e in values) + " %" if values else "—"


def sim_fidelity_findings(h: Headline) -> list[str]:
    cal = [e for r in h["rows"] for e in r["calibrated_error_pct"]]
    mid = [r["calibrated_error_pct"][len(h["lengths"]) // 2] for r in h["rows"]]
    stock = [e for r in h["rows"] for e in r["stock_error_pct"] or []]
    return [
        f"Hit/miss ratio error, calibrated simulator: at most {max(mid):g} % at the median length, "
        f"{max(cal):g} % at any length over {len(h['rows'])} runs (stock profile: up to {max(stock):g} %)."
    ]


def sim_fidelity_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(h["rows"]):
        color = plt.rcParams["axes.prop_cycle"].by_key()["color"][i % 10]
        ax.plot(h["lengths"], r["calibrated_error_pct"], "o-", color=color, label=f"{r['run']}: calibrated")
        if r["stock_error_pct"]:
            ax.plot(h["lengths"], r["stock_error_pct"], "x:", color=color, alpha=0.6)
    for bound in h.get("bounds_pct", []):
        ax.axhline(bound, color="k", ls="--", lw=0.8)
    ax.set(
        xlabel="prompt tokens",
        ylabel="hit/miss ratio error vs real vLLM (%)",
        title="bench.sim vs real vLLM (solid: calibrated, dotted: stock profile)",
    )
    ax.legend(fontsize=7)
    _save(fig, path)


# ---------------------------------------------------------------------------------------------
# real-vllm: kvroute's precise index against real vLLM pods' KV events and cached_tokens


def real_vllm_table(h: Headline) -> str:
    return md_table(["", "real vLLM", "bench.sim"], [list(r) for r in h["rows"]])


def real_vllm_findings(h: Headline) -> list[str]:
    real, sim = h["cached_tokens"]["real"], h["cached_tokens"]["sim"]
    same = sum(a == b for a, b in zip(real, sim, strict=True))
    return [f"`cached_tokens` equal on {same} of {len(real)} requests."]


def real_vllm_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    real, sim = h["cached_tokens"]["real"], h["cached_tokens"]["sim"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    xs = range(1, len(real) + 1)
    ax.bar([x - 0.2 for x in xs], real, 0.4, label="real vLLM")
    ax.bar([x + 0.2 for x in xs], sim, 0.4, label="bench.sim")
    pred = h["cached_tokens"].get("kvroute_predicted")
    if pred:
        ax.plot(list(xs), pred, "k_", markersize=14, label="kvroute PreciseIndex prediction")
    ax.set(xlabel="request in the sequence", ylabel="cached_tokens", title=h["title"])
    ax.legend(fontsize=8)
    _save(fig, path)


# ---------------------------------------------------------------------------------------------
# gpu-check: the h100-llama8b profile against an 8B-shaped forward on a GPU (``bench.gpu_check``)


def gpu_check_table(h: Headline) -> str:
    header = ["point", "profile ms", "GPU ms (graph)", "GPU / profile", "kernel sum ms", "eager wall ms"]
    body = [
        [
            r["point"],
            f"{r['profile_ms']:.2f}",
            f"{r['gpu_ms']:.2f}",
            f"{r['gpu_ms'] / r['profile_ms']:.2f}",
            fmt(r.get("kernel_sum_ms"), "{:.2f}"),
            fmt(r.get("eager_wall_ms"), "{:.1f}"),
        ]
        for r in h["rows"]
    ]
    return md_table(header, body)


def gpu_check_plot(h: Headline, path: Path) -> None:
    plt = _plt()
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in h["rows"]:
        groups.setdefault(r["point"].split()[0], []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], groups.items(), strict=True):
        xs = [int(r["point"].split("=")[1]) for r in rows]
        ax.plot(xs, [r["profile_ms"] for r in rows], "o--", label="profile (h100-llama8b)")
        ax.plot(xs, [r["gpu_ms"] for r in rows], "s-", label="GPU (graph replay)")
        ax.set(xscale="log", xlabel="batch" if name == "decode" else "prompt tokens", ylabel="ms per step", title=name)
        ax.legend(fontsize=8)
    _save(fig, path)


# ---------------------------------------------------------------------------------------------
# table: plain columns and rows (for a headline with no kind of its own yet)


def table_headline(title: str, module: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                   **extra: Any) -> Headline:  # fmt: skip
    """A ``table`` headline written by a benchmark itself (``python -m MODULE`` with this process's
    arguments, the code and the machine's load as it ends); ``import_headline`` takes it as it is."""
    return {
        "kind": "table",
        "title": title,
        "command": f"python -m {module} " + " ".join(sys.argv[1:]),
        "code": code_version(),
        "machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end",
        "columns": list(columns),
        "rows": [list(row) for row in rows],
        **extra,
    }


def plain_table(h: Headline) -> str:
    return md_table(h["columns"], [[str(c) for c in r] for r in h["rows"]])


class Kind:
    def __init__(
        self,
        table: Callable[[Headline], str],
        plot: Callable[[Headline, Path], None] | None = None,
        findings: Callable[[Headline], list[str]] = lambda _h: [],
    ) -> None:
        self.table, self.plot, self.findings = table, plot, findings


KINDS: dict[str, Kind] = {
    "routing": Kind(routing_table, routing_plot, routing_findings),
    "grid": Kind(grid_table, grid_plot, grid_findings),
    "pd": Kind(pd_table, pd_plot, pd_findings),
    "overhead": Kind(overhead_table, overhead_plot, overhead_findings),
    "decision": Kind(decision_table, decision_plot),
    "index-memory": Kind(index_memory_table, index_memory_plot),
    "sim-fidelity": Kind(sim_fidelity_table, sim_fidelity_plot, sim_fidelity_findings),
    "real-vllm": Kind(real_vllm_table, real_vllm_plot, real_vllm_findings),
    "gpu-check": Kind(gpu_check_table, gpu_check_plot),
    "table": Kind(plain_table),
}


def import_headline(src: Path) -> Headline:
    """A benchmark that writes its headline itself (``python -m bench.faults``: a ``table``)."""
    h = load(src)
    del h["name"]  # the name it is imported as
    return h


def _copy_images(paths: Sequence[str], prefix: str, captions: Mapping[str, str]) -> list[dict[str, str]]:
    """A benchmark's own PNGs into bench/plots/ as ``<prefix>-<file>``; a caption per file name's stem
    suffix (``-cdf``: ...)."""
    out = []
    for p in map(Path, paths):
        if not p.exists():
            continue
        dest = f"{prefix}-{p.name}"
        PLOTS_DIR.mkdir(parents=True, exist_ok=True)
        (PLOTS_DIR / dest).write_bytes(p.read_bytes())
        caption = next((c for suffix, c in captions.items() if p.stem.endswith(suffix)), p.stem)
        out.append({"file": dest, "caption": f"{p.stem.rsplit('-', 1)[0]}: {caption}"})
    return out


FIDELITY_LOAD_COLUMNS = (
    "workload", "req/s", "TTFT p50 ms real / sim (sim÷real, real runs 2.. ÷1)", "TTFT p90", "ITL p50", "ITL p90",
    "engine ITL mean", "TTFT request by request, sim÷real p10 / p50 / p90 (real run 2÷1)", "ITL request by request",
    "hit requests real / sim (same cached_tokens)", "preemptions real / sim",
    "waiting peak real / sim", "client stalls > 50 ms real / sim",
    "host step before each real run ÷ at calibration (simulated decode x)",
    "TTFT and ITL p50 / p90 within 15 % of the nearest real run (decode terms as fitted)",
)  # fmt: skip
FIDELITY_BOUND = 0.15  # issue 19: simulated within 15 % of the nearest real run on the same arrivals
FIDELITY_FIGURES = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90")


def _real_spread(row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Each further real run's figures over real run 1's (run 2, then any more)."""
    first = [row["real2_vs_real"]] if "real2_vs_real" in row else []
    return first + list(row.get("more_real_vs_real", ()))


def fidelity_within(row: Mapping[str, Any], sim: str = "sim") -> str:
    """How many of ``FIDELITY_FIGURES`` the simulated run (``sim``: the row's ``sim`` or ``sim_fit``) has
    within ``FIDELITY_BOUND`` of the real pod: of the nearest of its runs on the same arrivals (real run 1
    and every further one), so the real runs' own spread widens the bound on the side it lies."""
    ratios = row.get(f"{sim}_vs_real")
    if not ratios:
        return "-"
    ok = 0
    for k in FIDELITY_FIGURES:
        r = ratios.get(k)
        reals = [1.0, *(v for c in _real_spread(row) if (v := c.get(k)) is not None)]
        if r is not None and min(reals) * (1 - FIDELITY_BOUND) <= r <= max(reals) * (1 + FIDELITY_BOUND):
            ok += 1
    return f"{ok}/{len(FIDELITY_FIGURES)}"


def _paired(row: Mapping[str, Any], figure: str) -> str:
    """The per-request ratio of ``figure`` (ttft, itl): its p10 / p50 / p90, simulated over real run 1
    (real run 2's beside)."""
    fmt = lambda p: " / ".join("-" if p.get(q) is None else f"{p[q]:.2f}" for q in ("p10", "p50", "p90"))  # noqa: E731
    if f"paired_{figure}" not in row:
        return "-"
    real2 = row.get(f"paired_{figure}_real2")
    return fmt(row[f"paired_{figure}"]) + ("" if real2 is None else f" ({fmt(real2)})")


def fidelity_load_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """``bench.fidelity_load``'s rows as ``FIDELITY_LOAD_COLUMNS`` cells (its own table prints these too)."""
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    x = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    figures = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "engine_itl_mean")
    out = []
    for row in rows:
        r, s, c, spread = row["real"], row["sim"], row["sim_vs_real"], _real_spread(row)
        others = {k: "/".join(x(c2.get(k)) for c2 in spread) or "-" for k in figures}
        out.append([row["workload"], f"{row['rate']:g}",
                    *(f"{ms(r[k])} / {ms(s[k])} ({x(c[k])}, {others[k]})" for k in figures),
                    _paired(row, "ttft"), _paired(row, "itl"),
                    f"{r['hit_requests']} / {s['hit_requests']} ({row['same_cached_sim']}/{r['requests']})",
                    f"{r['preemptions']:.0f} / {s['preemptions']:.0f}",
                    f"{r['waiting_peak']:.0f} / {s['waiting_peak']:.0f}",
                    f"{r.get('client_stalls', '-')} / {s.get('client_stalls', '-')}",
                    _drift(row, (r, row.get("real2", {}), *row.get("more_real", ()))), _within(row)])  # fmt: skip
    return out


def _within(row: Mapping[str, Any]) -> str:
    """``fidelity_within`` of the row's simulated run, and of its run with the decode terms as fitted."""
    fit = f" ({fidelity_within(row, 'sim_fit')})" if "sim_fit_vs_real" in row else ""
    return fidelity_within(row) + fit


def _drift(row: Mapping[str, Any], reals: Sequence[Mapping[str, Any]]) -> str:
    """Each real run's speed probe over the one taken at calibration (1.30 = the host ran 30 % slower),
    and the factor the simulated run's decode terms were scaled by to follow real run 1's probe."""
    base = row.get("probe_calibrated_s")
    probes = [r.get("probe_s") for r in reals if r]
    if not base or not all(probes):
        return "-"
    anchor = row.get("decode_anchor")
    return (" / ".join(f"{p / base:.2f}" for p in probes) + (" (calibrated again)" if row.get("recalibrated") else "")
            + ("" if anchor is None else f" (x{anchor:.2f})"))  # fmt: skip


def import_fidelity_load(src: Path) -> Headline:
    """``python -m bench.fidelity_load`` output (its fidelity-load.json) as a ``table``: per workload and
    rate, real vs simulated TTFT/ITL (ratio sim/real, and each further real run / run 1), hits, preemptions, queue."""
    path = src / "fidelity-load.json" if src.is_dir() else src
    d = json.loads(path.read_text())
    prefix = src.name if src.is_dir() else "fidelity-load"  # another run's plots beside, not over, these
    captions = {
        "-cdf": "TTFT and ITL CDFs, real vs simulated",
        "-trajectory": "running, waiting and KV use over the run",
    }
    return {
        "kind": "table",
        "title": "Simulator fidelity under load",
        "command": d.get("command", "python -m bench.fidelity_load"),
        "code": code_version(),
        "columns": list(FIDELITY_LOAD_COLUMNS),
        "rows": fidelity_load_rows(d["rows"]),
        "calibration": d.get("overrides"),
        "images": _copy_images(d.get("plots", ()), prefix, captions),
    }


TIMELINE_COLUMNS = (
    "policy", "requests", "failed (after the event)", "keys moved (minimal)", "steady hit rate",
    "lowest hit after", "back within 2 points", "TTFT p50 / p90 steady, s", "worst TTFT p90 after, s", "targets",
)  # fmt: skip
TIMELINE_STEADY_S = 30.0  # bench.timeline's steady state: the windows of the last 30 s before the event


def timeline_figures(res: Mapping[str, Any]) -> tuple[str, str, str]:
    """(keys moved, steady hit rate, recovery) of one ``bench timeline`` result, as text."""
    share, steady, back = res["keys_moved"]["share"], res["steady_hit_rate"], res["recovered_s"]
    return (
        "n/a" if share is None else f"{share:.1%}",
        "n/a" if steady is None else f"{steady:.1%}",
        "never" if back is None else f"{back:.0f} s",
    )


def timeline_targets_text(res: Mapping[str, Any]) -> str:
    """``met`` or ``missed: ...`` over the targets that apply to the event."""
    missed = [name.replace("_", " ") for name, ok in res.get("targets", {}).items() if ok is False]
    return "missed: " + ", ".join(missed) if missed else "met"


def timeline_steady(wins: Sequence[Mapping[str, Any]], start: float, width: float) -> list[Mapping[str, Any]]:
    """The windows of the steady state: whole windows in the ``TIMELINE_STEADY_S`` before ``start``."""
    return [w for w in wins if start - TIMELINE_STEADY_S <= w["start_s"] and w["start_s"] + width <= start]


def timeline_rows(results: Sequence[Mapping[str, Any]], window_s: float) -> list[list[str]]:
    """``bench timeline``'s results as ``TIMELINE_COLUMNS`` cells (its own table prints these too)."""
    s = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    out = []
    for r in results:
        if "error" in r:
            out.append([r["policy"], "error: " + r["error"][:80], *[""] * (len(TIMELINE_COLUMNS) - 2)])
            continue
        share, steady, back = timeline_figures(r)
        start = r["event_start_s"]
        wins = r.get("windows", [])
        before = timeline_steady(wins, start, window_s)
        after = [w for w in wins if w["start_s"] >= start and w["requests"]]
        hits = [w["hit_rate"] for w in after if w["hit_rate"] is not None]
        p90s = [w["ttft_p90_s"] for w in after if w["ttft_p90_s"] is not None]
        steady50 = percentile([w["ttft_p50_s"] for w in before if w["ttft_p50_s"] is not None], 0.5)
        steady90 = percentile([w["ttft_p90_s"] for w in before if w["ttft_p90_s"] is not None], 0.5)
        out.append([r["policy"], str(r["requests"]), f"{r['failed']} ({r['failed_after_event']})",
                    f"{share} ({r['minimal_share']:.1%})", steady, f"{min(hits):.1%}" if hits else "-", back,
                    f"{s(steady50)} / {s(steady90)}", s(max(p90s) if p90s else None),
                    timeline_targets_text(r)])  # fmt: skip
    return out


def import_timeline(src: Path) -> Headline:
    """``python -m bench timeline`` output (its timeline.json) as a ``table``: per router, failed
    requests, keys moved, hit rate and TTFT around the event, recovery, targets; its plot copied."""
    path = src / "timeline.json" if src.is_dir() else src
    d = json.loads(path.read_text())
    meta = d["meta"]
    event = meta["event"]
    return {
        "kind": "table",
        "title": f"Fleet event: {event}",
        "command": meta["command"],
        "code": code_version(),
        "columns": list(TIMELINE_COLUMNS),
        "rows": timeline_rows(d["results"], meta["window_s"]),
        "workload": {k: v for k, v in meta.items() if k not in ("event", "command")},
        "images": _copy_timeline_plot(path.parent / f"timeline-{event}.png", event),
    }


def _copy_timeline_plot(png: Path, event: str) -> list[dict[str, str]]:
    if not png.exists():
        return []
    PLOTS_DIR.mkdir(parents=True, exist_ok=True)
    (PLOTS_DIR / png.name).write_bytes(png.read_bytes())
    return [{"file": png.name, "caption": f"{event}: hit rate and TTFT p50/p90 per window, a line per router, "
                                          "the event shaded"}]  # fmt: skip


def import_ramp(src: Path) -> Headline:
    """``python -m bench ramp`` output (its ramp.json) as a ``table``: per pod role, when the desired
    count rose and TTFT p90 broke (and the offered load then), and when the count fell back."""
    path = src / "ramp.json" if src.is_dir() else src
    d = json.loads(path.read_text())
    meta = d["meta"]
    f = lambda v, fmt="{:.1f}": "-" if v is None else fmt.format(v)  # noqa: E731
    rows = [[r["role"], f(r["rise_s"]), f(r.get("load_at_rise"), "{:.2f}"), f(r["break_s"]),
             f(r.get("load_at_break"), "{:.2f}"), f(r["lead_s"], "{:+.1f}"),
             f(r.get("prefill_capacity_ratio"), "{:.2f}"), f(r["window_fell_s"]), f(r["fell_s"]),
             f(r["peak_desired"], "{:.2f}"), f(r["ready"], "{:.0f}")] for r in d["roles"]]  # fmt: skip
    images = _copy_images(
        [str(path.parent / "ramp.png")], "ramp", {"ramp": "desired and ready pods, offered rate, TTFT p90"}
    )
    return {
        "kind": "table",
        "title": "Autoscaling signal under a load ramp",
        "command": meta["command"],
        "code": code_version(),
        "columns": [
            "role",
            "rise s",
            "load at rise",
            "TTFT break s",
            "load at break",
            "lead s",
            "capacity ÷ real",
            "window fell s",
            "count fell s",
            "peak desired",
            "ready pods",
        ],
        "rows": rows,
        "failed_requests": d["failed"],
        "images": images,
    }


IMPORTERS: dict[str, Callable[[Path], Headline]] = {
    "faults": import_headline,
    "workers": import_headline,
    "gc-pause": import_headline,
    "index-churn": import_headline,
    "decision": import_headline,  # ``bench.decision --scale``'s JSON (the main table is transcribed)
    "routing": import_routing,
    "grid": import_grid,
    "pd": import_pd,
    "overhead": import_overhead,
    "index-memory": import_index_memory,
    "fidelity-load": import_fidelity_load,
    "ramp": import_ramp,
    "timeline": import_timeline,
}


def importer_for(name: str) -> Callable[[Path], Headline]:
    """The importer a headline name calls for: ``routing-*`` → routing, ``pd*`` → pd, and so on."""
    for kind, fn in IMPORTERS.items():
        if name == kind or name.startswith(kind + "-"):
            return fn
    raise ResultsError(f"--as {name}: no importer; names start with one of {', '.join(IMPORTERS)}")


# ---------------------------------------------------------------------------------------------
# Commands


def load_all(results: Path = RESULTS_DIR) -> dict[str, Headline]:
    return {h["name"]: h for h in (load(p) for p in sorted(results.glob("*.json")))}


def build(results: Path = RESULTS_DIR, md: Path = RESULTS_MD, plots: Path = PLOTS_DIR, *, draw: bool = True) -> bool:
    """Rewrite ``md``'s blocks (and the plots); True when the markdown changed."""
    headlines = load_all(results)
    text = md.read_text()
    missing = sorted(set(headlines) - {m["name"] for m in BLOCK.finditer(text)})
    if missing:
        raise ResultsError(
            f"{md.name} has no block for {', '.join(missing)} (add '<!-- bench.results: NAME -->' "
            "and '<!-- /bench.results: NAME -->' where the table goes)"
        )
    new = render_markdown(text, headlines, plots, md.parent)
    if draw:
        for h in headlines.values():
            kind = KINDS[h["kind"]]
            if kind.plot is not None and not h.get("pending"):
                kind.plot(h, plot_path(h, plots))
    if new != text:
        md.write_text(new)
        return True
    return False


def import_run(src: Path, name: str, results: Path = RESULTS_DIR, kind: str | None = None, merge: bool = False) -> Path:
    """``src`` (a benchmark's output) as ``results/<name>.json``; the importer is ``kind``'s, or the one
    ``name`` calls for. Everything measured is replaced, notes included (they described the old figures).
    ``merge`` (grids only): ``src``'s cells replace the headline's cells of the same workload, pods and
    load, the others stay, with their provenance and notes (``merge_grid``)."""
    if not src.exists():
        raise ResultsError(f"{src}: no such file or directory")
    if kind is not None and kind not in IMPORTERS:
        raise ResultsError(f"--kind {kind}: not one of {', '.join(IMPORTERS)}")
    h = (IMPORTERS[kind] if kind is not None else importer_for(name))(src)
    old = results / f"{name}.json"
    if merge:
        if h["kind"] != "grid":
            raise ResultsError(f"--merge: only a grid's cells merge ({src} is a {h['kind']} output)")
        if not old.exists():
            raise ResultsError(f"--merge: {_rel(old)} does not exist; import without --merge first")
        h = merge_grid(json.loads(old.read_text()), h)
    elif old.exists():  # keep the title a section was given; everything measured is replaced
        h["title"] = json.loads(old.read_text()).get("title", h["title"])
    h = {"name": name, **h}
    results.mkdir(parents=True, exist_ok=True)
    old.write_text(json.dumps(h, indent=1, ensure_ascii=False) + "\n")
    return old


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.results", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md differs from the JSON (no plots)")
    sub = ap.add_subparsers(dest="cmd")
    imp = sub.add_parser("import", help="a benchmark's output as bench/results/NAME.json, then rerender")
    imp.add_argument("src", type=Path, help="bench run / pd_sweep / overhead output dir, or index_memory --json file")
    imp.add_argument("--as", dest="name", required=True, help="headline name, e.g. routing-multi-turn, pd, overhead")
    imp.add_argument(
        "--merge",
        action="store_true",
        help="grids: SRC's cells replace the headline's cells of the same workload, pods and load; the "
        "others, the notes and their provenance stay (a rerun of some cells)",
    )
    imp.add_argument(
        "--kind",
        choices=sorted(IMPORTERS),
        default=None,
        help="which benchmark wrote SRC, when NAME does not say (e.g. --as replicas --kind routing)",
    )
    a = ap.parse_args(argv)
    try:
        if a.cmd == "import":
            path = import_run(a.src, a.name, kind=a.kind, merge=a.merge)
            print(f"wrote {_rel(path)}")
        if a.check:
            text = RESULTS_MD.read_text()
            if render_markdown(text, load_all()) != text:
                print("bench/RESULTS.md is out of date: run `python -m bench.results`", file=sys.stderr)
                return 1
            return 0
        changed = build()
    except ResultsError as e:
        print(f"bench.results: {e}", file=sys.stderr)
        return 2
    print(
        "rewrote bench/RESULTS.md" if changed else "bench/RESULTS.md already up to date",
        "and the plots in bench/plots/",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
