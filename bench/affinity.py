"""``python -m bench.affinity DIR``: the follow-up turns each router moved off their conversation's pod, and why.

A follow-up is a request whose tag (the workload's session: a conversation, a trace session) came
before; it moved when it went to another pod than the session's previous request. For each run
under DIR (``<policy>.requests.jsonl``) it counts follow-ups and moved ones, the prompt tokens the
moved ones carried, how many of those the pods they went to reported cached, and the previous
turn's prompt (what the pod left behind held of the conversation, at most: a follow-up's prompt
extends the turn before it).

Runs kept with ``--kvroute-log-level debug`` (``<policy>.kvroute.log``) also say why kvroute moved
each one, from the decision's own terms (the "routed" line: blocks each eligible pod held, and per
pod the cost scorer's wait, own prefill, recompute and ranking cost), joined by request id:

- ``filtered``: the previous pod was not eligible (bounded load, saturation), so never weighed;
- ``forgotten``: kvroute's index credited the previous pod with under half of the previous turn
  (an evicted or never-recorded history, or keys that stop short of it);
- ``outweighed``: the previous pod held more, but the wait there cost more than the prefill saved;
- ``tied``: the previous pod held no more than the pick (the history was credited to both).

It also sets kvroute's predicted cached tokens beside those the pods reported (all requests): a
prediction well above what the pods served means the index remembers prefixes the pods evicted.

``--placement`` shows where the sessions started instead: per run, the sessions each pod took the first
request of (its homes: where their later turns go unless moved), and the median TTFT of the requests
served by the pods with that many homes. A pod's decode batch grows with the sessions it homes, and each
first token waits for a step of it: uneven homes show as a median rising with them.

The ``routing.cost.recompute_weight`` sweep behind its default of 6 (issue 20; kvroute-approx beside
sglang-router in each run, scrape on as deployed, 4 h100-llama8b pods, a 2-core host with 0.4-1.8
cores of other work, so TTFT only as kvroute / sglang-router in the same run). Mooncake conversation
trace (``--trace-sample 10 --max-requests 150``, 34 follow-ups; ``--rate`` 4.41 / 7.95 ≈ load 0.5 /
0.9) and multi-turn (288 requests, 240 follow-ups; 21.3 / 38.3 req/s); a cell run more than once
lists each run; sglang-router: Mooncake 28.0 %, 1-2 moved; multi-turn 81.4-82.0 %, 0 moved.

=====  =======================  =======================  ==================  =====================
w      Mooncake 0.5: hit, moved Mooncake 0.9: hit, moved multi-turn 0.5     multi-turn 0.9
=====  =======================  =======================  ==================  =====================
0      23.2 % 6                 25.1 % 11                79.9 % 10           78.9 % 15; 80.8 % 7
1      27.3 % 6                 26.1 % 10                82.0 % 0            81.4 % 1
3      27.8 % 4; 27.6 % 3       27.0 % 7; 27.3 % 4;      81.9 % 0            81.2 % 2; 81.9 % 0;
                                27.6 % 5                                     81.2 % 2
4      27.9 % 3                 27.8 % 4                 –                   81.5 % 1; 80.8 % 3
6      28.0 % 1; 28.0 % 1       27.9 % 2; 26.2 % 7;      81.9 % 0            80.3 % 3; 81.5 % 1;
                                27.9 % 3                                     81.2 % 2
=====  =======================  =======================  ==================  =====================

TTFT p50 / p90 against sglang-router: on Mooncake at 0.9 below it at every weight from 3 (0.53-0.89 /
0.59-0.74), at 0.5 within noise (w 3: 0.85-1.24 / 0.91-1.30; w 6: 0.83-1.07 / 0.81-0.94); at w 0 the
moves cost hit rate and TTFT alike (multi-turn 0.9: 1.3-14 × p50). Multi-turn at 0.9, where TTFTs are
tens of ms and the host's jitter dominates, read 0.5-1.9 / 0.3-2.9 at w 3, 4 and 6 (one w 6 run
stalled at 4.7 / 31: queues that never drained in an 8 s run, as the w 0 run beside it did). 6 keeps
the most follow-ups home on Mooncake at both loads (medians 28.0 / 27.9 % against 3's 27.7 / 27.3 %)
and changes nothing measurable on multi-turn; the moves left are mostly ``outweighed`` on Mooncake
and ``filtered`` (bounded load) on multi-turn. Rerun on a quiet host: the grid (``make bench-routing``).
Three Mooncake runs also lost 3-57 of 150 requests to 503s "all failed the healthy check": the
scrapes of all four pods (one sim process) timed out at once under the host's load, and kvroute
then has no pod it calls healthy (the Mooncake 0.9, w 4 run that lost 57 is left out above).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CAUSES = ("filtered", "forgotten", "outweighed", "tied")
FORGOTTEN_SHARE = 0.5  # index credits the previous pod with less than this share of the previous turn


@dataclass
class Moved:
    """One follow-up sent to another pod than its session's previous request."""

    request_id: str
    prev_pod: str
    pod: str
    prompt_tokens: int
    prev_prompt_tokens: int  # what the previous pod held of the conversation, at most
    cached_tokens: int  # reported by the pod it went to
    cause: str | None = None  # one of CAUSES; None without kvroute's decision log
    held_prev: float | None = None  # prompt tokens kvroute's index credited the previous pod with
    held_pick: float | None = None  # ... and the pod it picked
    wait_gap_s: float | None = None  # wait on the previous pod minus wait on the pick
    saved_s: float | None = None  # own prefill the previous pod would have saved (pick's work minus its)


