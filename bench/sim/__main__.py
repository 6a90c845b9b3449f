"""``python -m bench.sim``: run a fleet of simulated vLLM pods until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from bench.sim.events import ENCODINGS
from bench.sim.fleet import Fleet, FleetConfig
from bench.sim.pod import TLSFiles
from bench.sim.profiles import PROFILES, TUNABLE, parse_overrides


def build_parser() -> argparse.ArgumentParser:
    profiles = "; ".join(f"{n}: {p.block_size}-token blocks, {p.capacity_blocks} blocks" for n, p in PROFILES.items())
    ap = argparse.ArgumentParser(
        prog="python -m bench.sim",
        description="Run simulated vLLM pods (OpenAI API, prefix cache, /metrics, ZMQ KV events, "
        "P/D, faults) in one process. Each pod i listens on HTTP base-port+i, publishes "
        "KV events on zmq-base-port+2i and answers replay requests on zmq-base-port+2i+1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--pods", type=int, default=2, help="number of pods")
    ap.add_argument(
        "--base-port",
        type=int,
        default=8001,
        help="HTTP port of pod 0; pod i uses base-port+i (0: any free port per pod)",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address every socket binds to")
    ap.add_argument(
        "--profile", default="fast", choices=sorted(PROFILES), help=f"latency/capacity profile ({profiles})"
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"change one numeric field of the profile, e.g. a host calibration (repeatable; {', '.join(TUNABLE)})",
    )
    ap.add_argument(
        "--roles", default=None, help="P/D roles in pod order, e.g. 'prefill:2,decode:6'; unnamed pods are 'both'"
    )
    ap.add_argument(
        "--zmq-base-port",
        type=int,
        default=5557,
        help="KV events PUB port of pod 0 (pod i: +2i, its replay ROUTER +2i+1; 0: any free ports)",
    )
    ap.add_argument("--no-kv-events", action="store_true", help="do not publish KV events")
    ap.add_argument(
        "--kv-events-encoding",
        default="map",
        choices=ENCODINGS,
        help="'map': vLLM 0.26+ events as maps in an array batch; 'array': legacy tagged "
        "arrays; 'map-batch': the batch itself a map too (vLLM main)",
    )
    ap.add_argument("--topic", default="kv", help="ZMQ topic frame of every KV event message")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size in tokens (default: profile)")
    ap.add_argument(
        "--capacity-blocks", type=int, default=None, help="KV cache capacity per pod in blocks (default: profile)"
    )
    ap.add_argument("--model", default="sim-model", help="served model name")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="directory with tokenizer.json (+ tokenizer_config.json chat_template); needs "
        "the 'tokenizers' and 'jinja2' packages. Default: built-in hashed tokenizer",
    )
    ap.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply every modelled duration (0.5 = twice as fast)"
    )
    ap.add_argument(
        "--max-tokens-default", type=int, default=16, help="output length when a request sets no max_tokens"
    )
    ap.add_argument(
        "--pull-timeout",
        type=float,
        default=30.0,
        help="seconds a prefill pod keeps P/D blocks pinned waiting for the decode pod",
    )
    ap.add_argument(
        "--fault-error-rate",
        type=float,
        default=0.0,
        help="fraction of generation requests answered with HTTP 500 (all pods)",
    )
    ap.add_argument(
        "--fault-slowdown", type=float, default=1.0, help="multiply every pod's step time (a slow/throttled GPU)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed for the error-rate fault")
    ap.add_argument(
        "--ready-file",
        default=None,
        help="write a JSON list describing every pod (url, address, KV endpoints, engine "
        "id, role) here once all pods listen",
    )
    ap.add_argument("--tls-cert", default=None, help="serve https with this PEM certificate (chain)")
    ap.add_argument("--tls-key", default=None, help="the --tls-cert's unencrypted PEM key")
    ap.add_argument(
        "--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS; with --tls-cert)"
    )
    ap.add_argument(
        "--no-auto-tool-choice",
        action="store_true",
        help="answer as vLLM started without --enable-auto-tool-choice and --tool-call-parser: a chat or Messages "
        "request with tools whose tool_choice needs a parser (auto, the default with tools) gets 400",
    )
    ap.add_argument("--quiet", action="store_true", help="do not print the listening summary")
    return ap


def tls_from_args(args: argparse.Namespace) -> TLSFiles | None:
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return TLSFiles(args.tls_cert, args.tls_key, args.tls_client_ca)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    return FleetConfig(
        pods=args.pods,
        profile=args.profile,
        host=args.host,
        base_port=args.base_port,
        zmq_base_port=None if args.no_kv_events else args.zmq_base_port,
        roles=args.roles,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        model=args.model,
        kv_events_encoding=args.kv_events_encoding,
        topic=args.topic,
        time_scale=args.time_scale,
        default_max_tokens=args.max_tokens_default,
        tokenizer=args.tokenizer,
        pull_timeout_s=args.pull_timeout,
        error_rate=args.fault_error_rate,
        slowdown=args.fault_slowdown,
        seed=args.seed,
        profile_overrides=parse_overrides(args.overrides),
        tls=tls_from_args(args),
        auto_tool_choice=not args.no_auto_tool_choice,
    )


async def serve(cfg: FleetConfig, ready_file: str | None, quiet: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Fleet(cfg) as fleet:
        desc = fleet.describe()
        if not quiet:
            p0 = fleet.pods[0]
            overrides = "".join(f" {k}={v:g}" for k, v in cfg.profile_overrides.items())
            print(
                f"bench.sim: {len(fleet.pods)} pods, profile {cfg.profile}{overrides}, model {cfg.model}, "
                f"block {p0.block_size} tokens x {p0.capacity_blocks} blocks, time scale {cfg.time_scale}"
            )
            for d in desc:
                print(
                    f"  pod {d['index']} [{d['role']}] {d['url']}  events {d['kv_events_endpoint']}  "
                    f"replay {d['replay_endpoint']}  engine {d['engine_id']}"
                )
            print(
                "  admin: GET /sim/info, GET /sim/stats, POST /sim/fault "
                '{"restart":true,"down_s":1} | {"stall_s":2} | {"error_rate":0.2} | {"slowdown":3}'
            )
            print("Ctrl-C to stop.", flush=True)
        if ready_file:
            tmp = Path(ready_file + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "pods": desc}, indent=1))
            tmp.replace(ready_file)  # atomic: a poller never reads half a file
        await stop.wait()
        if not quiet:
            print("bench.sim: shutting down", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        cfg.validate()
    except ValueError as e:
        print(f"bench.sim: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg, args.ready_file, args.quiet))
    except OSError as e:
        print(f"bench.sim: cannot listen: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # e.g. --tokenizer without the 'tokenizers' package
        print(f"bench.sim: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
