"""Report: summary rows from client records and pod deltas, and the files written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.loadgen import Record

POD = {"requests": 0, "busy_s": 0.0, "prefix_queries_tokens": 0, "prefix_hits_tokens": 0, "prompt_tokens": 0,
       "preemptions": 0}  # fmt: skip


def _rec(ttft: float, gaps: list[float], ok: bool = True) -> Record:
    return Record(tag="", status=200 if ok else 503, ttft=ttft, e2e=ttft + sum(gaps), itl=gaps,
                  output_chunks=len(gaps) + 1 if ok else 0, error=None if ok else "HTTP 503")  # fmt: skip


def test_pod_deltas() -> None:
    before = [{**POD, "busy_s": 1.0, "requests": 2}]
    after = [{**POD, "busy_s": 3.5, "requests": 7}]
    assert report.pod_deltas(before, after)[0]["busy_s"] == 2.5
    assert report.pod_deltas(before, after)[0]["requests"] == 5


def test_has_content_skips_role_only_chunks() -> None:
    from bench.loadgen import _has_content

    assert not _has_content({"choices": [{"delta": {"role": "assistant"}}]})
    assert not _has_content({"choices": [], "usage": {"prompt_tokens": 3}})
    assert _has_content({"choices": [{"delta": {"content": "hi"}}]})
    assert _has_content({"choices": [{"text": "hi"}]})


def test_summarize() -> None:
    # First token at 210 ms, then 2 tokens 20 ms apart; one failed request.
    recs = [_rec(0.21, [0.02, 0.02]) for _ in range(4)] + [_rec(0.01, [], ok=False)]
    pods = [{**POD, "busy_s": 3.0, "prefix_queries_tokens": 100, "prefix_hits_tokens": 60},
            {**POD, "busy_s": 1.0, "prefix_queries_tokens": 100, "prefix_hits_tokens": 20}]  # fmt: skip
    run = report.summarize("p", "s", recs, pods, wall_s=2.0, ideal_hit_rate=0.9, extra={"x": 1})
    r = run.row
    assert r["requests"] == 5 and r["errors"] == 1 and r["error_samples"] == ["HTTP 503"]
    assert r["ttft_p50_s"] == pytest.approx(0.21)
    assert r["itl_p50_s"] == pytest.approx(0.02)
    assert r["output_tok_s"] == pytest.approx(4 * 3 / 2.0)
    assert r["hit_rate"] == pytest.approx(0.4)
    assert r["load_imbalance"] == pytest.approx(1.5)
    assert r["x"] == 1 and len(run.ttfts) == 4


def test_write_results_files(tmp_path: Path) -> None:
    pods = [{**POD, "busy_s": 1.0, "requests": 3}, {**POD, "busy_s": 2.0, "requests": 1}]
    ok = report.summarize("round-robin", "demo", [_rec(0.01, [0.1, 0.01])] * 3, pods, wall_s=1, ideal_hit_rate=0.5)
    ok.row["cpu_cores"] = {"sim": 0.3, "client": 0.1}
    failed = report.PolicyRun({"policy": "vllm-router", "scenario": "demo", "failed": "exited 1"})
    paths = report.write(tmp_path, [ok, failed], {"scenario": "demo", "pods": 2})
    names = {p.name for p in paths}
    assert {"results.json", "results.md", "ttft_cdf.png", "hit_rate.png", "pod_load.png"} <= names
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    rows = json.loads((tmp_path / "results.json").read_text())
    keys = {"policy", "scenario", "requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s",
            "itl_p99_s", "e2e_p50_s", "output_tok_s", "hit_rate", "ideal_hit_rate", "load_imbalance"}  # fmt: skip
    assert keys <= rows[0].keys()
    md = (tmp_path / "results.md").read_text()
    assert "| round-robin | 3 | 0 |" in md
    assert "vllm-router | failed to start: exited 1" in md
    assert "3 / 1" in md and "sim 0.30" in md


def test_ttft_split_subtracts_the_pods_own_time_from_the_clients() -> None:
    pods = [{**POD, "ttft_sum_s": 0.3, "ttft_count": 3}, {**POD, "ttft_sum_s": 0.1, "ttft_count": 1}]
    split = report.ttft_split([0.2, 0.1, 0.15, 0.15], pods)
    assert split["ttft_mean_s"] == pytest.approx(0.15)
    assert split["pod_ttft_mean_s"] == pytest.approx(0.1)
    assert split["path_ttft_mean_s"] == pytest.approx(0.05)
    # Pods twice as slow report wall seconds (0.2 s a request); the client's TTFTs are in pod time already.
    slow = [{**p, "ttft_sum_s": 2 * p["ttft_sum_s"]} for p in pods]
    assert report.ttft_split([0.2, 0.1, 0.15, 0.15], slow, time_scale=2.0) == pytest.approx(split)
    # P/D fleets (two legs per request) and pods that do not report it: no split.
    assert report.ttft_split([0.2], [{**pods[0], "role": "prefill"}, {**pods[1], "role": "decode"}]) == {}
    assert report.ttft_split([0.2], [POD]) == {}


def test_where_the_ttft_went_per_request() -> None:
    """The pods' own figures joined to the client's records: per-request medians of the pod's wait, its TTFT and
    the path (client less pod); a table in results.md; nothing where no pod reported them."""
    recs = [_rec(t, [0.02]) for t in (0.10, 0.12, 0.14, 0.30)] + [_rec(0.5, [], ok=False)]
    for r, (wait, pod) in zip(recs, [(0.0, 0.095), (0.01, 0.11), (0.02, 0.13), (0.2, 0.29)], strict=False):
        r.request_id, r.pod_wait, r.pod_ttft = "x", wait, pod
    recs.append(_rec(0.11, [0.02]))  # no pod figures: not timed
    run = report.summarize("kvroute-approx", "s", recs, [POD], wall_s=1.0, ideal_hit_rate=0.5)
    r = run.row
    assert r["timed_requests"] == 4
    assert r["pod_wait_p50_s"] == pytest.approx(0.015)
    assert r["pod_ttft_p50_s"] == pytest.approx(0.12)
    assert r["pod_ttft_p90_s"] == pytest.approx(0.242)  # 0.13 + 0.7 x (0.29 - 0.13)
    assert r["path_ttft_p50_s"] == pytest.approx(0.01)  # paths 5, 10, 10, 10 ms
    assert r["path_ttft_p90_s"] == pytest.approx(0.01)
    md = report.markdown([r], {"scenario": "s"})
    assert "| kvroute-approx | 4 | " in md and "pod's wait before its first step p50 s" in md
    untimed = report.summarize("sglang-router", "s", [_rec(0.1, [0.02])], [POD], wall_s=1.0, ideal_hit_rate=0.5).row
    assert "timed_requests" not in untimed
    assert "pod's wait" not in report.markdown([untimed], {"scenario": "s"})