@dataclass
class Affinity:
    policy: str
    follow_ups: int = 0
    moved: list[Moved] = field(default_factory=list)
    predicted_cached: int | None = None  # kvroute's prediction over all requests (decision log)
    reported_cached: int = 0
    prompt_tokens: int = 0

    @property
    def causes(self) -> Counter[str]:
        return Counter(m.cause for m in self.moved if m.cause is not None)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines() if line.strip()]


def answered(requests: Path) -> list[dict[str, Any]]:
    """A run's requests that succeeded, in arrival order."""
    return sorted((r for r in read_jsonl(requests) if r.get("status") == 200), key=lambda r: r["at_s"])


def decisions(log: Path) -> dict[str, dict[str, Any]]:
    """kvroute's "routed" debug lines by request id."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"msg":"routed"' in line:
            d = json.loads(line)
            out[d.get("request_id", "")] = d
    return out


def block_tokens(d: dict[str, Any]) -> float:
    """Prompt tokens per index block in this decision (logged; else from the pick's prediction)."""
    if d.get("block_tokens"):
        return float(d["block_tokens"])
    mb = d.get("matched_blocks") or 0
    return d.get("predicted_cached_tokens", 0) / mb if mb else 0.0


def explain(m: Moved, d: dict[str, Any]) -> None:
    """``m``'s cause and terms from its decision ``d``."""
    matches: dict[str, int] = d.get("matches") or {}
    est: dict[str, list[float | None]] = d.get("estimates_ms") or {}
    bt = block_tokens(d)
    if m.prev_pod not in est and m.prev_pod not in matches:
        m.cause = "filtered"
        return
    m.held_prev = min(m.prompt_tokens, matches.get(m.prev_pod, 0) * bt)
    m.held_pick = min(m.prompt_tokens, matches.get(m.pod, 0) * bt)
    prev, pick = est.get(m.prev_pod), est.get(m.pod)
    if prev and pick and None not in prev[:2] and None not in pick[:2]:
        m.wait_gap_s = ((prev[0] or 0.0) - (pick[0] or 0.0)) / 1e3
        m.saved_s = ((pick[1] or 0.0) - (prev[1] or 0.0)) / 1e3
    if m.held_prev < FORGOTTEN_SHARE * min(m.prev_prompt_tokens, m.prompt_tokens):
        m.cause = "forgotten"
    elif m.held_prev > m.held_pick:
        m.cause = "outweighed"
    else:
        m.cause = "tied"


def analyse(requests: Path, log: Path | None = None, name: str | None = None) -> Affinity:
    """One run's follow-ups (in arrival order; failed requests skipped) and, with ``log``, why each moved;
    ``name``: the run's (by default its policy, from the file's name)."""
    rows = answered(requests)
    ds = decisions(log) if log is not None else None
    out = Affinity(name or requests.name.removesuffix(".requests.jsonl"))
    last: dict[str, dict[str, Any]] = {}
    for r in rows:
        out.prompt_tokens += r.get("prompt_tokens") or 0
        out.reported_cached += r.get("cached_tokens") or 0
        prev = last.get(r["tag"])
        last[r["tag"]] = r
        if prev is None:
            continue
        out.follow_ups += 1
        if r["upstream"] == prev["upstream"]:
            continue
        m = Moved(r["request_id"], prev["upstream"], r["upstream"], r.get("prompt_tokens") or 0,
                  prev.get("prompt_tokens") or 0, r.get("cached_tokens") or 0)  # fmt: skip
        if ds is not None and (d := ds.get(r["request_id"])) is not None:
            explain(m, d)
        out.moved.append(m)
    if ds is not None:
        ids = {r["request_id"] for r in rows}
        out.predicted_cached = sum(d.get("predicted_cached_tokens", 0) for i, d in ds.items() if i in ids)
    return out


@dataclass
class Placement:
    """Where one run's sessions started (their first request's pod) and what its pods' requests took."""

    policy: str
    homes: Counter[str] = field(default_factory=Counter)  # pod -> sessions whose first request it served
    ttft: dict[str, list[float]] = field(default_factory=dict)  # pod -> its requests' TTFT (s)

    def by_homes(self) -> dict[int, float]:
        """The median TTFT of the requests served by pods homing each number of sessions (ascending)."""
        groups: dict[int, list[float]] = {}
        for pod, ttfts in self.ttft.items():
            groups.setdefault(self.homes[pod], []).extend(ttfts)
        return {n: statistics.median(v) for n, v in sorted(groups.items()) if v}


def place(requests: Path, name: str | None = None) -> Placement:
    """One run's placement (failed requests and those without a TTFT skipped); ``name`` as ``analyse``'s."""
    out = Placement(name or requests.name.removesuffix(".requests.jsonl"))
    seen: set[str] = set()
    for r in answered(requests):
        pod = r["upstream"]
        if r["tag"] not in seen:
            seen.add(r["tag"])
            out.homes[pod] += 1
        if r.get("ttft_s") is not None:
            out.ttft.setdefault(pod, []).append(r["ttft_s"])
    return out


def placement_table(runs: list[Placement]) -> str:
    lines = [
        "| run | pods used | sessions homed per pod | requests per pod | TTFT p50 s by a pod's homes (homes: p50) |",
        "|---|---|---|---|---|",
    ]
    for p in runs:
        homes = sorted(p.homes[pod] for pod in p.ttft)
        served = sorted(len(v) for v in p.ttft.values())
        by = ", ".join(f"{n}: {t:.4f}" for n, t in p.by_homes().items())
        lines.append(f"| {p.policy} | {len(p.ttft)} | {homes} | {served} | {by} |")
    return "\n".join(lines)


def _runs(root: Path) -> list[tuple[Path, str]]:
    """Each run's requests file under ``root`` and its name (the policy, prefixed by its directory)."""
    out = []
    for requests in sorted(root.rglob("*.requests.jsonl")):
        where = requests.parent.relative_to(root)
        name = requests.name.removesuffix(".requests.jsonl")
        out.append((requests, name if where == Path(".") else f"{where}/{name}"))
    return out


def collect(root: Path) -> list[Affinity]:
    runs = []
    for requests, name in _runs(root):
        log = requests.with_name(requests.name.removesuffix(".requests.jsonl") + ".kvroute.log")
        runs.append(analyse(requests, log if log.exists() else None, name))
    return runs


def placements(root: Path) -> list[Placement]:
    return [place(requests, name) for requests, name in _runs(root)]


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "–"


def table(runs: list[Affinity]) -> str:
    lines = [
        "| run | follow-ups | moved | tokens moved | cached where they went | previous turns' prompts | "
        + " | ".join(CAUSES)
        + " | outweighed: wait gap / prefill saved, median s | predicted / reported cached |",
        "|---|---|---|---|---|---|" + "---|" * len(CAUSES) + "---|---|",
    ]
    for a in runs:
        causes = a.causes
        out = [m for m in a.moved if m.cause == "outweighed" and m.wait_gap_s is not None and m.saved_s is not None]
        terms = f"{_median([m.wait_gap_s for m in out if m.wait_gap_s is not None])} / " + _median(
            [m.saved_s for m in out if m.saved_s is not None]
        )
        explained = a.predicted_cached is not None
        pred = f"{(a.predicted_cached or 0) / 1e3:.0f}k / {a.reported_cached / 1e3:.0f}k" if explained else "–"
        lines.append(
            f"| {a.policy} | {a.follow_ups} | {len(a.moved)} | {sum(m.prompt_tokens for m in a.moved) / 1e3:.1f}k | "
            f"{sum(m.cached_tokens for m in a.moved) / 1e3:.1f}k | "
            f"{sum(min(m.prev_prompt_tokens, m.prompt_tokens) for m in a.moved) / 1e3:.1f}k | "
            + " | ".join(str(causes[c]) if explained else "–" for c in CAUSES)
            + f" | {terms if explained else '–'} | {pred} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.affinity",
        description=(__doc__ or "").split("\n\n")[0].split(": ", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("dir", type=Path, help="a bench run's output directory (or a directory of them)")
    ap.add_argument("--moved", action="store_true", help="also list every moved follow-up with its terms")
    ap.add_argument("--placement", action="store_true",
                    help="where the sessions started instead: homes per pod, TTFT p50 by a pod's homes")  # fmt: skip
    a = ap.parse_args(argv)
    if not _runs(a.dir):
        print(f"bench.affinity: no <policy>.requests.jsonl under {a.dir}", file=sys.stderr)
        return 2
    if a.placement:
        print(placement_table(placements(a.dir)))
        return 0
    runs = collect(a.dir)
    print(table(runs))
    if a.moved:
        for run in runs:
            for m in run.moved:
                print(json.dumps({"run": run.policy, **vars(m)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
