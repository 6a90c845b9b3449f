"""``python -m bench.shadow``: does shadow mode predict what enforcing kvroute gains, and how do two
pools compare on mirrored traffic?

``compare`` runs one workload twice, each on a fresh simulated fleet at the same arrival times:
kvroute in ``mode: shadow`` (Envoy's round robin routes, kvroute decides and predicts), then kvroute
enforcing (``kvroute-approx``). It reports the shadow run's predicted hit rate (kvroute's
``predicted_cached / prompt``, arm shadow), the hit rate round robin really got, and the enforced
run's realised hit rate (the responses' ``cached_tokens / prompt_tokens`` in both runs), with TTFT
p50/p90: the gain shadow mode predicts (predicted − round robin) next to the gain enforcing realised
(enforced − round robin)::

    python -m bench.shadow compare --scenario multi-turn --pods 4 --max-requests 200 --out bench/out/shadow

``mirror`` sends the workload through an Envoy that balances the live pool round robin and mirrors
``--mirror-fraction`` of the requests (``kvroute envoy-config --mirror-to``) to a second Envoy whose
kvroute routes a second fleet; clients get the live pool's answers only. Both pools' TTFT and
inter-token latency come from their pods' own vLLM histograms (the mirrored responses are discarded),
hit rates from their counters, side by side::

    python -m bench.shadow mirror --scenario multi-turn --pods 4 --max-requests 200 --out bench/out/mirror

Each writes ``<out>/shadow.md``, ``shadow.json`` and ``shadow.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import harness, loadgen, workloads
from bench.envoy import EnvoyProcess
from bench.report import pod_deltas
from bench.sim.profiles import PROFILES, get_profile
from extproc.envoyconfig import Mirror, parse_host_port

SHADOW, ENFORCED = "kvroute-shadow", "kvroute-approx"
TTFT, ITL = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"


# --- figures ---------------------------------------------------------------------------------------


def usage_hit_rate(requests_jsonl: Path) -> float | None:
    """cached_tokens / prompt_tokens over the run's responses (what the pods reported to clients)."""
    prompt = cached = 0
    for line in requests_jsonl.read_text().splitlines():
        r = json.loads(line)
        if r["prompt_tokens"] is not None:
            prompt += r["prompt_tokens"]
            cached += r["cached_tokens"] or 0
    return cached / prompt if prompt else None


def compare_summary(rows: Mapping[str, Mapping[str, Any]], realised: Mapping[str, float | None]) -> dict[str, Any]:
    """The shadow run's prediction and real hit rate, the enforced run's realised one, and the two gains."""
    shadow, enforced = rows[SHADOW], rows[ENFORCED]
    tokens = shadow.get("rollout_tokens") or {}
    prompt = tokens.get("shadow/prompt", 0.0)
    predicted = tokens.get("shadow/predicted_cached", 0.0) / prompt if prompt else None
    base, won = realised[SHADOW], realised[ENFORCED]
    out: dict[str, Any] = {
        "shadow_predicted_hit_rate": predicted,
        "shadow_real_hit_rate": base,
        "enforced_hit_rate": won,
        "predicted_gain": None if predicted is None or base is None else predicted - base,
        "realised_gain": None if won is None or base is None else won - base,
    }
    for name, row in ((SHADOW, shadow), (ENFORCED, enforced)):
        for k in ("ttft_p50_s", "ttft_p90_s", "hit_rate", "errors", "requests"):
            out[f"{name}/{k}"] = row.get(k)
    if out["predicted_gain"] is not None and out["realised_gain"] is not None:
        out["gain_gap_points"] = 100 * (out["predicted_gain"] - out["realised_gain"])
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def compare_table(s: Mapping[str, Any]) -> str:
    lines = [
        "| run | routed by | predicted hit rate | realised hit rate (usage) | pods' hit rate | TTFT p50 s "
        "| TTFT p90 s |",
        "|---|---|---|---|---|---|---|",
        f"| shadow | Envoy round robin (kvroute predicts) | {_pct(s['shadow_predicted_hit_rate'])} "
        f"| {_pct(s['shadow_real_hit_rate'])} | {_pct(s[f'{SHADOW}/hit_rate'])} | {_s(s[f'{SHADOW}/ttft_p50_s'])} "
        f"| {_s(s[f'{SHADOW}/ttft_p90_s'])} |",
        f"| enforced | kvroute | - | {_pct(s['enforced_hit_rate'])} | {_pct(s[f'{ENFORCED}/hit_rate'])} "
        f"| {_s(s[f'{ENFORCED}/ttft_p50_s'])} | {_s(s[f'{ENFORCED}/ttft_p90_s'])} |",
    ]
    gap = s.get("gain_gap_points")
    lines += ["", f"gain predicted in shadow mode {_pct(s['predicted_gain'])}, realised when enforcing "
              f"{_pct(s['realised_gain'])}" + ("" if gap is None else f" ({gap:+.1f} points)")]  # fmt: skip
    return "\n".join(lines)


