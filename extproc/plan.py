"""``kvroute plan``: how many vLLM pods a workload needs, aggregated and prefill/decode, with the
arithmetic shown.

Inputs: the workload (a Mooncake trace, or rate, mean prompt/output tokens and prefix reuse), the
model's KV bytes per token and weights, the accelerator's memory, a pod latency profile (a JSON file
with the simulator's ``LatencyProfile`` fields: ``python -m bench.plan_check --export-profile NAME``
writes one; a profile calibrated on real pods works the same) and TTFT/ITL targets.

The profile is a file, not flags: it is a dozen numbers that belong together (one step-time model),
it can come from a calibration of real pods, and kvroute does not import the simulator (bench/).

The model (per request: n = uncached prompt tokens, c = cached ones, the profile's step model):
* prefill seconds s = (a·n + q·n·(c + n/2)/1e6 + base·ceil(n / max_num_batched_tokens)) / 1000 + api;
* a decode step with B streams of context C: t(B) = (base + b·B + k·B·C/1000) / 1000;
* KV tokens per pod = (memory × gpu_memory_utilization − weights) / KV bytes per token;
* hit rate = the workload's prefix reuse × min(1, cache tokens of the fleet / its reused working set);
* TTFT p90 ≈ s + queue wait, the wait of an M/D/1 queue per prefilling pod at utilisation ρ (mean
  ρ·s / (2(1 − ρ))) times ln 10 for its 90th percentile (an exponential tail);
* streams in flight = rate × output tokens × ITL (Little's law); the ITL target is a 90th percentile
  (of each request's mean gap between tokens, as bench/plan_check.py measures it), so the step is
  priced at the 90th percentile of streams on a pod, B + 1.28 √B (Poisson arrivals: the count in
  flight is Poisson too);
* ITL on a pod that also prefills (aggregated): vLLM runs a prefill chunk in the same step as the
  decodes (chunked prefill), so that step takes the chunk's time too: a request's mean gap is
  t(B90) + X · w / (o − 1), w = a prefill's work (s less the per-step base and API time), o − 1 the
  request's gaps, X the prefills that run while it decodes. Those are the ones that reached its pod
  while its own prefill waited and ran (W + s) and while it decoded; each prefill run meanwhile
  lengthens the decode by w, in which more arrive. kvroute sends a prefill to a pod that is not
  prefilling if there is one, so a pod that prefills gets λ_busy = λ·ρ^(N−1) of them per second (the
  N − 1 others all busy; one pod: λ), otherwise its share λ (its streams count as load too, so the
  pods without a prefill do not all take more). X is then a generalized Poisson count (the customers
  of an M/G/1 busy period begun by a Poisson number of them): θ = λ_busy·(W + s) + λ·(o − 1)·t
  starters, λ_busy·w more per prefill, mean θ / (1 − λ_busy·w); its 90th percentile sets the ITL p90.
  Priced as t(B90) / (1 − ρ) instead, the simulator measured twice the estimate (bench/RESULTS.md).
  On one pod fed Poisson arrivals (N = 1) this read within 13 % of the simulator over 2k-6k-token
  prompts and 16-200 output tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

GIB = 2**30
P90_OF_MEAN_WAIT = math.log(10)  # p90 / mean of an exponential tail
Z90 = 1.2816  # the 90th percentile of a standard normal
MAX_PODS = 1024
TRACE_BLOCK_TOKENS = 512  # Mooncake hash ids cover 512-token blocks
PROFILE_FIELDS = (
    "base_ms",
    "prefill_ms_per_token",
    "decode_ms_per_seq",
    "decode_ms_per_kctx",
    "attn_ms_quadratic",
    "max_num_batched_tokens",
    "max_num_seqs",
)


class PlanError(ValueError):
    """An input that cannot be planned with (named)."""


@dataclass(frozen=True, slots=True)
class Profile:
    base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    decode_ms_per_kctx: float
    attn_ms_quadratic: float
    max_num_batched_tokens: int
    max_num_seqs: int
    api_overhead_ms: float = 0.0
    api_ms_per_token: float = 0.0

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"--profile {path}: {e}") from None
        return cls.load_dict(data, f"--profile {path}")

    @classmethod
    def load_dict(cls, data: Any, where: str = "profile") -> Profile:
        """The fields it needs of a ``LatencyProfile`` as a mapping (others are ignored)."""
        if not isinstance(data, dict):
            raise PlanError(f"{where}: not a JSON object")
        missing = [f for f in PROFILE_FIELDS if not isinstance(data.get(f), int | float)]
        if missing:
            raise PlanError(f"{where}: missing or not numbers: {', '.join(missing)}")
        return cls(**{f: data[f] for f in cls.__dataclass_fields__ if f in data})

    def prefill_s(self, uncached: float, cached: float, prompt: float) -> float:
        chunks = math.ceil(uncached / self.max_num_batched_tokens) if uncached else 0
        api_ms = self.api_overhead_ms + self.api_ms_per_token * prompt
        return self.prefill_work_s(uncached, cached) + (self.base_ms * chunks + api_ms) / 1000

    def prefill_work_s(self, uncached: float, cached: float) -> float:
        """What a prefill adds to the steps that carry its chunks (no per-step base, no API time)."""
        ms = self.prefill_ms_per_token * uncached + self.attn_ms_quadratic * uncached * (cached + uncached / 2) / 1e6
        return ms / 1000

    def step_s(self, streams: float, context: float) -> float:
        return (
            self.base_ms + self.decode_ms_per_seq * streams + self.decode_ms_per_kctx * streams * context / 1000
        ) / 1000


@dataclass(frozen=True, slots=True)
class Workload:
    rate: float  # requests/s
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    reuse: float  # share of prompt tokens an infinite cache would serve
    working_set_tokens: float  # distinct prompt tokens that are reused (what the caches must hold)
    source: str
    # A trace's prompts as 512-token block ids (full blocks only): its hit rate at a cache size is
    # then an LRU replay, not the working-set bound.
    blocks: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    @classmethod
    def from_trace(cls, path: str | Path) -> Workload:
        """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (512-token blocks)."""
        rows, n = [], 0
        try:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):  # noqa: B007 (n names the bad line)
                    if line.strip():
                        r = json.loads(line)
                        rows.append(
                            (
                                float(r["timestamp"]),
                                int(r["input_length"]),
                                int(r["output_length"]),
                                [int(h) for h in r["hash_ids"]],
                            )
                        )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlanError(f"--trace {path}: line {n}: {e}") from None
        if len(rows) < 2:
            raise PlanError(f"--trace {path}: needs at least two requests")
        span_s = (rows[-1][0] - rows[0][0]) / 1000
        seen: set[int] = set()
        reused: set[int] = set()
        hit = total = 0
        blocks = []
        for _, length, _, ids in rows:
            full = min(len(ids), length // TRACE_BLOCK_TOKENS)
            blocks.append(tuple(ids[:full]))
            k = 0
            while k < full and ids[k] in seen:
                k += 1
            reused.update(ids[:k])
            hit += k * TRACE_BLOCK_TOKENS
            total += length
            seen.update(ids)
        return cls(
            rate=(len(rows) - 1) / span_s if span_s > 0 else math.inf,
            prompt_tokens=total / len(rows),
            output_tokens=sum(r[2] for r in rows) / len(rows),
            reuse=hit / total if total else 0.0,
            working_set_tokens=len(reused) * TRACE_BLOCK_TOKENS,
            source=f"trace {Path(path).name}: {len(rows)} requests over {span_s:.0f} s",
            blocks=tuple(blocks),
        )


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_p90_s: float
    itl_s: float
    utilization: float = 0.9  # never plan a pod busier than this (queues explode near 1)


@dataclass(frozen=True, slots=True)
class Memory:
    accelerator_gib: float
    weights_gib: float
    kv_bytes_per_token: int
    gpu_memory_utilization: float = 0.9

    def kv_tokens(self) -> int:
        free = self.accelerator_gib * self.gpu_memory_utilization - self.weights_gib
        if free <= 0:
            raise PlanError(
                f"no room for KV: {self.accelerator_gib} GiB x {self.gpu_memory_utilization} - "
                f"{self.weights_gib} GiB weights <= 0"
            )
        return int(free * GIB / self.kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class Option:
    """One fleet shape, with its estimates."""

    layout: str  # aggregated | pd
    prefill_pods: int  # aggregated: the pods (all prefill and decode)
    decode_pods: int  # aggregated: 0
    hit_rate: float
    ttft_p90_s: float
    itl_s: float
    prefill_utilization: float
    streams_per_pod: float
    # Aggregated: other requests' prefills that run while one decodes (``ItlEstimate``); P/D: none.
    prefills_while_decoding: float = 0.0  # mean
    prefills_while_decoding_p90: int = 0

    @property
    def pods(self) -> int:
        return self.prefill_pods + self.decode_pods


def hit_rate(w: Workload, cache_tokens: float) -> float:
    """The share of prompt tokens the fleet's caches serve. kvroute's affinity partitions the prefixes
    over the pods, so their caches add up to one: a trace is replayed through one LRU cache of that
    size; otherwise the reuse, as far as the caches hold its reused working set."""
    if w.blocks:
        return _lru_hits(w.blocks, int(cache_tokens // TRACE_BLOCK_TOKENS)) / (w.prompt_tokens * len(w.blocks))
    if w.working_set_tokens <= 0:
        return w.reuse
    return w.reuse * min(1.0, cache_tokens / w.working_set_tokens)


@lru_cache(maxsize=64)
def _lru_hits(blocks: tuple[tuple[int, ...], ...], capacity: int) -> int:
    """Prompt tokens served from one LRU cache of ``capacity`` blocks (leading blocks only, as vLLM)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in blocks:
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hits += k * TRACE_BLOCK_TOKENS
        for b in ids:
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def ttft_p90(s: float, rho: float) -> float:
    return math.inf if rho >= 1 else s + P90_OF_MEAN_WAIT * md1_wait(rho, s)


