"""Router overhead: Envoy alone vs Envoy + kvroute over the same instant backends, one run.

    python -m bench.overhead [--rates 100,300] [--duration 8] [--rounds 2] [--out bench/out/overhead]

For each rate and body size (1k- and 8k-token chat), rounds alternate three routers over the same
instant backends at the same open-loop Poisson rate: plain Envoy (round robin, no ext_proc), Envoy +
a do-nothing Python ext_proc server (``bench.noop_extproc``: the floor of any grpcio processor), and
Envoy + kvroute. Reported: latency p50/p99 of each, the latency each adds over plain Envoy, and the
CPU milliseconds per request of Envoy and of the ext_proc server (from /proc). Side by side in one
run because this machine is noisy: compare the differences and ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from bench import loadgen
from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from bench.procs import cpu_seconds, python_module, start_with_ready_file, stop

SIZES = {"1k": 1_000, "8k": 8_000}  # prompt tokens (≈ 4 characters each)
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]


def chat_bodies(tokens: int, n: int, docs: int = 32, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    corpus = [
        " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(tokens * 4 // 9)) for _ in range(docs)
    ]
    return [
        orjson.dumps(
            {
                "model": "bench",
                "max_tokens": 1,
                "messages": [
                    {"role": "system", "content": corpus[i % docs]},
                    {"role": "user", "content": f"question {i}: what does it say?"},
                ],
            }
        )
        for i in range(n)
    ]


def _round(url: str, bodies: list[bytes], rate: float, seed: int) -> list[loadgen.Record]:
    arrivals = loadgen.poisson_arrivals(len(bodies), rate, seed)
    specs = [loadgen.RequestSpec(body=b, at=t) for b, t in zip(bodies, arrivals, strict=True)]
    return asyncio.run(loadgen.run(url, specs, timeout=30))


ROUTERS = ("envoy", "envoy+noop-extproc", "envoy+kvroute")


def measure(rates: list[float], duration: float, rounds: int, pods: int = 4) -> dict[str, Any]:
    """Rounds alternate the three routers over the same backends; see the module docstring."""
    backends, addrs = start_with_ready_file(python_module("bench.instant", "--ports", ",".join(["0"] * pods)))
    assert isinstance(addrs, list)
    noop = None
    results: dict[str, Any] = {"rates": rates, "duration_s": duration, "rounds": rounds, "sizes": {}}
    try:
        noop, ready = start_with_ready_file(python_module("bench.noop_extproc", "--target", addrs[0]))
        assert isinstance(ready, dict)
        with (
            KVRouteProcess(addrs, extra_args=["--log-level", "warning"]) as kv,
            EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=addrs) as through,
            EnvoyProcess("epp.yaml", kvroute_port=ready["port"], pods=addrs) as through_noop,
            EnvoyProcess("epp.yaml", kvroute_port=None, pods=addrs, without_ext_proc=True) as plain,
        ):
            assert kv.proc is not None
            # router name -> (its Envoy, the ext_proc server's pid or None)
            routers = {
                "envoy": (plain, None),
                "envoy+noop-extproc": (through_noop, noop.pid),
                "envoy+kvroute": (through, kv.proc.pid),
            }
            bar = tqdm(total=len(rates) * len(SIZES) * rounds * len(routers), desc="overhead", unit="round")
            for rate, (size, tokens) in ((r, st) for r in rates for st in SIZES.items()):
                bodies = chat_bodies(tokens, int(rate * duration))
                lat: dict[str, list[float]] = {n: [] for n in routers}
                errors = dict.fromkeys(routers, 0)
                cpu_envoy = dict.fromkeys(routers, 0.0)
                cpu_proc = dict.fromkeys(routers, 0.0)
                sent = dict.fromkeys(routers, 0)
                for env, _ in routers.values():
                    _round(env.url, bodies[:50], rate, 99)  # warm connections and the index
                for r in range(rounds):
                    for name, (env, pid) in routers.items():
                        assert env.proc is not None
                        e0, p0 = cpu_seconds(env.proc.pid), cpu_seconds(pid) if pid else 0.0
                        recs = _round(env.url, bodies, rate, seed=r)
                        cpu_envoy[name] += cpu_seconds(env.proc.pid) - e0
                        cpu_proc[name] += (cpu_seconds(pid) - p0) if pid else 0.0
                        sent[name] += len(recs)
                        lat[name] += [x.e2e for x in recs if x.ok and x.e2e is not None]
                        errors[name] += sum(not x.ok for x in recs)
                        bar.update()
                row: dict[str, Any] = {
                    "rate": rate,
                    "body": size,
                    "requests_per_router": sent["envoy"],
                    "errors": errors,
                }
                for name, v in lat.items():
                    row[name] = {
                        "p50_ms": 1e3 * (loadgen.percentile(v, 0.5) or 0),
                        "p99_ms": 1e3 * (loadgen.percentile(v, 0.99) or 0),
                        "envoy_cpu_ms_per_req": 1e3 * cpu_envoy[name] / max(1, sent[name]),
                        "extproc_cpu_ms_per_req": 1e3 * cpu_proc[name] / max(1, sent[name]),
                    }
                for name in ROUTERS[1:]:
                    row[name]["added_p50_ms"] = row[name]["p50_ms"] - row["envoy"]["p50_ms"]
                    row[name]["added_p99_ms"] = row[name]["p99_ms"] - row["envoy"]["p99_ms"]
                row["latencies_ms"] = {k: [1e3 * x for x in v] for k, v in lat.items()}
                results["sizes"][f"{size}@{rate:.0f}"] = row
            bar.close()
    finally:
        stop(noop)
        stop(backends)
    return results


def report(res: dict[str, Any]) -> str:
    lines = [
        f"Open-loop Poisson arrivals, {res['duration_s']:.0f} s x {res['rounds']} alternating rounds per router, "
        "4 instant backends",
        "",
        "| req/s | body | router | p50 ms | p99 ms | added p50 ms | added p99 ms | Envoy CPU ms/req "
        "| ext_proc CPU ms/req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["sizes"].values():
        for name in ROUTERS:
            r = row[name]
            added = f"**{r['added_p50_ms']:+.2f}** | **{r['added_p99_ms']:+.2f}**" if "added_p50_ms" in r else "- | -"
            proc = f"{r['extproc_cpu_ms_per_req']:.2f}" if name != "envoy" else "-"
            lines.append(
                f"| {row['rate']:.0f} | {row['body']}-token chat | {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{added} | {r['envoy_cpu_ms_per_req']:.2f} | {proc} | {row['errors'][name]} |"
            )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(res["sizes"])
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    axes = axes[0]
    for ax, row in zip(axes, res["sizes"].values(), strict=True):
        for name, v in row["latencies_ms"].items():
            v = sorted(v)
            ax.plot(v, [i / len(v) for i in range(len(v))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency (ms, log)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{row['body']}-token chat @ {row['rate']:.0f} req/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rates", default="100,300", help="comma-separated request rates (req/s, open loop, Poisson)")
    ap.add_argument("--duration", type=float, default=8, help="seconds per round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per router and size")
    ap.add_argument("--out", default="bench/out/overhead", help="directory for results.json, table.md, overhead.png")
    a = ap.parse_args()
    res = measure([float(r) for r in a.rates.split(",")], a.duration, a.rounds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = report(res)
    (out / "table.md").write_text(table + "\n")
    slim = {
        **res,
        "sizes": {k: {kk: vv for kk, vv in v.items() if kk != "latencies_ms"} for k, v in res["sizes"].items()},
    }
    (out / "results.json").write_text(json.dumps(slim, indent=2))
    plot(res, out / "overhead.png")
    print(table)
    print(f"\nwrote {out}/results.json, table.md, overhead.png")


if __name__ == "__main__":
    main()
