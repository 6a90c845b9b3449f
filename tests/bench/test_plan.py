"""``kvroute plan`` (extproc/plan.py): its arithmetic, its inputs and errors, and a tiny simulated
check (bench/plan_check.py) that the planned count meets the targets and one pod fewer does not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import plan_check
from bench.sim.profiles import H100_LLAMA8B
from extproc import cli
from extproc import plan as planner

MODEL_ARGS = ["--kv-bytes-per-token", "131072", "--weights-gib", "15", "--accelerator-gib", "80"]


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "h100.json"
    assert plan_check.main(["--export-profile", "h100-llama8b", "-o", str(path)]) == 0
    return path


def fresh_6k(profile: Path, ttft_ms: int) -> list[str]:
    """7 req/s of fresh 6000-token prompts with 16 output tokens, a 50 ms ITL target."""
    return ["--profile", str(profile), "--rate", "7", "--prompt-tokens", "6000", "--output-tokens", "16",
            *MODEL_ARGS, "--ttft-p90-ms", str(ttft_ms), "--itl-ms", "50"]  # fmt: skip


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_arithmetic(profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """7 req/s of fresh 6000-token prompts: one prefill is 0.021 x 6000 + 1.17 x 6000 x 3000 / 1e6
    + 6.2 + 5 ms API = 158.3 ms; one pod would be 111 % busy, two are 55 % busy."""
    rc, out, _ = run_plan(
        capsys,
        *fresh_6k(profile, ttft_ms=500),
        "--json",
    )
    assert rc == 0
    r = json.loads(out)
    s = (0.021 * 6000 + 1.17 * 6000 * 3000 / 1e6 + 6.2 + 5.0) / 1000
    assert r["prefill_s_per_request"] == pytest.approx(s)
    assert r["kv_tokens_per_pod"] == int((80 * 0.9 - 15) * 2**30 / 131072) == 466_944
    assert r["prefill_tokens_per_s"] == 42_000
    assert r["decode_streams"] == pytest.approx(7 * 16 * 0.05)
    agg = r["aggregated"]
    assert agg["prefill_pods"] == 2 and agg["prefill_utilization"] == pytest.approx(7 * s / 2)
    rho = 7 * s / 2
    assert agg["ttft_p90_s"] == pytest.approx(s + math.log(10) * rho * s / (2 * (1 - rho)))
    assert r["pd"]["prefill_pods"] == 2 and r["pd"]["decode_pods"] == 1
    # ITL is a 90th-percentile target: the step is priced at the 90th percentile of a Poisson count
    # of streams (5.6 on the one decode pod: 5.6 + 1.28 x sqrt(5.6)), not at the mean.
    b90 = 5.6 + 1.2816 * math.sqrt(5.6)
    assert r["pd"]["itl_s"] == pytest.approx((6.2 + 0.022 * b90 + 0.05 * b90 * 6.008) / 1000)
    # Streams a decode pod carries within 50 ms at ~6008 tokens of context: (50 - 6.2) / (0.022 + 0.05 x 6.008).
    assert r["capacity_config"]["max_streams_per_pod"] == math.floor((50 - 6.2) / (0.022 + 0.05 * 6.008))
    # A tighter TTFT target needs more prefill pods: 200 ms leaves 41.7 ms of p90 wait, rho <= 0.186,
    # 7 x 0.158 / 0.186 -> 6 pods. The human output shows the arithmetic.
    _, out, _ = run_plan(
        capsys,
        *fresh_6k(profile, ttft_ms=200),
    )
    assert "aggregated: 6 pods" in out
    assert "(80 GiB x 0.9 - 15 GiB weights) / 131,072 B per token = 466,944 tokens" in out


def test_reuse_is_bounded_by_the_caches(profile: Path) -> None:
    p = planner.Profile.load(profile)
    w = planner.Workload(10, 4000, 100, 0.8, 2_000_000, "t")
    m = planner.Memory(80, 15, 131072)
    assert planner.hit_rate(w, 466_944 * 2) == pytest.approx(0.8 * 933_888 / 2_000_000)
    assert planner.hit_rate(w, 10**7) == 0.8
    # More reuse, fewer pods.
    t = planner.Targets(1.0, 0.05)
    fresh = planner.aggregated(planner.Workload(20, 8000, 100, 0.0, 0, "t"), p, m, t)
    reused = planner.aggregated(planner.Workload(20, 8000, 100, 0.9, 1_000_000, "t"), p, m, t)
    assert reused.prefill_pods < fresh.prefill_pods


def test_a_trace_is_replayed_through_an_lru_cache(
    tmp_path: Path, profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"timestamp": i * 500, "input_length": 2048, "output_length": 10, "hash_ids": [1, 2, 3, 10 + i]}
        for i in range(20)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    w = planner.Workload.from_trace(trace)
    assert w.rate == pytest.approx(2.0) and w.prompt_tokens == 2048
    assert w.reuse == pytest.approx(19 * 3 / 20 / 4)  # every later request hits its first three blocks
    assert planner.hit_rate(w, 512 * 100) == pytest.approx(w.reuse)
    assert planner.hit_rate(w, 512 * 3) == 0  # the fresh last block evicts the shared ones each time
    rc, out, _ = run_plan(
        capsys, "--profile", str(profile), "--trace", str(trace), *MODEL_ARGS, "--ttft-p90-ms", "500", "--itl-ms", "50"
    )
    assert rc == 0 and "LRU cache" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "5"], "without --trace, give --prompt-tokens, --output-tokens"),
        (["--rate", "5", "--prompt-tokens", "100", "--output-tokens", "10", "--prefix-reuse", "2"], "--prefix-reuse"),
        (["--rate", "0", "--prompt-tokens", "100", "--output-tokens", "10"], "--rate must be a positive number"),
        (
            ["--rate", "5", "--prompt-tokens", "100", "--output-tokens", "10", "--accelerator-gib", "10"],
            "no room for KV",
        ),
    ],
)
def test_bad_inputs_are_named(profile: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    base = ["--profile", str(profile), *MODEL_ARGS, "--ttft-p90-ms", "500", "--itl-ms", "50"]
    rc, _, err = run_plan(capsys, *base, *args)
    assert rc == 2 and message in err and "Traceback" not in err


def test_a_profile_file_missing_fields_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"base_ms": 6.2}))
    rc, _, err = run_plan(
        capsys,
        "--profile",
        str(bad),
        "--rate",
        "1",
        "--prompt-tokens",
        "10",
        "--output-tokens",
        "1",
        *MODEL_ARGS,
        "--ttft-p90-ms",
        "500",
        "--itl-ms",
        "50",
    )
    assert rc == 2 and "missing or not numbers: prefill_ms_per_token" in err
    assert planner.Profile.load_dict(
        json.loads((tmp_path / "p.json").read_text()) | {k: getattr(H100_LLAMA8B, k) for k in planner.PROFILE_FIELDS}
    )


@pytest.mark.integration
def test_simulated_fleet_meets_the_targets_at_the_planned_count_only(capsys: pytest.CaptureFixture[str]) -> None:
    """4 s of 7 req/s of 6000-token prompts on simulated H100 pods: 2 planned; 2 meet TTFT p90 500 ms,
    1 (overloaded: 111 % prefill utilisation) does not."""
    assert plan_check.main(["--duration", "4", "--layout", "aggregated", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["plan"]["prefill_pods"] == 2
    planned, fewer = res["runs"]
    assert planned["pods"] == 2 and planned["holds"], planned
    assert fewer["pods"] == 1 and not fewer["holds"], fewer


@pytest.mark.integration
def test_simulated_pd_fleet_meets_the_targets_at_the_planned_counts_only(capsys: pytest.CaptureFixture[str]) -> None:
    """P/D, 10 s of 8 req/s of 4000-token prompts and 400-token answers on simulated H100 pods, kvroute
    splitting every request: 2 prefill + 2 decode planned and meeting TTFT p90 300 ms and ITL 13 ms;
    one prefill pod fewer misses TTFT, one decode pod fewer misses ITL."""
    args = ["--rate", "8", "--prompt-tokens", "4000", "--output-tokens", "400", "--ttft-p90-ms", "300",
            "--itl-ms", "13", "--duration", "10", "--layout", "pd", "--json"]  # fmt: skip
    assert plan_check.main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["pd_plan"]["prefill_pods"], res["pd_plan"]["decode_pods"]) == (2, 2) and "plan" not in res
    planned, fewer_prefill, fewer_decode = res["pd_runs"]
    assert (planned["pods"], planned["decode_pods"]) == (2, 2) and planned["holds"], planned
    assert (fewer_prefill["pods"], fewer_prefill["decode_pods"]) == (1, 2) and not fewer_prefill["ttft_holds"]
    assert (fewer_decode["pods"], fewer_decode["decode_pods"]) == (2, 1) and not fewer_decode["itl_holds"]
