"""Benchmark results: one summary row per policy, written as results.json, results.md and plots.

Latencies come from the client (``bench.loadgen`` records); hit rates and per-pod load from the
pods' own counters (``/sim/stats`` deltas over the run), so a router cannot flatter itself.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import Record, percentile

# (key, header, format) of the markdown table; values missing from a row print as "-".
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("requests", "requests", "{}"),
    ("errors", "errors", "{}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("itl_p50_s", "ITL p50 s", "{:.4f}"),
    ("itl_p99_s", "ITL p99 s", "{:.4f}"),
    ("e2e_p50_s", "e2e p50 s", "{:.3f}"),
    ("output_tok_s", "output tok/s", "{:.0f}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("ideal_hit_rate", "ideal", "{:.1%}"),
    ("load_imbalance", "imbalance (max/mean busy)", "{:.2f}"),
)
POD_KEYS = ("requests", "busy_s", "prefix_queries_tokens", "prefix_hits_tokens", "prompt_tokens", "preemptions")
# P/D counters (0 when a pod does not report them): KV pulls and the tokens they brought.
PD_KEYS = ("transfers", "external_hits_tokens")
# Pod-side time to first token (0 when a pod does not report it): see ``ttft_split``.
POD_TTFT_KEYS = ("ttft_sum_s", "ttft_count")


@dataclass
class PolicyRun:
    """A summary row plus the raw samples the plots need (kept out of results.json)."""

    row: dict[str, Any]
    ttfts: list[float] = field(default_factory=list)


def pod_deltas(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Counter deltas over the run per pod, plus its P/D role (``both`` when it has none)."""
    out: list[dict[str, Any]] = []
    for b, a in zip(before, after, strict=True):
        d: dict[str, Any] = {k: a[k] - b[k] for k in POD_KEYS}
        d.update({k: a.get(k, 0) - b.get(k, 0) for k in (*PD_KEYS, *POD_TTFT_KEYS)})
        d["role"] = a.get("role", "both")
        out.append(d)
    return out


