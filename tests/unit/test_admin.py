"""The admin API: explain shows the live decision (same code, dry run) and changes nothing; the
endpoint list and index stats; the CLI against a running kvroute."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import orjson
import pytest

from bench.kvroute import KVRouteProcess, free_port
from extproc.admin.client import render_endpoints, render_explain
from extproc.admin.proto import admin_pb2 as pb
from extproc.admin.service import explain, index_stats, list_endpoints
from extproc.config import EndpointConfig, build_config
from extproc.endpoints.metrics import PodMetrics
from extproc.observability import Metrics
from extproc.router import Router

PODS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def body(seed: str, words: int = 300) -> bytes:
    text = " ".join(f"{seed}{i}" for i in range(words))
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def live(router: Router, raw: bytes, headers: dict[str, str] | None = None):
    """A live decision, its exchange over at once (its in-flight slot given back)."""
    out = router.route(router.parse("/v1/chat/completions", "POST", headers or {}, raw))
    router.release(out.endpoint, out.local_prefill)
    return out


def ask(router: Router, raw: bytes, headers: dict[str, str] | None = None) -> pb.ExplainResponse:
    return explain(router, pb.ExplainRequest(body=raw, headers=headers or {}))


def snapshot(router: Router) -> tuple:
    """Everything a decision may change: index, pins, in-flight counts, queue estimates, metrics."""
    eps = router.registry.by_address.values()
    return (
        router.index.block_counts(),
        len(router.scheduler.routes),
        {e.address: (e.inflight, e.prefills.wait(0.0), e.handoffs.pending(0.0)) for e in eps},
        router.metrics.registry.get_sample_value(
            "kvroute_decisions_total", {"pool": "p", "endpoint": PODS[0], "reason": "hash"}
        ),
    )


@pytest.fixture
def router() -> Router:
    cfg = build_config({"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}})
    return Router(cfg, Metrics())


def test_explain_ranks_as_the_live_decision_does_and_changes_nothing(router):
    # Some history and load: documents placed, one pod busier.
    homes = {f"doc{i}": live(router, body(f"doc{i}")).endpoint for i in range(6)}
    busy = next(a for a in PODS if a not in (homes["doc2"], homes["doc5"]))
    router.registry.by_address[busy].inflight += 3
    for seed in ("doc2", "doc5", "fresh"):
        raw = body(seed, 350)  # a follow-up of doc2/doc5 (same leading blocks), and a new document
        before = snapshot(router)
        x = ask(router, raw)
        assert snapshot(router) == before, "explain recorded something"
        decision = live(router, raw).decision
        ranked = [e.address for e in x.endpoints if e.rank >= 0]
        assert ranked[: len(decision.endpoints)] == [e.address for e in decision.endpoints]
        assert x.reason == decision.reason and x.http_status == 200 and x.pool == "p"
        top = x.endpoints[0]
        if seed != "fresh":
            assert top.address == homes[seed] and top.matched_blocks > 0 and top.predicted_cached_tokens > 0
            assert top.estimated_ttft_s < max(e.estimated_ttft_s for e in x.endpoints)
        # Cost scoring (the default) bounds no pod's load: no bounded-load verdict to show.
        assert all([f.filter for f in e.filters] == ["healthy", "saturation"] for e in x.endpoints)


def test_explain_shows_the_load_bound_where_one_applies():
    for routing in ({"scoring": "weighted"}, {"load_epsilon": 0.5}):
        cfg = build_config({"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, "routing": routing})
        r = Router(cfg, Metrics())
        r.registry.by_address[PODS[0]].inflight = 20  # far past (1 + 0.5) x the mean + the slack
        x = ask(r, body("doc"))
        verdicts = {e.address: [(f.filter, f.passed) for f in e.filters] for e in x.endpoints}
        assert verdicts[PODS[0]] == [("healthy", True), ("saturation", True), ("bounded-load", False)], routing
        assert verdicts[PODS[1]][-1] == ("bounded-load", True)


def test_explain_shows_why_an_endpoint_is_out(router):
    router.registry.apply("p", [EndpointConfig(address=a, ready=a != PODS[0]) for a in PODS])
    x = ask(router, body("doc"))
    out = next(e for e in x.endpoints if e.address == PODS[0])
    assert out.rank == -1 and out.state == "draining"
    assert [(f.filter, f.passed) for f in out.filters] == [("healthy", False)]
    assert "failed healthy" in render_explain(x)


def test_explain_answers_what_the_client_would_get(router):
    x = explain(router, pb.ExplainRequest(body=b'{"model": "m", "messages": ['))
    assert x.http_status == 400 and "not valid JSON" in x.error
    assert render_explain(x).startswith("refused: HTTP 400")


def test_explain_shows_the_pd_decision():
    eps = [{"address": PODS[0], "role": "prefill"}, *({"address": a, "role": "decode"} for a in PODS[1:])]
    r = Router(build_config({"pools": {"p": {"endpoints": eps}}, "pd": {"disaggregation": "conditional"}}), Metrics())
    for a in PODS[1:]:
        r.registry.by_address[a].inflight = 8  # streaming decode pods: a long prefill there would stall them
    x = ask(r, body("long", 3000))
    assert x.pd.split and x.pd.prefill == PODS[0] and x.pd.reason == "uncached" and x.pd.uncached_tokens > 1000
    assert x.pd.HasField("delay_s") and x.pd.HasField("allowance_s")
    assert x.endpoints[0].address in PODS[1:]
    assert r.registry.by_address[PODS[0]].prefills.wait(0.0) == 0  # no leg was queued
    assert "split -> prefill on" in render_explain(x)


@pytest.mark.usefixtures("still")
def test_explain_shows_a_hold():
    cfg = {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, "routing": {"hold": {"enabled": True}}}
    r = Router(build_config(cfg), Metrics())
    for e in r.registry.by_address.values():
        e.prefills.add(30.0, time.monotonic())  # long prefills queued everywhere
    x = ask(r, body("long", 3000))
    assert x.hold_s == r.config.routing.hold.max_s  # 30 s ahead: held the longest a hold lasts
    assert "held 1.000s before the answer" in render_explain(x) and x.hold_pace == 1.0
    assert "measured pace" not in render_explain(x)
    assert not ask(r, body("short", 30)).hold_s  # a short prompt is not held
    for e in r.registry.by_address.values():
        e.prefills = type(e.prefills)()
        e.prefills.add(0.2, time.monotonic())
    r.capacity.cost_fit = lambda pool, role, pods=None, min_prefills=None: (2.0, 100.0)  # type: ignore[method-assign]  # pods twice as fast
    r.capacity._paces.clear()  # (read again now, not after PACE_REFRESH_S)
    x = ask(r, body("long", 3000))
    assert x.hold_pace == 0.5 and 0.09 < x.hold_s < 0.12  # half of 0.2 s, and the margin on half of it
    paced = "at the pods' measured pace: 0.50 of routing.cost's seconds (kvroute_cost_model_fit 2.00)"
    assert paced in render_explain(x)
    off = Router(build_config({"pools": {"p": {"endpoints": [{"address": PODS[0]}]}}}), Metrics())
    assert "held" not in render_explain(ask(off, body("long", 3000)))  # holding off (the default)


def test_endpoints_and_index_stats(router):
    home = live(router, body("doc")).endpoint
    router.registry.acquire(home)
    got = list_endpoints(router)
    assert [e.address for e in got.endpoints] == PODS
    e = next(e for e in got.endpoints if e.address == home)
    assert e.inflight == 1 and e.index_blocks > 0 and e.state == "ready" and e.pool == "p"
    assert index_stats(router).approximate_blocks[home] == e.index_blocks
    assert home in render_endpoints(got)
    assert list_endpoints(router, "nope").endpoints == []


def test_endpoints_show_how_well_routing_cost_fits_the_pods(router):
    """No line until the pods' prefills are measured; then the fit per pool and role, and the factor to
    scale routing.cost by when it is off the warning's range."""
    assert not list_endpoints(router).cost_fits and "routing.cost" not in render_endpoints(list_endpoints(router))
    pod = PODS[0]
    t0 = time.monotonic()
    for i in range(25):  # a 4000-token prompt prefilled in 0.4 s each second (10k tokens/s; it assumes 50k/s)
        at = t0 - 26 + i
        router.capacity.on_scrape(pod, PodMetrics(prompt_tokens=4000.0 * i, prefix_cache_hits=0.0,
                                                  ttft_sum_s=0.4 * i, ttft_count=float(i)), at)  # fmt: skip
    (fit,) = list_endpoints(router).cost_fits
    assert (fit.pool, fit.role) == ("p", "both") and fit.fit == pytest.approx(0.2, rel=0.05) and fit.measured_prefills
    text = render_endpoints(list_endpoints(router))
    assert "routing.cost, pool p (both pods): the pods prefill at 0.20x" in text and "by 5.0" in text


