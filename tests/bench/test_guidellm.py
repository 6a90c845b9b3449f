"""bench.guidellm: guidellm as the load generator against the bench's routers, its report read into
``bench run``'s rows, and a tokenizer that counts guidellm's text as the simulated pods do."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer

from bench import guidellm, harness, report, results
from bench.sim.tokenizer import HFTokenizer, SimTokenizer

# Faker-style text: capitalised sentences of lorem words, a number prefix as guidellm writes it.
WORDS = ["suggest", "shake", "effort", "many", "last", "prepare", "small", "maintain", "hope", "parent"]
TEXT = "0 12 m0 Suggest shake effort many last. Prepare small hope.\nMaintain parent many effort small."


def test_guidellm_text_counts_as_many_tokens_as_at_the_pods(tmp_path: Path) -> None:
    sim = SimTokenizer()
    tok = Tokenizer.from_file(str(guidellm.build_tokenizer(WORDS, tmp_path / "g") / "tokenizer.json"))
    ids = tok.encode(TEXT).ids
    assert len(ids) == len(sim.encode(TEXT))
    # guidellm cuts a prompt to N tokens by decoding the first N ids: that text is N tokens at the pods.
    for n in (5, 11, len(ids)):
        cut = tok.decode(ids[:n])
        assert TEXT.startswith(cut) and len(sim.encode(cut)) == n
    plain = HFTokenizer(str(harness.precise_tokenizer(tmp_path / "p")))  # the bench's words only
    assert len(plain.encode(TEXT)) > 2 * len(sim.encode(TEXT))  # one token a byte: lengths far off


def test_newlines_split_alike_at_the_pods_and_in_the_export(tmp_path: Path) -> None:
    """A newline is a piece of its own at the pods, as the exported tokenizer's pre-tokenizer splits it: the
    same ids for message text with line breaks (guidellm's), so kvroute-precise's keys match the pods'."""
    text = TEXT + "\n\nShake many. \n Hope   \nlast"
    pieces = guidellm.tokenizer_pieces(WORDS)
    export = harness.precise_tokenizer(tmp_path / "p", extra_pieces=pieces)
    sim = SimTokenizer()
    assert HFTokenizer(str(export)).encode(text) == sim.encode(text)
    assert sim.encode("a\nB") == sim.encode("a") + sim.encode("\n") + sim.encode("B")
    # The bench's own words only: guidellm's are a token per byte there, so keys would never match.
    assert HFTokenizer(str(harness.precise_tokenizer(tmp_path / "q"))).encode(text) != sim.encode(text)


def _stat(p50: float, p90: float, p99: float, count: int = 3, total: float = 0.0) -> dict[str, Any]:
    return {"successful": {"count": count, "total_sum": total, "percentiles": {"p50": p50, "p90": p90, "p99": p99}}}


def report_doc(successful: int = 3, errored: int = 1) -> dict[str, Any]:
    metrics = {
        "request_totals": {"successful": successful, "errored": errored, "incomplete": 0,
                           "total": successful + errored},
        "time_to_first_token_ms": _stat(20.0, 40.0, 90.0, count=successful),
        "inter_token_latency_ms": _stat(5.0, 7.0, 9.0),
        "request_latency": _stat(0.5, 0.8, 1.0),
        "output_token_count": _stat(32, 32, 32, total=96.0),
        "prompt_token_count": _stat(8360, 8400, 8420),
    }  # fmt: skip
    return {"benchmarks": [{"metrics": metrics, "duration": 2.0, "requests": {"successful": requests(0.1, 0.4)}}]}


def requests(*offsets: float, start: float = 1.8e9) -> list[dict[str, Any]]:
    """Request records as guidellm writes them: each one's arrival target, and the scheduler's start."""
    return [{"info": {"scheduler_start_time": start, "timings": {"targeted_start": start + o}}} for o in offsets]


def test_report_becomes_a_routing_row(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report_doc()))
    row = guidellm.parse_report(path)
    assert row["requests"] == 4 and row["errors"] == 1
    assert (row["ttft_p50_s"], row["ttft_p90_s"], row["ttft_p99_s"]) == pytest.approx((0.02, 0.04, 0.09))
    assert row["itl_p50_s"] == pytest.approx(0.005) and row["e2e_p50_s"] == pytest.approx(0.5)
    assert row["output_tok_s"] == pytest.approx(48.0) and row["throughput_rps"] == pytest.approx(1.5)
    assert row["prompt_tokens_p50"] == 8360 and row["off_schedule"] == 0


def test_requests_aimed_before_guidellms_start_are_counted() -> None:
    """guidellm's Poisson offset left at its initial -1 s: arrival targets near 0, long before the start."""
    doc = report_doc()["benchmarks"][0]
    doc["requests"] = {"successful": requests(0.1, 0.2), "errored": [*requests(0.3), *requests(-0.86, start=0.0)]}
    assert guidellm.off_schedule(doc) == 0
    doc["requests"]["incomplete"] = [{"info": {"scheduler_start_time": 1.8e9, "timings": {"targeted_start": 28.2}}}]
    assert guidellm.off_schedule(doc) == 1


def test_a_report_without_successes_or_benchmarks_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report_doc(successful=0, errored=4)))
    with pytest.raises(guidellm.GuidellmError, match="no successful request"):
        guidellm.parse_report(path)
    path.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(guidellm.GuidellmError, match="expected one benchmark, found 0"):
        guidellm.parse_report(path)


