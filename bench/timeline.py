"""Fleet events under load: scale-out, scale-in, rolling restart and pod kill, on a timeline.

Each simulated pod runs as its own ``python -m bench.sim --pods 1`` process, so a pod can join with a
fresh cache at a new address, drain and stop, or be killed -9. Every pod the run will need is started
before the load (idle until it joins), so an event is only a membership change. The routers follow
the fleet as they would in a cluster: kvroute through its ``file`` discovery provider (the endpoints
file rewritten atomically, as a ConfigMap update) and Envoy in front of it through an EDS file (as a
Service's endpoints), the peer routers through their own worker APIs
(sglang-router ``POST /workers`` / ``DELETE /workers/{id}``, vllm-router ``/add_worker`` /
``/remove_worker``). Events, at ``--event-at`` s:

* ``scale-out``: ``--pods`` → ``--pods + --delta`` pods.
* ``scale-in``: ``--pods + --delta`` → ``--pods``, gracefully: the leaving pods drain (kvroute: ready
  false; peers: removed), are stopped once idle (``--drain-timeout``), then leave the set.
* ``rolling-restart``: every pod replaced one by one (maxSurge 1): the new pod, at a new address in
  the old one's cache bucket, joins, then the old one drains and stops.
* ``pod-kill``: one pod SIGKILLed; the routers learn it ``--detect-s`` later (failed readiness
  probes), and its replacement (new address, same bucket) joins ``--replace-s`` after that.

Figures: per ``--window`` (10 s) window, requests, failed, prefix hit rate (cached / prompt tokens,
as the pods report them) and TTFT p50/p90; failed requests overall and after the event started; the
share of keys moved: of the sessions (the workload's tag: a conversation, a user) served both before
the event and after it ended, the share whose *slot* changed between their last request before and
their first after. A slot is a pod's cache bucket, which a replacement inherits, so a rolling
restart that brings every session back to its bucket moves 0 and the minimal share is 0 (rolling
restart, pod kill), ``delta / (pods + delta)`` (scale-out, scale-in). Recovery: seconds from the
event's end to the first window whose hit rate is back within 2 points of the steady state (the
windows of the 30 s before the event).

Targets (issue 17), per policy: a graceful scale-in or rolling restart fails no request after the
event starts; a scale-out moves at most 1.2x the minimal share of keys; the hit rate is back within
2 points of the steady state at most 30 s after the event.

Policies (default: all six below, one timeline run): ``kvroute-approx``, ``kvroute-precise``, their
``-buckets`` variants (pods labelled with their cache bucket, ``routing.buckets.enabled``, the
session sent as ``x-session-id`` so a bucket holds whole conversations), ``sglang-router``
(cache_aware), ``vllm-router:consistent_hash`` (consistent hashing of ``x-session-id``), and any
``sglang-router:POLICY`` / ``vllm-router:POLICY``. The precise index needs the pods' tokens: the
pods keep bench.sim's built-in tokenizer (every policy alike) and a precise kvroute loads the same
one, exported by ``bench.harness.precise_tokenizer`` as ``bench run``'s kvroute-precise does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from bench import harness, loadgen, workloads
from bench import results as results_md
from bench.envoy import EnvoyProcess, write_pool
from bench.kvroute import KVRouteProcess
from bench.peers import PEERS, PeerRouter
from bench.procs import python_module, start_with_ready_file, stop
from bench.sim.profiles import get_profile
from bench.workloads import Item
from extproc.envoyconfig import POOL_CLUSTER

EVENTS = ("scale-out", "scale-in", "rolling-restart", "pod-kill")
KVROUTE_POLICIES = ("kvroute-approx", "kvroute-precise", "kvroute-approx-buckets", "kvroute-precise-buckets")
DEFAULT_POLICIES = [*KVROUTE_POLICIES, "sglang-router", "vllm-router:consistent_hash"]
SESSION_HEADER = "x-session-id"  # kvroute's route-id header and vllm-router's consistent-hash key
RECOVERY_POINTS = 0.02  # "recovered": hit rate within 2 points of the steady state
RECOVERY_TARGET_S = 30.0  # ... at most this long after the event (issue 17's target)
MOVED_TARGET = 1.2  # a scale-out moves at most this multiple of the minimal share of keys
GRACEFUL = ("scale-in", "rolling-restart")  # events that must fail no request


@dataclass
class TimelineConfig:
    event: str
    policies: list[str]
    rate: float  # req/s (pod time)
    pods: int = 4
    delta: int = 2  # pods added (scale-out) or removed (scale-in)
    profile: str = "h100-llama8b"
    time_scale: float = 1.0
    event_at: float = 60.0
    duration: float = 120.0
    window: float = 10.0
    drain_timeout: float = 60.0
    detect_s: float = 5.0
    replace_s: float = 10.0
    timeout: float = 120.0
    seed: int = 0
    kvroute_config: str | None = None
    out: Path = Path("bench/out/timeline")
    quiet: bool = False
    command: str | None = None


def check_policies(policies: Sequence[str]) -> None:
    """ValueError naming the policies this bench cannot run (before any fleet starts)."""
    bad = [p for p in policies if p not in KVROUTE_POLICIES and p.partition(":")[0] not in PEERS]
    if bad:
        raise ValueError(f"unknown policy {', '.join(map(repr, bad))}; choose from {', '.join(DEFAULT_POLICIES)}")


# ---- pods -------------------------------------------------------------------------------------------


@dataclass
class Pod:
    """One simulated pod process; ``bucket`` is its cache bucket (a replacement inherits it)."""

    bucket: str
    proc: Any
    info: dict[str, Any]

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def idle(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/sim/stats", timeout=2) as r:
                s = json.loads(r.read())
        except OSError:
            return True  # gone: nothing left to drain
        return s["running"] == 0 and s["waiting"] == 0

    def drained(self) -> bool:
        """Idle twice 0.2 s apart: a request routed just before the drain has reached the pod by then."""
        if not self.idle():
            return False
        time.sleep(0.2)
        return self.idle()


def start_pod(cfg: TimelineConfig, bucket: str) -> Pod:
    args = ["--pods", "1", "--base-port", "0", "--zmq-base-port", "0", "--profile", cfg.profile]
    proc, data = start_with_ready_file(
        python_module("bench.sim", *args, "--time-scale", str(cfg.time_scale), "--quiet")
    )
    assert isinstance(data, dict)
    return Pod(bucket, proc, data["pods"][0])


def wait_for(cond: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


# ---- how each router learns the fleet ------------------------------------------------------------


class Members(Protocol):
    def publish(self, ready: Sequence[Pod], draining: Sequence[Pod] = ()) -> None:
        """The fleet is now ``ready`` (+ ``draining``, which take no new requests); returns once applied."""


class FileMembers:
    """kvroute's ``file`` discovery: the endpoints file, rewritten atomically; applied when kvroute
    counted the reload (``kvroute_discovery{provider="file",stat="reloads"}``). Envoy's pool follows
    (its EDS file, ``envoy_pool``): it learns a pod before kvroute may name it and forgets it once
    kvroute has, before the pod stops. So the pods Envoy picks itself (failing open, a retry past
    kvroute's list) are the fleet's too: never a spare before it joins, nor the address of a pod that
    stopped (where another process may listen by then)."""

    def __init__(self, path: Path, precise: bool, buckets: bool, envoy_pool: Path) -> None:
        self.path, self.precise, self.buckets, self.envoy_pool = path, precise, buckets, envoy_pool
        self.writes = 0
        self.kvroute: KVRouteProcess | None = None
        self.envoy: EnvoyProcess | None = None
        self._in_envoy: set[str] = set()

    def endpoint(self, pod: Pod, ready: bool) -> dict[str, Any]:
        ep: dict[str, Any] = {"address": pod.address, "ready": ready}
        if self.buckets:
            ep["cache_bucket"] = pod.bucket
        if self.precise:
            ep["kv_events"], ep["kv_replay"] = pod.info["kv_events_endpoint"], pod.info["replay_endpoint"]
        return ep

    def publish(self, ready: Sequence[Pod], draining: Sequence[Pod] = ()) -> None:
        members = {p.address for p in [*ready, *draining]}  # a draining pod still finishes its requests
        self._publish_envoy(self._in_envoy | members)  # joining pods, before kvroute may name them
        eps = [self.endpoint(p, True) for p in ready] + [self.endpoint(p, False) for p in draining]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"pools": {"default": {"endpoints": eps}}}))
        tmp.replace(self.path)
        self.writes += 1
        if self.kvroute is not None and not wait_for(lambda: self.reloads() >= self.writes, 10.0):
            raise RuntimeError("kvroute did not reload the endpoints file within 10 s")
        self._publish_envoy(members)  # leaving pods, now that kvroute names them no more

    def _publish_envoy(self, pods: set[str]) -> None:
        joining, leaving = pods - self._in_envoy, self._in_envoy - pods
        if joining or leaving:
            write_pool(self.envoy_pool, sorted(pods))
            self._in_envoy = pods
            self.wait_envoy(joining, leaving)

    def wait_envoy(self, joining: AbstractSet[str], leaving: AbstractSet[str] = frozenset()) -> None:
        """Until Envoy sends requests to each ``joining`` pod (once health-checked) and has no
        ``leaving`` one (a pod that stays may fail a health check meanwhile: not waited for)."""
        envoy = self.envoy
        if envoy is None:
            return

        def applied() -> bool:
            hosts = envoy.cluster_hosts(POOL_CLUSTER)
            return all(hosts.get(p) for p in joining) and not leaving & hosts.keys()

        if not wait_for(applied, 10.0):
            raise RuntimeError(f"Envoy did not take {sorted(joining)} and drop {sorted(leaving)} within 10 s")

    def reloads(self) -> float:
        assert self.kvroute is not None
        for line in self.kvroute.metrics().splitlines():
            if line.startswith("kvroute_discovery{") and 'provider="file"' in line and 'stat="reloads"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


class PeerMembers:
    """A peer router's worker API; applied when its ``GET /workers`` lists exactly the ready pods."""

    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, url

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            raw = r.read()
        with contextlib.suppress(ValueError):
            return json.loads(raw)
        return raw

    def workers(self) -> dict[str, str]:
        """url -> worker id (sglang-router) or url (vllm-router)."""
        return {w["url"]: w.get("id", w["url"]) for w in self._call("GET", "/workers")["workers"]}

    def publish(self, ready: Sequence[Pod], draining: Sequence[Pod] = ()) -> None:
        want = {p.url for p in ready}
        have = self.workers()
        for url in sorted(want - have.keys()):
            if self.name == "sglang-router":
                self._call("POST", "/workers", {"url": url})
            else:
                self._call("POST", "/add_worker?url=" + url)
        for url in sorted(have.keys() - want):
            if self.name == "sglang-router":
                self._call("DELETE", f"/workers/{have[url]}")
            else:
                self._call("POST", "/remove_worker?url=" + url)
        if not wait_for(lambda: set(self.workers()) == want, 10.0, 0.1):
            raise RuntimeError(f"{self.name} did not take the new worker set within 10 s")


# ---- the events -----------------------------------------------------------------------------------


@dataclass
class Fleet:
    """Pods in the set now (``ready``), and spares started for the event."""

    cfg: TimelineConfig
    ready: list[Pod]
    spares: list[Pod]
    members: Members | None = None
    log: list[tuple[float, str]] = field(default_factory=list)  # (perf_counter, what)
    failures: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.log.append((time.perf_counter(), what))

    def drain_and_stop(self, leaving: Sequence[Pod]) -> None:
        """Graceful: no new requests, in-flight ones finish (``drain_timeout``), then the pods stop."""
        assert self.members is not None
        self.members.publish(self.ready, leaving)  # ``ready`` no longer holds them
        for p in leaving:
            if not wait_for(p.drained, self.cfg.drain_timeout, 0.1):
                self.failures.append(f"{p.address} still busy after {self.cfg.drain_timeout} s: stopped anyway")
        self.members.publish(self.ready)
        for p in leaving:
            stop(p.proc)
        self.note(f"stopped {', '.join(p.address for p in leaving)}")

    def run_event(self) -> None:
        assert self.members is not None
        cfg, ev = self.cfg, self.cfg.event
        self.note(f"{ev} starts")
        if ev == "scale-out":
            self.ready += self.spares
            self.members.publish(self.ready)
        elif ev == "scale-in":
            leaving, self.ready = self.ready[-cfg.delta :], self.ready[: -cfg.delta]
            self.drain_and_stop(leaving)
        elif ev == "rolling-restart":
            for old, new in zip(list(self.ready), self.spares, strict=True):
                self.ready = [new if p is old else p for p in self.ready]  # new one ready, old one drains
                self.note(f"{new.address} replaces {old.address}")
                self.drain_and_stop([old])
        elif ev == "pod-kill":
            victim, new = self.ready[0], self.spares[0]
            victim.proc.kill()
            self.note(f"killed {victim.address}")
            time.sleep(cfg.detect_s * cfg.time_scale)
            self.ready = self.ready[1:]
            self.members.publish(self.ready)
            self.note(f"{victim.address} removed")
            time.sleep(cfg.replace_s * cfg.time_scale)
            self.ready.append(new)
            self.members.publish(self.ready)
        self.note(f"{ev} done")


def fleet_plan(cfg: TimelineConfig) -> tuple[int, int]:
    """(pods in the set before the event, spare pods started for it)."""
    return {
        "scale-out": (cfg.pods, cfg.delta),
        "scale-in": (cfg.pods + cfg.delta, 0),
        "rolling-restart": (cfg.pods, cfg.pods),
        "pod-kill": (cfg.pods, 1),
    }[cfg.event]


def start_fleet(cfg: TimelineConfig, stack: contextlib.ExitStack) -> Fleet:
    before, spares = fleet_plan(cfg)
    ready = [start_pod(cfg, f"b{i}") for i in range(before)]
    # A replacement inherits its predecessor's bucket; a scale-out pod opens a new one.
    spare_buckets = [f"b{before + i}" for i in range(spares)] if cfg.event == "scale-out" else [
        ready[i % before].bucket for i in range(spares)]  # fmt: skip
    fleet = Fleet(cfg, ready, [start_pod(cfg, b) for b in spare_buckets])
    for p in [*fleet.ready, *fleet.spares]:
        stack.callback(stop, p.proc)
    return fleet


# ---- routers ------------------------------------------------------------------------------------


def kvroute_config(cfg: TimelineConfig, policy: str, endpoints_file: Path) -> dict[str, Any]:
    user: dict[str, Any] = {}
    if cfg.kvroute_config:  # the user's routing settings; discovery and the pods come from this run
        user = yaml.safe_load(Path(cfg.kvroute_config).read_text()) or {}
    own: dict[str, Any] = {
        "discovery": {"provider": "file", "file": {"path": str(endpoints_file), "poll_interval_s": 0.1}},
        "default_pool": "default",
    }
    if "precise" in policy:  # token-exact keys, as the pods hash their blocks
        own.update(harness.precise_settings(get_profile(cfg.profile).block_size))
    routing = dict(user.get("routing") or {})
    if policy.endswith("-buckets"):
        routing["buckets"] = {**(routing.get("buckets") or {}), "enabled": True}
    return harness.time_scaled({**user, **own, "routing": routing}, cfg.time_scale)


def open_router(
    policy: str, cfg: TimelineConfig, fleet: Fleet, stack: contextlib.ExitStack
) -> tuple[str, Callable[[Item], tuple[tuple[str, str], ...]]]:
    """Start ``policy``'s router over ``fleet.ready``; (its URL, the headers each request carries)."""
    session: Callable[[Item], tuple[tuple[str, str], ...]] = lambda item: ((SESSION_HEADER, item.tag),)  # noqa: E731
    if policy in KVROUTE_POLICIES:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{policy}-")))
        (tmp / "envoy").mkdir()  # a directory of its own: Envoy reloads its pool on any move into it
        members = FileMembers(tmp / "endpoints.yaml", "precise" in policy, policy.endswith("-buckets"),
                              tmp / "envoy" / "pool.json")  # fmt: skip
        members.publish(fleet.ready)
        (tmp / "kvroute.yaml").write_text(yaml.safe_dump(kvroute_config(cfg, policy, members.path)))
        kv = stack.enter_context(
            KVRouteProcess(config=str(tmp / "kvroute.yaml"), extra_args=["--log-level", "warning"])
        )
        members.kvroute = kv
        ready = [p.address for p in fleet.ready]
        env = stack.enter_context(
            EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=ready, pool_file=members.envoy_pool)
        )
        members.envoy = env
        members.wait_envoy(set(ready))
        fleet.members = members
        return env.url, session if policy.endswith("-buckets") else (lambda _item: harness.NO_HEADERS)
    name, _, peer_policy = policy.partition(":")
    if name not in PEERS:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(DEFAULT_POLICIES)}")
    peer = stack.enter_context(PeerRouter(name, peer_policy or "cache_aware", [p.url for p in fleet.ready]))
    fleet.members = PeerMembers(name, peer.url)
    return peer.url, session if peer_policy == "consistent_hash" else (lambda _item: harness.NO_HEADERS)


