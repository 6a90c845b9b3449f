"""``kvroute plan``'s aggregated ITL estimate (extproc/plan.py): a prefill chunk shares the decodes'
step, so a request's mean gap is t(B90) + X·w/(o − 1), X the prefills run while it decodes, a
generalized Poisson count whose 90th percentile sets the estimate."""

from __future__ import annotations

import math
import re

import pytest

from extproc import plan as planner

H100 = planner.Profile(
    base_ms=6.2,
    prefill_ms_per_token=0.021,
    decode_ms_per_seq=0.022,
    decode_ms_per_kctx=0.050,
    attn_ms_quadratic=1.17,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    api_overhead_ms=5.0,
)
MEMORY = planner.Memory(accelerator_gib=80, weights_gib=15, kv_bytes_per_token=131_072)


def workload(rate: float = 7.0, prompt: float = 6000, output: float = 16) -> planner.Workload:
    return planner.Workload(rate, prompt, output, 0.0, 0.0, "test")


def borel_tanner_quantile(theta: float, lam: float, q: float = 0.9) -> int:
    """The same count summed another way: a Poisson(θ) number k of starters, each busy period of k
    starters serving n in all with the Borel-Tanner probability k/n · e^(−λn) (λn)^(n−k) / (n − k)!."""
    cdf, n = math.exp(-theta), 0
    while cdf < q:
        n += 1
        cdf += sum(
            math.exp(-theta + k * math.log(theta) - math.lgamma(k + 1))  # P(k starters)
            * k / n * math.exp(-lam * n + (n - k) * math.log(lam * n) - math.lgamma(n - k + 1))
            for k in range(1, n + 1)
        )  # fmt: skip
    return n


@pytest.mark.parametrize(("theta", "lam"), [(0.8, 0.3), (2.6, 0.5), (1.1, 0.29), (12.0, 0.6)])
def test_generalized_poisson_quantile_is_the_busy_period_count(theta: float, lam: float) -> None:
    assert planner.generalized_poisson_quantile(theta, lam) == borel_tanner_quantile(theta, lam)


def test_generalized_poisson_edges() -> None:
    assert planner.generalized_poisson_quantile(0.0, 0.5) == 0
    assert planner.generalized_poisson_quantile(2.0, 0.0) == 4  # plain Poisson(2): P(X <= 3) = 0.857, P(<= 4) = 0.947
    with pytest.raises(planner.PlanError, match="faster than a pod runs them"):
        planner.generalized_poisson_quantile(1.0, 1.0)


def test_without_prefills_the_gap_is_the_decode_step() -> None:
    est = planner.itl_aggregated(workload(rate=1e-6), H100, 0.0, 1, streams=4.0)
    assert est.p90 == 0 and est.itl_s == pytest.approx(est.step_s)
    assert est.step_s == pytest.approx(H100.step_s(planner.p90_streams(4.0), 6008))


def test_one_pod_takes_every_arrival_and_more_pods_take_fewer_while_prefilling() -> None:
    """One pod: λ_busy = λ. Three pods at the same per-pod rate: λ·ρ² while it prefills (kvroute sends a
    prefill to a pod that is not prefilling), so fewer prefills land in a stream's decode."""
    one = planner.itl_aggregated(workload(rate=3.5), H100, 0.0, 1, streams=2.0)
    assert one.rate_busy == one.rate == pytest.approx(3.5)
    s = H100.prefill_s(6000, 0, 6000)
    rho, wait = 3.5 * s, 3.5 * s * s / (2 * (1 - 3.5 * s))
    assert one.work_s == pytest.approx((0.021 * 6000 + 1.17 * 6000 * 3000 / 1e6) / 1000)
    assert one.seeds == pytest.approx(3.5 * (wait + s) + 3.5 * 15 * one.step_s)
    assert one.mean == pytest.approx(one.seeds / (1 - 3.5 * one.work_s))
    assert one.itl_s == pytest.approx(one.step_s + one.p90 * one.work_s / 15)
    three = planner.itl_aggregated(workload(rate=10.5), H100, 0.0, 3, streams=2.0)
    assert three.rate == pytest.approx(3.5) and three.rate_busy == pytest.approx(3.5 * rho**2)
    assert three.p90 < one.p90 and three.itl_s < one.itl_s


def test_the_old_mean_model_under_planned_and_this_one_prices_the_prefill_steps() -> None:
    """The plan_check case (bench/RESULTS.md): 7 req/s of 6000-token prompts, 16 output tokens, 2 pods.
    t(B90) / (1 − ρ) said 17.5 ms where the simulator measured 37.8 ms p90; three prefills stretch the
    90th-percentile request's 15 gaps by 147 ms: 7.8 + 3 x 147.1 / 15 = 37.2 ms."""
    t = planner.Targets(ttft_p90_s=0.5, itl_s=0.05)
    opt = planner.aggregated(workload(), H100, MEMORY, t)
    assert opt.prefill_pods == 2 and opt.prefills_while_decoding_p90 == 3
    assert opt.itl_s * 1e3 == pytest.approx(37.2, abs=0.2)
    # A 30 ms target needs a third pod: fewer prefills per pod and fewer land in a stream's decode.
    tight = planner.aggregated(workload(), H100, MEMORY, planner.Targets(0.5, 0.03))
    assert tight.prefill_pods == 3 and tight.itl_s <= 0.03


def test_the_plan_shows_the_arithmetic_and_it_adds_up() -> None:
    t = planner.Targets(ttft_p90_s=0.5, itl_s=0.05)
    r = planner.plan(workload(), H100, MEMORY, t)
    text = "\n".join(planner.explain(r, H100, MEMORY))
    m = re.search(r"mean gap is t\(B90\) \+ X x w / \(o - 1\) = ([\d.]+) \+ (\d+) x ([\d.]+) / (\d+) ms", text)
    assert m is not None, text
    step, x, work, gaps = float(m[1]), int(m[2]), float(m[3]), int(m[4])
    assert (step + x * work / gaps) / 1e3 == pytest.approx(r["aggregated"]["itl_s"], abs=1e-4)
    assert f"90th percentile {x}" in text and "generalized Poisson" in text
    assert r["aggregated"]["prefills_while_decoding_p90"] == x and r["pd"]["prefills_while_decoding_p90"] == 0