def pd_summary(records: Sequence[Record], pods: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where prompt tokens came from, per client request, comparable across P/D and plain fleets.

    ``computed_per_prompt``: prompt tokens some pod had to prefill (each leg's queried tokens less
    its own prefix-cache hits and the KV it pulled), over the prompt tokens clients sent; 1 minus it
    is the reuse a plain fleet's hit rate measures. Pulled KV is counted apart (``pulled_per_prompt``):
    real vLLM reports ``cached_tokens`` 0 for it on the decode leg while bench.sim counts it, so
    neither the client's ``cached_tokens`` nor ``hit_rate`` (whose queries count a split request's
    prompt on both legs) compares a P/D fleet with a plain one.
    """
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    pulled = sum(p.get("external_hits_tokens", 0) for p in pods)
    computed = sum(p["prefix_queries_tokens"] - p["prefix_hits_tokens"] for p in pods) - pulled
    return {
        "prefill_legs": sum(p["requests"] for p in pods if p.get("role") == "prefill"),
        "transfers": sum(p.get("transfers", 0) for p in pods),
        "client_prompt_tokens": prompt,
        "computed_per_prompt": computed / prompt if prompt else None,
        "pulled_per_prompt": pulled / prompt if prompt else None,
        # TTFT p99 per request class (the tag without its number: mixed-pd's "c" chats, "d" documents).
        "ttft_p99_by_class": {
            c: _q([r.ttft for r in ok if r.ttft is not None and r.tag.rstrip("0123456789") == c], 0.99)
            for c in sorted({r.tag.rstrip("0123456789") for r in ok})
        },
    }


def ttft_split(ttfts: Sequence[float], pods: Sequence[Mapping[str, Any]], time_scale: float = 1.0) -> dict[str, Any]:
    """Mean TTFT as the client saw it, the part spent inside the pods (from their HTTP handler's receipt
    to the first token: queueing, prefill) and the rest, ``path``: client, Envoy, the router's
    decision and the connections. Two policies with the same hit rate but different TTFT differ in
    one or the other: routing (pods queue more) or the path (e.g. CPU taken from the fleet).
    Plain fleets only: a P/D request's two legs have no single pod-side TTFT. ``ttfts`` are in pod
    time; pods ``time_scale`` times slower report theirs in wall seconds, so they are scaled to match."""
    n = sum(p.get("ttft_count", 0) for p in pods)
    if not ttfts or not n or any(p.get("role", "both") != "both" for p in pods):
        return {}
    client = statistics.fmean(ttfts)
    pod = sum(p.get("ttft_sum_s", 0.0) for p in pods) / n / time_scale
    return {"ttft_mean_s": client, "pod_ttft_mean_s": pod, "path_ttft_mean_s": client - pod}


def ttft_parts(ok: Sequence[Record]) -> dict[str, Any]:
    """Where each request's TTFT went, from the records the serving pod reported its own figures for
    (``Record.pod_ttft``): medians (and the path's p90) over requests of the pod's wait before its first
    engine step, the pod's TTFT (that wait, then the steps to the first token) and the path (the client's
    TTFT less the pod's: client, proxy, the router's hop and decision, the connections). Each is its own
    median; they need not add up. Empty where no pod reported (real vLLM, P/D fleets)."""
    timed = [r for r in ok if r.ttft is not None and r.pod_ttft is not None]
    if not timed:
        return {}
    path = [r.ttft - r.pod_ttft for r in timed]  # type: ignore[operator]
    return {
        "timed_requests": len(timed),
        "pod_wait_p50_s": _q([r.pod_wait for r in timed if r.pod_wait is not None], 0.5),
        "pod_ttft_p50_s": _q([r.pod_ttft for r in timed], 0.5),  # type: ignore[misc]
        "pod_ttft_p90_s": _q([r.pod_ttft for r in timed], 0.9),  # type: ignore[misc]
        "path_ttft_p50_s": _q(path, 0.5),
        "path_ttft_p90_s": _q(path, 0.9),
    }


def _q(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q)


def summarize(
    policy: str,
    scenario: str,
    records: Sequence[Record],
    pods: Sequence[Mapping[str, Any]],
    *,
    wall_s: float,
    ideal_hit_rate: float,
    extra: Mapping[str, Any] | None = None,
    time_scale: float = 1.0,
) -> PolicyRun:
    """One row: client latency percentiles, pod-side hit rate and load balance. ``records`` in pod time;
    ``time_scale``: how much slower than that the pods ran (their own figures are in wall seconds)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    queried = sum(p["prefix_queries_tokens"] for p in pods)
    hits = sum(p["prefix_hits_tokens"] for p in pods)
    busy = [p["busy_s"] for p in pods]
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    errors = [r.error or f"HTTP {r.status}" for r in records if not r.ok]
    row: dict[str, Any] = {
        "policy": policy,
        "scenario": scenario,
        "requests": len(records),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "ttft_p50_s": _q(ttft, 0.5),
        "ttft_p90_s": _q(ttft, 0.9),
        "ttft_p99_s": _q(ttft, 0.99),
        "itl_p50_s": _q(itl, 0.5),
        "itl_p99_s": _q(itl, 0.99),
        "itl_p999_s": _q(itl, 0.999),
        "e2e_p50_s": _q(e2e, 0.5),
        "output_tok_s": sum(r.output_chunks for r in ok) / wall_s if wall_s > 0 else 0.0,
        "hit_rate": hits / queried if queried else 0.0,
        "ideal_hit_rate": ideal_hit_rate,
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else None,
        "wall_s": wall_s,
        "itl_samples": len(itl),  # gaps between streamed chunks: 0 means nothing streamed
        "pods": [dict(p) for p in pods],
        **pd_summary(records, pods),
        **ttft_split(ttft, pods, time_scale),
        **ttft_parts(ok),
    }
    row.update(extra or {})
    return PolicyRun(row, ttft)


def cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def cell_spread(row: Mapping[str, Any], key: str, fmt: str) -> str:
    """``cell``, followed by the min–max over repeated runs when the row is a median (``median_row``)
    and they differ."""
    text = cell(row, key, fmt)
    lo_hi = (row.get("spread") or {}).get(key)
    if not lo_hi or lo_hi[0] == lo_hi[1]:
        return text
    return f"{text} ({fmt.format(lo_hi[0])}–{fmt.format(lo_hi[1])})"


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def middle_run(rows: Sequence[Mapping[str, Any]]) -> int:
    """Index of the run whose TTFT p50 is the median (the lower middle for an even count) among the
    runs that did not fail, or -1 when all failed: its samples, pods and CPU stand for the median."""
    ok = [i for i, r in enumerate(rows) if not r.get("failed")]
    if not ok:
        return -1
    ok.sort(key=lambda i: rows[i].get("ttft_p50_s") or float("inf"))
    return ok[(len(ok) - 1) // 2]


def median_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's rows from repeated runs (same arrivals, fresh fleets) as one row: every number
    is the median of the runs that did not fail, ``spread`` holds its [min, max], ``repeats`` the
    runs that count; other fields come from the middle run. All failed: the first failure."""
    if not rows:
        raise ValueError("median_row: no rows")
    mid = middle_run(rows)
    if mid < 0:
        return {**rows[0], "repeats": 0, "failed_runs": len(rows)}
    ok = [r for r in rows if not r.get("failed")]
    out: dict[str, Any] = dict(rows[mid])
    spread: dict[str, list[float]] = {}
    for k, v in rows[mid].items():
        if not _number(v):
            continue
        values = [r[k] for r in ok if _number(r.get(k))]
        m = statistics.median(values)
        out[k] = int(m) if all(isinstance(x, int) for x in values) and m == int(m) else m  # counts stay counts
        if len(values) > 1:
            spread[k] = [min(values), max(values)]
    if "contended" in out:
        out["contended"] = any(r.get("contended") for r in ok)
    out["repeats"], out["spread"] = len(ok), spread
    if len(ok) < len(rows):
        out["failed_runs"] = len(rows) - len(ok)
    return out


def median_runs(per_run: Sequence[Sequence[PolicyRun]]) -> list[PolicyRun]:
    """``per_run[k][i]``: policy i in run k (the same policies in the same order every run) → one
    ``PolicyRun`` per policy with ``median_row``'s row and the middle run's TTFT samples."""
    out = []
    for runs in zip(*per_run, strict=True):
        rows = [r.row for r in runs]
        mid = middle_run(rows)
        out.append(PolicyRun(median_row(rows), runs[mid].ttfts if mid >= 0 else []))
    return out


def decisions(reasons: Mapping[str, float] | None) -> str:
    """kvroute's P/D decision counts (``pd_reasons``) as one cell."""
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted((reasons or {}).items()))


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['policy']} | failed to start: {r['failed']} |" + " |" * (len(COLUMNS) - 2))
            continue
        lines.append("| " + " | ".join(cell_spread(r, k, f) for k, _, f in COLUMNS) + " |")
    return "\n".join(lines)