# ---- figures ------------------------------------------------------------------------------------


def windows(recs: Sequence[dict[str, Any]], width: float, end: float) -> list[dict[str, Any]]:
    """Per-window figures of request rows (``at_s``, ``ok``, ``ttft_s``, ``prompt_tokens``,
    ``cached_tokens``), by arrival time."""
    out = []
    for i in range(max(1, math.ceil(end / width))):
        rows = [r for r in recs if i * width <= r["at_s"] < (i + 1) * width]
        ok = [r for r in rows if r["ok"]]
        prompt = sum(r["prompt_tokens"] or 0 for r in ok)
        ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
        out.append({
            "start_s": i * width,
            "requests": len(rows),
            "failed": len(rows) - len(ok),
            "hit_rate": sum(r["cached_tokens"] or 0 for r in ok) / prompt if prompt else None,
            "ttft_p50_s": loadgen.percentile(ttfts, 0.5),
            "ttft_p90_s": loadgen.percentile(ttfts, 0.9),
        })  # fmt: skip
    return out


def keys_moved(recs: Sequence[dict[str, Any]], slot: dict[str, str], start: float, end: float) -> dict[str, Any]:
    """Of the sessions served before ``start`` and after ``end``, the share whose slot changed."""
    last: dict[str, str] = {}
    first: dict[str, str] = {}
    for r in sorted(recs, key=lambda r: r["at_s"]):
        s = slot.get(r["upstream"] or "")
        if not r["ok"] or s is None:
            continue
        if r["at_s"] < start:
            last[r["tag"]] = s
        elif r["at_s"] >= end and r["tag"] not in first:
            first[r["tag"]] = s
    both = last.keys() & first.keys()
    moved = sum(1 for t in both if last[t] != first[t])
    return {"sessions": len(both), "moved": moved, "share": moved / len(both) if both else None}