def histogram_deltas(before: str, after: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram summed over pods' /metrics texts, after − before."""

    def buckets(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name + "_bucket":
                    le = float(s.labels["le"])
                    out[le] = out.get(le, 0.0) + s.value
        return out

    b, a = buckets(before), buckets(after)
    return sorted((le, a[le] - b.get(le, 0.0)) for le in a)


def histogram_quantile(q: float, cumulative: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket holding the q-th observation."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * cumulative[-1][1], 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 0.0)
        prev_le, prev_n = le, n
    return prev_le


def fleet_metrics(fleet: harness.SimFleet) -> str:
    texts = []
    for p in fleet.pods:
        with urllib.request.urlopen(p["url"] + "/metrics", timeout=5) as r:
            texts.append(r.read().decode())
    return "\n".join(texts)


def pool_figures(before: str, after: str, stats: Sequence[Mapping[str, Any]], time_scale: float) -> dict[str, Any]:
    """One pool's TTFT and inter-token latency (its pods' histograms, pod time) and hit rate (counters)."""
    ttft, itl = histogram_deltas(before, after, TTFT), histogram_deltas(before, after, ITL)

    def q(v: float | None) -> float | None:
        return None if v is None else v / time_scale

    queried = sum(p["prefix_queries_tokens"] for p in stats)
    return {
        "requests": sum(p["requests"] for p in stats),
        "hit_rate": sum(p["prefix_hits_tokens"] for p in stats) / queried if queried else None,
        "ttft_p50_s": q(histogram_quantile(0.5, ttft)),
        "ttft_p90_s": q(histogram_quantile(0.9, ttft)),
        "tpot_p50_s": q(histogram_quantile(0.5, itl)),
        "tpot_p90_s": q(histogram_quantile(0.9, itl)),
    }


def mirror_table(pools: Mapping[str, Mapping[str, Any]]) -> str:
    lines = [
        "| pool | routed by | requests | hit rate | TTFT p50 s | TTFT p90 s | TPOT p50 s | TPOT p90 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, how in (("live", "Envoy round robin"), ("mirror", "kvroute")):
        p = pools[name]
        lines.append(f"| {name} | {how} | {p['requests']} | {_pct(p['hit_rate'])} | {_s(p['ttft_p50_s'])} "
                     f"| {_s(p['ttft_p90_s'])} | {_s(p['tpot_p50_s'])} | {_s(p['tpot_p90_s'])} |")  # fmt: skip
    return "\n".join(lines)


def plot(path: Path, title: str, hit: Mapping[str, float | None], ttft: Mapping[str, tuple[Any, Any]]) -> Path:
    """Hit rates (bars) beside TTFT p50/p90 per run or pool, in the style of bench/plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(hit)
    ax1.bar(names, [hit[n] or 0.0 for n in names], color=["#999999", "#4c72b0", "#dd8452", "#55a868"][: len(names)])
    for i, n in enumerate(names):
        ax1.text(i, (hit[n] or 0.0) + 0.01, _pct(hit[n]), ha="center", fontsize=8)
    ax1.set(ylabel="prefix cache hit rate (tokens)", ylim=(0, 1), title="Hit rate")
    ax1.tick_params(axis="x", labelsize=8)
    runs = list(ttft)
    xs = range(len(runs))
    ax2.bar([x - 0.2 for x in xs], [ttft[r][0] or 0.0 for r in runs], 0.4, label="p50")
    ax2.bar([x + 0.2 for x in xs], [ttft[r][1] or 0.0 for r in runs], 0.4, label="p90")
    ax2.set_xticks(list(xs), runs, fontsize=8)
    ax2.set(ylabel="time to first token (s)", title="TTFT")
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write(out: Path, data: Mapping[str, Any], text: str, png: Path) -> None:
    (out / "shadow.json").write_text(json.dumps(data, indent=1))
    (out / "shadow.md").write_text(text + "\n")
    print(f"\n{text}\n\nwrote {out / 'shadow.md'}, {out / 'shadow.json'}, {png}")


# --- the runs --------------------------------------------------------------------------------------


def run_compare(cfg: harness.RunConfig, w: workloads.Workload) -> dict[str, Any]:
    runs, meta = harness.run(replace(cfg, policies=[SHADOW, ENFORCED]), w)
    rows = {r.row["policy"]: r.row for r in runs}
    failed = [f"{p}: {r['failed']}" for p, r in rows.items() if r.get("failed")]
    if failed:
        raise SystemExit("bench.shadow: " + "; ".join(failed))
    realised = {p: usage_hit_rate(cfg.out / f"{p}.requests.jsonl") for p in (SHADOW, ENFORCED)}
    s = compare_summary(rows, realised)
    title = f"shadow vs enforced — {w.name}, {meta['requests']} requests, {cfg.pods} pods"
    png = plot(cfg.out / "shadow.png", title,
               {"round robin\n(shadow run)": s["shadow_real_hit_rate"],
                "kvroute predicted\n(shadow run)": s["shadow_predicted_hit_rate"],
                "kvroute realised\n(enforced run)": s["enforced_hit_rate"]},
               {"shadow run\n(round robin)": (s[f"{SHADOW}/ttft_p50_s"], s[f"{SHADOW}/ttft_p90_s"]),
                "enforced run\n(kvroute)": (s[f"{ENFORCED}/ttft_p50_s"], s[f"{ENFORCED}/ttft_p90_s"])})  # fmt: skip
    _write(cfg.out, {"meta": meta, "summary": s}, f"# {title}\n\n{compare_table(s)}", png)
    return s


def _drained(fleet: harness.SimFleet, before: Sequence[Mapping[str, Any]], want: int, timeout: float) -> None:
    """Wait until ``fleet`` has served ``want`` more requests (mirrored copies end after the client's)."""
    deadline = time.monotonic() + timeout
    while sum(a["requests"] - b["requests"] for a, b in zip(fleet.stats(), before, strict=True)) < want:
        if time.monotonic() > deadline:
            print(f"bench.shadow: the mirror pool did not finish {want} requests in {timeout:g}s", file=sys.stderr)
            return
        time.sleep(0.2)


def run_mirror(cfg: harness.RunConfig, w: workloads.Workload, fraction: float) -> dict[str, Any]:
    if cfg.chars_per_token == "auto":  # as harness.run resolves it
        measured = workloads.ideal_hit_rate(w.items, get_profile(cfg.profile).block_size)["chars_per_token"]
        cfg = replace(cfg, chars_per_token=round(measured, 2))
    rate = cfg.rate if cfg.rate is not None else cfg.load * harness.calibrate(cfg, w.items)["capacity_rps"]
    times = harness.arrivals(w.items, rate, cfg.seed, cfg.duration)
    items = w.items[: len(times)]
    specs = workloads.specs(items, [t * cfg.time_scale for t in times])
    with contextlib.ExitStack() as stack:
        live, shadow = stack.enter_context(harness.SimFleet(cfg)), stack.enter_context(harness.SimFleet(cfg))
        mirror_router = harness.open_router(ENFORCED, shadow, stack, cfg)
        to = Mirror(parse_host_port(mirror_router.url.removeprefix("http://"), "mirror"), fraction)
        env = stack.enter_context(EnvoyProcess("epp.yaml", kvroute_port=None, pods=live.addresses,
                                               without_ext_proc=True, mirror=to))  # fmt: skip
        before = {"live": (live.stats(), fleet_metrics(live)), "mirror": (shadow.stats(), fleet_metrics(shadow))}
        recs = asyncio.run(loadgen.run(env.url, specs, timeout=cfg.timeout))
        ok = sum(r.ok for r in recs)
        _drained(shadow, before["mirror"][0], int(ok * fraction * 0.95), cfg.timeout)
        pools = {}
        for name, fleet in (("live", live), ("mirror", shadow)):
            stats, text = before[name]
            pools[name] = pool_figures(text, fleet_metrics(fleet), pod_deltas(stats, fleet.stats()), cfg.time_scale)
    meta = {"scenario": w.name, "requests": len(items), "ok": ok, "rate_rps": rate, "pods": cfg.pods,
            "profile": cfg.profile, "time_scale": cfg.time_scale, "mirror_fraction": fraction,
            "command": cfg.command}  # fmt: skip
    title = f"mirrored: live (round robin) vs mirror (kvroute) — {w.name}, {len(items)} requests, {cfg.pods} pods each"
    png = plot(cfg.out / "shadow.png", title, {p: pools[p]["hit_rate"] for p in pools},
               {p: (pools[p]["ttft_p50_s"], pools[p]["ttft_p90_s"]) for p in pools})  # fmt: skip
    _write(cfg.out, {"meta": meta, "pools": pools}, f"# {title}\n\n{mirror_table(pools)}", png)
    return pools


# --- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.shadow", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("what", choices=["compare", "mirror"], help="shadow vs enforced, or a mirrored run")
    ap.add_argument("--scenario", default="multi-turn", choices=sorted(workloads.SCENARIOS), help="workload")
    ap.add_argument("--max-requests", type=int, default=200, help="use the first N requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES), help="simulated pod profile")
    ap.add_argument("--pods", type=int, default=4, help="pods per fleet")
    ap.add_argument("--rate", type=float, default=None, help="req/s (default: calibrate, then --load of capacity)")
    ap.add_argument("--load", type=float, default=0.7, help="fraction of calibrated capacity when --rate is unset")
    ap.add_argument("--time-scale", type=float, default=1.0, help="as in `python -m bench run` (figures in pod time)")
    ap.add_argument("--chars-per-token", type=harness.chars_per_token_arg, default="auto",
                    help="kvroute's routing.chars_per_token: its predicted cached tokens are prompt characters "
                    "over it, so it must match the pods' tokenizer (auto: measured on the workload; bench.sim's "
                    "pseudo-words run ~8 characters a token, English text ~4)")  # fmt: skip
    ap.add_argument("--mirror-fraction", type=float, default=1.0, help="mirror: share of requests copied")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench/out/shadow-<what>)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if not 0 < a.mirror_fraction <= 1:
        raise SystemExit("bench.shadow: --mirror-fraction must be > 0 and at most 1")
    w = workloads.build(a.scenario, None, a.max_requests, seed=a.seed)
    cfg = harness.RunConfig(policies=[], pods=a.pods, profile=a.profile, time_scale=a.time_scale, load=a.load,
                            rate=a.rate, seed=a.seed, timeout=a.timeout, quiet=a.quiet,
                            chars_per_token=a.chars_per_token,
                            out=a.out or Path(f"bench/out/shadow-{a.what}"),
                            command="python -m bench.shadow " + " ".join(argv))  # fmt: skip
    cfg.out.mkdir(parents=True, exist_ok=True)
    harness.stop_on_sigterm()
    if a.what == "compare":
        run_compare(cfg, w)
    else:
        run_mirror(cfg, w, a.mirror_fraction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
