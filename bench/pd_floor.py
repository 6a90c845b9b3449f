"""``python -m bench.pd_floor DIR``: how far each run's TTFT p99 is from what the pods allow at all.

A request's **floor** is its first token on an idle pod holding whatever of its prompt could be
cached: the API server's time plus its uncached tokens prefilled in chunks of the pod's step budget
with nothing else in the steps (the simulated profile's own step model, pod seconds). No router,
split or not, can give it sooner: a split adds the hop, the KV pull and the decode pod's admission
to the same prefill. What could be cached is what the ``never`` run under DIR found (every pod role
both, cache-aware routing: on bench.sim workloads its hit rate is the workload's ideal one), so DIR
must hold one.

For every run under DIR (a ``<policy>.requests.jsonl`` beside a ``run.json``) it prints measured
TTFT p50/p99, the p99 of the floors, and measured minus floor per request (p50: what the path
adds to any request; p99: queues): a policy whose TTFT p99 sits a path's overhead above the floor
p99 cannot be beaten on that figure by more than noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import percentile
from bench.sim.profiles import PROFILES, LatencyProfile

NEVER = "kvroute-pd-never"


def floor_seconds(profile: LatencyProfile, prompt_tokens: int, cached_tokens: int) -> float:
    """First token of a ``prompt_tokens`` prompt with ``cached_tokens`` of it cached, alone on an idle
    pod: API time plus the rest prefilled in step-budget chunks (vLLM computes at least the last token)."""
    done = min(max(cached_tokens, 0), max(prompt_tokens - 1, 0))
    s = profile.api_seconds(prompt_tokens)
    while done < prompt_tokens:
        n = min(profile.max_num_batched_tokens, prompt_tokens - done)
        s += profile.step_seconds([(n, done)], 0, 0)
        done += n
    return s


@dataclass(frozen=True)
class Run:
    name: str
    policy: str
    requests: list[dict]
    profile: LatencyProfile


def collect(root: Path) -> list[Run]:
    runs = []
    for req_file in sorted(root.rglob("*.requests.jsonl")):
        meta = req_file.with_name("run.json")
        if not meta.exists():
            continue
        info = json.loads(meta.read_text())
        name = info.get("profile", "h100-llama8b")
        if name not in PROFILES:
            raise SystemExit(f"bench.pd_floor: {meta} names profile {name!r}, not one of {sorted(PROFILES)}")
        policy = req_file.name.removesuffix(".requests.jsonl")
        where = req_file.parent.relative_to(root)
        reqs = [json.loads(line) for line in req_file.read_text().splitlines() if line.strip()]
        runs.append(Run(policy if where == Path(".") else str(where), policy, reqs, PROFILES[name]))
    return runs


def cacheable(runs: list[Run]) -> dict[str, int]:
    """Request id → prompt tokens the never run found cached (the most over several never runs)."""
    out: dict[str, int] = {}
    for r in runs:
        if r.policy != NEVER:
            continue
        for q in r.requests:
            if q.get("request_id") and q.get("status") == 200:
                out[q["request_id"]] = max(out.get(q["request_id"], 0), int(q.get("cached_tokens") or 0))
    return out


def _pct(xs: list[float], q: float) -> float:
    v = percentile(xs, q)
    assert v is not None  # callers pass non-empty lists
    return v


def table(runs: list[Run], cached: dict[str, int]) -> str:
    lines = [
        "| run | requests | TTFT p50 s | TTFT p99 s | floor p99 s | p99 − floor p99 s | excess p50 / p99 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ok = [q for q in r.requests if q.get("status") == 200 and q.get("ttft_s") is not None]
        known = [q for q in ok if q.get("request_id") in cached]
        if not known:
            continue
        ttft = [q["ttft_s"] for q in known]
        floors = [floor_seconds(r.profile, q["prompt_tokens"], cached[q["request_id"]]) for q in known]
        excess = [t - f for t, f in zip(ttft, floors, strict=True)]
        p99, f99 = _pct(ttft, 0.99), _pct(floors, 0.99)
        lines.append(
            f"| {r.name} | {len(known)} | {_pct(ttft, 0.5):.3f} | {p99:.3f} | {f99:.3f} | {p99 - f99:+.3f} "
            f"| {_pct(excess, 0.5):+.3f} / {_pct(excess, 0.99):+.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.pd_floor",
        description=(__doc__ or "").split("\n\n")[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("dir", type=Path, help="a pd_sweep (or bench run) output directory holding a never run")
    a = ap.parse_args(argv)
    runs = collect(a.dir)
    cached = cacheable(runs)
    if not cached:
        print(f"bench.pd_floor: no {NEVER}.requests.jsonl with request ids under {a.dir}: the floor needs "
              "what a never run found cached", file=sys.stderr)  # fmt: skip
        return 2
    print(table(runs, cached))
    return 0


if __name__ == "__main__":
    sys.exit(main())