def minimal_share(cfg: TimelineConfig) -> float:
    if cfg.event in ("scale-out", "scale-in"):
        return cfg.delta / (cfg.pods + cfg.delta)
    return 0.0


def recovery_s(wins: Sequence[dict[str, Any]], start: float, end: float, width: float) -> dict[str, Any]:
    steady = [w["hit_rate"] for w in results_md.timeline_steady(wins, start, width) if w["hit_rate"] is not None]
    if not steady:
        return {"steady_hit_rate": None, "recovered_s": None}
    target = sum(steady) / len(steady) - RECOVERY_POINTS
    after = [w for w in wins if w["start_s"] >= end and w["hit_rate"] is not None]
    back = next((w for w in after if w["hit_rate"] >= target), None)
    return {"steady_hit_rate": target + RECOVERY_POINTS,
            "recovered_s": None if back is None else max(0.0, back["start_s"] + width - end)}  # fmt: skip


# ---- one policy, the whole run ---------------------------------------------------------------------


def run_policy(policy: str, cfg: TimelineConfig, items: Sequence[Item], times: Sequence[float]) -> dict[str, Any]:
    k = 1.0 / cfg.time_scale  # wall seconds -> pod seconds
    with contextlib.ExitStack() as stack:
        fleet = start_fleet(cfg, stack)
        url, headers = open_router(policy, cfg, fleet, stack)
        slot = {p.address: p.bucket for p in [*fleet.ready, *fleet.spares]}
        specs = workloads.specs(items, [t * cfg.time_scale for t in times], headers=[headers(it) for it in items])
        t0 = time.perf_counter() + 0.05  # loadgen.run's own start, near enough for the event clock

        def event() -> None:
            time.sleep(max(0.0, t0 + cfg.event_at * cfg.time_scale - time.perf_counter()))
            try:
                fleet.run_event()
            except Exception as e:  # reported with the run; the load goes on
                fleet.failures.append(f"event failed: {e}")

        thread = threading.Thread(target=event, name="timeline-event", daemon=True)
        thread.start()
        recs = asyncio.run(loadgen.run(url, specs, timeout=cfg.timeout))
        thread.join(timeout=cfg.drain_timeout + 30)
        kv = fleet.members.kvroute if isinstance(fleet.members, FileMembers) else None
        precise_blocks = kv.precise_stat("blocks_stored") if kv is not None and "precise" in policy else None
        indexes = harness.index_decisions(kv.metrics()) if kv is not None else None
    first = min(r.start for r in recs)
    rows: list[dict[str, Any]] = [
        {"tag": r.tag, "at_s": (r.start - first) * k, "ok": r.ok, "ttft_s": None if r.ttft is None else r.ttft * k,
         "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "upstream": r.upstream,
         "error": r.error}
        for r in recs
    ]  # fmt: skip
    marks = [((t - first) * k, what) for t, what in fleet.log]
    start = next((t for t, w in marks if w.endswith("starts")), cfg.event_at)
    end = next((t for t, w in marks if w.endswith("done")), start)
    wins = windows(rows, cfg.window, max(r["at_s"] for r in rows) + 1e-9)
    moved = keys_moved(rows, slot, start, end)
    failed_after = sum(1 for r in rows if not r["ok"] and r["at_s"] >= start)
    recovery = recovery_s(wins, start, end, cfg.window)
    return {
        "policy": policy,
        "event": cfg.event,
        "requests": len(rows),
        "failed": sum(1 for r in rows if not r["ok"]),
        "failed_after_event": failed_after,
        "errors": sorted({r["error"] for r in rows if r["error"]})[:5],
        "event_start_s": round(start, 2),
        "event_end_s": round(end, 2),
        "marks": [(round(t, 2), w) for t, w in marks],
        "keys_moved": moved,
        "minimal_share": minimal_share(cfg),
        **recovery,
        "targets": targets(cfg.event, failed_after, moved["share"], minimal_share(cfg), recovery["recovered_s"]),
        # blocks the pods' KV events put in kvroute's precise index (0: it routed on approximate keys)
        **({} if precise_blocks is None else {"precise_blocks_stored": precise_blocks}),
        # kvroute's decisions by index (precise: token-exact keys from the pods' tokenizer)
        **({} if indexes is None else {"index_decisions": indexes}),
        "windows": wins,
        "event_problems": fleet.failures,
        "requests_rows": rows,
    }


