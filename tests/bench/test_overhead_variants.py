"""bench.results imports every router a ``bench.overhead --variants`` run measured, each kvroute
variant beside the do-nothing server with the same options."""

import json
from pathlib import Path
from typing import Any

from bench import overhead, results


def _router(p50: float, cpu: float, **extra: Any) -> dict[str, Any]:
    return {"p50_ms": p50, "p99_ms": 2 * p50, "envoy_cpu_ms_per_req": 0.5, "extproc_cpu_ms_per_req": cpu, **extra}


def test_overhead_import_takes_the_variant_rows(tmp_path: Path) -> None:
    variants = overhead.parse_variants("product")
    names = [v.name for v in variants]
    case = {
        "rate": 300.0, "body": "8k", "requests_per_router": 900, "errors": dict.fromkeys(names, 0),
        "envoy": _router(1.0, 0.0),
        "envoy+noop-extproc": _router(2.0, 0.9, added_p50_ms=1.0, added_p99_ms=2.0),
        "envoy+kvroute": _router(2.4, 1.3, added_p50_ms=1.4, added_p99_ms=2.8, own_cpu_ms_per_req=0.4, own_p50_ms=0.4),
        "envoy+noop-extproc/uvloop": _router(1.8, 0.8, added_p50_ms=0.8, added_p99_ms=1.6),
        "envoy+kvroute/uvloop": _router(2.0, 1.0, added_p50_ms=1.0, added_p99_ms=2.0, own_cpu_ms_per_req=0.2,
                                        own_p50_ms=0.2),
    }  # fmt: skip
    res = {"rates": [300.0], "duration_s": 5.0, "rounds": 1, "routers": names, "sizes": {"8k@300": case}}
    (tmp_path / "results.json").write_text(json.dumps(res))
    h = results.import_overhead(tmp_path)
    assert [r["router"] for r in h["rows"]] == names
    assert " --variants noop,kvroute,noop/uvloop,kvroute/uvloop --out " in h["command"]
    block = results.render_block({"name": "overhead", **h})
    assert "| own CPU ms/req | own p50 ms |" in block
    kv = (
        "| 300 | 8k-token chat | envoy+kvroute/uvloop | 2.00 | 4.00 | +1.00 | +2.00 | 0.50 | 1.00 | +0.20 | +0.20 | 0 |"
    )
    noop = "| 300 | 8k-token chat | envoy+noop-extproc/uvloop | 1.80 | 3.60 | +0.80 | +1.60 | 0.50 | 0.80 | - | - | 0 |"
    assert kv in block and noop in block
    # Each kvroute variant is weighed against its own floor.
    assert "(envoy+kvroute/uvloop, over envoy+noop-extproc/uvloop): kvroute adds +1.00 ms p50" in block
    assert "its own CPU over that floor +0.20 ms per request" in block
    assert "8k-token chat: kvroute adds +1.40 ms p50" in block and "+0.40 ms per request" in block
    results.overhead_plot({"name": "overhead", **h}, tmp_path / "o.png")
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def test_peer_rows_sit_beside_envoy_alone_with_their_proxy_cpu(tmp_path: Path) -> None:
    """``--peers``: a peer router in Envoy's place is a row with its own proxy CPU, its latency over Envoy
    alone's as "added", no ext_proc column and no own part; the command names the peers."""
    names = ["envoy", "envoy+noop-extproc/authz_http/uvloop", "envoy+kvroute/authz_http/uvloop", "sglang-router"]
    case = {
        "rate": 100.0, "body": "1k", "requests_per_router": 300, "errors": dict.fromkeys(names, 0),
        "envoy": _router(1.0, 0.0),
        names[1]: _router(1.2, 0.2, added_p50_ms=0.2, added_p99_ms=0.4),
        names[2]: _router(1.5, 0.4, added_p50_ms=0.5, added_p99_ms=1.0, own_cpu_ms_per_req=0.2, own_p50_ms=0.3),
        "sglang-router": {"p50_ms": 0.9, "p99_ms": 1.9, "envoy_cpu_ms_per_req": 0.35, "extproc_cpu_ms_per_req": 0.0,
                          "added_p50_ms": -0.1, "added_p99_ms": -0.1},
    }  # fmt: skip
    res = {"rates": [100.0], "duration_s": 5.0, "rounds": 1, "routers": names, "peers": ["sglang-router"],
           "sizes": {"1k@100": case}}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(res))
    h = results.import_overhead(tmp_path)
    assert " --variants noop/authz_http/uvloop,kvroute/authz_http/uvloop --peers sglang-router --out " in h["command"]
    block = results.render_block({"name": "overhead", **h})
    assert "| 100 | 1k-token chat | sglang-router | 0.90 | 1.90 | -0.10 | -0.10 | 0.35 | - | - | - | 0 |" in block
    assert "| proxy CPU ms/req |" in block
    assert not any("sglang-router" in line for line in block.splitlines() if "kvroute adds" in line)


def test_peers_are_checked_and_rows_named_in_the_report() -> None:
    res = {"duration_s": 5, "rounds": 1, "peers": ["vllm-router"], "sizes": {"1k@100": {
        "rate": 100.0, "body": "1k", "errors": {"envoy": 0, "vllm-router": 0},
        "envoy": _router(1.0, 0.0), "vllm-router": _router(1.6, 0.0, added_p50_ms=0.6, added_p99_ms=1.2)}},
        "routers": ["envoy", "vllm-router"]}  # fmt: skip
    table = overhead.report(res)
    assert "| 100 | 1k-token chat | vllm-router | 1.60 | 3.20 | **+0.60** | **+1.20** | 0.50 | - | - | - | 0 |" in table
