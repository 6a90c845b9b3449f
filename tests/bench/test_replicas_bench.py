"""The benchmark's replica variants: POLICY@N (N kvroute replicas behind Envoy, sharing nothing) and
POLICY@N+redis (sharing state through a redis-server started for the run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from bench import harness
from tests.redis_server import require_redis_server


def test_variant_names_parse_and_expand() -> None:
    assert harness.replica_variant("kvroute-approx") == ("kvroute-approx", 1, False)
    assert harness.replica_variant("kvroute-approx@3+redis") == ("kvroute-approx", 3, True)
    assert harness.replica_variant("kvroute-precise@2") == ("kvroute-precise", 2, False)
    with pytest.raises(ValueError, match="POLICY@N"):
        harness.replica_variant("kvroute-approx@x")
    assert harness.with_replicas(["round-robin", "kvroute-approx"], 3, True) == [
        "round-robin", "kvroute-approx", "kvroute-approx@3", "kvroute-approx@3+redis"]  # fmt: skip
    assert harness.with_replicas(["kvroute-approx"], 1, False) == ["kvroute-approx"]
    with pytest.raises(SystemExit, match="only kvroute policies"):
        bench_main._policies("round-robin@2")


def test_authz_variants_parse_for_kvroute_only() -> None:
    assert harness.api_variant("kvroute-precise:authz") == ("kvroute-precise", "epp-authz.yaml")
    assert harness.api_variant("kvroute-approx:authz_http") == ("kvroute-approx", "epp-authz-http.yaml")
    assert harness.api_variant("noop-extproc:authz") == ("noop-extproc", "epp-authz.yaml")
    assert harness.api_variant("kvroute-approx") == ("kvroute-approx", None)
    assert harness.api_variant("sglang-router:cache_aware") == ("sglang-router:cache_aware", None)
    assert bench_main._policies("kvroute-approx:authz,kvroute-precise:authz@2,noop-extproc:authz_http") == [
        "kvroute-approx:authz", "kvroute-precise:authz@2", "noop-extproc:authz_http"]  # fmt: skip
    with pytest.raises(SystemExit, match="only kvroute-approx and kvroute-precise"):
        bench_main._policies("kvroute-shadow:authz")
    with pytest.raises(SystemExit, match="runs one kvroute"):
        bench_main._policies("kvroute-approx:authz_http@2")
    # ext_proc on kvroute's own HTTP/2 server: Envoy's ext_proc config, replicas allowed.
    assert harness.api_variant("kvroute-approx:h2") == ("kvroute-approx", "epp.yaml")
    assert bench_main._policies("kvroute-approx:h2,kvroute-precise:h2@2,noop-extproc:h2") == [
        "kvroute-approx:h2", "kvroute-precise:h2@2", "noop-extproc:h2"]  # fmt: skip
    with pytest.raises(SystemExit, match="over another transport"):
        bench_main._policies("kvroute-shadow:h2")
    # ... and with the body STREAMED right behind the headers (deploy/'s Envoy settings).
    assert harness.api_variant("kvroute-approx:h2-streamed") == ("kvroute-approx", "epp.yaml")
    assert bench_main._policies("kvroute-approx:h2-streamed,kvroute-precise:h2-streamed@2") == [
        "kvroute-approx:h2-streamed", "kvroute-precise:h2-streamed@2"]  # fmt: skip
    patch = harness.body_mode_patch("STREAMED")
    streamed = (patch["processing_mode"], patch["ext_proc"])
    assert streamed[0]["response_trailer_mode"] == "SEND"  # the slot held to the exchange's end
    assert harness.h2_variant("kvroute-approx:h2-streamed@2+redis") == (True, *streamed)
    assert harness.h2_variant("kvroute-approx:h2") == (True, None, None)
    assert harness.h2_variant("kvroute-approx") == (False, None, None)


def test_pd_reasons_add_up_over_replicas() -> None:
    from prometheus_client import generate_latest

    from extproc.observability import Metrics

    texts = []
    for n in (3, 1):  # two replicas' /metrics, one after the other
        m = Metrics()
        m.pd_decisions.labels("split", "uncached").inc(n)
        texts.append(generate_latest(m.registry).decode())
    assert harness.pd_reasons("\n".join(texts)) == {"split/uncached": 4.0}


@pytest.mark.integration
@pytest.mark.slow
def test_two_replicas_sharing_through_redis_keep_one_replicas_hit_rate(tmp_path: Path) -> None:
    require_redis_server()
    rc = bench_main.main(["run", "--scenario", "multi-turn", "--max-requests", "24", "--pods", "2", "--rate", "6",
                          "--policies", "kvroute-approx,kvroute-approx@2+redis", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    one, shared = rows["kvroute-approx"], rows["kvroute-approx@2+redis"]
    assert one["errors"] == 0 and shared["errors"] == 0 and shared["requests"] == 24
    assert shared["hit_rate"] >= one["hit_rate"] - 0.01
    assert set(shared["cpu_cores"]) >= {"kvroute", "kvroute-2", "redis"}  # both replicas ran, and Redis
