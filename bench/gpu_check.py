"""Shape check of the h100-llama8b latency profile against a real Llama-3.1-8B-shaped forward on a CUDA GPU.

    python -m bench.gpu_check --out bench/out/gpu-check [--repeats 5] [--no-graphs] [--no-stock-sdpa]

Builds ``transformers.LlamaForCausalLM`` from a Llama-3.1-8B config written inline (hidden 4096, 32 layers,
32 heads, 8 KV heads, intermediate 14336, vocab 128256, rope theta 500000) with random bf16 weights made
on the GPU (no checkpoint, no download) and times, with CUDA events after warm-ups (median of repeats):

- miss: prefill of one n-token prompt, n in 512..8192 (logits of the last token only, as vLLM does);
- hit: the first n-16 tokens' KV already in a StaticCache, only the forward of the last 16 tokens;
- decode: one new token for each of B sequences with ~1000 tokens of context each, B in 1, 8, 32, 64.

Each point is reported three ways: ``wall_ms`` (events around the eager HF forward: includes Python and
kernel-launch gaps, which dominate small forwards), ``kernel_ms`` (sum of the GPU kernels of one forward,
from torch.profiler: what the GPU actually spent) and ``graph_ms`` (replay of a captured CUDA graph of the
forward, where capture works). ``gpu_ms`` is graph_ms, else the smaller of kernel_ms and wall_ms,
and is what gets compared with the profile's ``step_seconds`` for the same step.

Attention runs through ``torch.nn.functional.scaled_dot_product_attention`` registered as a custom HF
attention function (``kvroute_sdpa_gqa``): native GQA (``enable_gqa``), no mask, causal when the query
covers the whole KV. HF's stock 'sdpa' path materialises a mask whenever a StaticCache holds KV and then
copies K and V to all 32 query heads (``repeat_kv``), which no serving engine does; ``--no-stock-sdpa``
skips the side-by-side check of that path. For the 16-token hit the 16 queries attend all n keys (the
causal triangle inside the last 16 is dropped): the same work to within 16/n, and the values are
random anyway. Exit 2 when torch or a CUDA device is missing (``--tiny`` runs a small model on CPU: a
smoke test of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

HIT_TAIL = 16
ATTN_NAME = "kvroute_sdpa_gqa"

# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json); the llama3 RoPE frequency scaling is left
# out: it changes the values of the rotary table, not the work.
LLAMA31_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# Same GQA ratio, tiny: for --tiny smoke runs on a CPU.
TINY: dict[str, Any] = {
    **LLAMA31_8B,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1024,
}


def log(msg: str) -> None:
    print(msg, flush=True)


def load_h100_profile() -> Any:
    """bench/sim/profiles.py's H100_LLAMA8B, loaded by path: bench.sim's package imports need the project's deps."""
    path = Path(__file__).resolve().parent / "sim" / "profiles.py"
    spec = importlib.util.spec_from_file_location("_kvroute_sim_profiles", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module.H100_LLAMA8B


def profile_ms(profile: Any, chunks: Sequence[tuple[int, int]], decode_seqs: int = 0, ctx_tokens: int = 0) -> float:
    return float(profile.step_seconds(list(chunks), decode_seqs, ctx_tokens)) * 1000


def lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least-squares coefficients of ``rows`` for ``ys``."""
    import numpy as np

    return [float(x) for x in np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)[0]]


class Bench:
    """Times one callable: events around eager calls, kernel sum from the profiler, CUDA-graph replays."""

    def __init__(self, torch: Any, cuda: bool, warmup: int, repeats: int, graphs: bool) -> None:
        self.torch = torch
        self.cuda = cuda
        self.warmup = warmup
        self.repeats = repeats
        self.graphs = graphs and cuda
        self.graph_error: str | None = None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _wall(self, fn: Callable[[], Any], setup: Callable[[], Any]) -> list[float]:
        times = []
        for i in range(self.warmup + self.repeats):
            setup()
            self.sync()
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                ms = float(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1000
            if i >= self.warmup:
                times.append(ms)
        return times

    def _kernels(self, fn: Callable[[], Any], setup: Callable[[], Any]) -> float | None:
        if not self.cuda:
            return None
        prof_mod = self.torch.profiler
        setup()
        self.sync()
        try:
            with prof_mod.profile(activities=[prof_mod.ProfilerActivity.CUDA]) as prof:
                fn()
                self.sync()
            total_us = 0.0
            for ev in prof.key_averages():
                us: Any = getattr(ev, "self_device_time_total", None)
                if us is None:
                    us = getattr(ev, "self_cuda_time_total", 0.0)
                total_us += float(us)
        except Exception as exc:  # no CUPTI: keep the event timings
            log(f"  profiler failed: {type(exc).__name__}: {exc}")
            return None
        return total_us / 1000 if total_us > 0 else None

    def _graph(self, fn: Callable[[], Any], setup: Callable[[], Any]) -> list[float] | None:
        if not self.graphs:
            return None
        torch = self.torch
        graph = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    setup()
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            self.sync()
            graph = torch.cuda.CUDAGraph()
            setup()
            self.sync()
            with torch.cuda.graph(graph):
                fn()
            self.sync()
            times = []
            for i in range(self.warmup + self.repeats):
                setup()
                self.sync()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                if i >= self.warmup:
                    times.append(float(start.elapsed_time(end)))
            return times
        except Exception as exc:  # capture can fail on host syncs inside HF code: keep the other numbers
            self.graph_error = f"{type(exc).__name__}: {exc}"[:500]
            log(f"  CUDA graph capture failed: {self.graph_error}")
            return None
        finally:
            del graph
            self.sync()

    def measure(self, fn: Callable[[], Any], setup: Callable[[], Any] | None = None, graph: bool = False) -> dict:
        setup = setup or (lambda: None)
        wall = self._wall(fn, setup)
        kernel_ms = self._kernels(fn, setup)
        graph_times = self._graph(fn, setup) if graph else None
        out: dict[str, Any] = {
            "wall_ms": statistics.median(wall),
            "wall_ms_all": [round(t, 4) for t in wall],
            "kernel_ms": kernel_ms,
            "graph_ms": statistics.median(graph_times) if graph_times else None,
            "graph_ms_all": [round(t, 4) for t in graph_times] if graph_times else None,
        }
        # Both the eager wall time (launch gaps) and the profiled kernel sum (profiler overhead) overstate the
        # GPU's time; a graph replay is the cleanest figure.
        out["gpu_ms"] = out["graph_ms"] or min(v for v in (out["kernel_ms"], out["wall_ms"]) if v is not None)
        return out


def register_attention(torch: Any) -> None:
    from transformers import AttentionInterface

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attn(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: Any = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        causal = query.shape[2] > 1 and query.shape[2] == key.shape[2]
        out = sdpa(query, key, value, is_causal=causal, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTN_NAME, attn)


def set_attention(model: Any, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name


def build_model(torch: Any, shape: dict[str, Any], device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    config._attn_implementation = ATTN_NAME
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old_dtype)
    model.eval()
    # Whatever HF's init did (or skipped): fresh random weights, made where they live. Never time on zeros.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.normal_(0.0, 0.02)
    set_attention(model, ATTN_NAME)
    return model


def rewind(cache: Any, length: int) -> None:
    """Put a StaticCache back to ``length`` tokens (its slots are overwritten in place by the next forward)."""
    for layer in cache.layers:
        cl = getattr(layer, "cumulative_length", None)
        if cl is None or not hasattr(cl, "fill_"):
            raise RuntimeError("this transformers' StaticCache has no cumulative_length tensor; cannot rewind it")
        cl.fill_(length)


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        log("bench.gpu_check: torch is not installed here; run it where python3 has torch + transformers and CUDA")
        return 2
    cuda = bool(torch.cuda.is_available())
    if not cuda and not args.tiny:
        log("bench.gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing measured")
        return 2
    try:
        import transformers
        from transformers import StaticCache
    except ImportError as exc:
        log(f"bench.gpu_check: transformers is missing or too old ({exc})")
        return 2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "gpu_check.json"
    profile = load_h100_profile()
    device = "cuda" if cuda else "cpu"
    shape = TINY if args.tiny else LLAMA31_8B
    result: dict[str, Any] = {
        "command": " ".join(["python", "-m", "bench.gpu_check", *sys.argv[1:]]),
        "profile": profile.name,
        "model_shape": shape,
        "tiny": args.tiny,
        "attention": ATTN_NAME,
        "hit_tail_tokens": HIT_TAIL,
        "decode_ctx_tokens": args.decode_ctx,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": getattr(torch.version, "cuda", None),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        },
        "miss": [],
        "hit": [],
        "decode": [],
        "stock_sdpa": [],
        "errors": [],
    }

    def save() -> None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")

    t_start = time.perf_counter()
    log(f"device {result['env']['device']}, torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    register_attention(torch)
    t0 = time.perf_counter()
    model = build_model(torch, shape, device)
    n_params = sum(p.numel() for p in model.parameters())
    result["params"] = n_params
    result["build_s"] = round(time.perf_counter() - t0, 2)
    log(f"model built: {n_params / 1e9:.2f} B params, dtype {next(model.parameters()).dtype}, {result['build_s']} s")
    bench = Bench(torch, cuda, args.warmup, args.repeats, graphs=not args.no_graphs)
    vocab = shape["vocab_size"]
    cfg = model.config

    def finite(out: Any) -> bool:
        return bool(torch.isfinite(out.logits).all())

    def forward(ids: Any, pos: Any, cache: Any) -> Any:
        return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def miss_point(n: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (1, n), device=device)
        pos = torch.arange(n, device=device)[None]
        cache = StaticCache(config=cfg, max_cache_len=n)  # preallocated, written in place, as vLLM's KV blocks
        m = bench.measure(lambda: forward(ids, pos, cache), setup=lambda: rewind(cache, 0), graph=True)
        rewind(cache, 0)
        m["finite"] = finite(forward(ids, pos, cache))
        return {"n": n, **m, "profile_ms": profile_ms(profile, [(n, 0)])}

    def hit_point(n: int, attn_graph: bool) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (1, n), device=device)
        cache = StaticCache(config=cfg, max_cache_len=n)
        forward(ids[:, : n - HIT_TAIL], torch.arange(n - HIT_TAIL, device=device)[None], cache)
        tail, tail_pos = ids[:, n - HIT_TAIL :], torch.arange(n - HIT_TAIL, n, device=device)[None]
        m = bench.measure(
            lambda: forward(tail, tail_pos, cache), setup=lambda: rewind(cache, n - HIT_TAIL), graph=attn_graph
        )
        rewind(cache, n - HIT_TAIL)
        m["finite"] = finite(forward(tail, tail_pos, cache))
        return {"n": n, **m, "profile_ms": profile_ms(profile, [(HIT_TAIL, n - HIT_TAIL)])}

    def decode_point(b: int, attn_graph: bool) -> dict[str, Any]:
        ctx = args.decode_ctx
        cache = StaticCache(config=cfg, max_cache_len=ctx + 1)
        forward(
            torch.randint(0, vocab, (b, ctx), device=device),
            torch.arange(ctx, device=device)[None].expand(b, -1),
            cache,
        )
        ids = torch.randint(0, vocab, (b, 1), device=device)
        pos = torch.full((b, 1), ctx, device=device, dtype=torch.long)
        m = bench.measure(lambda: forward(ids, pos, cache), setup=lambda: rewind(cache, ctx), graph=attn_graph)
        rewind(cache, ctx)
        m["finite"] = finite(forward(ids, pos, cache))
        return {"batch": b, "ctx": ctx, **m, "profile_ms": profile_ms(profile, [], b, b * ctx)}

    def guarded(section: str, key: Any, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        try:
            point = fn()
        except Exception as exc:
            msg = f"{section} {key}: {type(exc).__name__}: {exc}"[:800]
            log(f"  FAILED {msg}")
            result["errors"].append(msg)
            point = None
        if cuda:
            torch.cuda.empty_cache()
        save()
        return point

    def measure_all() -> None:
        measure_sections(args, result, bench, miss_point, hit_point, decode_point, guarded, model)

    with torch.inference_mode():
        measure_all()

    summarize(result, profile)
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    save()
    plot(result, out_dir / "gpu_check.png")
    print_table(result)
    log(f"wrote {json_path} ({result['elapsed_s']} s)")
    return 0


def measure_sections(
    args: argparse.Namespace,
    result: dict[str, Any],
    bench: Bench,
    miss_point: Callable[[int], dict[str, Any]],
    hit_point: Callable[[int, bool], dict[str, Any]],
    decode_point: Callable[[int, bool], dict[str, Any]],
    guarded: Callable[[str, Any, Callable[[], dict[str, Any]]], dict[str, Any] | None],
    model: Any,
) -> None:
    sections: list[tuple[str, str, str, list[int], Callable[[int], dict[str, Any]]]] = [
        ("miss", "miss (prefill of n tokens):", "n={:5d}", args.prompt_lens, miss_point),
        ("hit", f"hit (last {HIT_TAIL} tokens over a cached prefix of n-{HIT_TAIL}):", "n={:5d}", args.prompt_lens,
         lambda n: hit_point(n, True)),
        ("decode", f"decode (1 token for each of B sequences, {args.decode_ctx} tokens of context each):", "B={:3d}",
         args.batches, lambda b: decode_point(b, True)),
    ]  # fmt: skip
    for section, header, label, keys, point in sections:
        log(header)
        for key in keys:
            p = guarded(section, key, partial(point, key))
            if p:
                result[section].append(p)
                log(
                    f"  {label.format(key)} wall {p['wall_ms']:8.2f} kernels {p['kernel_ms'] or 0:8.2f} "
                    f"graph {p['graph_ms'] or 0:8.2f} profile {p['profile_ms']:8.2f} ms"
                )
    result["graph_error"] = bench.graph_error

    if not args.no_stock_sdpa:
        log("HF stock 'sdpa' (mask + repeat_kv with a StaticCache), for comparison:")
        try:
            set_attention(model, "sdpa")
            for label, fn in (
                (f"hit n={max(args.prompt_lens)}", lambda: hit_point(max(args.prompt_lens), False)),
                (f"decode B={max(args.batches)}", lambda: decode_point(max(args.batches), False)),
            ):
                p = guarded("stock_sdpa", label, fn)
                if p:
                    p["point"] = label
                    result["stock_sdpa"].append(p)
                    log(f"  {label}: wall {p['wall_ms']:8.2f} kernels {p['kernel_ms'] or 0:8.2f} ms")
        except Exception as exc:
            result["errors"].append(f"stock sdpa: {type(exc).__name__}: {exc}"[:800])
        finally:
            set_attention(model, ATTN_NAME)


def summarize(result: dict[str, Any], profile: Any) -> None:
    """Ratios measured/profile, hit/miss TTFT ratios and fits of the profile's terms to the measurements."""
    for section in ("miss", "hit", "decode", "stock_sdpa"):
        for p in result[section]:
            p["ratio"] = p["gpu_ms"] / p["profile_ms"] if p["profile_ms"] else None
    miss = {p["n"]: p for p in result["miss"]}
    result["hit_miss"] = [
        {
            "n": h["n"],
            "measured": h["gpu_ms"] / miss[h["n"]]["gpu_ms"],
            "measured_wall": h["wall_ms"] / miss[h["n"]]["wall_ms"],
            "profile": h["profile_ms"] / miss[h["n"]]["profile_ms"],
        }
        for h in result["hit"]
        if h["n"] in miss
    ]
    fits: dict[str, Any] = {
        "profile": {
            "base_ms": profile.base_ms,
            "prefill_ms_per_token": profile.prefill_ms_per_token,
            "attn_ms_quadratic": profile.attn_ms_quadratic,
            "decode_ms_per_seq_at_ctx": profile.decode_ms_per_seq
            + profile.decode_ms_per_kctx * result["decode_ctx_tokens"] / 1000,
        }
    }
    if len(result["miss"]) >= 3:
        rows = [[1.0, float(p["n"]), p["n"] * p["n"] / 2 / 1e6] for p in result["miss"]]
        base, a, q = lstsq(rows, [p["gpu_ms"] for p in result["miss"]])
        fits["miss"] = {
            "base_ms": base,
            "prefill_ms_per_token": a,
            "attn_ms_quadratic": q,
            "model": "gpu_ms = base + a*n + q*n^2/2/1e6",
        }
    if len(result["decode"]) >= 2:
        base, k = lstsq([[1.0, float(p["batch"])] for p in result["decode"]], [p["gpu_ms"] for p in result["decode"]])
        fits["decode"] = {"base_ms": base, "ms_per_seq_at_ctx": k, "model": "gpu_ms = base + k*B"}
    result["fits"] = fits


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    title = f"{result['env']['device']}: Llama-3.1-8B-shaped HF forward vs profile {result['profile']}"
    fig.suptitle(title + (" (TINY smoke run)" if result["tiny"] else ""))
    for ax, section, xkey, name in (
        (axes[0][0], "miss", "n", "miss: prefill of n tokens"),
        (axes[0][1], "hit", "n", f"hit: last {HIT_TAIL} tokens over n-{HIT_TAIL} cached"),
        (axes[1][1], "decode", "batch", f"decode step, {result['decode_ctx_tokens']} ctx tokens/seq"),
    ):
        pts = result[section]
        if not pts:
            continue
        xs = [p[xkey] for p in pts]
        ax.plot(xs, [p["wall_ms"] for p in pts], "o:", label="measured, eager wall")
        ax.plot(xs, [p["gpu_ms"] for p in pts], "o-", label="measured, GPU (graph or kernel sum)")
        ax.plot(xs, [p["profile_ms"] for p in pts], "s--", label=f"profile {result['profile']}")
        ax.set_title(name)
        ax.set_xlabel("prompt tokens n" if xkey == "n" else "batch B (sequences)")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[1][0]
    hm = result.get("hit_miss", [])
    if hm:
        xs = [p["n"] for p in hm]
        ax.plot(xs, [p["measured"] for p in hm], "o-", label="measured (GPU)")
        ax.plot(xs, [p["measured_wall"] for p in hm], "o:", label="measured (eager wall)")
        ax.plot(xs, [p["profile"] for p in hm], "s--", label="profile")
        ax.set_yscale("log")
        ax.set_title("hit/miss step-time ratio")
        ax.set_xlabel("prompt tokens n")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


def print_table(result: dict[str, Any]) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    log("\npoint          wall_ms  kernel_ms  graph_ms  profile_ms  gpu/profile")
    for section, key in (("miss", "n"), ("hit", "n"), ("decode", "batch"), ("stock_sdpa", "point")):
        for p in result[section]:
            label = p["point"] if section == "stock_sdpa" else f"{section} {key}={p[key]}"
            log(
                f"{label:14s} {f(p['wall_ms']):>7s}  {f(p['kernel_ms']):>9s}  {f(p['graph_ms']):>8s}  "
                f"{f(p['profile_ms']):>10s}  {f(p['ratio']):>11s}"
            )
    for p in result.get("hit_miss", []):
        log(
            f"hit/miss n={p['n']:5d}: measured {p['measured']:.4f} (wall {p['measured_wall']:.4f}), "
            f"profile {p['profile']:.4f}"
        )
    log("fits: " + json.dumps(result.get("fits", {}), indent=None))
    if result["errors"]:
        log(f"errors: {result['errors']}")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.png")
    ap.add_argument(
        "--prompt-lens",
        type=_int_list,
        default=[512, 1024, 2048, 4096, 8192],
        help="prompt lengths n for miss and hit (comma-separated; default %(default)s)",
    )
    ap.add_argument(
        "--batches", type=_int_list, default=[1, 8, 32, 64], help="decode batch sizes (default %(default)s)"
    )
    ap.add_argument("--decode-ctx", type=int, default=1000, help="context tokens per decode sequence (default 1000)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before each point (default 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per point, median reported (default 5)")
    ap.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph capture of hit and decode forwards")
    ap.add_argument("--no-stock-sdpa", action="store_true", help="skip the HF stock 'sdpa' comparison points")
    ap.add_argument("--tiny", action="store_true", help="tiny model, CPU allowed: a smoke test, not a measurement")
    args = ap.parse_args(argv)
    if min(args.prompt_lens) <= HIT_TAIL or min(args.batches) < 1 or args.repeats < 1 or args.decode_ctx < 1:
        ap.error(f"prompt lengths must exceed {HIT_TAIL}; batches, repeats and --decode-ctx must be >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