def targets(
    event: str, failed_after: int, moved: float | None, minimal: float, recovered: float | None
) -> dict[str, bool | None]:
    """Issue 17's targets met (True), missed (False), or not applying to this event / not measured (None)."""
    return {
        "no_failures": failed_after == 0 if event in GRACEFUL else None,
        "keys_moved": None if event != "scale-out" or moved is None else moved <= MOVED_TARGET * minimal + 1e-9,
        "recovered": recovered is not None and recovered <= RECOVERY_TARGET_S,
    }


def run(cfg: TimelineConfig, workload: workloads.Workload) -> list[dict[str, Any]]:
    check_policies(cfg.policies)
    times = harness.arrivals(workload.items, cfg.rate, cfg.seed, cfg.duration)
    items = workload.items[: len(times)]
    if times and times[-1] < cfg.event_at + cfg.window:
        raise ValueError(
            f"the workload's {len(items)} requests end at {times[-1]:.0f} s, before the event's aftermath; "
            "raise --rate or use a longer workload"
        )
    cfg.out.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in cfg.policies:
        try:
            res = run_policy(policy, cfg, items, times)
        except Exception as e:  # one router that cannot start must not lose the others' figures
            res = {"policy": policy, "event": cfg.event, "error": f"{type(e).__name__}: {e}"}
        with (cfg.out / f"{policy}.requests.jsonl").open("w") as f:
            for row in res.pop("requests_rows", []):
                f.write(json.dumps(row) + "\n")
        results.append(res)
        if not cfg.quiet:
            print(summary_line(res), flush=True)
    meta = {"event": cfg.event, "command": cfg.command, "workload": workload.name, "rate_rps": cfg.rate,
            "requests": len(items), "pods": cfg.pods, "delta": cfg.delta, "profile": cfg.profile,
            "time_scale": cfg.time_scale, "event_at_s": cfg.event_at, "window_s": cfg.window}  # fmt: skip
    (cfg.out / "timeline.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, cfg.out / f"timeline-{cfg.event}.png", cfg)
    return results


def summary_line(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"{res['policy']:28} ERROR {res['error']}"
    share, steady, back = results_md.timeline_figures(res)
    return (
        f"{res['policy']:28} failed {res['failed']:3d} (after the event started {res['failed_after_event']:3d})  "
        f"keys moved {share} (minimal {res['minimal_share']:.1%}, {res['keys_moved']['sessions']} sessions)  "
        f"steady hit rate {steady}, back within 2 points {back} after the event; "
        f"targets {results_md.timeline_targets_text(res)}"
    )


def markdown_table(results: Sequence[dict[str, Any]], window_s: float) -> str:
    return results_md.md_table(results_md.TIMELINE_COLUMNS, results_md.timeline_rows(results, window_s))


def plot(results: Sequence[dict[str, Any]], path: Path, cfg: TimelineConfig) -> None:
    """Hit rate and TTFT p50/p90 per window, one line per policy, the event shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "windows" in r]
    if not ok:
        return
    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in ok:
        xs = [w["start_s"] + cfg.window / 2 for w in r["windows"]]
        ax_hit.plot(xs, [w["hit_rate"] for w in r["windows"]], marker="o", label=r["policy"])
        (line,) = ax_ttft.plot(xs, [w["ttft_p90_s"] for w in r["windows"]], marker="o", label=f"{r['policy']} p90")
        ax_ttft.plot(xs, [w["ttft_p50_s"] for w in r["windows"]], ls="--", color=line.get_color())
    start, end = ok[0]["event_start_s"], max(r["event_end_s"] for r in ok)
    for ax in (ax_hit, ax_ttft):
        ax.axvspan(start, max(end, start + 0.5), color="grey", alpha=0.2)
    ax_hit.set_ylabel("prefix hit rate")
    ax_ttft.set_ylabel("TTFT (s): p90 solid, p50 dashed")
    ax_ttft.set_xlabel(f"time (s, {cfg.window:g} s windows)")
    ax_hit.set_title(f"{cfg.event}: {cfg.pods} pods, {cfg.rate:g} req/s, {cfg.profile}")
    ax_hit.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