def _prefill(w: Workload, p: Profile, h: float) -> float:
    return p.prefill_s(w.prompt_tokens * (1 - h), w.prompt_tokens * h, w.prompt_tokens)


def md1_wait(rho: float, s: float) -> float:
    """The M/D/1 mean wait for a server busy ``rho`` of the time with ``s``-second jobs (rho < 1)."""
    return rho * s / (2 * (1 - rho))


def p90_streams(mean: float) -> float:
    """Streams in flight on a pod at the 90th percentile, about mean + 1.28 √mean (a Poisson count):
    pricing the step at the mean left the planned P/D fleet's ITL p90 12.2 ms against an 11 ms target."""
    return mean + Z90 * math.sqrt(mean)


@dataclass(frozen=True, slots=True)
class ItlEstimate:
    """A request's mean inter-token gap, 90th percentile, on a pod that also prefills (module doc)."""

    step_s: float  # t(B90): a decode step without a prefill chunk
    work_s: float  # w: what one prefill adds to the steps that carry it
    gaps: float  # o - 1
    rate: float  # λ: prefills/s per pod
    rate_busy: float  # λ_busy: those a pod gets while it prefills
    seeds: float  # θ: prefills queued behind its own, or arriving over its plain decode steps
    spread: float  # λ_busy·w: prefills arriving while one prefill's chunks run
    mean: float  # of X
    p90: int  # of X
    itl_s: float


