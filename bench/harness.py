"""Run one workload through several routing policies, each on a fresh simulated fleet.

Per policy: start ``python -m bench.sim`` (fresh, empty caches), start the router under test in
front of it, replay the workload with the streaming client at the same arrival times, read the
pods' counters, stop everything (also on errors and Ctrl-C). A router that fails to start is
reported with its log tail and the other policies still run.

Load. ``--load`` is a fraction of the fleet's capacity, measured once per run: a closed-loop
calibration (``--calib-concurrency`` requests in flight per pod, non-streaming) sends the first
requests of the same workload through plain Envoy round robin on a fresh fleet; the throughput
between the 20th and 80th percentile of completions is the capacity. ``--rate`` skips it.
Arrivals are Poisson at ``load × capacity``, or the trace's own timestamps rescaled to that rate.

kvroute-approx and kvroute-precise (and their replica variants) run as deploy/base/kvroute.yaml runs
kvroute in a cluster: scraping every pod's /metrics at the shipped interval, so queues and each
pod's KV size (what the approximate index remembers) come from the pods (``production_scrape``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench import loadgen, report, results, workloads
from bench.envoy import AUTHZ_CONFIGS, EnvoyProcess, body_mode_patch
from bench.peers import PEERS, PeerRouter
from bench.procs import cpu_seconds, machine_busy, python_module, ready_process, start_with_ready_file, stop
from bench.replicas import KVRouteReplicas, ReplicatedEnvoy
from bench.sim.profiles import get_profile
from bench.sim.tokenizer import export_tokenizer
from bench.workloads import Item, Workload
from extproc.config import HeadersConfig

POLICIES: dict[str, str] = {
    "round-robin": "Envoy ROUND_ROBIN over the pool, no ext_proc (a Kubernetes Service)",
    "random": "Envoy RANDOM over the pool, no ext_proc",
    "least-request": "Envoy LEAST_REQUEST over the pool, no ext_proc (least loaded: no-reuse's reference)",
    "noop-extproc": "Envoy + a do-nothing Python ext_proc server routing round robin (bench.noop_extproc on uvloop, "
    "kvroute's processing mode): the path of any grpcio ext_proc router, without a decision",
    "naive-hash": "client hashes the first 256 chars of the last message mod N; Envoy routes by cluster header",
    "kvroute-approx": "Envoy + kvroute (approximate prefix index), envoy/epp.yaml",
    "kvroute-precise": "Envoy + kvroute fed by the pods' KV events, keyed with their tokenizer (precise index)",
    "kvroute-shadow": "Envoy round robin routes, kvroute in mode shadow predicts (python -m bench.shadow)",
    "sglang-router": "sglang-router --policy cache_aware (full HTTP proxy); sglang-router:POLICY for others",
    "vllm-router": "vllm-router --policy cache_aware (full HTTP proxy); vllm-router:POLICY for others",
}
ALL = [
    *(p for p in POLICIES if p not in ("kvroute-shadow", "least-request", "noop-extproc")),
    "vllm-router:consistent_hash",
]
# Prefill/decode disaggregation over the same pod count (``--policies pd``): "never" routes over
# every pod as role both; the others run the fleet as --roles prefill:P,decode:D (``--pd-split``).
PD_POLICIES: dict[str, str] = {
    "kvroute-pd-never": "Envoy + kvroute, pd.disaggregation never: every pod role both (cache-aware routing only)",
    "kvroute-pd-always": "Envoy + kvroute, pd.disaggregation always, gateway hand-off, P:D pods (--pd-split)",
    "kvroute-pd-conditional": "Envoy + kvroute, pd.disaggregation conditional (--pd-threshold), gateway hand-off",
    "vllm-router-pd": "vllm-router --vllm-pd-disaggregation --prefill URL... --decode URL... (cache_aware)",
}
PD = list(PD_POLICIES)
# A kvroute policy as several replicas behind Envoy (``--kvroute-replicas N``): POLICY@N shares
# nothing, POLICY@N+redis shares state through a redis-server started for the run (``--redis``).
REPLICAS_SEP, REDIS_SUFFIX = "@", "+redis"
# A peer router behind the same Envoy as kvroute (``sglang-router+envoy``): where it would sit in a
# Gateway API deployment, behind the gateway, one hop more. Compares the routing with the path equal.
BEHIND_ENVOY = "+envoy"
# A kvroute policy (or the do-nothing server) behind Envoy's ext_authz filter instead of ext_proc: one Check per
# request, the access log releasing its pod slot; as a gRPC call (``kvroute-approx:authz``) or an HTTP/1.1
# request (``kvroute-approx:authz_http``): ``:`` and a key of bench.envoy.AUTHZ_CONFIGS. Or ext_proc to
# kvroute's own HTTP/2 server (``kvroute-approx:h2``, server.h2_port) instead of grpcio's; ``:h2-streamed``:
# that, with the body STREAMED right behind the headers rather than BUFFERED.
AUTHZ_POLICIES = ("kvroute-approx", "kvroute-precise", "noop-extproc")
# A kvroute policy with one of its settings changed, side by side with the default (``kvroute-approx:h2~hold``):
# ``~`` and a key of CONFIG_VARIANTS, last in the name.
VARIANT_SEP = "~"
CONFIG_VARIANTS: dict[str, dict[str, Any]] = {
    # routing.hold on, scraping or not: long prompts take turns on a pod (the cost defaults fit the simulated H100 pods)
    "hold": {"routing": {"hold": {"enabled": True}}},
    "no-hold": {"routing": {"hold": {"enabled": False}}},  # routing.hold off (its default holds where kvroute scrapes)
    "hold-m20": {"routing": {"hold": {"enabled": True, "margin": 0.2}}},  # ... with twice the default margin
    # A Responses request's prompt_cache_key (Codex: the conversation's id) as its route id
    "cache-key": {"headers": {"route_id_fields": ["prompt_cache_key"]}},
    # The branch spread's room as before routing.cost.branch_room_gap: only a pod under a quarter of its fair part
    "no-gap": {"routing": {"cost": {"branch_room_gap": None}}},
    # The branch spread's room for any prefix, as before routing.cost.branch_fair_homes
    "no-fair-homes": {"routing": {"cost": {"branch_fair_homes": False}}},
}
H2, H2_STREAMED = "h2", "h2-streamed"
TRANSPORTS = {**AUTHZ_CONFIGS, H2: "epp.yaml", H2_STREAMED: "epp.yaml"}  # a policy's ``:SUFFIX`` -> its Envoy config


def h2_variant(policy: str) -> tuple[bool, dict[str, Any] | None, dict[str, Any] | None]:
    """Whether ``policy`` (``NAME:h2``, ``NAME:h2-streamed``, with or without ``@N...``) runs on kvroute's own
    HTTP/2 server, and the Envoy processing_mode / ext_proc patches its body mode needs (None: as epp.yaml)."""
    base = policy.partition(REPLICAS_SEP)[0]
    if base.endswith(f":{H2_STREAMED}"):
        streamed = body_mode_patch("STREAMED")  # kvroute envoy-config --processing-mode STREAMED
        return True, streamed["processing_mode"], streamed["ext_proc"]
    return base.endswith(f":{H2}"), None, None


def api_variant(name: str) -> tuple[str, str | None]:
    """``kvroute-approx:authz`` → (``kvroute-approx``, ``epp-authz.yaml``); a plain name → (name, None)."""
    for api, config in TRANSPORTS.items():
        base = name.removesuffix(f":{api}")
        if base != name and base in AUTHZ_POLICIES:
            return base, config
    return name, None


def config_variant(policy: str) -> tuple[str, dict[str, Any]]:
    """``kvroute-approx:h2~hold`` → (``kvroute-approx:h2``, its settings); a plain name → (name, {})."""
    base, sep, key = policy.rpartition(VARIANT_SEP)
    if not sep:
        return policy, {}
    if key not in CONFIG_VARIANTS or not base.startswith("kvroute-"):
        raise ValueError(f"{policy!r}: KVROUTE_POLICY{VARIANT_SEP}VARIANT, VARIANT one of {', '.join(CONFIG_VARIANTS)}")
    return base, CONFIG_VARIANTS[key]


def replica_variant(policy: str) -> tuple[str, int, bool]:
    """``kvroute-approx@3+redis`` → (``kvroute-approx``, 3, True); a plain name → (name, 1, False)."""
    base, sep, rest = policy.partition(REPLICAS_SEP)
    if not sep:
        return policy, 1, False
    redis = rest.endswith(REDIS_SUFFIX)
    n = rest.removesuffix(REDIS_SUFFIX)
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{policy!r}: POLICY@N or POLICY@N+redis, N replicas (1 or more)")
    return base, int(n), redis


def with_replicas(policies: Sequence[str], replicas: int, redis: bool) -> list[str]:
    """Each kvroute policy followed by its variants: @N (N > 1) and, with ``redis``, @N+redis."""
    out: list[str] = []
    for p in policies:
        out.append(p)
        if p.startswith("kvroute-") and REPLICAS_SEP not in p:
            if replicas > 1:
                out.append(f"{p}{REPLICAS_SEP}{replicas}")
            if redis:
                out.append(f"{p}{REPLICAS_SEP}{replicas}{REDIS_SUFFIX}")
    return out


NO_HEADERS: tuple[tuple[str, str], ...] = ()
READ_RESPONSES = {"response_header_mode": "SEND", "response_body_mode": "STREAMED"}


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every ``with`` block stops what it started."""

    def _raise(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


class RouterStartError(RuntimeError):
    """The router under test did not come up; the message names it and holds its log tail."""


@dataclass
class RunConfig:
    policies: list[str]
    pods: int = 4
    profile: str = "h100-llama8b"
    time_scale: float = 1.0
    load: float = 0.7
    rate: float | None = None  # req/s; None: calibrate
    seed: int = 0
    duration: float | None = None  # cap on the arrival span (s)
    timeout: float = 300.0
    calib_requests: int = 160
    calib_concurrency: int = 8  # in flight per pod during calibration
    quiet_wait: float = 0.0  # s to wait before each policy for other work to go below quiet_cores
    quiet_cores: float = 0.5
    kvroute_config: str | None = None
    pd_split: str = "1:3"  # prefill:decode[:both] pods for the P/D policies (sums to ``pods``)
    pd_threshold: int = 1000  # kvroute-pd-conditional: pd.threshold_tokens
    # kvroute's routing.chars_per_token for every kvroute policy: None keeps kvroute's default (4,
    # English), "auto" measures the workload's (bench.sim's pseudo-words run ~8 characters a token).
    chars_per_token: float | str | None = None
    # kvroute's --log-level; below warning its log is kept as <out>/<policy>.kvroute.log (debug: one
    # "routed" line per decision, with the P/D estimates, for tuning; costs the router some CPU).
    kvroute_log_level: str = "warning"
    # A TTFT objective per request class (the tag's first letter: c chats, d documents), pod ms, sent
    # as kvroute's x-slo-ttft-ms (scaled by time_scale: kvroute weighs it against wall-clock estimates).
    slo_ms: dict[str, float] = field(default_factory=dict)
    out: Path = Path("bench/out/run")
    # Runs of every policy on the same arrivals, fresh fleets each time (interleaved: run 1 of every
    # policy, then run 2...); each run's files go to <out>/run-K/, <out>/ gets the medians.
    repeat: int = 1
    # One bench.sim process per pod instead of one for the fleet: vLLM pods each have their own API
    # server, while one process reads and tokenizes a burst's prompts one after another (the Mooncake
    # traces' bursts: a few ms of every router's path). Not for P/D (peers are resolved inside a fleet).
    sim_procs: bool = False
    # Pieces of a client's text beyond the workloads' (bench.guidellm: guidellm's words), which
    # kvroute-precise's tokenizer must know as the pods' tokenizer does (``precise_tokenizer``).
    extra_pieces: tuple[str, ...] = ()
    quiet: bool = False
    command: str | None = None  # how this run was started, for the report


@dataclass
class Router:
    url: str
    pids: dict[str, int]  # process name -> pid, for CPU accounting
    headers: Callable[[Item], tuple[tuple[str, str], ...]] = lambda _item: NO_HEADERS
    metrics: Callable[[], str] | None = None  # the router's Prometheus text, read after the run


SLO_HEADER = HeadersConfig().ttft_slo  # the header kvroute reads a request's TTFT objective from


def slo_header(cfg: RunConfig, item: Item) -> tuple[tuple[str, str], ...]:
    """The request's TTFT objective (``cfg.slo_ms`` by class) in kvroute's wall-clock milliseconds."""
    ms = cfg.slo_ms.get(item.tag[:1])
    return NO_HEADERS if ms is None else ((SLO_HEADER, f"{ms * cfg.time_scale:g}"),)


def rollout_tokens(metrics_text: str) -> dict[str, float]:
    """kvroute's prompt / predicted / reported cached tokens by ``arm/kind`` (kvroute_rollout_tokens_total)."""
    return {
        f"{s.labels['arm']}/{s.labels['kind']}": s.value
        for family in text_string_to_metric_families(metrics_text)
        if family.name == "kvroute_rollout_tokens"
        for s in family.samples
        if s.name == "kvroute_rollout_tokens_total"
    }


def pd_reasons(metrics_text: str) -> dict[str, float]:
    """kvroute's P/D decisions by ``outcome/reason`` (kvroute_pd_decisions_total) from its /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):  # several replicas: added up
        if family.name == "kvroute_pd_decisions":
            for s in family.samples:
                if s.name == "kvroute_pd_decisions_total":
                    key = f"{s.labels['outcome']}/{s.labels['reason']}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


class SimFleet:
    """``python -m bench.sim`` in its own process (so its CPU is measured apart from the client), or with
    ``cfg.sim_procs`` one such process per pod."""

    def __init__(self, cfg: RunConfig, roles: str | None = None) -> None:
        if cfg.sim_procs and roles:
            raise ValueError("sim_procs: P/D roles need the fleet's pods in one process (the prefill and "
                             "decode peers are resolved inside it); run P/D policies without it")  # fmt: skip
        per_proc, self.count = (1, cfg.pods) if cfg.sim_procs else (cfg.pods, 1)
        args = ["--pods", str(per_proc), "--base-port", "0", "--zmq-base-port", "0", "--profile", cfg.profile]
        if roles:
            args += ["--roles", roles]
        self.args = python_module("bench.sim", *args, "--time-scale", str(cfg.time_scale), "--quiet")
        self.procs: list[Any] = []
        self.pods: list[dict[str, Any]] = []

    def pids(self) -> dict[str, int]:
        """The fleet's processes by name, for CPU accounting: ``sim``, then ``sim-2``... with a process per pod
        (as bench.replicas names kvroute's)."""
        return {("sim" if i == 0 else f"sim-{i + 1}"): p.pid for i, p in enumerate(self.procs)}

    def __enter__(self) -> SimFleet:
        try:
            for _ in range(self.count):
                proc, data = start_with_ready_file(self.args)
                self.procs.append(proc)
                assert isinstance(data, dict)
                self.pods += data["pods"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            stop(proc)

    @property
    def addresses(self) -> list[str]:
        return [p["address"] for p in self.pods]

    def urls(self, role: str) -> list[str]:
        return [p["url"] for p in self.pods if p.get("role", "both") in (role, "both")]

    def stats(self) -> list[dict[str, Any]]:
        return [self._get(p, "/sim/stats") for p in self.pods]

    def request_timings(self) -> dict[str, tuple[float, float]]:
        """Each request's (wait before its first engine step, TTFT) at the pod that served it, wall seconds
        from the pod's receipt, by request id (``join_pod_timings``); none for a P/D fleet (two legs each)."""
        if any(p.get("role", "both") != "both" for p in self.pods):
            return {}
        return join_pod_timings([self._get(p, "/sim/requests")["requests"] for p in self.pods])

    @staticmethod
    def _get(pod: dict[str, Any], path: str) -> Any:
        with urllib.request.urlopen(pod["url"] + path, timeout=5) as r:
            return json.loads(r.read())


def join_pod_timings(per_pod: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, tuple[float, float]]:
    """One map of the pods' request timings; a request id more than one pod gave a first token to (a mirror,
    a retry that got that far) is left out: whose figures the client saw is unknown."""
    seen: dict[str, tuple[float, float]] = {}
    twice: set[str] = set()
    for timings in per_pod:
        for rid, (wait, ttft) in timings.items():
            if rid in seen:
                twice.add(rid)
            seen[rid] = (wait, ttft)
    for rid in twice:
        del seen[rid]
    return seen


def with_pod_timings(r: loadgen.Record, timings: Mapping[str, tuple[float, float]]) -> loadgen.Record:
    """``r`` with its pod's wait and TTFT (``SimFleet.request_timings``) where the pod reported them."""
    t = timings.get(r.request_id) if r.request_id and r.ttft is not None else None
    return r if t is None else replace(r, pod_wait=t[0], pod_ttft=t[1])


# kvroute-precise's tokenizer: bench.sim's built-in one as a Hugging Face directory, giving the ids
# the pods give the workloads' text (its vocabulary), which kvroute needs for token-exact keys.
PRECISE_TOKENIZER_DIR = Path(__file__).resolve().parent / "out" / ".cache" / "sim-tokenizer"


def precise_tokenizer(out: Path | None = None, extra_pieces: Sequence[str] = ()) -> Path:
    """Build (once; ~0.1 s) and return the directory kvroute loads as the model's tokenizer. ``extra_pieces``:
    a client's words beyond the workloads' (guidellm's), known under the pods' ids too (without them such a
    word is a token per byte here and one piece at the pods: no block key would match); such a tokenizer
    goes to a directory of its own, named by its pieces."""
    pieces = workloads.tokenizer_pieces()
    if extra_pieces:
        pieces = sorted({*pieces, *extra_pieces})
        if out is None:
            digest = hashlib.sha256("\n".join(pieces).encode()).hexdigest()[:12]
            out = PRECISE_TOKENIZER_DIR.with_name(f"{PRECISE_TOKENIZER_DIR.name}-{digest}")
    return export_tokenizer(out or PRECISE_TOKENIZER_DIR, pieces)


def precise_settings(block_size: int, extra_pieces: Sequence[str] = ()) -> dict[str, Any]:
    """kvroute's KV events on, and the bench model (pool ``default``) keyed with the pods' tokenizer and
    block size (without a tokenizer kvroute keys every request approximately). The pods keep their
    built-in tokenizer: ``precise_tokenizer`` is the same one, for kvroute."""
    tokenizer = precise_tokenizer(extra_pieces=extra_pieces)
    model = {"pool": "default", "block_size": block_size, "tokenizer": str(tokenizer)}
    return {"kv_events": {"enabled": True}, "models": {workloads.MODEL: model}}


def precise_config(fleet: SimFleet, block_size: int, extra_pieces: Sequence[str] = ()) -> dict[str, Any]:
    """kvroute config for the event-driven index: the pods' KV event and replay addresses, and
    ``precise_settings``."""
    eps = [{"address": p["address"], "kv_events": p["kv_events_endpoint"], "kv_replay": p["replay_endpoint"]}
           for p in fleet.pods]  # fmt: skip
    return {"pools": {"default": {"endpoints": eps}}, "default_pool": "default",
            **precise_settings(block_size, extra_pieces)}  # fmt: skip


class NotPreciseError(RuntimeError):
    """A kvroute-precise run whose kvroute keyed no request precisely: its figures are approximate."""


def counter_totals(metrics_text: str, family: str, label: str) -> dict[str, float]:
    """A kvroute counter's totals by one label, replicas added up."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == family:
            for s in fam.samples:
                if s.name == family + "_total":
                    out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def cost_fit(metrics_text: str) -> dict[str, float]:
    """kvroute_cost_model_fit by ``pool/role`` (the pods' measured prefill rate over routing.cost's; replicas'
    figures averaged): how well the run's cost model fit the simulated pods. Empty until measured."""
    got: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "kvroute_cost_model_fit":
            for s in fam.samples:
                got.setdefault(f"{s.labels['pool']}/{s.labels['role']}", []).append(s.value)
    return {k: sum(v) / len(v) for k, v in got.items()}


def index_decisions(metrics_text: str) -> dict[str, float]:
    """kvroute's decisions by index, ``precise`` / ``approx`` (kvroute_index_decisions_total), replicas added up."""
    return counter_totals(metrics_text, "kvroute_index_decisions", "index")


def decision_ms_mean(metrics_text: str) -> float | None:
    """kvroute's mean decision time, end of body to answer (kvroute_decision_seconds, replicas
    pooled), in host milliseconds; None when it decided nothing (or is not kvroute)."""
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "kvroute_decision_seconds":
            for s in family.samples:
                if s.name == "kvroute_decision_seconds_sum":
                    total += s.value
                elif s.name == "kvroute_decision_seconds_count":
                    count += s.value
    return 1e3 * total / count if count else None


def check_precise(policy: str, counts: dict[str, float]) -> None:
    """NotPreciseError unless ``policy``'s kvroute made precise decisions (for kvroute-precise only)."""
    if api_variant(replica_variant(config_variant(policy)[0])[0])[0] != "kvroute-precise":
        return
    if not counts.get("precise"):
        raise NotPreciseError(
            f"{policy}: kvroute made no precise decision ({counts.get('approx', 0):.0f} approximate; "
            "kvroute_index_decisions_total): the figures would be the approximate index's under the precise "
            "name. Does kvroute load the pods' tokenizer (models.<model>.tokenizer) and get their KV events?"
        )


# kvroute as deploy/base/kvroute.yaml runs it in a cluster: polling each pod's /metrics (queue,
# running requests, KV use, and the KV size the approximate index bounds each pod's history by).
PRODUCTION_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "base" / "kvroute.yaml"


def production_scrape(time_scale: float = 1.0) -> dict[str, Any]:
    """The shipped config's ``scrape`` section, defaults filled in, its times ``time_scale`` × longer
    (pods that many times slower are seen as fresh, relative to their own pace, as real ones)."""
    from extproc.config import ScrapeConfig

    shipped = (yaml.safe_load(PRODUCTION_CONFIG.read_text()) or {}).get("scrape") or {}
    scrape = ScrapeConfig(**shipped).model_dump()
    return {**scrape, **{k: scrape[k] * time_scale for k in ("interval_s", "timeout_s", "max_age_s")}}


def _deep_merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s settings on ``base``, section by section (a variant sets one field of a section)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _write_config(
    cfg: dict[str, Any], path: Path, base: str | None, time_scale: float = 1.0, chars_per_token: float | None = None,
    defaults: dict[str, Any] | None = None, variant: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """``cfg`` over the user's ``base`` file over ``defaults``, then a policy's ``variant`` (its ``~NAME``:
    settings, merged into their sections), with the run's own settings (``--chars-per-token``,
    ``--time-scale``) applied last."""
    # the user's routing/scoring settings; pools, kv_events and the P/D mode come from this run
    user = (yaml.safe_load(Path(base).read_text()) or {}) if base is not None else {}
    merged = {**(defaults or {}), **user, **cfg}
    if isinstance(user.get("pd"), dict) and "pd" in cfg:  # e.g. max_split_delay_s for a sweep
        merged["pd"] = {**user["pd"], **cfg["pd"]}
    cfg = _deep_merged(merged, variant or {})
    if chars_per_token is not None:
        cfg = {**cfg, "routing": {**(cfg.get("routing") or {}), "chars_per_token": chars_per_token}}
    path.write_text(yaml.safe_dump(time_scaled(cfg, time_scale)))


def time_scaled(cfg: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """``cfg`` with every setting that prices pod time (kvroute's cost model, the P/D delays)
    multiplied by ``time_scale`` (defaults filled in): pods ``--time-scale`` times slower are judged
    as kvroute would judge real ones."""
    if time_scale == 1.0:
        return cfg
    from extproc.config import CostConfig, PDConfig

    def scaled(section: Any, defaults: Any, fields: tuple[str, ...]) -> dict[str, Any]:
        section = dict(section or {})
        values = {f: section.get(f, getattr(defaults, f)) for f in fields}
        return {**section, **{f: float(v) * time_scale for f, v in values.items() if v is not None}}

    routing = dict(cfg.get("routing") or {})
    routing["cost"] = scaled(
        routing.get("cost"), CostConfig(), ("per_token_s", "per_token_context_s", "per_inflight_s", "per_waiting_s")
    )
    pd_times = ("max_split_delay_s", "ttft_target_s", "transfer_s_per_token", "split_overhead_s", "prefill_timeout_s")
    pd = scaled(cfg.get("pd"), PDConfig(), pd_times)
    return {**cfg, "routing": routing, "pd": pd}


KVROUTE_LOG_LEVEL_ARG: dict[str, Any] = dict(
    default="warning",
    choices=["debug", "info", "warning"],
    help="kvroute's log level; below warning its log is kept in the output directory as "
    "<policy>.kvroute.log (debug: every routing decision with its P/D estimates; costs the router CPU)",
)


def chars_per_token_arg(value: str) -> float | str:
    """``--chars-per-token``: ``auto`` or a number of characters (0.5-32, as kvroute accepts)."""
    if value == "auto":
        return value
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither 'auto' nor a number") from None
    if not 0.5 <= x <= 32:
        raise argparse.ArgumentTypeError(f"{value} is outside 0.5-32")
    return x


def parse_pd_split(split: str, pods: int) -> tuple[int, int, int]:
    """``"P:D"`` or ``"P:D:B"`` → (P, D, B): prefill-only, decode-only and role-both pods, summing to
    ``pods``, with at least one pod able to prefill and one other able to decode."""
    try:
        parts = [int(x) for x in split.split(":")]
        if len(parts) not in (2, 3) or min(parts) < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"--pd-split {split!r}: expected PREFILL:DECODE[:BOTH] counts, e.g. 1:3 or 1:0:3") from None
    p, d, b = (*parts, 0) if len(parts) == 2 else parts
    if p + d + b != pods:
        raise ValueError(f"--pd-split {split}: {p + d + b} pods named, but --pods is {pods}")
    if p + b < 1 or d + b < 1 or (p == 0 and d == 0 and b < 2):
        raise ValueError(f"--pd-split {split}: need a pod that prefills and another that decodes")
    return p, d, b


def pd_roles(policy: str, cfg: RunConfig) -> str | None:
    """The sim's ``--roles`` for ``policy``: None (every pod both) unless it disaggregates; role-both
    pods (the third count of ``--pd-split``) come last."""
    if policy not in PD_POLICIES or policy == "kvroute-pd-never":
        return None
    p, d, _ = parse_pd_split(cfg.pd_split, cfg.pods)
    return ",".join(f"{role}:{n}" for role, n in (("prefill", p), ("decode", d)) if n) or None


def pd_config(fleet: SimFleet, policy: str, threshold: int) -> dict[str, Any]:
    """kvroute config for a ``kvroute-pd-*`` policy: endpoint roles as the fleet runs them, gateway hand-off."""
    eps = [{"address": p["address"], "role": p.get("role", "both")} for p in fleet.pods]
    pd = {"disaggregation": policy.removeprefix("kvroute-pd-"), "handoff": "gateway", "threshold_tokens": threshold}
    return {"pools": {"default": {"endpoints": eps}}, "default_pool": "default", "pd": pd}


def _started(stack: contextlib.ExitStack, policy: str, thing: Any) -> Any:
    try:
        return stack.enter_context(thing)
    except RouterStartError:
        raise
    except Exception as e:  # any start failure: name the router, keep its log tail
        raise RouterStartError(f"{policy}: failed to start: {e}") from e


def open_router(policy: str, fleet: SimFleet, stack: contextlib.ExitStack, cfg: RunConfig) -> Router:
    """Start ``policy``'s router in front of ``fleet``; everything it starts is stopped by ``stack``."""
    addrs = fleet.addresses
    if policy in ("round-robin", "random", "least-request"):
        lb = {"random": "RANDOM", "least-request": "LEAST_REQUEST"}.get(policy)
        env = _started(stack, policy, EnvoyProcess("epp.yaml", kvroute_port=None, pods=addrs, without_ext_proc=True,
                                                   pool_lb_policy=lb))  # fmt: skip
        return Router(env.url, {"envoy": env.proc.pid})
    if (variant := api_variant(policy))[0] == "noop-extproc":
        config = variant[1] or "epp.yaml"
        h2, mode, ext = h2_variant(policy)
        server = H2 if h2 else "uvloop"
        args = python_module("bench.noop_extproc", "--target", ",".join(addrs), "--server", server,
                             *(["--authz-http"] if config == AUTHZ_CONFIGS["authz_http"] else []))  # fmt: skip
        noop, ready = _started(stack, policy, ready_process(args))
        assert isinstance(ready, dict)
        env = _started(stack, policy, EnvoyProcess(config, kvroute_port=ready["port"], pods=addrs,
                                                   kvroute_http_port=ready.get("http_port"), processing_mode=mode,
                                                   ext_proc=ext))  # fmt: skip
        return Router(env.url, {"envoy": env.proc.pid, "noop-extproc": noop.pid})
    if policy == "naive-hash":
        env = _started(stack, policy, EnvoyProcess("cluster.yaml", kvroute_port=None, pods=addrs,
                                                   without_ext_proc=True, strip_client_headers=False))  # fmt: skip
        clusters = ["ep_" + a.rsplit(":", 1)[0].replace(".", "_") + "_" + a.rsplit(":", 1)[1] for a in addrs]

        def pick(item: Item) -> tuple[tuple[str, str], ...]:
            return (("x-kvroute-cluster", clusters[workloads.naive_hash_pod(item, len(addrs))]),)

        return Router(env.url, {"envoy": env.proc.pid}, pick)
    name, overlay = config_variant(policy)
    name, replicas, redis = replica_variant(name)
    h2, body_mode, body_ext = h2_variant(name)
    name, authz_config = api_variant(name)
    authz_http = authz_config == AUTHZ_CONFIGS["authz_http"]
    if name in ("kvroute-approx", "kvroute-precise", "kvroute-shadow") or name.startswith("kvroute-pd-"):
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{policy}-")))
        config = str(tmp / "kvroute.yaml")
        cpt = cfg.chars_per_token if isinstance(cfg.chars_per_token, float) else None  # run() resolved "auto"
        if name == "kvroute-precise":
            own = precise_config(fleet, get_profile(cfg.profile).block_size, cfg.extra_pieces)
        elif name == "kvroute-approx":
            own = {}  # the pods come as --endpoints
        elif name == "kvroute-shadow":
            own = {"mode": "shadow"}
        else:
            own = pd_config(fleet, name, cfg.pd_threshold)
        # approx and precise scrape the pods as in production (a user's scrape section wins)
        scrape = {"scrape": production_scrape(cfg.time_scale)} if name in ("kvroute-approx", "kvroute-precise") else {}
        _write_config(own, Path(config), cfg.kvroute_config, cfg.time_scale, cpt, defaults=scrape, variant=overlay)
        # --endpoints (this run's pods) on top of a user config file: flags override the file's pools.
        endpoints = addrs if name in ("kvroute-approx", "kvroute-shadow") else ()
        kvs = _started(stack, policy, KVRouteReplicas(replicas, endpoints, ["--log-level", cfg.kvroute_log_level],
                                                      config=config, redis=redis, authz_http=authz_http,
                                                      h2=h2))  # fmt: skip
        if cfg.kvroute_log_level != "warning":  # copied before kvroute stops and its directory goes
            cfg.out.mkdir(parents=True, exist_ok=True)
            for i, kv in enumerate(kvs.replicas):
                log_name = f"{policy}.kvroute.log" if i == 0 else f"{policy}.kvroute-{i + 1}.log"
                stack.callback(shutil.copyfile, kv.log_path, cfg.out / log_name)
        envoy_config = authz_config or "epp.yaml"
        http_port = kvs.replicas[0].authz_http_port or None
        if replicas == 1:
            # Shadow: kvroute learns each response's pod and usage (bench.envoy names the pod).
            mode = READ_RESPONSES if name == "kvroute-shadow" else body_mode
            env = _started(stack, policy, EnvoyProcess(envoy_config, kvroute_port=kvs.ports[0], pods=addrs,
                                                       processing_mode=mode, ext_proc=body_ext,
                                                       kvroute_http_port=http_port))  # fmt: skip
        else:  # Envoy spreads the ext_proc streams (or Checks) over the replicas, round robin
            env = _started(stack, policy, ReplicatedEnvoy(envoy_config, kvs.ports, pods=addrs,
                                                          processing_mode=body_mode, ext_proc=body_ext))  # fmt: skip
        return Router(env.url, {"envoy": env.proc.pid, **kvs.pids()}, metrics=kvs.metrics)
    if policy == "vllm-router-pd":
        pd_urls = (fleet.urls("prefill"), fleet.urls("decode"))
        peer = _started(stack, policy, PeerRouter("vllm-router", "cache_aware", [], pd=pd_urls))
        return Router(peer.url, {"vllm-router": peer.proc.pid})
    name, _, peer_policy = policy.removesuffix(BEHIND_ENVOY).partition(":")
    if name in PEERS:
        peer = _started(stack, policy, PeerRouter(name, peer_policy or "cache_aware", [p["url"] for p in fleet.pods]))
        url, pids = peer.url, {name: peer.proc.pid}
        if policy.endswith(BEHIND_ENVOY):
            env = _started(stack, policy, EnvoyProcess("epp.yaml", kvroute_port=None, pods=[f"127.0.0.1:{peer.port}"],
                                                       without_ext_proc=True))  # fmt: skip
            url, pids = env.url, {"envoy": env.proc.pid, **pids}
        if peer_policy == "consistent_hash":
            # Its hash key is a session id (header or body); without one every request lands on one
            # pod. The workload's tag (user / conversation / trace) is the natural session.
            return Router(url, pids, lambda item: (("x-session-id", item.tag),))
        return Router(url, pids)
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(ALL)}")


async def closed_loop(url: str, specs: Sequence[loadgen.RequestSpec], concurrency: int, timeout: float,
                      on_done: Callable[[loadgen.Record], None] | None = None) -> list[loadgen.Record]:  # fmt: skip
    """Send ``specs`` in order keeping ``concurrency`` requests in flight (saturation, for calibration)."""
    todo = iter(specs)
    out: list[loadgen.Record] = []
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            for spec in todo:  # a shared iterator: each spec goes to exactly one worker
                rec = await loadgen._one(session, url, spec, time.perf_counter(), timeout)
                out.append(rec)
                if on_done is not None:
                    on_done(rec)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def saturation_rate(records: Sequence[loadgen.Record]) -> float:
    """Completions per second between the 20th and 80th percentile completion (no ramp, no drain)."""
    ends = sorted(r.start + r.e2e for r in records if r.ok and r.e2e is not None)
    if len(ends) < 5:
        raise RuntimeError(f"calibration: only {len(ends)} of {len(records)} requests succeeded")
    i, j = len(ends) // 5, (4 * len(ends)) // 5
    return (j - i) / max(ends[j] - ends[i], 1e-9)


def calibrate(cfg: RunConfig, items: Sequence[Item]) -> dict[str, Any]:
    """Capacity (req/s) of a fresh fleet behind round robin, saturated with this workload."""
    if cfg.quiet_wait > 0:
        wait_quiet(cfg.quiet_wait, cfg.quiet_cores, cfg.quiet)
    sample = list(items[: cfg.calib_requests])
    specs = workloads.specs(sample, [0.0] * len(sample), stream=False)
    bar = tqdm(total=len(specs), desc="calibrate (round-robin, closed loop)", unit="req", disable=cfg.quiet)
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(SimFleet(cfg))
        router = open_router("round-robin", fleet, stack, cfg)
        t0 = time.perf_counter()
        recs = asyncio.run(
            closed_loop(router.url, specs, cfg.calib_concurrency * cfg.pods, cfg.timeout, lambda _r: bar.update())
        )
        wall = time.perf_counter() - t0
    bar.close()
    rate = saturation_rate(recs) * cfg.time_scale  # per second of pod time
    return {"capacity_rps": rate, "calib_requests": len(specs), "calib_wall_s": wall,
            "calib_concurrency_per_pod": cfg.calib_concurrency}  # fmt: skip


def arrivals(items: Sequence[Item], rate: float, seed: int, duration: float | None) -> list[float]:
    """Poisson at ``rate``, or trace times rescaled to a mean of ``rate``; cut at ``duration``."""
    if items and all(it.at is not None for it in items):
        span = max(it.at or 0.0 for it in items)
        scale = (len(items) / rate) / span if span > 0 else 0.0
        times = [(it.at or 0.0) * scale for it in items]
    else:
        times = loadgen.poisson_arrivals(len(items), rate, seed)
    if duration is not None:
        times = [t for t in times if t <= duration]
    return times


def wait_quiet(max_wait: float, max_other_cores: float, quiet: bool = False) -> float:
    """Wait (at most ``max_wait`` s) until other work on the host uses under ``max_other_cores``.

    This machine is shared: a policy measured while something else saturates the cores would be
    compared unfairly. Returns the busy cores of the last 2 s sample.
    """
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = machine_busy(), time.monotonic()
        time.sleep(2.0)
        busy = (machine_busy() - b0) / (time.monotonic() - t0)
        if busy < max_other_cores or time.monotonic() >= deadline:
            return busy
        if not quiet:
            print(f"  waiting for a quieter machine: {busy:.2f} cores busy with other work", file=sys.stderr)


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    out = {"machine": machine_busy()}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            out[name] = cpu_seconds(pid)
    out["client"] = time.process_time()
    return out


def _write_requests(path: Path, recs: Sequence[loadgen.Record], first: float) -> None:
    """Per-request figures (no prompt text) for looking into a percentile: which requests made it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in recs:
            row = {"tag": r.tag, "request_id": r.request_id, "at_s": round(r.start - first, 4), "status": r.status,
                   "ttft_s": r.ttft, "e2e_s": r.e2e, "max_gap_s": max(r.itl, default=None), "gaps": len(r.itl),
                   "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "upstream": r.upstream,
                   "pod_wait_s": r.pod_wait, "pod_ttft_s": r.pod_ttft, "error": r.error}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def run_policy(
    policy: str, cfg: RunConfig, items: Sequence[Item], times: Sequence[float], scenario: str, ideal: float
) -> report.PolicyRun:
    """One policy on a fresh fleet; a start failure becomes a row with ``failed`` set."""
    if cfg.quiet_wait > 0:
        wait_quiet(cfg.quiet_wait, cfg.quiet_cores, cfg.quiet)
    try:
        with contextlib.ExitStack() as stack:
            fleet = stack.enter_context(SimFleet(cfg, pd_roles(policy, cfg)))
            router = open_router(policy, fleet, stack, cfg)
            specs = workloads.specs(items, times, headers=[router.headers(it) + slo_header(cfg, it) for it in items])
            pids = {**fleet.pids(), **router.pids}
            before, cpu0 = fleet.stats(), _cpu(pids)
            bar = tqdm(total=len(specs), desc=f"{scenario} / {policy}", unit="req", disable=cfg.quiet)
            t0 = time.perf_counter()
            recs = asyncio.run(loadgen.run(router.url, specs, timeout=cfg.timeout, on_done=lambda _r: bar.update()))
            wall = time.perf_counter() - t0
            bar.close()
            cpu1, after = _cpu(pids), fleet.stats()
            timings = fleet.request_timings()
            metrics = router.metrics() if router.metrics is not None else ""
            reasons, rollout, indexes = pd_reasons(metrics), rollout_tokens(metrics), index_decisions(metrics)
            decision_ms = decision_ms_mean(metrics)
            fit = cost_fit(metrics)
            deferred = counter_totals(metrics, "kvroute_tokenize_deferred", "result")
            check_precise(policy, indexes)
    except (RouterStartError, NotPreciseError) as e:
        print(f"\n*** {e}\n", file=sys.stderr)
        return report.PolicyRun({"policy": policy, "scenario": scenario, "failed": str(e).splitlines()[0]})
    first = min(r.start for r in recs)
    lag = [(r.start - first) - (s.at - specs[0].at) for r, s in zip(recs, specs, strict=True)]
    recs = [pod_time(with_pod_timings(r, timings), cfg.time_scale) for r in recs]
    _write_requests(cfg.out / f"{policy}.requests.jsonl", recs, first / cfg.time_scale)
    # "machine" covers every process on the host: much more than the sum of ours means other work
    # competed for the cores during this run.
    cores = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0 if k in cpu1}
    other = cores["machine"] - sum(v for k, v in cores.items() if k != "machine")
    extra = {
        "cpu_cores": cores,
        "other_cores": other,
        "contended": other > cfg.quiet_cores,
        "send_lag_p99_s": loadgen.percentile(lag, 0.99),
    }
    if reasons:
        extra["pd_reasons"] = reasons
    if rollout:
        extra["rollout_tokens"] = rollout
    if indexes:
        extra["index_decisions"] = indexes
    if deferred:  # precise decisions made on the prompt's head: rests recorded / skipped / failed
        extra["tokenize_deferred"] = deferred
    if decision_ms is not None:  # host time (not scaled): a part of the path, beside path_ttft_mean_s
        extra["decision_ms_mean"] = decision_ms
    if fit:  # the pods' measured prefill rate over kvroute's cost model (1: routing.cost fits them)
        extra["cost_fit"] = fit
    if extra["contended"]:
        print(f"  note: {policy}: other work used {other:.2f} cores during the run (flagged)", file=sys.stderr)
    return report.summarize(policy, scenario, recs, report.pod_deltas(before, after), wall_s=wall / cfg.time_scale,
                            ideal_hit_rate=ideal, extra=extra, time_scale=cfg.time_scale)  # fmt: skip


def pod_time(r: loadgen.Record, time_scale: float) -> loadgen.Record:
    """A record's times in seconds of pod time (the fleet ran ``time_scale`` times slower)."""
    if time_scale == 1.0:
        return r
    k = 1.0 / time_scale

    def scaled(v: float | None) -> float | None:
        return None if v is None else v * k

    return replace(r, start=r.start * k, ttft=scaled(r.ttft), e2e=scaled(r.e2e), itl=[g * k for g in r.itl],
                   pod_wait=scaled(r.pod_wait), pod_ttft=scaled(r.pod_ttft))  # fmt: skip


def run(cfg: RunConfig, workload: Workload) -> tuple[list[report.PolicyRun], dict[str, Any]]:
    """Calibrate (unless ``cfg.rate``), then every policy in turn; writes results under ``cfg.out``."""
    profile = get_profile(cfg.profile)
    t_start = time.monotonic()
    ideal = workloads.ideal_hit_rate(workload.items, profile.block_size)
    meta: dict[str, Any] = {
        "scenario": workload.name,
        "command": cfg.command,
        "workload": workload.params,
        "pods": cfg.pods,
        "profile": cfg.profile,
        "time_scale": cfg.time_scale,
        "machine": f"{os.cpu_count()} CPU cores, no GPU (simulated pods)",
        "code": results.code_version(),  # what bench.results shows beside the figures
        "ideal_hit_rate": ideal["hit_rate"],
    }
    if cfg.chars_per_token == "auto":
        cfg = replace(cfg, chars_per_token=round(ideal["chars_per_token"], 2))
    if cfg.chars_per_token is not None:
        meta["kvroute_chars_per_token"] = cfg.chars_per_token
    if any(p in PD_POLICIES for p in cfg.policies):
        meta["pd_split"] = cfg.pd_split
        meta["pd_threshold_tokens"] = cfg.pd_threshold
    if cfg.rate is None:
        meta.update(calibrate(cfg, workload.items))
        meta["load"] = cfg.load
        rate = cfg.load * meta["capacity_rps"]
    else:
        rate = cfg.rate
    meta["rate_rps"] = rate
    times = arrivals(workload.items, rate, cfg.seed, cfg.duration)
    items = workload.items[: len(times)]  # arrival times increase, so a duration cap keeps a prefix
    meta["requests"] = len(items)
    if len(items) != len(workload.items):
        meta["ideal_hit_rate"] = workloads.ideal_hit_rate(items, profile.block_size)["hit_rate"]
    wall_times = [t * cfg.time_scale for t in times]  # slowed pods get the same load: arrivals slowed as much
    per_run = []
    for k in range(1, cfg.repeat + 1):
        rcfg = replace(cfg, out=run_dir(cfg.out, k)) if cfg.repeat > 1 else cfg
        runs = [run_policy(p, rcfg, items, wall_times, workload.name, meta["ideal_hit_rate"]) for p in cfg.policies]
        if cfg.repeat > 1:  # each run's own table beside its per-request records
            report.write(rcfg.out, runs, {**meta, "run": k}, plots=False)
        per_run.append(runs)
    if cfg.repeat > 1:
        meta["repeat"] = cfg.repeat
        runs = report.median_runs(per_run)
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    report.write(cfg.out, runs, meta)
    return runs, meta


def run_dir(out: Path, k: int) -> Path:
    """Where run ``k`` (from 1) of a repeated run keeps its files."""
    return out / f"run-{k}"
