"""``make demo``: Envoy round robin vs Envoy + kvroute on a simulated vLLM fleet, side by side.

Many users ask several questions about a few long shared documents. The same requests, at the
same arrival times, go once through plain Envoy round robin and once through Envoy + kvroute, each
on a fresh fleet of simulated pods (h100-llama8b profile). The table compares prefix-cache hit
rate (from the pods' own counters), time to first token, throughput and per-pod load.

A thin wrapper over ``bench.harness`` (``python -m bench run`` does the same for any workload and
policy list).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import harness, report, workloads

# kvroute as deploy/ runs it: the ext_proc stream on its own HTTP/2 server (server.h2_port).
POLICIES = ["round-robin", "kvroute-approx:h2"]


def comparison(rows: Sequence[dict[str, Any]]) -> str:
    """The two rows and their ratio (kvroute / round robin) on the metrics that matter here."""
    cols = [
        ("hit_rate", "prefix hit rate", "{:.1%}"),
        ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
        ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
        ("output_tok_s", "output tok/s", "{:.0f}"),
        ("e2e_p50_s", "e2e p50 s", "{:.3f}"),
    ]
    head = ["router", "requests", "errors", *(h for _, h, _ in cols), "requests per pod"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['policy']} | failed: {r['failed']} |")
            continue
        cells = [r["policy"], str(r["requests"]), str(r["errors"])]
        cells += [report.cell(r, k, f) for k, _, f in cols]
        cells.append(" / ".join(str(int(p["requests"])) for p in r["pods"]))
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) == 2 and not any(r.get("failed") for r in rows):
        base, kv = rows
        ratios = ["**kvroute / round robin**", "", ""]
        for k, _, _ in cols:
            a, b = base.get(k), kv.get(k)
            ratios.append(f"**{b / a:.2f}x**" if a and b is not None else "-")
        lines.append("| " + " | ".join([*ratios, ""]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--profile", default="h100-llama8b")
    ap.add_argument("--documents", type=int, default=16, help="shared documents (groups)")
    ap.add_argument("--users", type=int, default=4, help="users per document")
    ap.add_argument("--questions", type=int, default=3, help="questions per user")
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the capacity measured by calibration")
    ap.add_argument("--rate", type=float, default=None, help="req/s instead of calibrating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars-per-token", type=harness.chars_per_token_arg, default="auto",
                    help="kvroute's routing.chars_per_token; auto: the simulated text's own (~8 characters a "
                    "token), as a tokenizer would count it")  # fmt: skip
    ap.add_argument("--out", default="bench/out/demo")
    a = ap.parse_args(argv)
    w = workloads.shared_prefix(
        groups=a.documents, users=a.users, questions=a.questions, doc_tokens=a.doc_tokens, seed=a.seed
    )
    command = " ".join(["python -m bench.demo", *(sys.argv[1:] if argv is None else argv)])
    cfg = harness.RunConfig(
        policies=POLICIES, pods=a.pods, profile=a.profile, load=a.load, rate=a.rate, seed=a.seed,
        calib_requests=min(len(w.items), 120), out=Path(a.out), command=command, chars_per_token=a.chars_per_token,
    )  # fmt: skip
    print(
        f"kvroute demo: {len(w.items)} requests ({a.documents} documents x {a.doc_tokens} tokens, "
        f"{a.users} users each asking {a.questions} questions) on {a.pods} simulated {a.profile} pods\n"
    )
    harness.stop_on_sigterm()
    try:
        runs, meta = harness.run(cfg, w)
    except KeyboardInterrupt:
        print("\ninterrupted: every process this demo started has been stopped", file=sys.stderr)
        return 130
    print()
    print(comparison([r.row for r in runs]))
    print(
        f"\n{meta['requests']} requests at {meta['rate_rps']:.1f} req/s (open loop, Poisson), ideal hit rate "
        f"{meta['ideal_hit_rate']:.1%} (one infinite cache). Results and plots: {cfg.out}/"
    )
    return 1 if any(r.row.get("failed") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