def generalized_poisson_quantile(theta: float, lam: float, q: float = 0.9) -> int:
    """The ``q`` quantile of Consul's generalized Poisson count, P(x) = θ(θ + λx)^(x−1) e^(−θ−λx) / x!
    (0 <= λ < 1): the customers served in an M/G/1 busy period begun by a Poisson(θ) number of them,
    λ arriving per customer's service."""
    if theta <= 0:
        return 0
    if not 0 <= lam < 1:
        raise PlanError(f"prefills arrive faster than a pod runs them (lambda·w = {lam:.2f})")
    total, x = 0.0, 0
    while True:
        log_p = math.log(theta) + (x - 1) * math.log(theta + lam * x) - theta - lam * x - math.lgamma(x + 1)
        total += math.exp(log_p)
        if total >= q or x > 100_000:
            return x
        x += 1


def itl_aggregated(w: Workload, p: Profile, h: float, pods: int, streams: float) -> ItlEstimate:
    """ITL p90 on each of ``pods`` pods that share the workload at hit rate ``h``, ``streams`` each."""
    n, c = w.prompt_tokens * (1 - h), w.prompt_tokens * h
    s = p.prefill_s(n, c, w.prompt_tokens)
    work = p.prefill_work_s(n, c)
    step = p.step_s(p90_streams(streams), w.prompt_tokens + w.output_tokens / 2)
    gaps = max(1.0, w.output_tokens - 1)
    rate = w.rate / pods
    rho = rate * s
    if rho >= 1:
        raise PlanError(f"{pods} pods: prefill utilisation {rho:.2f} >= 1")
    wait = md1_wait(rho, s)  # as the TTFT estimate
    busy = rate * rho ** (pods - 1)
    seeds, spread = busy * (wait + s) + rate * gaps * step, busy * work
    x90 = generalized_poisson_quantile(seeds, spread)
    return ItlEstimate(step, work, gaps, rate, busy, seeds, spread, seeds / (1 - spread), x90, step + x90 * work / gaps)


