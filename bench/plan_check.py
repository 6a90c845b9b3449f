"""Check ``kvroute plan`` with the simulator: plan a fleet for a workload, then run simulated pods
(the same latency profile) behind real Envoy and kvroute at the planned count and at one pod fewer,
and report whether the TTFT p90 and ITL targets hold in each run.

Layouts (``--layout``): ``aggregated`` (every pod prefills and decodes: the planned count, then one
pod fewer) and ``pd`` (prefill and decode pods, kvroute splitting every request with the gateway
hand-off, as the simulator's P/D policies run: the planned counts, then one prefill pod fewer, which
should miss the TTFT target, and one decode pod fewer, which should miss the ITL target).

    python -m bench.plan_check --profile h100-llama8b --rate 7 --prompt-tokens 6000 --output-tokens 16 \\
        --ttft-p90-ms 500 --itl-ms 50 --duration 60 --layout aggregated
    python -m bench.plan_check --profile h100-llama8b --rate 8 --prompt-tokens 4000 --output-tokens 400 \\
        --ttft-p90-ms 300 --itl-ms 11 --duration 60 --layout pd
    python -m bench.plan_check --export-profile h100-llama8b -o h100.json   # for kvroute plan --profile

The workload: Poisson arrivals at ``--rate``; each prompt is a prefix shared by one of
``--documents`` documents (``--prefix-reuse`` of its tokens) and a fresh rest. ITL is each request's
mean gap between streamed tokens; the target holds when their 90th percentile is within it (what
``kvroute plan`` estimates: on an aggregated pod, the decode step plus the prefill chunks that share
steps with a request's decode, at their 90th percentile count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench import loadgen
from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from bench.sim.profiles import PROFILES, LatencyProfile, get_profile
from bench.workloads import MODEL, words
from extproc import plan as planner


def export_profile(profile: LatencyProfile) -> str:
    return json.dumps(asdict(profile), indent=1)


def requests(args: argparse.Namespace) -> list[loadgen.RequestSpec]:
    rng = random.Random(args.seed)
    shared = round(args.prompt_tokens * args.prefix_reuse)
    docs = [words(random.Random(f"doc/{i}"), shared) for i in range(args.documents)] if shared else [""]
    n = max(1, round(args.rate * args.duration))
    out = []
    for i, at in enumerate(loadgen.poisson_arrivals(n, args.rate, args.seed)):
        text = rng.choice(docs) + words(rng, round(args.prompt_tokens) - shared)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": round(args.output_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.append(loadgen.RequestSpec(orjson.dumps(body), at=at, request_id=f"plan-{i}"))
    return out


def run_fleet(
    pods: int, args: argparse.Namespace, specs: list[loadgen.RequestSpec], decode: int | None = None
) -> dict[str, Any]:
    """Simulated pods behind Envoy and kvroute; TTFT p90 and ITL p90 of the run. ``decode``: P/D,
    ``pods`` prefill pods and that many decode pods, every request split (gateway hand-off)."""
    sim_args = ["--pods", str(pods + (decode or 0)), "--base-port", "0", "--no-kv-events", "--profile", args.profile,
                "--quiet"]  # fmt: skip
    if decode is not None:
        sim_args += ["--roles", f"prefill:{pods},decode:{decode}"]
    sim, data = start_with_ready_file(python_module("bench.sim", *sim_args))
    try:
        assert isinstance(data, dict)
        addrs = [p["address"] for p in data["pods"]]
        eps = [{"address": p["address"], "role": p.get("role", "both")} for p in data["pods"]]
        config: dict[str, Any] = {"pools": {"default": {"endpoints": eps}}}
        if decode is not None:
            config["pd"] = {"disaggregation": "always", "handoff": "gateway"}
        with tempfile.TemporaryDirectory(prefix="plan-check-") as d:
            cfg = Path(d) / "kvroute.yaml"
            cfg.write_text(yaml.safe_dump(config))
            with (
                KVRouteProcess(config=str(cfg)) as k,
                EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=addrs) as env,
            ):
                recs = asyncio.run(loadgen.run(env.url, specs, timeout=args.duration * 4 + 30))
    finally:
        stop(sim)
    ok = [r for r in recs if r.ok and r.ttft is not None]
    itl = [sum(r.itl) / len(r.itl) for r in ok if r.itl]
    ttft_p90 = loadgen.percentile([r.ttft for r in ok if r.ttft is not None], 0.9)
    itl_p90 = loadgen.percentile(itl, 0.9)
    ttft_ok = ttft_p90 is not None and ttft_p90 <= args.ttft_p90_ms / 1000
    itl_ok = itl_p90 is None or itl_p90 <= args.itl_ms / 1000
    return {
        "pods": pods,
        "decode_pods": decode,
        "ttft_holds": ttft_ok,
        "itl_holds": itl_ok,
        "requests": len(recs),
        "ok": len(ok),
        "ttft_p90_s": ttft_p90,
        "itl_p90_s": itl_p90,
        "holds": len(ok) == len(recs) and ttft_ok and itl_ok,
    }


def check(args: argparse.Namespace) -> dict[str, Any]:
    profile = get_profile(args.profile)
    p = planner.Profile.load_dict(asdict(profile))
    w = planner.Workload(
        args.rate,
        args.prompt_tokens,
        args.output_tokens,
        args.prefix_reuse,
        args.documents * round(args.prompt_tokens * args.prefix_reuse),
        "bench.plan_check",
    )
    m = planner.Memory(args.accelerator_gib, args.weights_gib, profile.kv_bytes_per_token)
    t = planner.Targets(args.ttft_p90_ms / 1000, args.itl_ms / 1000)
    specs = requests(args)
    out: dict[str, Any] = {}
    if args.layout in ("aggregated", "both"):
        planned = planner.aggregated(w, p, m, t)
        runs = [run_fleet(n, args, specs) for n in (planned.prefill_pods, planned.prefill_pods - 1) if n >= 1]
        out |= {"plan": asdict(planned), "runs": runs}
    if args.layout in ("pd", "both"):
        pd = planner.disaggregated(w, p, m, t)
        shapes = [(pd.prefill_pods, pd.decode_pods), (pd.prefill_pods - 1, pd.decode_pods),
                  (pd.prefill_pods, pd.decode_pods - 1)]  # fmt: skip
        out |= {"pd_plan": asdict(pd), "pd_runs": [run_fleet(n, args, specs, d) for n, d in shapes if min(n, d) >= 1]}
    return out


def run_line(r: dict[str, Any]) -> str:
    ttft = "-" if r["ttft_p90_s"] is None else f"{r['ttft_p90_s'] * 1e3:.0f} ms"
    itl = "-" if r["itl_p90_s"] is None else f"{r['itl_p90_s'] * 1e3:.1f} ms"
    shape = f"{r['pods']} pods" if r["decode_pods"] is None else f"{r['pods']} prefill + {r['decode_pods']} decode"
    checks = (("TTFT", r["ttft_holds"]), ("ITL", r["itl_holds"]), ("requests", r["ok"] == r["requests"]))
    missed = [name for name, ok in checks if not ok]
    verdict = "targets hold" if r["holds"] else "missed: " + ", ".join(missed)
    return f"  {shape}: {r['ok']}/{r['requests']} ok, TTFT p90 {ttft}, ITL p90 {itl}: {verdict}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.plan_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES))
    ap.add_argument("--export-profile", metavar="NAME", choices=sorted(PROFILES), help="write NAME as JSON and exit")
    ap.add_argument("-o", "--output", help="with --export-profile: the file (default stdout)")
    ap.add_argument("--rate", type=float, default=7.0)
    ap.add_argument("--prompt-tokens", type=float, default=6000)
    ap.add_argument("--output-tokens", type=float, default=16)
    ap.add_argument("--prefix-reuse", type=float, default=0.0)
    ap.add_argument("--documents", type=int, default=20, help="distinct shared prefixes (with --prefix-reuse)")
    ap.add_argument("--ttft-p90-ms", type=float, default=500)
    ap.add_argument("--itl-ms", type=float, default=50)
    ap.add_argument("--accelerator-gib", type=float, default=80)
    ap.add_argument("--weights-gib", type=float, default=15)
    ap.add_argument("--duration", type=float, default=60, help="seconds of arrivals per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=["aggregated", "pd", "both"], default="both",
                    help="which of the plan's fleets to run (P/D: kvroute splits every request)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.export_profile:
        text = export_profile(get_profile(args.export_profile))
        if args.output:
            Path(args.output).write_text(text + "\n")
        else:
            print(text)
        return 0
    try:
        res = check(args)
    except planner.PlanError as e:
        print(f"bench.plan_check: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        if "plan" in res:
            pl = res["plan"]
            print(f"plan: {pl['prefill_pods']} pods (estimated TTFT p90 {pl['ttft_p90_s'] * 1e3:.0f} ms, "
                  f"ITL p90 {pl['itl_s'] * 1e3:.1f} ms with {pl['prefills_while_decoding_p90']} prefills "
                  "while a request decodes)")  # fmt: skip
            print("\n".join(run_line(r) for r in res["runs"]))
        if "pd_plan" in res:
            pl = res["pd_plan"]
            print(f"P/D plan: {pl['prefill_pods']} prefill + {pl['decode_pods']} decode pods (estimated TTFT p90 "
                  f"{pl['ttft_p90_s'] * 1e3:.0f} ms, ITL {pl['itl_s'] * 1e3:.1f} ms)")  # fmt: skip
            print("\n".join(run_line(r) for r in res["pd_runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
