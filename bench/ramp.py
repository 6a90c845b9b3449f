"""Autoscaling signals under a load ramp: does kvroute ask for more pods before TTFT breaks, and does
it let them go after the ramp?

    python -m bench ramp --pods 2 --profile h100-llama8b --prompt-tokens 2000 --output-tokens 32 \\
        --base-load 0.3 --peak-load 1.3 --out bench/out/ramp
    python -m bench ramp --pods 3 --pd-split 1:2 ...   # prefill and decode pods: a count per role

Simulated pods (``python -m bench.sim``) behind real Envoy and kvroute (scraping the pods' /metrics
as the shipped config does); fresh prompts (every token is prefill demand) arrive as a Poisson
process whose rate follows the ramp: ``--base-s`` at the base rate, up over ``--up-s`` to the peak,
``--hold-s`` there, down over ``--down-s``, then ``--tail-s`` at the base rate again. Rates are
``--base-load`` / ``--peak-load`` times the fleet's prefill capacity: the pods that prefill × one
pod's prefill tokens/s (``--prefill-capacity`` when pinned, which kvroute then uses too; else the
profile's prefill model, as ``kvroute plan`` computes it) / ``--prompt-tokens``.

Every ``--scrape-s`` the bench reads kvroute's /metrics: per role, kvroute_desired_replicas,
kvroute_capacity_ready_replicas and the demand against one pod's capacity (kvroute_capacity_demand /
_per_pod), from which the count the window alone wants (before the scale-down delay) is derived:
max(demand / per-pod capacity) / target utilisation (the prefill demand is the rate on the window's
trend while it climbs clearly: ``--trend-z``, capacity.trend_z; ``off`` for the window's mean, to
compare). The client's TTFT p90 at each scrape is the 90th percentile of the first tokens that
arrived in the last ``--ttft-window`` s (what a client could know by then, not the requests still
waiting).

Figures, per role: ``rise_s`` the first scrape where the desired count exceeds the ready pods
(an HPA would add one), ``break_s`` the first where TTFT p90 exceeds ``--ttft-p90-ms`` and
``lead_s = break_s - rise_s`` (positive: the signal came first), ``load_at_rise`` / ``load_at_break``
the offered rate then over the fleet's prefill capacity (the rise would ideally come at the target
utilisation), ``prefill_capacity_ratio`` kvroute's prefill tokens/s per pod (median over the scrapes)
over what a pod sustains (above 1: it counts on faster pods than there are, and asks for too few);
after the peak, ``window_fell_s`` the last time the window alone still wanted more than the ready
pods and ``fell_s`` the first time the desired count is back at or below them: ``fell_s -
window_fell_s`` is the scale-down delay at work (``--scale-down-delay``, kvroute's
capacity.scale_down_delay_s; short here so the run stays short).
Times are pod time (``--time-scale`` divides them out), from the first request. Writes ramp.json,
requests.jsonl and ramp.png (desired and ready pods with the offered rate; TTFT p90 and its target).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import harness, loadgen, workloads
from bench.envoy import EnvoyProcess
from bench.harness import RunConfig
from bench.kvroute import KVRouteProcess
from bench.sim.profiles import PROFILES, get_profile
from extproc import plan as planner
from extproc.config import CapacityConfig

CAPACITY_KINDS = ("prefill_tokens_per_s", "streams")  # as extproc.capacity exports them


@dataclass
class RampConfig:
    pods: int = 2
    pd_split: str | None = None  # "P:D[:B]": pods by role, kvroute splitting every request (gateway hand-off)
    profile: str = "h100-llama8b"
    time_scale: float = 1.0
    prompt_tokens: int = 2000
    output_tokens: int = 32
    base_load: float = 0.3
    peak_load: float = 1.3
    base_s: float = 20.0
    up_s: float = 40.0
    hold_s: float = 20.0
    down_s: float = 20.0
    tail_s: float = 60.0
    ttft_p90_ms: float | None = None  # None: 4 x one prompt's prefill on an idle pod (the profile's model)
    ttft_window_s: float = 5.0
    scrape_s: float = 1.0
    # kvroute's capacity section (pod seconds; scaled by time_scale like its cost settings)
    capacity_window_s: float = 10.0
    scale_down_delay_s: float = 20.0
    target_utilization: float = 0.7
    trend_z: float | None = CapacityConfig().trend_z  # capacity.trend_z (None: the window's mean)
    prefill_capacity: float | None = None  # capacity.prefill_tokens_per_s (per pod)
    kvroute_config: str | None = None
    seed: int = 0
    timeout: float = 300.0
    out: Path = Path("bench/out/ramp")
    quiet: bool = False
    command: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more kvroute settings over the file's

    @property
    def span_s(self) -> float:
        return self.base_s + self.up_s + self.hold_s + self.down_s + self.tail_s

    @property
    def ramp_end_s(self) -> float:
        """When the rate is back at the base."""
        return self.base_s + self.up_s + self.hold_s + self.down_s


# ---- the load ------------------------------------------------------------------------------------


def prefill_pods(cfg: RampConfig) -> int:
    if cfg.pd_split is None:
        return cfg.pods
    p, _d, b = harness.parse_pd_split(cfg.pd_split, cfg.pods)
    return p + b


def capacity_rps(cfg: RampConfig) -> float:
    """Requests/s the prefilling pods sustain at 100 % (the unit of ``--base-load`` / ``--peak-load``)."""
    if cfg.prefill_capacity is not None:
        per_pod = cfg.prefill_capacity / cfg.prompt_tokens
    else:
        n = cfg.prompt_tokens
        per_pod = 1.0 / planner.Profile.load_dict(asdict(get_profile(cfg.profile))).prefill_s(n, 0, n)
    return prefill_pods(cfg) * per_pod


def ttft_target_s(cfg: RampConfig) -> float:
    if cfg.ttft_p90_ms is not None:
        return cfg.ttft_p90_ms / 1000
    n = cfg.prompt_tokens
    return 4 * planner.Profile.load_dict(asdict(get_profile(cfg.profile))).prefill_s(n, 0, n)


def rate_at(cfg: RampConfig, t: float, unit: float) -> float:
    """Offered req/s at pod time ``t``: base, linear up, peak, linear down, base."""
    lo, hi = cfg.base_load * unit, cfg.peak_load * unit
    edges = [cfg.base_s, cfg.base_s + cfg.up_s, cfg.base_s + cfg.up_s + cfg.hold_s, cfg.ramp_end_s]
    if t < edges[0] or t >= edges[3]:
        return lo
    if t < edges[1]:
        return lo + (hi - lo) * (t - edges[0]) / cfg.up_s
    if t < edges[2]:
        return hi
    return hi - (hi - lo) * (t - edges[2]) / cfg.down_s


def arrivals(cfg: RampConfig, unit: float) -> list[float]:
    """A Poisson process with rate ``rate_at`` over the span (thinning of one at the highest rate)."""
    top = max(cfg.base_load, cfg.peak_load) * unit
    if top <= 0:
        return []
    rng, t, out = random.Random(cfg.seed), 0.0, list[float]()
    while True:
        t += rng.expovariate(top)
        if t >= cfg.span_s:
            return out
        if rng.random() * top < rate_at(cfg, t, unit):
            out.append(t)


# ---- kvroute's signals ------------------------------------------------------------------------------


def parse_signals(text: str) -> dict[str, dict[str, Any]]:
    """Per role (summed over pools): desired, ready, and demand / per-pod capacity by kind."""
    roles: dict[str, dict[str, Any]] = {}

    def role(labels: dict[str, str]) -> dict[str, Any]:
        return roles.setdefault(labels["role"], {"desired": 0.0, "ready": 0.0, "demand": {}, "per_pod": {}})

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.name == "kvroute_desired_replicas":
                role(s.labels)["desired"] += s.value
            elif fam.name == "kvroute_capacity_ready_replicas":
                role(s.labels)["ready"] += s.value
            elif fam.name in ("kvroute_capacity_demand", "kvroute_capacity_per_pod"):
                kinds = role(s.labels)["demand" if fam.name == "kvroute_capacity_demand" else "per_pod"]
                kinds[s.labels["kind"]] = kinds.get(s.labels["kind"], 0.0) + s.value
    return roles


def window_wants(sig: dict[str, Any], target_utilization: float) -> float:
    """Pods the demand of the window alone asks for (kvroute's count before its scale-down delay,
    without the queue-wait term)."""
    need = max((sig["demand"].get(k, 0.0) / sig["per_pod"][k] for k in CAPACITY_KINDS if sig["per_pod"].get(k)),
               default=0.0)  # fmt: skip
    return need / target_utilization


class Scraper:
    """Reads ``metrics()`` every ``every`` s on a thread; samples are (perf_counter, text-parsed roles)."""

    def __init__(self, metrics: Callable[[], str], every: float) -> None:
        self.metrics, self.every = metrics, every
        self.samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ramp-scraper", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                self.samples.append((t, parse_signals(self.metrics())))
            except OSError as e:  # a missed scrape is a gap in the series, not the end of the run
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(max(0.0, self.every - (time.perf_counter() - t)))

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---- figures ------------------------------------------------------------------------------------


def trailing_p90(rows: Sequence[dict[str, Any]], at: Sequence[float], window: float) -> list[float | None]:
    """At each time in ``at``: the TTFT p90 of the first tokens that arrived in the ``window`` before it."""
    firsts = sorted((r["at_s"] + r["ttft_s"], r["ttft_s"]) for r in rows if r["ok"] and r["ttft_s"] is not None)
    return [loadgen.percentile([v for seen, v in firsts if t - window < seen <= t], 0.9) for t in at]


def role_figures(series: Sequence[dict[str, Any]], role: str, target_s: float, cfg: RampConfig) -> dict[str, Any]:
    """Rise, break, lead and fall of one role's count (see the module doc); times in pod seconds."""
    pts = [(s["t_s"], s["roles"][role], s["ttft_p90_s"]) for s in series if role in s["roles"]]
    if not pts:
        return {"role": role, "samples": 0}
    rise = next((t for t, sig, _ in pts if sig["desired"] > sig["ready"]), None)
    brk = next((t for t, _, p in pts if p is not None and p > target_s), None)
    peak_t, peak_sig, _ = max(pts, key=lambda x: x[1]["desired"])
    after = [(t, sig) for t, sig, _ in pts if t >= peak_t]
    fell = next((t for t, sig in after if sig["desired"] <= sig["ready"]), None)
    wants_more = [t for t, sig in after if window_wants(sig, cfg.target_utilization) > sig["ready"]
                  and (fell is None or t < fell)]  # fmt: skip
    window_fell = wants_more[-1] if wants_more else None
    base = [sig["desired"] for t, sig, _ in pts if t < cfg.base_s]
    unit = capacity_rps(cfg)

    def load_at(t: float | None) -> float | None:  # the offered rate then, over the fleet's prefill capacity
        return None if t is None else rate_at(cfg, t, unit) / unit

    # kvroute's prefill tokens/s per pod (its pod time: x time_scale) over the load unit's per pod
    # (--prefill-capacity, else the profile's): above 1, it counts on pods faster than they are.
    priced = sorted(v for _, sig, _ in pts if sig["demand"].get("prefill_tokens_per_s")
                    and (v := sig["per_pod"].get("prefill_tokens_per_s")))  # fmt: skip
    per_pod = unit / prefill_pods(cfg) * cfg.prompt_tokens
    return {
        "role": role,
        "samples": len(pts),
        "ready": pts[0][1]["ready"],
        "base_desired": max(base, default=None),
        "peak_desired": peak_sig["desired"],
        "peak_s": peak_t,
        "rise_s": rise,
        "break_s": brk,
        "lead_s": None if rise is None or brk is None else brk - rise,
        "load_at_rise": load_at(rise),
        "load_at_break": load_at(brk),
        "prefill_capacity_ratio": priced[len(priced) // 2] * cfg.time_scale / per_pod if priced else None,
        "window_fell_s": window_fell,
        "fell_s": fell,
        "fall_delay_s": None if fell is None or window_fell is None else fell - window_fell,
        "end_desired": pts[-1][1]["desired"],
    }


# ---- the run ------------------------------------------------------------------------------------


def kvroute_config(cfg: RampConfig, fleet: harness.SimFleet, chars_per_token: float) -> dict[str, Any]:
    user: dict[str, Any] = {}
    if cfg.kvroute_config:  # the user's routing settings; the pods and the capacity section come from this run
        user = yaml.safe_load(Path(cfg.kvroute_config).read_text()) or {}
    k = cfg.time_scale
    capacity = {**(user.get("capacity") or {}), "window_s": cfg.capacity_window_s * k,
                "scale_down_delay_s": cfg.scale_down_delay_s * k,
                "target_utilization": cfg.target_utilization, "trend_z": cfg.trend_z}  # fmt: skip
    if cfg.prefill_capacity is not None:
        capacity["prefill_tokens_per_s"] = cfg.prefill_capacity / k
    queue_target = capacity.get("queue_target_s", CapacityConfig().queue_target_s)  # kvroute's default, scaled too
    if queue_target is not None:
        capacity["queue_target_s"] = float(queue_target) * k
    if cfg.pd_split is None:
        own: dict[str, Any] = {"pools": {"default": {"endpoints": [{"address": a} for a in fleet.addresses]}},
                               "default_pool": "default"}  # fmt: skip
    else:
        own = harness.pd_config(fleet, "kvroute-pd-always", RunConfig.pd_threshold)
        own["pd"] = {**(user.get("pd") or {}), **own["pd"]}
    # Prompt tokens as the pods count them: kvroute's default 4 characters a token would double the
    # demand of the simulator's pseudo-words (as the harness's --chars-per-token auto).
    routing = {"chars_per_token": round(chars_per_token, 2), **(user.get("routing") or {})}
    # kvroute scrapes the pods as shipped (a user's scrape section wins): the queue term reads their waiting.
    scrape = {"scrape": harness.production_scrape(k)}
    return harness.time_scaled({**scrape, **user, **own, **cfg.extra, "routing": routing, "capacity": capacity}, k)


def run(cfg: RampConfig) -> dict[str, Any]:
    unit = capacity_rps(cfg)
    times = arrivals(cfg, unit)
    if not times:
        raise ValueError("the ramp has no requests: raise --base-load / --peak-load or the durations")
    items = workloads.no_reuse(len(times), cfg.prompt_tokens, cfg.output_tokens, cfg.seed).items
    specs = workloads.specs(items, [t * cfg.time_scale for t in times])
    run_cfg = RunConfig(policies=[], pods=cfg.pods, profile=cfg.profile, time_scale=cfg.time_scale,
                                pd_split=cfg.pd_split or RunConfig.pd_split)  # fmt: skip
    roles = None if cfg.pd_split is None else harness.pd_roles("kvroute-pd-always", run_cfg)
    k = 1.0 / cfg.time_scale
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(harness.SimFleet(run_cfg, roles))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ramp-")))
        cpt = workloads.ideal_hit_rate(items[:50], get_profile(cfg.profile).block_size)["chars_per_token"]
        (tmp / "kvroute.yaml").write_text(yaml.safe_dump(kvroute_config(cfg, fleet, cpt)))
        kvroute = KVRouteProcess(config=str(tmp / "kvroute.yaml"), extra_args=["--log-level", "warning"])
        kv = stack.enter_context(kvroute)
        env = stack.enter_context(EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=fleet.addresses))
        with Scraper(kv.metrics, cfg.scrape_s * cfg.time_scale) as scraper:
            t0 = time.perf_counter()
            recs = asyncio.run(loadgen.run(env.url, specs, timeout=cfg.timeout))
    first = min(r.start for r in recs)
    rows = [{"tag": r.tag, "at_s": (r.start - first) * k, "ok": r.ok, "ttft_s": None if r.ttft is None else r.ttft * k,
             "prompt_tokens": r.prompt_tokens, "upstream": r.upstream, "error": r.error} for r in recs]  # fmt: skip
    target = ttft_target_s(cfg)
    stamps = [(t - first) * k for t, _ in scraper.samples]
    p90s = trailing_p90(rows, stamps, cfg.ttft_window_s)
    series: list[dict[str, Any]] = [
        {"t_s": round(ts, 3), "rate_rps": rate_at(cfg, ts, unit), "ttft_p90_s": p, "roles": sig}
        for ts, p, (_, sig) in zip(stamps, p90s, scraper.samples, strict=True)
    ]
    role_names = sorted({r for _, sig in scraper.samples for r in sig})
    meta = {"command": cfg.command, "config": {k_: v for k_, v in asdict(cfg).items() if k_ != "out"},
            "capacity_rps": unit, "base_rps": cfg.base_load * unit, "peak_rps": cfg.peak_load * unit,
            "requests": len(rows), "ttft_target_s": target, "ramp_end_s": cfg.ramp_end_s,
            "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    result = {
        "meta": meta,
        "failed": sum(1 for r in rows if not r["ok"]),
        "errors": sorted({r["error"] for r in rows if r["error"]})[:5],
        "scrape_errors": scraper.errors[:5],
        "roles": [role_figures(series, r, target, cfg) for r in role_names],
        "series": series,
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "ramp.json").write_text(json.dumps(result, indent=1, default=str))
    with (cfg.out / "requests.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    plot(result, cfg.out / "ramp.png")
    return result


def _s(v: float | None, fmt: str = ".1f") -> str:
    return "never" if v is None else f"{v:{fmt}} s"


def _frac(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def summary(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"{m['requests']} requests, {m['base_rps']:.2f} -> {m['peak_rps']:.2f} req/s (fleet prefill capacity "
        f"{m['capacity_rps']:.2f} req/s), ramp back at base at {m['ramp_end_s']:g} s; failed {result['failed']}; "
        f"TTFT p90 target {m['ttft_target_s'] * 1e3:.0f} ms",
    ]
    for r in result["roles"]:
        if not r["samples"]:
            continue
        lead = "n/a" if r["lead_s"] is None else f"{r['lead_s']:+.1f} s"
        lines.append(
            f"  {r['role']:8} ready {r['ready']:g}, desired {r['base_desired'] or 0:.2f} at base, peak "
            f"{r['peak_desired']:.2f} at {r['peak_s']:.1f} s; above ready at {_s(r['rise_s'])}, TTFT p90 over "
            f"target at {_s(r['break_s'])} (lead {lead}); window back at ready after {_s(r['window_fell_s'])}, "
            f"desired back at {_s(r['fell_s'])} (delay {_s(r['fall_delay_s'])}); offered load at the rise "
            f"{_frac(r['load_at_rise'])}, at the break {_frac(r['load_at_break'])}; kvroute's prefill capacity per "
            f"pod / the pods' {_frac(r['prefill_capacity_ratio'])}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Desired and ready pods per role (offered rate behind), and TTFT p90 against its target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    if not series:
        return
    xs = [s["t_s"] for s in series]
    fig, (ax_n, ax_t) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax_rate = ax_n.twinx()
    ax_rate.plot(xs, [s["rate_rps"] for s in series], color="grey", alpha=0.4, label="offered req/s")
    ax_rate.set_ylabel("offered req/s", color="grey")
    for fig_role in result["roles"]:
        role = fig_role["role"]
        pts = [(s["t_s"], s["roles"][role]) for s in series if role in s["roles"]]
        (line,) = ax_n.plot([t for t, _ in pts], [sig["desired"] for _, sig in pts], label=f"{role} desired")
        ax_n.step([t for t, _ in pts], [sig["ready"] for _, sig in pts], where="post", ls="--",
                  color=line.get_color(), label=f"{role} ready")  # fmt: skip
        for ax in (ax_n, ax_t):
            if fig_role["rise_s"] is not None:
                ax.axvline(fig_role["rise_s"], color=line.get_color(), ls=":", lw=1)
    target = result["meta"]["ttft_target_s"]
    ax_t.plot(xs, [s["ttft_p90_s"] for s in series], color="C3", label="TTFT p90 (trailing window)")
    ax_t.axhline(target, color="C3", ls="--", lw=1, label=f"target {target * 1e3:.0f} ms")
    for ax in (ax_n, ax_t):
        ax.axvline(result["meta"]["ramp_end_s"], color="grey", ls="-.", lw=1)
    ax_n.set_ylabel("pods (desired: kvroute_desired_replicas)")
    ax_t.set_ylabel("TTFT p90 (s)")
    ax_t.set_xlabel("time (s); dotted: desired above ready, dash-dot: rate back at base")
    ax_n.set_title("kvroute_desired_replicas under a load ramp")
    ax_n.legend(fontsize=8, loc="upper left")
    ax_t.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _z(value: str) -> float | None:
    if value == "off":
        return None
    try:
        z = float(value)
    except ValueError:
        z = -1.0
    if not z >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected standard errors >= 0 or 'off', got {value!r}")
    return z


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    d = RampConfig()
    ap = argparse.ArgumentParser(prog="python -m bench ramp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pods", type=int, default=d.pods)
    ap.add_argument("--pd-split", default=None, help="PREFILL:DECODE[:BOTH] pods (kvroute splits every request)")
    ap.add_argument("--profile", default=d.profile, choices=sorted(PROFILES))
    ap.add_argument("--time-scale", type=float, default=d.time_scale, help="pods this many times slower")
    ap.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    ap.add_argument("--output-tokens", type=int, default=d.output_tokens)
    ap.add_argument("--base-load", type=float, default=d.base_load, help="base rate / fleet prefill capacity")
    ap.add_argument("--peak-load", type=float, default=d.peak_load, help="peak rate / fleet prefill capacity")
    for name in ("base", "up", "hold", "down", "tail"):
        ap.add_argument(f"--{name}-s", type=float, default=getattr(d, f"{name}_s"), help=f"s of the {name} phase")
    ap.add_argument("--ttft-p90-ms", type=float, default=None,
                    help="TTFT p90 target (default: 4 x one prompt's prefill on an idle pod)")  # fmt: skip
    ap.add_argument("--ttft-window", type=float, default=d.ttft_window_s, help="s of first tokens per TTFT p90")
    ap.add_argument("--scrape-s", type=float, default=d.scrape_s, help="s between /metrics scrapes")
    ap.add_argument("--capacity-window", type=float, default=d.capacity_window_s, help="capacity.window_s")
    ap.add_argument("--scale-down-delay", type=float, default=d.scale_down_delay_s,
                    help="capacity.scale_down_delay_s (kvroute's default is 120 s)")  # fmt: skip
    ap.add_argument("--target-utilization", type=float, default=d.target_utilization)
    ap.add_argument("--trend-z", type=_z, default=d.trend_z,
                    help="capacity.trend_z: a climbing prefill rate counts at its trend ('off': the mean)")  # fmt: skip
    ap.add_argument("--prefill-capacity", type=float, default=None,
                    help="capacity.prefill_tokens_per_s per pod (default: kvroute's cost model)")  # fmt: skip
    ap.add_argument("--kvroute-config", default=None, help="kvroute YAML (routing...) under the run's own settings")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per-request timeout (s)")
    ap.add_argument("--out", default=str(d.out))
    a = ap.parse_args(argv)
    cfg = RampConfig(
        pods=a.pods, pd_split=a.pd_split, profile=a.profile, time_scale=a.time_scale, prompt_tokens=a.prompt_tokens,
        output_tokens=a.output_tokens, base_load=a.base_load, peak_load=a.peak_load, base_s=a.base_s, up_s=a.up_s,
        hold_s=a.hold_s, down_s=a.down_s, tail_s=a.tail_s, ttft_p90_ms=a.ttft_p90_ms, ttft_window_s=a.ttft_window,
        scrape_s=a.scrape_s, capacity_window_s=a.capacity_window, scale_down_delay_s=a.scale_down_delay,
        target_utilization=a.target_utilization, trend_z=a.trend_z, prefill_capacity=a.prefill_capacity,
        kvroute_config=a.kvroute_config, seed=a.seed, timeout=a.timeout, out=Path(a.out),
        command="python -m bench ramp " + " ".join(argv),
    )  # fmt: skip
    if cfg.pd_split is not None:
        try:
            harness.parse_pd_split(cfg.pd_split, cfg.pods)
        except ValueError as e:
            raise SystemExit(f"bench ramp: {e}") from None
    for name in ("up_s", "down_s"):
        if getattr(cfg, name) <= 0 or not math.isfinite(getattr(cfg, name)):
            raise SystemExit(f"bench ramp: --{name.replace('_', '-')} must be > 0")
    harness.stop_on_sigterm()
    try:
        result = run(cfg)
    except ValueError as e:
        raise SystemExit(f"bench ramp: {e}") from None
    print(summary(result))
    print(f"wrote {cfg.out}/ (ramp.json, ramp.png, requests.jsonl)")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
