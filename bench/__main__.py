"""``python -m bench``: benchmark kvroute against baselines and peer routers on a simulated fleet.

    python -m bench run --scenario shared-prefix --policies round-robin,kvroute-approx --pods 4 \\
        --profile h100-llama8b --load 0.7 --max-requests 300 --out bench/out/shared-prefix
    python -m bench run --trace ../shared/traces/mooncake_conversation_trace.jsonl --trace-sample 10 ...
    python -m bench workload --scenario multi-turn      # request count, tokens, ideal hit rate
    python -m bench policies                            # what each policy name runs
    python -m bench grid --quick                        # issue 20's routing grid (make bench-routing)
    python -m bench ramp --pods 2 --peak-load 1.3       # autoscaling signals under a load ramp (bench/ramp.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import harness, report, workloads
from bench.grid import SIM_PROCS_HELP
from bench.sim.profiles import PROFILES, get_profile


def _workload_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=sorted(workloads.SCENARIOS), help="synthetic workload")
    src.add_argument("--trace", help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    p.add_argument("--scenario-param", action="append", default=[], metavar="NAME=INT",
                   help="scenario: set one of its parameters (e.g. turns=20 for multi-turn; repeatable)")  # fmt: skip
    p.add_argument("--max-requests", type=int, default=None, help="use the first N requests")
    p.add_argument("--trace-sample", type=int, default=1, help="trace: keep one session in N over the whole trace")
    p.add_argument("--max-output-tokens", type=int, default=64, help="trace: cap on output_length")
    p.add_argument("--trace-spread", action="store_true",
                   help="trace: spread the requests that share a timestamp evenly over the trace's clock step "
                   "(Mooncake's tick every 3 s; as written, a tick's requests arrive at one instant)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="workload text and Poisson arrivals")
    p.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES), help="simulated pod profile")


def _build_workload(a: argparse.Namespace) -> workloads.Workload:
    kw = {}
    if a.trace:
        kw = {
            "sample": a.trace_sample,
            "spread": a.trace_spread,
            "max_output_tokens": a.max_output_tokens,
            "max_input_tokens": workloads.max_input_tokens(get_profile(a.profile).max_model_len, a.max_output_tokens),
        }
    else:
        for param in a.scenario_param:
            name, sep, value = param.partition("=")
            if not sep or not value.lstrip("-").isdigit():
                raise SystemExit(f"bench: --scenario-param {param!r}: use NAME=INT (e.g. turns=20)")
            kw[name] = int(value)
    try:
        return workloads.build(a.scenario, a.trace, a.max_requests, seed=a.seed, **kw)
    except TypeError as e:  # a parameter the scenario does not take
        raise SystemExit(f"bench: --scenario-param: {e}") from None


def timeline_doc() -> str:
    from bench import timeline

    return timeline.__doc__ or ""


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of 1 or more")
    return int(value)


def _policies(spec: str) -> list[str]:
    groups = {"all": harness.ALL, "pd": harness.PD}
    names = [n for p in spec.split(",") if p.strip() for n in groups.get(p.strip(), [p.strip()])]
    for n in names:
        try:
            one = harness.config_variant(n)[0]
            base = harness.replica_variant(one)[0]
        except ValueError as e:
            raise SystemExit(f"bench: {e}") from None
        if base != one and not base.startswith("kvroute-"):
            raise SystemExit(f"bench: {n!r}: only kvroute policies run as replicas")
        authz = any(base.endswith(f":{api}") for api in harness.TRANSPORTS)
        if base != one and base.endswith(":authz_http"):
            raise SystemExit(f"bench: {n!r}: ext_authz over HTTP runs one kvroute (server.authz_http_port)")
        if authz and base.startswith("kvroute-") and harness.api_variant(base)[1] is None:
            raise SystemExit(f"bench: {n!r}: only kvroute-approx and kvroute-precise run over another transport")
        base = harness.api_variant(base)[0]
        known = base in harness.POLICIES or base in harness.PD_POLICIES
        if not known and n.removesuffix(harness.BEHIND_ENVOY).partition(":")[0] not in ("sglang-router", "vllm-router"):
            raise SystemExit(f"unknown policy {n!r}; see `python -m bench policies`")
    return names


def cmd_run(a: argparse.Namespace, argv: list[str]) -> int:
    if any(p in harness.PD_POLICIES for p in _policies(a.policies)):
        try:
            harness.parse_pd_split(a.pd_split, a.pods)
        except ValueError as e:
            raise SystemExit(f"bench: {e}") from None
    w = _build_workload(a)
    if not w.items:
        print("bench: the workload has no requests", file=sys.stderr)
        return 2
    cfg = harness.RunConfig(
        policies=harness.with_replicas(_policies(a.policies), a.kvroute_replicas, a.redis),
        pods=a.pods,
        profile=a.profile,
        time_scale=a.time_scale,
        load=a.load,
        rate=a.rate,
        seed=a.seed,
        duration=a.duration,
        timeout=a.timeout,
        calib_requests=a.calib_requests,
        calib_concurrency=a.calib_concurrency,
        quiet_wait=a.quiet_wait,
        quiet_cores=a.quiet_cores,
        kvroute_config=a.kvroute_config,
        pd_split=a.pd_split,
        pd_threshold=a.pd_threshold,
        chars_per_token=a.chars_per_token,
        kvroute_log_level=a.kvroute_log_level,
        out=Path(a.out or f"bench/out/{w.name}"),
        repeat=a.repeat,
        sim_procs=a.sim_procs,
        command="python -m bench " + " ".join(argv),
    )
    runs, meta = harness.run(cfg, w)
    rows = [r.row for r in runs]
    print()
    print(report.markdown_table(rows))
    print()
    print(report.pod_table(rows))
    if any(p in harness.PD_POLICIES for p in cfg.policies):
        print()
        print(report.pd_table(rows))
    print(f"\nrate {meta['rate_rps']:.2f} req/s, {meta['requests']} requests, {meta['elapsed_s']} s; wrote {cfg.out}/")
    return 1 if any(r.get("failed") for r in rows) else 0


def cmd_timeline(a: argparse.Namespace, argv: list[str]) -> int:
    from bench import timeline

    w = _build_workload(a)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()] if a.policies else timeline.DEFAULT_POLICIES
    cfg = timeline.TimelineConfig(
        event=a.event, policies=policies, rate=a.rate, pods=a.pods, delta=a.delta, profile=a.profile,
        time_scale=a.time_scale, event_at=a.event_at, duration=a.duration, window=a.window,
        drain_timeout=a.drain_timeout, detect_s=a.detect_s, replace_s=a.replace_s, timeout=a.timeout, seed=a.seed,
        kvroute_config=a.kvroute_config, out=Path(a.out or f"bench/out/timeline-{a.event}"),
        command="python -m bench " + " ".join(argv),
    )  # fmt: skip
    try:
        results = timeline.run(cfg, w)
    except ValueError as e:
        raise SystemExit(f"bench: {e}") from None
    print()
    print(timeline.markdown_table(results, cfg.window))
    print(f"\nwrote {cfg.out}/ (timeline.json, timeline-{a.event}.png, <policy>.requests.jsonl)")
    return 1 if any("error" in r for r in results) else 0


def cmd_workload(a: argparse.Namespace) -> int:
    w = _build_workload(a)
    ideal = workloads.ideal_hit_rate(w.items, get_profile(a.profile).block_size)
    print(f"{w.name}: {len(w.items)} requests, {ideal['prompt_tokens']} prompt tokens, "
          f"ideal hit rate {ideal['hit_rate']:.1%}  {w.params}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["grid"]:  # its own parser (python -m bench grid --help)
        from bench import grid

        return grid.main(argv[1:])
    if argv[:1] == ["ramp"]:  # its own parser (python -m bench ramp --help)
        from bench import ramp

        return ramp.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="replay a workload through each policy on a fresh simulated fleet",
                       description=harness.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _workload_args(r)
    r.add_argument("--policies", default="round-robin,kvroute-approx",
                   help=f"comma list, 'all' ({', '.join(harness.ALL)}) or 'pd' ({', '.join(harness.PD)})")  # fmt: skip
    r.add_argument("--pods", type=int, default=4)
    r.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="pods run this many times slower, arrivals are slowed as much and kvroute's "
        "cost settings scaled: every figure is in pod time, with the harness's own jitter "
        "(Python, Envoy, the client on a busy host) that much smaller next to it",
    )
    r.add_argument("--load", type=float, default=0.7, help="arrival rate as a fraction of measured capacity")
    r.add_argument("--rate", type=float, default=None, help="arrival rate in req/s (skips calibration)")
    r.add_argument("--duration", type=float, default=None, help="drop requests arriving after this many seconds")
    r.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    r.add_argument("--calib-requests", type=int, default=160, help="requests in the capacity calibration")
    r.add_argument("--calib-concurrency", type=int, default=8, help="in-flight requests per pod when calibrating")
    r.add_argument("--quiet-wait", type=float, default=0.0,
                   help="wait up to this many s before each policy for other work on the host to stop")  # fmt: skip
    r.add_argument("--quiet-cores", type=float, default=0.5, help="cores other work may use to count as quiet")
    r.add_argument(
        "--kvroute-config",
        default=None,
        help="kvroute YAML (routing, scoring...) for the kvroute policies; the run's pods are added",
    )
    r.add_argument("--pd-split", default="1:3",
                   help="P/D policies: PREFILL:DECODE[:BOTH] pods summing to --pods (BOTH: role both)")  # fmt: skip
    r.add_argument("--chars-per-token", type=harness.chars_per_token_arg, default=None,
                   help="kvroute's routing.chars_per_token for its policies: a number, or auto (measured "
                        "on the workload); default: kvroute's own (4, English text)")  # fmt: skip
    r.add_argument("--pd-threshold", type=int, default=1000,
                   help="kvroute-pd-conditional: split when the decode pod lacks this many prompt tokens")  # fmt: skip
    r.add_argument("--kvroute-log-level", **harness.KVROUTE_LOG_LEVEL_ARG)
    r.add_argument("--kvroute-replicas", type=int, default=1, metavar="N",
                   help="also run each kvroute policy as N replicas behind Envoy, sharing nothing (POLICY@N); "
                        "any policy can also be named POLICY@N or POLICY@N+redis")  # fmt: skip
    r.add_argument("--redis", action="store_true",
                   help="and as N replicas sharing state through a redis-server on loopback "
                        "(POLICY@N+redis)")  # fmt: skip
    r.add_argument("--repeat", type=_positive_int, default=1, metavar="N",
                   help="run every policy N times on the same arrivals, fresh fleets each time (interleaved); "
                        "the table shows medians with their min-max, each run's files are in OUT/run-K/")  # fmt: skip
    r.add_argument("--sim-procs", action="store_true", help=SIM_PROCS_HELP)
    r.add_argument("--out", default=None, help="output directory (default bench/out/<workload>)")
    t = sub.add_parser("timeline", help="a fleet event under load (scale-out, scale-in, rolling-restart, pod-kill)",
                       description=timeline_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _workload_args(t)
    t.add_argument("--event", required=True, choices=["scale-out", "scale-in", "rolling-restart", "pod-kill"])
    t.add_argument("--policies", default=None,
                   help="comma list (see the description); default: kvroute's four and the two peers")  # fmt: skip
    t.add_argument(
        "--rate", type=float, required=True, help="arrival rate in req/s (Poisson; a trace's own times rescaled)"
    )
    t.add_argument("--pods", type=int, default=4, help="pods before scale-out / after scale-in / replaced or killed")
    t.add_argument("--delta", type=int, default=2, help="pods added (scale-out) or removed (scale-in)")
    t.add_argument("--event-at", type=float, default=60.0, help="s after the load starts")
    t.add_argument("--duration", type=float, default=120.0, help="s of arrivals")
    t.add_argument("--window", type=float, default=10.0, help="s per window in the figures")
    t.add_argument("--drain-timeout", type=float, default=60.0, help="s a draining pod may take to finish")
    t.add_argument("--detect-s", type=float, default=5.0, help="pod-kill: s until the routers learn it")
    t.add_argument("--replace-s", type=float, default=10.0, help="pod-kill: s after that until its replacement joins")
    t.add_argument("--time-scale", type=float, default=1.0, help="pods this many times slower (as in run)")
    t.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    t.add_argument("--kvroute-config", default=None, help="kvroute YAML (routing...) for the kvroute policies")
    t.add_argument("--out", default=None, help="output directory (default bench/out/timeline-<event>)")
    w = sub.add_parser("workload", help="print a workload's size and ideal hit rate")
    _workload_args(w)
    sub.add_parser("policies", help="list the policies")
    sub.add_parser("ramp", help="autoscaling signals under a load ramp (python -m bench ramp --help)")
    sub.add_parser("grid", help="issue 20's routing grid: workloads x loads x pod counts (grid --help)")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        harness.stop_on_sigterm()
        try:
            return cmd_run(a, argv)
        except KeyboardInterrupt:
            print("\nbench: interrupted; every process it started has been stopped", file=sys.stderr)
            return 130
    if a.cmd == "timeline":
        harness.stop_on_sigterm()
        return cmd_timeline(a, argv)
    if a.cmd == "workload":
        return cmd_workload(a)
    for name, what in {**harness.POLICIES, **harness.PD_POLICIES}.items():
        print(f"{name:18} {what}")
    print(f"{'KVROUTE@N[+redis]':18} a kvroute policy as N replicas behind Envoy (round robin over ext_proc "
          "streams), sharing state through a redis-server with +redis")  # fmt: skip
    print(f"{'KVROUTE:authz':18} kvroute-approx, kvroute-precise (or noop-extproc) behind Envoy's ext_authz "
          "filter instead of ext_proc (envoy/epp-authz.yaml: a Check per request; :authz_http, over HTTP)")  # fmt: skip
    print(f"{'KVROUTE:h2':18} kvroute-approx, kvroute-precise (or noop-extproc) with Envoy's ext_proc stream on "
          "kvroute's own HTTP/2 server (server.h2_port) instead of grpcio; :h2-streamed, with the body STREAMED "
          "right behind the headers instead of BUFFERED")  # fmt: skip
    for key, settings in harness.CONFIG_VARIANTS.items():
        print(f"{'KVROUTE~' + key:18} a kvroute policy (last in its name) with {settings}")
    print(f"{'PEER+envoy':18} a peer router (sglang-router, vllm-router[:POLICY]) behind the same Envoy as "
          "kvroute, as behind a gateway: the path equal, the routing compared")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