def test_hit_rate_and_balance_from_the_pods_counters() -> None:
    pods = [{"prefix_queries_tokens": 100, "prefix_hits_tokens": 60, "busy_s": 3.0, "requests": 2},
            {"prefix_queries_tokens": 100, "prefix_hits_tokens": 20, "busy_s": 1.0, "requests": 1}]  # fmt: skip
    got = guidellm.hit_and_balance(pods)
    assert got["hit_rate"] == pytest.approx(0.4) and got["load_imbalance"] == pytest.approx(1.5)


def test_guidellm_command_names_the_router_tokenizer_and_rate(tmp_path: Path) -> None:
    args = guidellm.guidellm_args(Path("g"), "http://127.0.0.1:1", tmp_path, "kind=x", 2.5, 10, 7, tmp_path / "o.json")
    s = " ".join(args)
    assert "kind=openai_http,target=http://127.0.0.1:1,model=sim-model" in s
    assert f"kind=hf_auto,model={tmp_path}" in s and "kind=poisson,rate=2.5" in s
    assert "kind=max_requests,count=10" in s and "kind=static,value=7" in s and f"path={tmp_path}/o.json" in s


@pytest.mark.integration
@pytest.mark.slow
def test_guidellm_drives_kvroute_and_results_import_it(tmp_path: Path) -> None:
    if not guidellm.GUIDELLM.exists():
        pytest.skip("guidellm is not installed (make guidellm)")
    data = "kind=synthetic_text,prefix_tokens=200,prefix_count=2,prompt_tokens=40,output_tokens=4"
    out = tmp_path / "out"
    rc = guidellm.main(["--policies", "kvroute-approx", "--data", data, "--rate", "4", "--requests", "6",
                        "--pods", "2", "--profile", "fast", "--out", str(out)])  # fmt: skip
    assert rc == 0
    (row,) = json.loads((out / "results.json").read_text())
    assert row["policy"] == "kvroute-approx" and row["requests"] == 6 and row["errors"] == 0
    assert row["ttft_p50_s"] > 0 and 0 < row["hit_rate"] < 1  # the shared prefixes hit at the pods
    assert sum(p["requests"] for p in row["pods"]) == 6
    assert row["prompt_tokens_p50"] >= 240  # prefix + prompt, counted at the pods (chat tags on top)
    h = results.import_routing(out)
    assert h["rows"][0]["policy"] == "kvroute-approx" and "guidellm" in h["title"]


def test_missing_guidellm_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert guidellm.main(["--guidellm", str(tmp_path / "guidellm"), "--out", str(tmp_path / "out")]) == 2
    assert "make guidellm" in capsys.readouterr().err


def test_a_run_sent_off_schedule_is_run_again(monkeypatch: pytest.MonkeyPatch) -> None:
    late = iter([39, 0, *[5] * guidellm.OFF_SCHEDULE_TRIES])

    def once(policy: str, *_: object) -> report.PolicyRun:
        return report.PolicyRun({"policy": policy, "off_schedule": next(late)})

    monkeypatch.setattr(guidellm, "run_once", once)
    cfg, setup = object(), object()
    assert guidellm.run_policy("kvroute-approx", cfg, setup).row["off_schedule"] == 0  # type: ignore[arg-type]
    with pytest.raises(guidellm.GuidellmError, match="off its Poisson schedule"):
        guidellm.run_policy("kvroute-approx", cfg, setup)  # type: ignore[arg-type]


def test_repeat_interleaves_rounds_and_reports_medians(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "guidellm"
    exe.write_text("")
    order: list[tuple[str, str]] = []
    p50 = {"kvroute-approx": iter([0.030, 0.050, 0.040]), "sglang-router": iter([0.020, 0.022, 0.021])}

    def run(
        policy: str, cfg: object, s: object, tries: int = guidellm.OFF_SCHEDULE_TRIES, tag: str = ""
    ) -> report.PolicyRun:
        order.append((policy, tag))
        return report.PolicyRun(
            {"policy": policy, "scenario": "guidellm", "requests": 6, "ttft_p50_s": next(p50[policy])}
        )

    monkeypatch.setattr(guidellm, "run_policy", run)
    monkeypatch.setattr(guidellm, "faker_text", lambda _: SimpleNamespace(chars_per_token=5.8, words=WORDS))
    monkeypatch.setattr(guidellm, "build_tokenizer", lambda words, where: tmp_path)
    out = tmp_path / "out"
    assert guidellm.main(["--guidellm", str(exe), "--repeat", "3", "--out", str(out)]) == 0
    # One policy after the other in each round, the rounds one after the other; each round's report its own.
    assert order == [(p, f".{k}") for k in (1, 2, 3) for p in ("kvroute-approx", "sglang-router")]
    rows = {r["policy"]: r for r in json.loads((out / "results.json").read_text())}
    assert rows["kvroute-approx"]["ttft_p50_s"] == pytest.approx(0.040) and rows["kvroute-approx"]["repeats"] == 3
    assert rows["kvroute-approx"]["spread"]["ttft_p50_s"] == pytest.approx([0.030, 0.050])
    assert rows["sglang-router"]["ttft_p50_s"] == pytest.approx(0.021)
    assert json.loads((out / "run.json").read_text())["repeat"] == 3


def test_repeat_below_one_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        guidellm.main(["--repeat", "0", "--out", str(tmp_path / "out")])
    assert "--repeat must be 1 or more" in capsys.readouterr().err
