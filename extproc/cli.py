"""``kvroute`` command line."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from extproc import __version__, envoyconfig
from extproc import plan as planner
from extproc.admin import client as admin_client
from extproc.config import Config, ConfigError, load_config

EXIT_CONFIG = 2
EXIT_STARTUP = 3

DESCRIPTION = """\
kvroute: a KV-cache-aware router for vLLM behind Envoy.

Envoy streams each request to kvroute over gRPC (ext_proc). kvroute parses the OpenAI body,
hashes the prompt prefix, finds the pod most likely to hold it in its KV cache without
overloading any pod, and tells Envoy where to send it:
  epp mode      header + metadata x-gateway-destination-endpoint=<ip:port,...> (Endpoint Picker
                protocol; Envoy's override_host policy sends it to that pod, retries to the next)
  cluster mode  header x-kvroute-cluster=<cluster> (one Envoy cluster per pod or pool)
"""

EPILOG = """\
examples:
  kvroute serve --endpoints 127.0.0.1:8001,127.0.0.1:8002
  kvroute serve --pool-name llama --pool-namespace llm      # Kubernetes: follow an InferencePool
  kvroute serve --selector app=vllm --target-port 8000      # Kubernetes: pods by label
  kvroute serve --endpoints-file endpoints.yaml             # a file, re-read when it changes
  kvroute serve --config kvroute.yaml --grpc-port 9002
  kvroute check-config kvroute.yaml

Flags override the config file. Exit code 2: the configuration is invalid; 3: a port to listen on
(server.grpc_port, health_port, metrics_port) is taken or cannot be bound, or discovery cannot start
(the endpoints file is unreadable, the Kubernetes API refuses the watch or cannot be reached), or
with --workers, a worker exits before it serves.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="run the ext_proc server",
        description="Run the ext_proc gRPC server, the gRPC health service and the Prometheus endpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--config",
        "-c",
        help="YAML config file (pools, models, routing, headers, server); reloaded when it changes or on SIGHUP "
        "(flags keep overriding it; a change that needs a restart, e.g. a port, is refused and logged)",
    )
    s.add_argument(
        "--endpoints",
        help="comma-separated ip:port list of vLLM pods; becomes pool 'default' (quick start without a file)",
    )
    s.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME",
        help="serve only these models (repeatable); others get 404. Default: any model",
    )
    s.add_argument("--mode", choices=["epp", "cluster"], help="how the pick is returned to Envoy (default epp)")
    s.add_argument("--listen", help="address to bind (default 0.0.0.0)")
    s.add_argument("--grpc-port", type=int, help="ext_proc gRPC port (default 9002; 0 = pick a free one)")
    s.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    s.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 9090; 0 = off)")
    s.add_argument("--h2-port", type=int,
                   help="also serve ext_proc on this port with kvroute's own HTTP/2 server, at about half "
                   "grpcio's CPU per request (point Envoy's ext_proc cluster here; default 0 = off)")  # fmt: skip
    s.add_argument("--authz-http-port", type=int,
                   help="serve Envoy's ext_authz over HTTP on this port (envoy-config --api ext_authz_http; "
                   "default 0 = off)")  # fmt: skip
    s.add_argument("--admin-port", type=int,
                   help="admin gRPC port for kvroute explain / endpoints (default 0 = off; on 127.0.0.1)")  # fmt: skip
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    s.add_argument("--event-loop", choices=["uvloop", "asyncio"], help="default uvloop (less CPU per request)")
    s.add_argument(
        "--workers",
        type=_workers,
        metavar="N|auto",
        help="ext_proc worker processes sharing the ports (SO_REUSEPORT) and the routing state, under one "
        "supervisor that serves health and metrics for all and restarts a worker that dies; auto: one per "
        "usable CPU (default 1: a single process)",
    )
    s.add_argument(
        "--redis-url",
        metavar="URL",
        help="share routing state with other kvroute replicas through Redis: redis://HOST:PORT/DB (rediss:// "
        "for TLS; the password from $KVROUTE_REDIS_PASSWORD); the config's redis section has the rest",
    )
    d = s.add_argument_group(
        "discovery",
        "Where the pods come from when not listed with --endpoints or in the config (discovery section):",
    )
    d.add_argument(
        "--endpoints-file",
        metavar="PATH",
        help="a YAML/JSON file {pools: {<name>: {endpoints: [...]}}}, re-read when it changes (provider file)",
    )
    d.add_argument(
        "--pool-name",
        action="append",
        metavar="NAME",
        help="follow this InferencePool (inference.networking.k8s.io/v1) in Kubernetes: its selector and "
        "targetPorts pick the pods; repeatable (one kvroute pool each, named like it)",
    )
    d.add_argument("--pool-namespace", metavar="NS", help="the InferencePools' and pods' namespace")
    d.add_argument(
        "--selector",
        metavar="K=V,...",
        help="Kubernetes without an InferencePool: the vLLM pods' labels (pool 'default'; needs --target-port)",
    )
    d.add_argument("--target-port", type=int, metavar="PORT", help="the pods' serving port (with --selector)")
    d.add_argument("--kubeconfig", metavar="PATH", help="default: in-cluster service account, else ~/.kube/config")

    c = sub.add_parser("check-config", help="validate a config file and print the effective config")
    c.add_argument("config")
    c.add_argument("--endpoints", help=argparse.SUPPRESS)

    e = sub.add_parser(
        "envoy-config",
        help="print a ready Envoy config for kvroute (mode, pods, kvroute address, ports, TLS)",
        description=envoyconfig.DESCRIPTION,
        epilog=envoyconfig.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    envoyconfig.add_arguments(e)
    admin_client.add_arguments(sub)
    planner.add_arguments(sub)
    return p


def _workers(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of processes (1 or more), or auto")
    return n


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {}
    if getattr(args, "endpoints", None):
        eps = [{"address": a.strip()} for a in args.endpoints.split(",") if a.strip()]
        o["pools"] = {"default": {"endpoints": eps}}
        o["default_pool"] = "default"
    discovery = _discovery_overrides(args)
    if discovery:
        o["discovery"] = discovery
    if getattr(args, "model", None):
        pools = [p["name"] for p in discovery.get("kubernetes", {}).get("pools", [])] or ["default"]
        o["models"] = {m: {"pool": pools[0]} for m in args.model}
    if getattr(args, "mode", None):
        o["mode"] = args.mode
    server = {
        k: getattr(args, a)
        for k, a in (
            ("listen", "listen"),
            ("grpc_port", "grpc_port"),
            ("health_port", "health_port"),
            ("metrics_port", "metrics_port"),
            ("admin_port", "admin_port"),
            ("authz_http_port", "authz_http_port"),
            ("h2_port", "h2_port"),
            ("log_level", "log_level"),
            ("event_loop", "event_loop"),
            ("workers", "workers"),
        )
        if getattr(args, a, None) is not None
    }
    if server:
        o["server"] = server
    if getattr(args, "redis_url", None):
        o["redis"] = {"url": args.redis_url}
    return o


def _discovery_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The discovery flags as a config ``discovery`` section (empty when none is given)."""
    if getattr(args, "endpoints_file", None):
        return {"provider": "file", "file": {"path": args.endpoints_file}}
    pools: list[dict[str, Any]] = [{"name": n, "inference_pool": n} for n in getattr(args, "pool_name", None) or ()]
    if getattr(args, "selector", None):
        selector = {}
        for part in args.selector.split(","):
            k, sep, v = part.partition("=")
            if not sep or not k.strip():
                raise ConfigError(f"--selector: {part!r} is not key=value")
            selector[k.strip()] = v.strip()
        pools.append({"name": "default", "selector": selector, "target_port": args.target_port})
    elif getattr(args, "target_port", None) is not None:
        raise ConfigError("--target-port: needs --selector")
    k8s: dict[str, Any] = {"pools": pools} if pools else {}
    for key, attr in (("namespace", "pool_namespace"), ("kubeconfig", "kubeconfig")):
        if getattr(args, attr, None):
            k8s[key] = getattr(args, attr)
    if not k8s:
        return {}
    return {"provider": "kubernetes", "kubernetes": k8s}


def build(args: argparse.Namespace) -> Config:
    return load_config(args.config, overrides_from_args(args))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("explain", "endpoints"):  # a client of a running kvroute's admin service
        return admin_client.run(args)
    if args.command == "plan":  # arithmetic on its flags alone, no kvroute config
        return planner.run(args)
    if args.command == "envoy-config":  # its flags are Envoy's, not kvroute's own config
        try:
            envoyconfig.run(args, ["kvroute", *(sys.argv[1:] if argv is None else argv)])
        except ConfigError as e:
            print(f"kvroute envoy-config: {e}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    try:
        config = build(args)
    except ConfigError as e:
        print(f"kvroute: invalid configuration:\n{e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check-config":
        print(config.model_dump_json(indent=2))
        return 0
    from extproc.app import run_loop, serve
    from extproc.errors import StartupError
    from extproc.observability import setup_logging
    from extproc.workers import is_worker, supervise, worker_count

    setup_logging(config.server.log_level)
    try:
        if worker_count(config.server.workers) > 1 and not is_worker():
            return supervise(config, sys.argv[1:] if argv is None else argv)
        with contextlib.suppress(KeyboardInterrupt):
            run_loop(config.server.event_loop, serve(config, args.config, overrides_from_args(args)))
    except StartupError as e:
        print(f"kvroute: cannot start: {e}", file=sys.stderr)
        return EXIT_STARTUP
    return 0


if __name__ == "__main__":
    sys.exit(main())