def pod_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Requests and busy seconds per pod, one line per policy."""
    lines = ["| policy | requests per pod | busy s per pod |", "|---|---|---|"]
    for r in rows:
        if r.get("pods"):
            reqs = " / ".join(str(int(p["requests"])) for p in r["pods"])
            busy = " / ".join(f"{p['busy_s']:.1f}" for p in r["pods"])
            lines.append(f"| {r['policy']} | {reqs} | {busy} |")
    return "\n".join(lines)


def pd_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Roles, split requests, KV pulls and where prompt tokens came from (``pd_summary``)."""
    lines = [
        "| policy | roles | prefill legs | KV pulls | prefilled / prompt tokens | pulled / prompt tokens "
        "| ITL samples | ITL p99.9 s | TTFT p99 s per request class | kvroute decisions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("pods"):
            roles = Counter(p.get("role", "both") for p in r["pods"])
            role_s = ", ".join(f"{k} {v}" for k, v in sorted(roles.items()))
            cols = [cell(r, "prefill_legs", "{}"), cell(r, "transfers", "{:.0f}"),
                    cell(r, "computed_per_prompt", "{:.1%}"), cell(r, "pulled_per_prompt", "{:.1%}"),
                    cell(r, "itl_samples", "{}"), cell(r, "itl_p999_s", "{:.4f}"),
                    ", ".join(f"{c or '-'} {v:.3f}" for c, v in (r.get("ttft_p99_by_class") or {}).items()
                              if v is not None),
                    decisions(r.get("pd_reasons"))]  # fmt: skip
            lines.append(f"| {r['policy']} | {role_s} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


# ``ttft_parts_table``'s columns after the policy, as ``COLUMNS`` (key, header, format): the keys ``ttft_parts`` and
# ``ttft_split`` give, and kvroute's decision time as the harness reads it from its /metrics.
TTFT_PARTS: tuple[tuple[str, str, str], ...] = (
    ("timed_requests", "requests timed", "{}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.4f}"),
    ("pod_wait_p50_s", "pod's wait before its first step p50 s", "{:.4f}"),
    ("pod_ttft_p50_s", "pod's TTFT p50 s", "{:.4f}"),
    ("path_ttft_p50_s", "path p50 s", "{:.4f}"),
    ("path_ttft_p90_s", "path p90 s", "{:.4f}"),
    ("path_ttft_mean_s", "path mean s", "{:.4f}"),
    ("decision_ms_mean", "decision mean ms", "{:.2f}"),
)


def ttft_parts_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the TTFT went (``ttft_parts``, ``ttft_split``), one line per policy whose pods reported it."""
    lines = [
        "| policy | " + " | ".join(h for _, h, _ in TTFT_PARTS) + " |",
        "|---|" + "---|" * len(TTFT_PARTS),
    ]
    for r in rows:
        if r.get("timed_requests"):
            lines.append(f"| {r['policy']} | " + " | ".join(cell_spread(r, k, f) for k, _, f in TTFT_PARTS) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def cpu_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """CPU use of every process in cores (from /proc) and client send lag: is the CPU side a limit?"""
    lines = [
        "| policy | CPU cores used (machine: all processes on the host) | other work, cores | send lag p99 ms |",
        "|---|---|---|---|",
    ]
    for r in rows:
        cpu = r.get("cpu_cores")
        if cpu:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            lag = r.get("send_lag_p99_s")
            other = r.get("other_cores")
            flag = " (contended)" if r.get("contended") else ""
            other_s = "-" if other is None else f"{other:.2f}{flag}"
            lines.append(f"| {r['policy']} | {parts} | {other_s} | {'-' if lag is None else f'{1e3 * lag:.1f}'} |")
    return "\n".join(lines)


def markdown(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    head = [f"# {meta.get('scenario', 'benchmark')}", ""]
    head += [f"- {k}: {v}" for k, v in meta.items() if k != "scenario"]
    tables = [markdown_table(rows), pod_table(rows)]
    if any(p.get("role", "both") != "both" for r in rows for p in r.get("pods", ())):
        tables.append(pd_table(rows))
    if parts := ttft_parts_table(rows):
        tables.append(parts)
    return "\n\n".join(["\n".join(head), *tables, cpu_table(rows)]) + "\n"


def write(out: Path, runs: Sequence[PolicyRun], meta: Mapping[str, Any], plots: bool = True) -> list[Path]:
    """results.json (list of rows), results.md, run.json (meta) and the plots; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.row for r in runs]
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "run.json").write_text(json.dumps(meta, indent=1))
    (out / "results.md").write_text(markdown(rows, meta))
    paths = [out / "results.json", out / "results.md", out / "run.json"]
    return paths + (plot(out, runs, str(meta.get("scenario", ""))) if plots else [])


def plot(out: Path, runs: Sequence[PolicyRun], title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if not r.row.get("failed")]
    if not done:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in done:
        v = sorted(r.ttfts)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=r.row["policy"])
    ax.set_xscale("log")
    ax.set(xlabel="time to first token (s, log)", ylabel="CDF", title=f"TTFT — {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)

    names = [r.row["policy"] for r in done]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(done)), 4.5))
    ax.bar(names, [r.row["hit_rate"] for r in done], label="measured (pods' counters)")
    ax.axhline(done[0].row["ideal_hit_rate"], color="k", ls="--", label="ideal (one infinite cache)")
    ax.set(ylabel="prefix cache hit rate (tokens)", ylim=(0, 1), title=f"Hit rate — {title}")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(done)), 4.5))
    npods = len(done[0].row["pods"])
    width = 0.8 / max(npods, 1)
    for i in range(npods):
        xs = [j + i * width for j in range(len(done))]
        ax.bar(xs, [r.row["pods"][i]["busy_s"] for r in done], width, label=f"pod {i}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(done))], names, rotation=30)
    ax.set(ylabel="engine busy seconds", title=f"Per-pod load — {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pod_load.png", dpi=110)
    plt.close(fig)
    return [out / "ttft_cdf.png", out / "hit_rate.png", out / "pod_load.png"]
