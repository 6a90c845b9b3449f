"""Decision latency: parse + keys (+ tokenize) + index match + score + record, per request.

    python -m bench.decision [--tokens 8000] [--docs 20] [--requests 400]

Runs the router in-process (no gRPC, no Envoy: ``bench.overhead`` measures those) for 8k-token
chats over a set of shared documents, once with the approximate index (character blocks) and once
in precise mode (the model's tokenizer and chat template, token blocks, the numpy precise index).
Cold = the first request on a document (its text is tokenized in full); warm = later questions on
a known document (only the new text is tokenized).
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path
from typing import Any

import orjson

from bench.loadgen import percentile
from bench.vllm_model import build as build_model
from extproc.config import build_config
from extproc.observability import Metrics
from extproc.router import Router

ROOT = Path(__file__).resolve().parent.parent
PODS = [f"10.0.0.{i}:8000" for i in range(1, 9)]


def documents(n: int, tokens: int, tok: Any) -> list[str]:
    """Real text (stdlib sources) cut to ≈ ``tokens`` tokens each."""
    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out: list[str] = []
    for p in src:
        text = p.read_text(errors="replace")
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= tokens:
            out.append(tok._tok.decode(ids[:tokens]))
        if len(out) == n:
            break
    return out


def run(precise: bool, docs: list[str], requests: int, model_dir: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}}
    if precise:
        cfg["models"] = {"m": {"pool": "p", "tokenizer": str(model_dir), "block_size": 16}}
        cfg["kv_events"] = {"enabled": True}
    router = Router(build_config(cfg), Metrics())
    cold: list[float] = []
    warm: list[float] = []
    seen: set[int] = set()
    for i in range(requests):
        d = i % len(docs)
        body = orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": docs[d]},
                    {"role": "user", "content": f"Question {i}: what does this module do?"},
                ],
            }
        )
        headers = {":path": "/v1/chat/completions", ":method": "POST"}
        t0 = time.perf_counter()
        req = router.parse("/v1/chat/completions", "POST", headers, body)
        out = router.route(req)
        dt = time.perf_counter() - t0
        router.release(out.endpoint)
        (warm if d in seen else cold).append(dt)
        seen.add(d)
    return {
        "index": "precise" if precise else "approx",
        "cold_p50_ms": 1e3 * (percentile(cold, 0.5) or 0),
        "warm_p50_ms": 1e3 * (percentile(warm, 0.5) or 0),
        "warm_p99_ms": 1e3 * (percentile(warm, 0.99) or 0),
        "requests": requests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decision", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=8000, help="document length in tokens")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--requests", type=int, default=400)
    a = ap.parse_args()
    model_dir = build_model(ROOT / ".cache" / "tiny-llama")
    from extproc.tokenize import ModelTokenizer

    docs = documents(a.docs, a.tokens, ModelTokenizer.from_dir(model_dir))
    rows = [run(False, docs, a.requests, model_dir), run(True, docs, a.requests, model_dir)]
    print(f"{a.tokens}-token chats over {len(docs)} documents, {a.requests} decisions each, 8 pods\n")
    print("| index | cold p50 ms | warm p50 ms | warm p99 ms |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['index']} | {r['cold_p50_ms']:.2f} | {r['warm_p50_ms']:.2f} | {r['warm_p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
