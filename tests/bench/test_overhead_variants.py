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
