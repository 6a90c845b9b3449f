"""``python -m bench.pd_sweep``: where conditional P/D sits between never and always splitting.

Runs ``kvroute-pd-never`` once (every pod role both), then, for every ``--pd-split`` pool (P:D, or
P:D:B with B pods of role both), ``kvroute-pd-always`` and ``kvroute-pd-conditional`` at every ``--delays`` value of
``pd.max_split_delay_s`` (and every ``--thresholds`` value of ``pd.threshold_tokens``, every
``--stall-weights`` value of ``pd.split_delay_per_stall``, every ``--ttft-targets`` value of
``pd.ttft_target_s``; always and conditional at every ``--step-tokens`` value of
``pd.prefill_step_tokens`` and ``--redirect`` value of ``pd.redirect_decode``), all over the
same requests at the same Poisson arrival times (so each policy can be compared at its own best
split of the same pod count), and plots
TTFT p99 against ITL p99 (``tradeoff.png``) next to a markdown table (``sweep.md``). With ``--repeats N``
every configuration runs N times, interleaved, and the medians are reported with their min-max::

    python -m bench.pd_sweep --scenario mixed-pd --pd-split 1:3 --rate 5.81 --delays 0,0.05,0.25,2 \\
        --out bench/out/pd-sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from bench import harness, report, workloads
from bench.sim.profiles import PROFILES

COLUMNS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_p999_s", "output_tok_s", "errors")


def _floats(spec: str) -> list[float]:
    try:
        return [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bench.pd_sweep: {spec!r} is not a comma-separated list of numbers") from None


def _optional_floats(spec: str) -> list[float | None]:
    """Like ``_floats``, where ``none`` stands for leaving the setting unset; empty: ``[None]``."""
    return [None if x.strip() == "none" else _floats(x)[0] for x in spec.split(",") if x.strip()] or [None]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.pd_sweep",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--scenario", default="mixed-pd", choices=sorted(workloads.SCENARIOS), help="workload")
    ap.add_argument("--max-requests", type=int, default=200, help="use the first N requests")
    ap.add_argument("--profile", default="h100-llama8b", choices=sorted(PROFILES), help="simulated pod profile")
    ap.add_argument("--pods", type=int, default=4, help="pods in every fleet")
    ap.add_argument("--pd-split", default="1:3",
                    help="PREFILL:DECODE[:BOTH] pods for always and conditional; a comma list runs each")  # fmt: skip
    ap.add_argument("--rate", type=float, default=None, help="req/s (default: calibrate, then --load of capacity)")
    ap.add_argument("--load", type=float, default=0.7, help="fraction of calibrated capacity when --rate is unset")
    ap.add_argument("--delays", default="0,0.05,0.25,2", help="pd.max_split_delay_s values for conditional")
    ap.add_argument("--thresholds", default="1000", help="pd.threshold_tokens values for conditional")
    ap.add_argument("--stall-weights", default="0.05",
                    help="pd.split_delay_per_stall values for conditional (1000: flat max_split_delay_s)")  # fmt: skip
    ap.add_argument("--ttft-targets", default="",
                    help="pd.ttft_target_s values for conditional, pod seconds; none: unset (default)")  # fmt: skip
    ap.add_argument("--chat-slo-ms", default="",
                    help="x-slo-ttft-ms on the chats (pod ms; none: no header) for conditional, one variant "
                    "per value; documents keep pd.ttft_target_s")  # fmt: skip
    ap.add_argument("--step-tokens", default="",
                    help="pd.prefill_step_tokens values for always and conditional (0: legs unpaced); "
                    "default: kvroute's")  # fmt: skip
    ap.add_argument("--redirect", default="",
                    help="pd.redirect_decode values for always and conditional (on,off); "
                    "default: kvroute's")  # fmt: skip
    ap.add_argument("--time-scale", type=float, default=1.0, help="as in `python -m bench run` (figures in pod time)")
    ap.add_argument("--vllm-router", action="store_true",
                    help="also run vllm-router's own P/D mode (vllm-router-pd) over every split's pods")  # fmt: skip
    ap.add_argument("--chars-per-token", type=harness.chars_per_token_arg, default=None,
                    help="as in `python -m bench run` (auto: measured on the workload)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (interleaved); medians reported")
    ap.add_argument("--quiet-wait", type=float, default=20.0, help="s to wait for a quiet host before each run")
    ap.add_argument("--kvroute-log-level", **harness.KVROUTE_LOG_LEVEL_ARG)
    ap.add_argument("--out", type=Path, default=Path("bench/out/pd-sweep"), help="output directory")
    ap.add_argument("--replot", action="store_true", help="only redraw sweep.md and tradeoff.png from OUT/sweep.json")
    return ap


def write(out: Path, points: list[dict[str, Any]], title: str) -> None:
    (out / "sweep.md").write_text(f"{title}\n\n{table(points)}\n")
    plot(points, out / "tradeoff.png", title)


def point(label: str, rows: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    """One configuration's figures: medians over its repeats (failed repeats left out), with the
    (min, max) of each in ``spread`` and the mean count of each P/D decision."""
    out: dict[str, Any] = {"label": label, **params, "repeats": len(rows), "spread": {}}
    for k in COLUMNS:
        values = [r[k] for r in rows if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
        if len(values) > 1:
            out["spread"][k] = (min(values), max(values))
    reasons: dict[str, list[float]] = {}
    for r in rows:
        for k, v in (r.get("pd_reasons") or {}).items():
            reasons.setdefault(k, []).append(v)
    out["pd_reasons"] = {k: sum(v) / len(rows) for k, v in reasons.items()}
    return out


def table(points: list[dict[str, Any]]) -> str:
    head = "| policy | TTFT p50 s | TTFT p99 s | ITL p50 s | ITL p99 s | ITL p99.9 s | out tok/s | errors | decisions |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    fmts = ("{:.3f}", "{:.3f}", "{:.4f}", "{:.4f}", "{:.4f}", "{:.0f}", "{:g}")
    for p in points:
        cells = []
        for k, f in zip(COLUMNS, fmts, strict=True):
            text = report.cell(p, k, f)
            if k in ("ttft_p99_s", "itl_p99_s") and k in p.get("spread", {}):
                lo, hi = p["spread"][k]
                text += f" ({f.format(lo)}–{f.format(hi)})"
            cells.append(text)
        lines.append(f"| {p['label']} | " + " | ".join(cells) + f" | {report.decisions(p['pd_reasons'])} |")
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    points = [p for p in points if p["itl_p99_s"] is not None and p["ttft_p99_s"] is not None]  # failed runs

    def line_of(p: dict[str, Any]) -> tuple[str, int, float, float, float]:
        target, slo = p.get("ttft_target_s") or 0.0, p.get("chat_slo_ms") or 0.0
        return p.get("pd_split", ""), p["threshold_tokens"], p.get("split_delay_per_stall", 0.0), target, slo

    lines = sorted({line_of(p) for p in points if "threshold_tokens" in p})
    for split, t, w, target, slo in lines:
        line = sorted((p for p in points if "threshold_tokens" in p and line_of(p) == (split, t, w, target, slo)),
                      key=lambda p: p["max_split_delay_s"])  # fmt: skip
        xs, ys = [p["itl_p99_s"] * 1e3 for p in line], [p["ttft_p99_s"] for p in line]
        at = f" {split}" if len({s for s, *_ in lines}) > 1 else ""
        at += (f", target {target:g} s" if target else "") + (f", chats {slo:g} ms" if slo else "")
        ax.plot(xs, ys, "o-", label=f"conditional{at}, threshold {t}, w={w:g} (delay rising along the line)")
    for p in points:
        kind = p["label"].split()[0]
        marker = {"never": "s", "always": "^", "vllm-router-pd": "x"}.get(kind)
        if marker:
            ax.plot(p["itl_p99_s"] * 1e3, p["ttft_p99_s"], marker, markersize=9, label=p["label"])
        ax.annotate(p["label"].removeprefix("conditional "), (p["itl_p99_s"] * 1e3, p["ttft_p99_s"]), fontsize=8)
        spread = p.get("spread", {})
        if "itl_p99_s" in spread and "ttft_p99_s" in spread:  # min-max over repeats
            (x0, x1), (y0, y1) = spread["itl_p99_s"], spread["ttft_p99_s"]
            x, y = p["itl_p99_s"], p["ttft_p99_s"]
            ax.errorbar(x * 1e3, y, xerr=[[(x - x0) * 1e3], [(x1 - x) * 1e3]], yerr=[[y - y0], [y1 - y]],
                        fmt="none", ecolor="grey", alpha=0.5, capsize=2)  # fmt: skip
    ax.set_xlabel("ITL p99 (ms)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.replot:
        saved = json.loads((a.out / "sweep.json").read_text())
        write(a.out, saved["points"], saved["title"])
        return 0
    delays, thresholds, weights = _floats(a.delays), [int(t) for t in _floats(a.thresholds)], _floats(a.stall_weights)
    targets, chat_slos = _optional_floats(a.ttft_targets), _optional_floats(a.chat_slo_ms)
    steps = [int(x) for x in _floats(a.step_tokens)] if a.step_tokens.strip() else [None]
    redirects = [x.strip() for x in a.redirect.split(",") if x.strip()] or [None]
    if any(x not in (None, "on", "off") for x in redirects):
        raise SystemExit("bench.pd_sweep: --redirect takes on, off or both")
    splits = [x.strip() for x in a.pd_split.split(",") if x.strip()]
    if any(x < 0 for x in [*delays, *thresholds, *weights]) or not weights or a.repeats < 1:
        raise SystemExit("bench.pd_sweep: delays, thresholds and stall weights must be >= 0, repeats >= 1")
    if any(x is not None and x < 0 for x in steps):
        raise SystemExit("bench.pd_sweep: step tokens must be >= 0")
    if any(x is not None and x <= 0 for x in [*targets, *chat_slos]):
        raise SystemExit("bench.pd_sweep: TTFT targets and chat SLOs must be > 0")
    try:
        for split in splits or [a.pd_split]:  # an empty list names the bad value
            harness.parse_pd_split(split, a.pods)
    except ValueError as e:
        raise SystemExit(f"bench.pd_sweep: {e}") from None
    work = workloads.build(a.scenario, None, a.max_requests)
    a.out.mkdir(parents=True, exist_ok=True)
    base = harness.RunConfig(
        policies=["kvroute-pd-never"], pods=a.pods, profile=a.profile, rate=a.rate, load=a.load,
        quiet_wait=a.quiet_wait, pd_split=splits[0], out=a.out / "never", time_scale=a.time_scale,
        chars_per_token=a.chars_per_token, kvroute_log_level=a.kvroute_log_level,
        command=" ".join(["python -m bench.pd_sweep", *(argv if argv is not None else sys.argv[1:])]),
    )  # fmt: skip
    configs: list[tuple[str, dict[str, Any], harness.RunConfig]] = [("never", {}, base)]
    for split, step, redirect in itertools.product(splits, steps, redirects):
        at = (f" {split}" if len(splits) > 1 else "") + (f" s={step}" if len(steps) > 1 else "")
        at += f" redirect {redirect}" if len(redirects) > 1 else ""
        name = split.replace(":", "x") + (f"-s{step}" if step is not None else "")
        name += f"-redirect-{redirect}" if redirect is not None else ""
        overrides: dict[str, Any] = {"prefill_step_tokens": step} if step is not None else {}
        if redirect is not None:
            overrides["redirect_decode"] = redirect == "on"
        always = replace(base, policies=["kvroute-pd-always"], pd_split=split, out=a.out / f"always-{name}")
        if overrides:
            (a.out / f"always-{name}.yaml").write_text(yaml.safe_dump({"pd": overrides}))
            always = replace(always, kvroute_config=str(a.out / f"always-{name}.yaml"))
        configs.append((f"always{at}", {"pd_split": split, **overrides}, always))
        if a.vllm_router and step == steps[0] and redirect == redirects[0]:
            configs.append((f"vllm-router-pd{at}", {"pd_split": split}, replace(
                base, policies=["vllm-router-pd"], pd_split=split, out=a.out / f"vllm-router-pd-{name}")))  # fmt: skip
        for t, w, target, slo, d in itertools.product(thresholds, weights, targets, chat_slos, delays):
            tag = f"{name}-t{t}-d{d:g}" + (f"-w{w:g}" if len(weights) > 1 else "")
            tag += (f"-T{target:g}" if target is not None else "") + (f"-chat{slo:g}ms" if slo is not None else "")
            user = a.out / f"conditional-{tag}.yaml"
            pd = {"max_split_delay_s": d, "split_delay_per_stall": w, "ttft_target_s": target, **overrides}
            user.write_text(yaml.safe_dump({"pd": pd}))
            label = f"conditional d={d:g}" + (f" t={t}" if len(thresholds) > 1 else "")
            label += (f" w={w:g}" if len(weights) > 1 else "") + (f" T={target:g}" if target is not None else "")
            label += (f" chats {slo:g} ms" if slo is not None else "") + at
            cfg = replace(base, policies=["kvroute-pd-conditional"], kvroute_config=str(user), pd_threshold=t,
                          pd_split=split, out=a.out / f"conditional-{tag}",
                          slo_ms={"c": slo} if slo is not None else {})  # fmt: skip
            params = {**pd, "threshold_tokens": t, "pd_split": split, "chat_slo_ms": slo}
            configs.append((label, params, cfg))
    rows: dict[str, list[dict[str, Any]]] = {}
    meta: dict[str, Any] = {}
    for rep in range(a.repeats):  # interleaved, so drift in the host's load spreads over every configuration
        suffix = f"-r{rep + 1}" if a.repeats > 1 else ""
        for label, _, cfg in configs:
            (run,), meta_r = harness.run(replace(cfg, rate=a.rate, out=Path(f"{cfg.out}{suffix}")), work)
            meta = meta or meta_r
            a.rate = meta["rate_rps"]  # the first run calibrates (unless --rate); every later one replays it
            rows.setdefault(label, []).append(run.row)
    points = [point(label, rows[label], **params) for label, params, _ in configs]
    rate = meta["rate_rps"]
    reps = f", medians of {a.repeats} runs (min–max)" if a.repeats > 1 else ""
    reps += f", time scale {a.time_scale:g} (pod time)" if a.time_scale != 1.0 else ""
    title = f"{work.name}, {a.pods} pods (P:D {', '.join(splits)}), {rate:.2f} req/s, {len(work.items)} requests{reps}"
    (a.out / "sweep.json").write_text(json.dumps({"meta": meta, "title": title, "points": points}, indent=1))
    write(a.out, points, title)
    print(f"{title}\n\n{table(points)}\n\nwrote {a.out}/sweep.md, tradeoff.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
