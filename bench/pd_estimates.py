"""``python -m bench.pd_estimates DIR``: how close kvroute's first-token estimates came to the TTFTs measured.

For every run under DIR kept with ``--kvroute-log-level debug`` (``<policy>.kvroute.log`` beside
``<policy>.requests.jsonl``), joins each request's "routed" line with its measured TTFT by
x-request-id (by arrival order for runs without one) and prints, for splits and for local
prefills weighed against a split, measured minus estimated TTFT in pod seconds. A split's
estimate is ``local_ttft_ms + split_delay_ms``; the difference of the two medians is roughly what
``pd.split_overhead_s`` leaves out (both also miss what the client, Envoy and the pod add to any
request), and a long tail of split errors points at queues the estimate does not see.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.loadgen import percentile

QUANTILES = (0.1, 0.5, 0.9, 0.99)


@dataclass
class Errors:
    """Measured minus estimated TTFT (pod seconds) of one run's decisions, by kind."""

    run: str
    split: list[float] = field(default_factory=list)
    local: list[float] = field(default_factory=list)
    unmatched: int = 0
    by_order: bool = False  # joined by arrival order (no request ids)


def run_errors(log: Path, requests: Path, time_scale: float, name: str) -> Errors:
    """Join one run's decisions (kvroute's "routed" debug lines) with its requests: by request id,
    or for runs from before the bench sent one, by arrival order (decisions are logged as requests
    arrive, which at these rates are far enough apart)."""
    reqs = [json.loads(line) for line in requests.read_text().splitlines() if line.strip()]
    decisions = [json.loads(line) for line in log.read_text(errors="replace").splitlines() if '"msg":"routed"' in line]
    if any(r.get("request_id") for r in reqs):
        ttft = {r["request_id"]: r.get("ttft_s") for r in reqs if r.get("request_id")}
        measured = [ttft.get(d.get("request_id", "")) for d in decisions]
        out = Errors(name)
    else:
        if len(reqs) != len(decisions):
            raise SystemExit(f"bench.pd_estimates: {requests} has no request ids and {len(reqs)} requests "
                             f"for {len(decisions)} decisions: cannot join them")  # fmt: skip
        measured = [r.get("ttft_s") for r in sorted(reqs, key=lambda r: r["at_s"])]
        out = Errors(name, by_order=True)
    for d, m in zip(decisions, measured, strict=True):
        pd = d.get("pd") or {}
        if pd.get("local_ttft_ms") is None:  # no split was weighed (never, cached, no prefill pod)
            continue
        if m is None:
            out.unmatched += 1
            continue
        est_ms = pd["local_ttft_ms"] + (pd["split_delay_ms"] if pd.get("split") else 0.0)
        (out.split if pd.get("split") else out.local).append(m - est_ms / 1e3 / time_scale)
    return out


def collect(root: Path) -> list[Errors]:
    runs = []
    for log in sorted(root.rglob("*.kvroute.log")):
        policy = log.name.removesuffix(".kvroute.log")
        requests = log.with_name(f"{policy}.requests.jsonl")
        if not requests.exists():
            continue
        meta = log.with_name("run.json")
        scale = float(json.loads(meta.read_text()).get("time_scale", 1.0)) if meta.exists() else 1.0
        where = log.parent.relative_to(root)
        errs = run_errors(log, requests, scale, policy if where == Path(".") else str(where))
        if errs.split or errs.local or errs.unmatched:  # runs that never weighed a split (never) say nothing
            runs.append(errs)
    return runs


def table(runs: list[Errors]) -> str:
    qs = " / ".join(f"p{round(q * 100)}" for q in QUANTILES)
    lines = [
        f"| run | splits | split error {qs} s | local | local error {qs} s | split − local median s |",
        "|---|---|---|---|---|---|",
    ]

    def cells(xs: list[float]) -> str:
        return " / ".join(f"{percentile(xs, q):+.3f}" for q in QUANTILES) if xs else "–"

    for r in runs:
        gap = f"{statistics.median(r.split) - statistics.median(r.local):+.3f}" if r.split and r.local else "–"
        run = r.run + (" (joined by order)" if r.by_order else "")
        lines.append(f"| {run} | {len(r.split)} | {cells(r.split)} | {len(r.local)} | {cells(r.local)} | {gap} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.pd_estimates",
        description=(__doc__ or "").split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("dir", type=Path, help="a bench run or pd_sweep output directory")
    a = ap.parse_args(argv)
    runs = collect(a.dir)
    if not runs:
        print(f"bench.pd_estimates: no <policy>.kvroute.log under {a.dir} (run with --kvroute-log-level debug)",
              file=sys.stderr)  # fmt: skip
        return 2
    print(table(runs))
    unmatched = sum(r.unmatched for r in runs)
    if unmatched:
        print(f"\n{unmatched} decisions had no measured request (failed, or sent without the bench's request id)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
