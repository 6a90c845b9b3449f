"""P/D benchmark pieces: the mixed-pd workload, fleet roles, kvroute and vllm-router P/D configs,
and the P/D columns of the report (no fleet is started here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench import harness, report, workloads
from bench.loadgen import Record
from bench.peers import peer_command
from bench.sim.tokenizer import SimTokenizer
from extproc.config import load_config

TOK = SimTokenizer()


def _tokens(item: workloads.Item) -> int:
    return len(TOK.encode(item.messages[0]["content"]))


def test_mixed_pd_mixes_short_chats_and_reused_long_documents() -> None:
    w = workloads.mixed_pd(requests=120, seed=3)
    assert w.name == "mixed-pd" and len(w.items) == 120
    chats = [it for it in w.items if it.tag.startswith("c")]
    docs = [it for it in w.items if it.tag.startswith("d")]
    assert 0.25 < len(docs) / len(w.items) < 0.55  # doc_fraction 0.4
    assert all(150 <= _tokens(it) <= 500 for it in chats)
    assert all(6000 + 40 <= _tokens(it) <= 12000 + 120 for it in docs)
    assert all(200 <= it.max_tokens <= 500 for it in w.items)  # long outputs for every request
    # Documents are reused: same tag, same document prefix, a different question after it.
    by_doc: dict[str, list[str]] = {}
    for it in docs:
        by_doc.setdefault(it.tag, []).append(it.messages[0]["content"])
    reused = [texts for texts in by_doc.values() if len(texts) > 1]
    assert reused
    a, b = reused[0][:2]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert len(TOK.encode(a[:common])) >= 6000


def test_mixed_pd_is_deterministic_and_registered() -> None:
    assert workloads.mixed_pd(requests=30, seed=1).items == workloads.mixed_pd(requests=30, seed=1).items
    assert workloads.mixed_pd(requests=30, seed=1).items != workloads.mixed_pd(requests=30, seed=2).items
    w = workloads.build("mixed-pd", None, 25)
    assert len(w.items) == 25 and w.items == workloads.mixed_pd().items[:25]
    assert 0.3 < workloads.ideal_hit_rate(workloads.mixed_pd().items, 16)["hit_rate"] < 0.9


def test_pd_split_and_roles() -> None:
    assert harness.parse_pd_split("1:3", 4) == (1, 3, 0)
    assert harness.parse_pd_split("1:0:3", 4) == (1, 0, 3)  # one prefill pod, three that do either
    assert harness.parse_pd_split("0:0:4", 4) == (0, 0, 4)
    for bad in ("0:4", "4:0", "2:3", "x", "1:1", "1:-1:4", "1:2:3:4", "0:0:1"):
        with pytest.raises(ValueError, match="pd-split"):
            harness.parse_pd_split(bad, 4 if bad != "0:0:1" else 1)
    cfg = harness.RunConfig(policies=harness.PD, pods=4, pd_split="2:2")
    assert harness.pd_roles("kvroute-pd-never", cfg) is None  # same pods, every one role both
    assert harness.pd_roles("kvroute-approx", cfg) is None
    for p in ("kvroute-pd-always", "kvroute-pd-conditional", "vllm-router-pd"):
        assert harness.pd_roles(p, cfg) == "prefill:2,decode:2"
    hybrid = harness.RunConfig(policies=harness.PD, pods=4, pd_split="1:0:3")
    assert harness.pd_roles("kvroute-pd-conditional", hybrid) == "prefill:1"  # the sim makes the rest both
    every_pod_both = harness.RunConfig(policies=harness.PD, pods=4, pd_split="0:0:4")
    assert harness.pd_roles("kvroute-pd-always", every_pod_both) is None


class _Fleet:
    pods = [{"address": "127.0.0.1:8001", "role": "prefill", "url": "http://127.0.0.1:8001"},
            {"address": "127.0.0.1:8002", "role": "decode", "url": "http://127.0.0.1:8002"}]  # fmt: skip


@pytest.mark.parametrize("mode", ["never", "always", "conditional"])
def test_pd_config_is_a_valid_kvroute_config(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "kvroute.yaml"
    harness._write_config(harness.pd_config(_Fleet(), f"kvroute-pd-{mode}", 700), path, None)  # type: ignore[arg-type]
    cfg = load_config(path)
    assert cfg.pd.disaggregation == mode and cfg.pd.handoff == "gateway" and cfg.pd.threshold_tokens == 700
    assert [e.role for e in cfg.pools["default"].endpoints] == ["prefill", "decode"]


def test_pd_config_keeps_the_users_pd_tuning(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text("pd: {max_split_delay_s: 0.2, disaggregation: never}\nrouting: {scoring: weighted}\n")
    path = tmp_path / "kvroute.yaml"
    harness._write_config(harness.pd_config(_Fleet(), "kvroute-pd-conditional", 700), path, str(user))  # type: ignore[arg-type]
    cfg = load_config(path)
    assert cfg.pd.disaggregation == "conditional"  # the policy decides the mode
    assert cfg.pd.max_split_delay_s == 0.2 and cfg.routing.scoring == "weighted"  # the user's tuning stays


def test_vllm_router_pd_command() -> None:
    cmd = peer_command("vllm-router", "cache_aware", [], 1, 2, pd=(["http://p1"], ["http://d1", "http://d2"]))
    assert "--worker-urls" not in cmd and "--vllm-pd-disaggregation" in cmd
    s = " ".join(cmd)
    assert "--prefill http://p1 --decode http://d1 --decode http://d2" in s
    with pytest.raises(ValueError, match="vllm-router only"):
        peer_command("sglang-router", "cache_aware", [], 1, 2, pd=([], []))


def _pod(role: str, **kw: Any) -> dict[str, Any]:
    base = {k: 0 for k in (*report.POD_KEYS, *report.PD_KEYS)}
    return {**base, "role": role, **kw}


def test_pd_summary_counts_pulled_kv_apart_from_local_hits() -> None:
    before = [_pod("prefill"), _pod("decode")]
    after = [
        _pod("prefill", requests=2, prefix_queries_tokens=2000, prefix_hits_tokens=500),
        _pod("decode", requests=2, prefix_queries_tokens=2000, prefix_hits_tokens=100, transfers=2,
             external_hits_tokens=1400),
    ]  # fmt: skip
    pods = report.pod_deltas(before, after)
    assert [p["role"] for p in pods] == ["prefill", "decode"]
    recs = [Record(tag="", status=200, ttft=0.1, e2e=1.0, itl=[0.01], output_chunks=2, prompt_tokens=1000)] * 2
    run = report.summarize("kvroute-pd-always", "mixed-pd", recs, pods, wall_s=1.0, ideal_hit_rate=0.5)
    r = run.row
    assert (r["prefill_legs"], r["transfers"], r["client_prompt_tokens"]) == (2, 2, 2000)
    # Prefilled: 1500 on the prefill pod, 2000 - 100 - 1400 = 500 on the decode pod, of 2000 sent.
    assert r["computed_per_prompt"] == pytest.approx(1.0)
    assert r["pulled_per_prompt"] == pytest.approx(0.7)
    assert r["hit_rate"] == pytest.approx(600 / 4000)  # both legs queried: not comparable to a plain fleet
    assert r["itl_samples"] == 2
    md = report.markdown([r], {"scenario": "mixed-pd"})
    assert "| kvroute-pd-always | decode 1, prefill 1 | 2 | 2 | 100.0% | 70.0% | 2 | 0.0100 | - 0.100 |" in md


def test_pod_deltas_without_pd_counters() -> None:
    pod = {k: 1 for k in report.POD_KEYS}
    (d,) = report.pod_deltas([pod], [pod])
    assert d["role"] == "both" and d["transfers"] == 0
    assert "prefill legs" not in report.markdown([{"policy": "x", "pods": [d]}], {})


def test_pd_sweep_table_and_plot(tmp_path: Path) -> None:
    from bench import pd_sweep

    row = {"ttft_p50_s": 0.03, "ttft_p99_s": 0.4, "itl_p50_s": 0.008, "itl_p99_s": 0.014, "itl_p999_s": 0.02,
           "output_tok_s": 1800.0, "errors": 0, "pd_reasons": {"split/uncached": 40, "local/cached": 160}}  # fmt: skip
    flat = {"max_split_delay_s": 0.05, "threshold_tokens": 1000, "pd_split": "2:2"}
    points = [
        pd_sweep.point("never", [row]),
        pd_sweep.point(
            "conditional d=0.05",
            [{**row, "ttft_p99_s": 0.45}, {**row, "ttft_p99_s": 0.5, "pd_reasons": {}}, {**row, "ttft_p99_s": 0.7}],
            max_split_delay_s=0.05,
            threshold_tokens=1000,
        ),
        pd_sweep.point("always", [{"policy": "kvroute-pd-always", "failed": "did not start"}]),
        pd_sweep.point("always 2:2", [row], pd_split="2:2"),
        pd_sweep.point("conditional d=0.05 2:2", [row], max_split_delay_s=0.05, threshold_tokens=1000, pd_split="2:2"),
        pd_sweep.point("conditional d=0.05 w=1000 2:2", [row], **{**flat, "split_delay_per_stall": 1000}),
        pd_sweep.point("vllm-router-pd 2:2", [{**row, "pd_reasons": None}], pd_split="2:2"),
        pd_sweep.point("conditional d=0.05 chats 100 ms 2:2", [row], **flat, chat_slo_ms=100.0),
    ]
    text = pd_sweep.table(points)
    never = "| never | 0.030 | 0.400 | 0.0080 | 0.0140 | 0.0200 | 1800 | 0 | local/cached 160, split/uncached 40 |"
    assert never in text
    # Three repeats: the median with its range; decision counts averaged over the repeats.
    cond = "| conditional d=0.05 | 0.030 | 0.500 (0.450–0.700) | 0.0080 | 0.0140 (0.0140–0.0140) | 0.0200 |"
    assert cond in text and "local/cached 106.667" not in text and "local/cached 107" in text
    assert "| always | - | - | - | - | - | - | - |" in text  # a failed run is shown, not fatal
    assert "| vllm-router-pd 2:2 | 0.030 | 0.400 |" in text  # a peer router has no kvroute decisions
    assert "| always 2:2 | 0.030 | 0.400 |" in text and "| conditional d=0.05 2:2 | 0.030 | 0.400 |" in text
    pd_sweep.plot(points, tmp_path / "t.png", "title")
    assert (tmp_path / "t.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="not a comma-separated"):
        pd_sweep.main(["--delays", "0,x"])
    with pytest.raises(SystemExit, match="stall weights must be >= 0"):
        pd_sweep.main(["--stall-weights", "0.05,-1"])
    with pytest.raises(SystemExit, match="chat SLOs must be > 0"):
        pd_sweep.main(["--chat-slo-ms", "none,0"])
    with pytest.raises(SystemExit, match="PREFILL:DECODE"):
        pd_sweep.main(["--pd-split", "4"])
    with pytest.raises(SystemExit, match="need a pod that prefills and another that decodes"):
        pd_sweep.main(["--pd-split", "1:3,0:4"])  # every split of a comma list is checked before any run


def test_chat_slo_header_is_kvroutes_in_wall_clock_ms() -> None:
    """RunConfig.slo_ms: chats (tag c…) carry x-slo-ttft-ms, kvroute's header, scaled to the wall-clock
    time kvroute estimates in; other classes carry none."""
    from extproc.config import HeadersConfig

    assert HeadersConfig().ttft_slo == harness.SLO_HEADER
    cfg = harness.RunConfig(policies=["kvroute-pd-conditional"], time_scale=3.0, slo_ms={"c": 100.0})
    chat = workloads.Item(({"role": "user", "content": "hi"},), 10, tag="c7")
    doc = workloads.Item(({"role": "user", "content": "doc"},), 10, tag="d3")
    assert harness.slo_header(cfg, chat) == (("x-slo-ttft-ms", "300"),)
    assert harness.slo_header(cfg, doc) == ()
    assert harness.slo_header(harness.RunConfig(policies=[]), chat) == ()


def test_pd_reasons_read_from_kvroute_metrics() -> None:
    from prometheus_client import generate_latest

    from extproc.observability import Metrics

    m = Metrics()
    m.pd_decisions.labels("split", "uncached").inc(3)
    m.pd_decisions.labels("local", "prefill-busy").inc()
    text = generate_latest(m.registry).decode()
    assert harness.pd_reasons(text) == {"split/uncached": 3.0, "local/prefill-busy": 1.0}
    assert harness.pd_reasons("") == {}


def test_time_scale_prices_kvroute_in_pod_time_and_reports_pod_time(tmp_path: Path) -> None:
    from extproc.config import CostConfig, PDConfig

    user = {"routing": {"cost": {"per_token_s": 1e-5}, "scoring": "cost"}, "pd": {"max_split_delay_s": 0.1}}
    assert harness.time_scaled(user, 1.0) is user
    cfg = harness.time_scaled({**user, "default_pool": "default"}, 3.0)
    assert cfg["routing"]["cost"]["per_token_s"] == pytest.approx(3e-5)  # the user's value, scaled
    assert cfg["routing"]["cost"]["per_inflight_s"] == pytest.approx(3 * CostConfig().per_inflight_s)  # defaults too
    assert cfg["routing"]["cost"]["per_token_context_s"] == pytest.approx(3 * CostConfig().per_token_context_s)
    assert cfg["routing"]["scoring"] == "cost" and cfg["default_pool"] == "default"
    assert cfg["pd"]["max_split_delay_s"] == pytest.approx(0.3)
    assert cfg["pd"]["transfer_s_per_token"] == pytest.approx(3 * PDConfig().transfer_s_per_token)
    assert user["routing"]["cost"] == {"per_token_s": 1e-5}  # not modified in place
    path = tmp_path / "k.yaml"
    harness._write_config({"pools": {"default": {"endpoints": [{"address": "127.0.0.1:9"}]}}}, path, None, 2.0)
    loaded = load_config(path)
    assert loaded.routing.cost.per_waiting_s == pytest.approx(2 * CostConfig().per_waiting_s)
    assert loaded.pd.prefill_timeout_s == pytest.approx(2 * PDConfig().prefill_timeout_s)

    rec = Record(tag="c1", status=200, start=30.0, ttft=0.3, e2e=3.0, itl=[0.03, 0.06], pod_wait=0.06, pod_ttft=0.27)
    scaled = harness.pod_time(rec, 3.0)
    assert (scaled.start, scaled.ttft, scaled.e2e) == pytest.approx((10.0, 0.1, 1.0))
    assert (scaled.pod_wait, scaled.pod_ttft) == pytest.approx((0.02, 0.09))  # the pods' wall seconds too
    assert scaled.itl == pytest.approx([0.01, 0.02]) and rec.itl == [0.03, 0.06]
    assert harness.pod_time(rec, 1.0) is rec


def test_chars_per_token_measured_on_the_workload_and_checked(tmp_path: Path) -> None:
    import argparse

    from extproc.config import load_config

    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({"routing": {"scoring": "cost"}}))
    path = tmp_path / "k.yaml"
    own = harness.pd_config(_Fleet(), "kvroute-pd-conditional", 700)  # type: ignore[arg-type]
    harness._write_config(own, path, str(user), 1.0, 8.14)
    loaded = load_config(path)
    assert loaded.routing.chars_per_token == pytest.approx(8.14) and loaded.routing.scoring == "cost"

    ideal = workloads.ideal_hit_rate(workloads.mixed_pd(requests=20).items, 16)
    assert 6.0 < ideal["chars_per_token"] < 10.0  # pseudo-words: ~8 characters a token, not English's 4
    assert harness.chars_per_token_arg("auto") == "auto" and harness.chars_per_token_arg("3.5") == 3.5
    for bad in ("x", "0", "100"):
        with pytest.raises(argparse.ArgumentTypeError):
            harness.chars_per_token_arg(bad)


def test_pd_estimates_join_decisions_with_measured_ttfts(tmp_path: Path) -> None:
    """bench.pd_estimates: kvroute's wall-clock estimates (time-scaled config) against pod-time TTFTs,
    joined by request id; decisions without a split weighed, or without a measured request, left out."""
    from bench import pd_estimates

    run = tmp_path / "conditional"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"time_scale": 2.0}))

    def routed(rid: str, split: bool, local_ms: float | None, delay_ms: float | None) -> str:
        pd = {"split": split, "local_ttft_ms": local_ms, "split_delay_ms": delay_ms}
        return json.dumps({"msg": "routed", "request_id": rid, "pd": pd}, separators=(",", ":"))

    (run / "kvroute-pd-conditional.kvroute.log").write_text("\n".join([
        routed("bench-0", True, 200.0, 100.0),  # estimate 0.3 s wall = 0.15 s pod; measured 0.2
        routed("bench-1", False, 400.0, 300.0),  # local: 0.2 s pod; measured 0.21
        routed("bench-2", False, None, None),  # cached: nothing weighed
        routed("bench-9", True, 100.0, 0.0),  # no such request
        '{"msg":"prefill leg","request_id":"bench-0","ms":50}',
    ]))  # fmt: skip
    (run / "kvroute-pd-conditional.requests.jsonl").write_text("\n".join(
        json.dumps({"request_id": f"bench-{i}", "ttft_s": t}) for i, t in enumerate((0.2, 0.21, 0.05))
    ))  # fmt: skip
    (errs,) = pd_estimates.collect(tmp_path)
    assert errs.split == pytest.approx([0.05]) and errs.local == pytest.approx([0.01]) and errs.unmatched == 1
    assert "| conditional | 1 | +0.050" in pd_estimates.table([errs])
    assert pd_estimates.main([str(tmp_path / "nothing")]) == 2


def test_pd_floor_is_the_idle_pod_prefill_of_what_never_left_uncached(tmp_path: Path) -> None:
    """bench.pd_floor: a request's floor is API time plus its uncached tokens in step-budget chunks
    (the profile's step model), the cache being what the never run found; every run is measured
    against those floors."""
    from bench import pd_floor
    from bench.sim.profiles import H100_LLAMA8B as prof

    # 12k tokens, 1k cached: a full step-budget chunk, then the rest on top of it.
    budget = prof.max_num_batched_tokens
    want = (
        prof.api_seconds(12_000)
        + prof.step_seconds([(budget, 1000)], 0, 0)
        + prof.step_seconds([(11_000 - budget, 1000 + budget)], 0, 0)
    )
    assert pd_floor.floor_seconds(prof, 12_000, 1000) == pytest.approx(want)
    # Fully cached: vLLM still computes the last token.
    assert pd_floor.floor_seconds(prof, 500, 500) == pytest.approx(
        prof.api_seconds(500) + prof.step_seconds([(1, 499)], 0, 0)
    )

    def run(name: str, policy: str, rows: list[tuple[int, int, float]]) -> None:
        d = tmp_path / name
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"profile": prof.name, "time_scale": 3.0}))
        (d / f"{policy}.requests.jsonl").write_text("\n".join(
            json.dumps({"request_id": f"bench-{i}", "status": 200, "ttft_s": t, "prompt_tokens": n,
                        "cached_tokens": c}) for i, (n, c, t) in enumerate(rows)
        ))  # fmt: skip

    # never found bench-1's prefix cached; the split run reports pulled KV as cached, which must not count.
    run("never", pd_floor.NEVER, [(12_000, 0, 0.40), (9_000, 8_000, 0.05)])
    run("split", "kvroute-pd-conditional", [(12_000, 12_000, 0.50), (9_000, 9_000, 0.30)])
    runs = pd_floor.collect(tmp_path)
    cached = pd_floor.cacheable(runs)
    assert cached == {"bench-0": 0, "bench-1": 8000}
    out = pd_floor.table(runs, cached)
    f0 = pd_floor.floor_seconds(prof, 12_000, 0)
    f1 = pd_floor.floor_seconds(prof, 9_000, 8_000)
    f99 = f1 + (f0 - f1) * 0.99
    p99 = 0.30 + 0.20 * 0.99
    assert "| split | 2 | " in out and f"| {p99:.3f} | {f99:.3f} | {p99 - f99:+.3f} |" in out
    assert pd_floor.main([str(tmp_path / "split")]) == 2  # no never run there: no floor