def test_index_stats_of_a_precise_router_count_the_kv_intake_windows():
    r = Router(build_config({"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}},
                             "kv_events": {"enabled": True}}), Metrics())  # fmt: skip
    stats = index_stats(r).precise
    assert stats["kv_intake_windows"] == 0 and stats["endpoints"] == 0
    assert r.live.intake is not None
    r.live.intake.windows = 3
    assert index_stats(r).precise["kv_intake_windows"] == 3
    asyncio.run(r.live.aclose())


@pytest.mark.integration
def test_cli_against_a_running_kvroute(tmp_path):
    admin = free_port()
    req = tmp_path / "req.json"
    req.write_bytes(body("doc"))
    with KVRouteProcess(PODS, extra_args=["--admin-port", str(admin)]):

        def cli(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "extproc.cli", *argv, "--admin", f"127.0.0.1:{admin}"],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip

        r = cli("explain", "--body", str(req), "-H", "x-tenant-id:acme")
        assert r.returncode == 0, r.stderr
        assert "pick" in r.stdout and "reason hash" in r.stdout
        r = cli("explain", "--body", str(req), "--json")
        got = json.loads(r.stdout)
        assert got["http_status"] == 200 and len(got["endpoints"]) == 4
        r = cli("endpoints", "--json")
        assert [e["address"] for e in json.loads(r.stdout)["endpoints"]] == PODS
        assert "10.0.0.1:8000" in cli("endpoints").stdout
        r = cli("endpoints", "--pool", "nope")
        assert r.returncode == 3 and "NOT_FOUND: no pool named 'nope'" in r.stderr
    r = cli("endpoints")
    assert r.returncode == 3 and "UNAVAILABLE" in r.stderr  # nothing listens any more