def aggregated(w: Workload, p: Profile, m: Memory, t: Targets) -> Option:
    """The fewest pods that each prefill and decode and meet both targets."""
    kv = m.kv_tokens()
    for n in range(1, MAX_PODS + 1):
        h = hit_rate(w, kv * n)
        s = _prefill(w, p, h)
        rho = w.rate * s / n
        streams = w.rate * w.output_tokens * t.itl_s / n
        if rho > t.utilization or streams > p.max_num_seqs or streams * (w.prompt_tokens + w.output_tokens) > kv:
            continue
        est = itl_aggregated(w, p, h, n, streams)
        ttft = ttft_p90(s, rho)
        if est.itl_s <= t.itl_s and ttft <= t.ttft_p90_s:
            return Option("aggregated", n, 0, h, ttft, est.itl_s, rho, streams, est.mean, est.p90)
    raise PlanError(f"no fleet of up to {MAX_PODS} pods meets the targets (a single prompt's prefill alone may not)")


def disaggregated(w: Workload, p: Profile, m: Memory, t: Targets) -> Option:
    """Prefill pods for the TTFT target, decode pods for the ITL target; the hit rate is the
    prefill pods' caches' (the decode pods pull what they prefilled)."""
    kv = m.kv_tokens()
    context = w.prompt_tokens + w.output_tokens / 2
    for npf in range(1, MAX_PODS + 1):
        h = hit_rate(w, kv * npf)
        s = _prefill(w, p, h)
        rho = w.rate * s / npf
        if rho <= t.utilization and (ttft := ttft_p90(s, rho)) <= t.ttft_p90_s:
            break
    else:
        raise PlanError(f"no prefill fleet of up to {MAX_PODS} pods meets the TTFT target")
    for nd in range(1, MAX_PODS + 1):
        streams = w.rate * w.output_tokens * t.itl_s / nd
        fits = streams <= p.max_num_seqs and streams * (w.prompt_tokens + w.output_tokens) <= kv
        if fits and (itl := p.step_s(p90_streams(streams), context)) <= t.itl_s:
            return Option("pd", npf, nd, h, ttft, itl, rho, streams)
    raise PlanError(f"no decode fleet of up to {MAX_PODS} pods meets the ITL target")


def plan(w: Workload, p: Profile, m: Memory, t: Targets) -> dict[str, Any]:
    kv = m.kv_tokens()
    agg, pd = aggregated(w, p, m, t), disaggregated(w, p, m, t)
    h = agg.hit_rate
    workload = asdict(w)
    del workload["blocks"]
    return {
        "workload": workload,
        "targets": asdict(t),
        "kv_tokens_per_pod": kv,
        "kv_gib_per_pod": round(kv * m.kv_bytes_per_token / GIB, 2),
        "prefill_tokens_per_s": w.rate * w.prompt_tokens * (1 - h),
        "prefill_s_per_request": _prefill(w, p, h),
        "decode_streams": w.rate * w.output_tokens * t.itl_s,
        "aggregated": asdict(agg),
        "pd": asdict(pd),
        "capacity_config": {"max_streams_per_pod": max(1, math.floor(max_streams(p, w, t.itl_s)))},
    }


def max_streams(p: Profile, w: Workload, itl_s: float) -> float:
    """Streams a decode-only pod carries within the ITL target (capacity.max_streams_per_pod)."""
    per = p.decode_ms_per_seq + p.decode_ms_per_kctx * (w.prompt_tokens + w.output_tokens / 2) / 1000
    return min(p.max_num_seqs, max(0.0, (itl_s * 1000 - p.base_ms) / per))


def explain(r: dict[str, Any], p: Profile, m: Memory) -> Iterable[str]:
    """The plan with its arithmetic, for people."""
    w, t = r["workload"], r["targets"]
    a, pd = r["aggregated"], r["pd"]
    h = a["hit_rate"]
    n_unc = w["prompt_tokens"] * (1 - h)
    yield f"workload: {w['source']}"
    yield (
        f"  {w['rate']:.2f} req/s x {w['prompt_tokens']:.0f} prompt tokens, {w['output_tokens']:.0f} output tokens; "
        f"prefix reuse {w['reuse']:.1%} over a working set of {w['working_set_tokens']:,.0f} tokens"
    )
    yield (
        f"targets: TTFT p90 <= {t['ttft_p90_s'] * 1e3:.0f} ms, ITL <= {t['itl_s'] * 1e3:.1f} ms, "
        f"utilisation <= {t['utilization']:.0%}"
    )
    yield ""
    yield "KV memory per pod"
    yield (
        f"  ({m.accelerator_gib:g} GiB x {m.gpu_memory_utilization:g} - {m.weights_gib:g} GiB weights) / "
        f"{m.kv_bytes_per_token:,} B per token = {r['kv_tokens_per_pod']:,} tokens ({r['kv_gib_per_pod']:g} GiB)"
    )
    yield "expected hit rate"
    if a["prefill_pods"] and w["source"].startswith("trace"):
        yield (
            f"  the trace replayed through one LRU cache of {a['prefill_pods']} pods x {r['kv_tokens_per_pod']:,} "
            f"tokens (kvroute partitions prefixes over the pods) = {h:.1%} (infinite cache: {w['reuse']:.1%})"
        )
    elif w["working_set_tokens"] > 0:
        yield (
            f"  {w['reuse']:.1%} reuse x min(1, {a['prefill_pods']} pods x {r['kv_tokens_per_pod']:,} tokens / "
            f"{w['working_set_tokens']:,.0f} working set) = {h:.1%}"
        )
    else:
        yield f"  {w['reuse']:.1%} reuse (its prefixes always fit the caches) = {h:.1%}"
    yield "prefill demand"
    yield (
        f"  {w['rate']:.2f} req/s x {w['prompt_tokens']:.0f} x (1 - {h:.3f}) = {r['prefill_tokens_per_s']:,.0f} "
        f"uncached tokens/s; one request: {n_unc:.0f} tokens = {r['prefill_s_per_request'] * 1e3:.1f} ms"
    )
    yield (
        f"  ({p.prefill_ms_per_token} ms/token + {p.attn_ms_quadratic} ms per 1e6 token pairs + "
        f"{p.base_ms} ms per {p.max_num_batched_tokens}-token step + API)"
    )
    yield "decode demand"
    yield (
        f"  {w['rate']:.2f} req/s x {w['output_tokens']:.0f} tokens x {t['itl_s'] * 1e3:.1f} ms ITL = "
        f"{r['decode_streams']:.1f} streams in flight; a decode pod carries "
        f"{r['capacity_config']['max_streams_per_pod']} within the ITL target"
    )
    yield ""
    yield (
        f"aggregated: {a['prefill_pods']} pods   prefill utilisation {a['prefill_utilization']:.0%}, "
        f"{a['streams_per_pod']:.1f} streams/pod, TTFT p90 ~{a['ttft_p90_s'] * 1e3:.0f} ms, "
        f"ITL p90 ~{a['itl_s'] * 1e3:.1f} ms"
    )
    yield from _explain_itl(w, p, a)
    yield (
        f"P/D:        {pd['prefill_pods']} prefill + {pd['decode_pods']} decode   prefill utilisation "
        f"{pd['prefill_utilization']:.0%}, TTFT p90 ~{pd['ttft_p90_s'] * 1e3:.0f} ms; "
        f"{pd['streams_per_pod']:.1f} streams/decode pod, ITL p90 ~{pd['itl_s'] * 1e3:.1f} ms (step at p90 streams); "
        f"hit rate {pd['hit_rate']:.1%}"
    )
    yield "  TTFT p90 = prefill + ln(10) x M/D/1 mean wait (rho x s / (2 (1 - rho))) per prefilling pod"
    yield f"kvroute config: capacity.max_streams_per_pod: {r['capacity_config']['max_streams_per_pod']}"


def _explain_itl(w: dict[str, Any], p: Profile, a: dict[str, Any]) -> Iterable[str]:
    """The aggregated ITL estimate's arithmetic (``itl_aggregated``)."""
    wl = Workload(w["rate"], w["prompt_tokens"], w["output_tokens"], w["reuse"], w["working_set_tokens"], w["source"])
    e = itl_aggregated(wl, p, a["hit_rate"], a["prefill_pods"], a["streams_per_pod"])
    yield (
        f"  ITL: a prefill chunk shares the decodes' step, so a request's mean gap is t(B90) + X x w / (o - 1) "
        f"= {e.step_s * 1e3:.1f} + {e.p90} x {e.work_s * 1e3:.1f} / {e.gaps:.0f} ms"
    )
    yield (
        f"  X, other prefills on its pod while it decodes (kvroute sends them to pods not prefilling first): "
        f"{e.rate_busy:.2f} req/s while it prefills x (M/D/1 wait + prefill) + {e.rate:.2f} req/s x {e.gaps:.0f} "
        f"steps x {e.step_s * 1e3:.1f} ms = {e.seeds:.2f}, each letting {e.rate_busy:.2f} x {e.work_s * 1e3:.0f} ms "
        f"= {e.spread:.2f} more arrive: generalized Poisson, mean {e.mean:.2f}, 90th percentile {e.p90}"
    )


def add_arguments(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="prefill/decode replica counts for a workload, with the arithmetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("workload (a trace, or rate and lengths)")
    src.add_argument("--trace", metavar="FILE", help="a Mooncake trace (JSONL: timestamp ms, input_length, ...)")
    src.add_argument("--rate", type=float, help="requests per second")
    src.add_argument("--prompt-tokens", type=float, help="mean prompt tokens")
    src.add_argument("--output-tokens", type=float, help="mean output tokens")
    src.add_argument("--prefix-reuse", type=float, default=0.0, help="share of prompt tokens an infinite cache serves")
    src.add_argument(
        "--working-set-tokens",
        type=float,
        default=0.0,
        help="distinct reused prefix tokens the caches must hold (0: they always fit)",
    )
    p.add_argument(
        "--profile",
        required=True,
        metavar="FILE",
        help="pod latency profile, JSON (python -m bench.plan_check --export-profile h100-llama8b)",
    )
    p.add_argument("--kv-bytes-per-token", type=int, required=True, help="e.g. 131072 for Llama-3.1-8B bf16")
    p.add_argument("--weights-gib", type=float, required=True, help="model weights per pod (GiB)")
    p.add_argument("--accelerator-gib", type=float, required=True, help="accelerator memory per pod (GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's, default 0.9")
    p.add_argument("--ttft-p90-ms", type=float, required=True)
    p.add_argument("--itl-ms", type=float, required=True)
    p.add_argument("--max-utilization", type=float, default=0.9, help="never plan a pod busier (default 0.9)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")


def inputs(args: argparse.Namespace) -> tuple[Workload, Profile, Memory, Targets]:
    if args.trace:
        w = Workload.from_trace(args.trace)
    else:
        missing = [
            f"--{n.replace('_', '-')}" for n in ("rate", "prompt_tokens", "output_tokens") if getattr(args, n) is None
        ]
        if missing:
            raise PlanError(f"without --trace, give {', '.join(missing)}")
        w = Workload(
            args.rate,
            args.prompt_tokens,
            args.output_tokens,
            args.prefix_reuse,
            args.working_set_tokens,
            f"{args.rate:g} req/s, {args.prompt_tokens:g}/{args.output_tokens:g} tokens",
        )
    for name, v, lo, hi in (
        ("--prefix-reuse", w.reuse, 0, 1),
        ("--gpu-memory-utilization", args.gpu_memory_utilization, 0, 1),
        ("--max-utilization", args.max_utilization, 0, 0.999),
    ):
        if not lo <= v <= hi:
            raise PlanError(f"{name} must be within {lo}..{hi}, got {v}")
    for name, v in (
        ("--rate", w.rate),
        ("--prompt-tokens", w.prompt_tokens),
        ("--output-tokens", w.output_tokens),
        ("--ttft-p90-ms", args.ttft_p90_ms),
        ("--itl-ms", args.itl_ms),
        ("--kv-bytes-per-token", args.kv_bytes_per_token),
    ):
        if not v > 0 or not math.isfinite(v):
            raise PlanError(f"{name} must be a positive number, got {v}")
    m = Memory(args.accelerator_gib, args.weights_gib, args.kv_bytes_per_token, args.gpu_memory_utilization)
    t = Targets(args.ttft_p90_ms / 1000, args.itl_ms / 1000, args.max_utilization)
    return w, Profile.load(args.profile), m, t


def run(args: argparse.Namespace) -> int:
    try:
        w, p, m, t = inputs(args)
        r = plan(w, p, m, t)
    except PlanError as e:
        print(f"kvroute plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print("\n".join(explain(r, p, m)))
    return 0
