"""Measured prefill capacity (extproc/capacity.py): uncached prompt tokens per second of prefill busy
time, from the pods' scraped counters; its fallback to the cost model, the pin's precedence, the
exported source; and, against a simulated pod (bench.sim), that it reads what the pod sustains."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import astuple, dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench import loadgen, ramp, workloads
from bench.sim import Fleet, FleetConfig
from extproc.capacity import PACE_MIN_PREFILLS, PACE_REFRESH_S, CapacityCollector, CapacityTracker, _union
from extproc.config import build_config
from extproc.endpoints.metrics import MetricsScraper, PodMetrics
from extproc.endpoints.pool import Registry
from tests.polling import eventually
from tests.unit.test_capacity import PODS, Clock, setup, signal
from tests.unit.test_metrics_scrape import FakePod, pods  # noqa: F401 - the fixture


@dataclass(frozen=True)
class Req:
    """One request as the pod sees it: arrival (its TTFT starts), first token, prompt and cached tokens."""

    arrival: float
    first_token: float
    prompt: int
    cached: int = 0


def scraped(reqs: Iterable[Req], at: float) -> PodMetrics:
    """The pod's counters at ``at``, as vLLM keeps them: prompt tokens and TTFT at the first token,
    prefix-cache hits when the request is scheduled (here: at arrival)."""
    done = [r for r in reqs if r.first_token <= at]
    return PodMetrics(
        prefix_cache_hits=float(sum(r.cached for r in reqs if r.arrival <= at)),
        prompt_tokens=float(sum(r.prompt for r in done)),
        ttft_sum_s=sum(r.first_token - r.arrival for r in done),
        ttft_count=float(len(done)),
    )


def feed(tracker: CapacityTracker, clock: Clock, reqs: list[Req], until_t: float, pod: str = PODS[0]) -> None:
    """Scrape ``pod`` every 0.1 s from 1000 s (the tests' clock) to ``until_t``."""
    for i in range(round((until_t - 1000) / 0.1) + 1):
        clock.t = 1000 + i * 0.1
        tracker.on_scrape(pod, scraped(reqs, clock.t), clock.t)


def one_at_a_time(n: int, every: float = 0.5, ttft: float = 0.1, prompt: int = 4000) -> list[Req]:
    return [Req(1000.03 + i * every, 1000.03 + i * every + ttft, prompt) for i in range(n)]


def test_one_prefill_at_a_time_reads_tokens_per_busy_second_not_per_elapsed_second() -> None:
    """4000 tokens in 0.1 s every 0.5 s: 40k tokens/s busy, though the pod computes only 8k a second."""
    tracker, _, clock = setup({"window_s": 30})
    feed(tracker, clock, one_at_a_time(40), 1020.5)
    sig = signal(tracker)
    assert sig.prefill_source == "measured" and sig.measured_prefills == 40
    assert sig.per_pod["prefill_tokens_per_s"] == pytest.approx(40_000, rel=0.02)


def test_prefills_batched_together_count_their_shared_time_once() -> None:
    """Pairs arriving together, both first tokens 0.2 s later (one step, as vLLM batches them): the
    pod computed 8000 tokens in 0.2 s. A sum of the requests' times would count 0.4 s (20k/s)."""
    reqs = [Req(1000.03 + i, 1000.23 + i, 4000) for i in range(15) for _ in range(2)]
    tracker, _, clock = setup({"window_s": 30})
    feed(tracker, clock, reqs, 1016)
    assert signal(tracker).per_pod["prefill_tokens_per_s"] == pytest.approx(40_000, rel=0.02)


def test_a_saturated_pod_reads_its_throughput() -> None:
    """Requests queue back to back (each waits for the one before): the spans cover the whole time, so
    busy time is the elapsed time and the figure is what the pod got through, 4000 / 0.1 s."""
    reqs = [Req(1000.0, 1000.1 + 0.1 * i, 4000) for i in range(100)]
    tracker, _, clock = setup({"window_s": 30})
    feed(tracker, clock, reqs, 1011)
    assert signal(tracker).per_pod["prefill_tokens_per_s"] == pytest.approx(40_000, rel=0.03)


def test_prefix_cache_hits_are_not_prefill_work() -> None:
    """Half of each prompt cached: 2000 uncached tokens in 0.1 s is 20k/s."""
    reqs = [Req(r.arrival, r.first_token, r.prompt, cached=2000) for r in one_at_a_time(30)]
    tracker, _, clock = setup({})
    feed(tracker, clock, reqs, 1016)
    assert signal(tracker).per_pod["prefill_tokens_per_s"] == pytest.approx(20_000, rel=0.02)


def test_the_cost_model_until_enough_prefills_then_measured_and_the_pin_wins() -> None:
    tracker, _, clock = setup({"window_s": 30, "measured_min_prefills": 20})
    reqs = one_at_a_time(19)
    feed(tracker, clock, reqs, 1010)
    assert signal(tracker).prefill_source == "cost_model"  # 19 < 20
    feed(tracker, clock, [*reqs, Req(1010.03, 1010.13, 4000)], 1010.5)
    assert signal(tracker).prefill_source == "measured"
    clock.t += 31  # the window moved past them all: back to the cost model
    assert signal(tracker).prefill_source == "cost_model"

    pinned, _, clock = setup({"prefill_tokens_per_s": 12_345})
    feed(pinned, clock, one_at_a_time(40), 1020.5)
    sig = signal(pinned)
    assert sig.prefill_source == "pinned" and sig.per_pod["prefill_tokens_per_s"] == 12_345
    assert sig.measured_prefills == 40  # measured all the same, for the operator to compare

    off, _, clock = setup({"measured": False})
    feed(off, clock, one_at_a_time(40), 1020.5)
    assert signal(off).prefill_source == "cost_model" and signal(off).measured_prefills == 0


def test_counters_that_go_back_are_a_restart_not_negative_work() -> None:
    tracker, _, clock = setup({})
    reqs = one_at_a_time(30)
    feed(tracker, clock, reqs, 1016)
    before = tracker.measured("p", "both")
    clock.t = 1016.1
    tracker.on_scrape(PODS[0], PodMetrics(prompt_tokens=0.0, ttft_sum_s=0.0, ttft_count=0.0), 1016.1)  # restarted
    after = tracker.measured("p", "both")
    assert after == before and after.tokens_per_s == pytest.approx(40_000, rel=0.02)
    # A vLLM that reports none of these keeps the cost model.
    bare, _, clock = setup({})
    for i in range(100):
        bare.on_scrape(PODS[0], PodMetrics(num_requests_running=1.0), 1000 + i * 0.1)
    assert signal(bare).prefill_source == "cost_model"


def test_pods_of_a_role_pool_their_figures_and_removed_pods_are_forgotten() -> None:
    """Two pods, one at 40k/s, one at 20k/s (0.2 s per 4000): tokens over summed busy time, 80k / 3 s."""
    tracker, reg, clock = setup({"window_s": 30})
    feed(tracker, clock, one_at_a_time(10), 1006, pod=PODS[0])
    feed(tracker, clock, one_at_a_time(10, ttft=0.2), 1006, pod=PODS[1])
    assert tracker.measured("p", "both").tokens_per_s == pytest.approx(80_000 / 3, rel=0.02)
    cfg = build_config({"pools": {"p": {"endpoints": [{"address": PODS[1]}]}}})
    reg.apply("p", cfg.pools["p"].endpoints)
    tracker.signals()
    assert PODS[0] not in tracker._scraped and tracker.measured("p", "both").tokens_per_s == pytest.approx(20_000)


def test_prometheus_exports_the_source_and_the_prefills_behind_it() -> None:
    tracker, _, clock = setup({})
    feed(tracker, clock, one_at_a_time(40), 1020.5)
    registry = CollectorRegistry()
    registry.register(CapacityCollector(tracker))
    got = {
        (s.name, s.labels.get("source", "")): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
        if s.name.startswith(("kvroute_capacity_prefill_source", "kvroute_capacity_measured_prefills"))
    }
    assert got == {
        ("kvroute_capacity_prefill_source", "measured"): 1.0,
        ("kvroute_capacity_prefill_source", "pinned"): 0.0,
        ("kvroute_capacity_prefill_source", "cost_model"): 0.0,
        ("kvroute_capacity_measured_prefills", ""): 40.0,
    }


def _fit_gauge(tracker: CapacityTracker) -> list[float]:
    registry = CollectorRegistry()
    registry.register(CapacityCollector(tracker))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return [s.value for f in families for s in f.samples if s.name == "kvroute_cost_model_fit"]


def test_the_cost_models_fit_is_measured_exported_and_warned_of_once(caplog: pytest.LogCaptureFixture) -> None:
    """4000-token prompts prefilled in 0.4 s (10k tokens/s) where routing.cost assumes 20 us a token
    (50k/s, nothing routed here to price a prompt mix): the fit reads 0.2, and the warning says to scale
    routing.cost by 5, once per FIT_WARN_EVERY_S for the pool and role (extproc/capacity.py)."""
    tracker, _, clock = setup({"window_s": 30})
    feed(tracker, clock, one_at_a_time(20, every=1.0), 1005)
    assert signal(tracker).cost_fit is None and _fit_gauge(tracker) == []  # under capacity.measured_min_prefills
    feed(tracker, clock, one_at_a_time(40, every=1.0, ttft=0.4), 1040.5)
    with caplog.at_level("WARNING", logger="kvroute"):
        assert signal(tracker).cost_fit == pytest.approx(0.2, rel=0.03)
        assert _fit_gauge(tracker) == [pytest.approx(0.2, rel=0.03)]
    warned = [r for r in caplog.records if "routing.cost does not fit the pods" in r.getMessage()]
    assert len(warned) == 1 and "by 5.00" in warned[0].getMessage()  # the gauge's evaluation did not warn again
    assert warned[0].fields["pool"] == "p" and warned[0].fields["role"] == "both"


def test_a_cost_model_that_fits_is_not_warned_of_and_prices_the_prompt_mix(caplog: pytest.LogCaptureFixture) -> None:
    """What kvroute sent in the window is priced by the cost model (its context term included); pods that
    prefill at that rate read a fit of 1."""
    tracker, reg, clock = setup({"window_s": 30})
    pod = reg.pools["p"].endpoints[0]
    ttft = tracker.cost().prefill_s(4000, 0)  # what the cost model prices a 4000-token prompt at
    reqs = one_at_a_time(40, every=0.5, ttft=ttft)
    for r in reqs:  # kvroute sent each one
        clock.t = r.arrival
        tracker.observe("p", pod, 4000, 4000)
    clock.t = 1000.0
    with caplog.at_level("WARNING", logger="kvroute"):
        feed(tracker, clock, reqs, 1020.5)
        assert signal(tracker).cost_fit == pytest.approx(1.0, rel=0.05)
    assert not [r for r in caplog.records if "routing.cost does not fit" in r.getMessage()]


def test_union_of_spans() -> None:
    assert _union([]) == 0
    assert _union([(0, 1), (0.5, 2), (3, 4), (3.5, 3.6)]) == pytest.approx(3.0)


async def test_the_scraper_tells_its_listeners_of_every_new_figure(
    pods: tuple[list[FakePod], list[str]],  # noqa: F811 - the fixture
) -> None:
    """Own scrapes and figures taken from a peer alike; a failing listener does not stop the others."""
    ep = pods[1][0]
    seen: list[tuple[str, float | None]] = []

    def broken(ep: str, m: PodMetrics, at: float) -> None:
        raise RuntimeError("a listener's bug")

    scraper = MetricsScraper([ep], interval_s=60)
    scraper.subscribe(broken)
    scraper.subscribe(lambda ep, m, at: seen.append((ep, m.ttft_count)))
    await scraper.start()  # one scrape at once, the next in a minute
    try:
        await eventually(lambda: seen, "the first scrape")
        assert seen == [(ep, 9.0)]  # the fake pod's TTFT count
        assert scraper.offer(ep, astuple(PodMetrics(ttft_count=12.0)), 0.0)
        assert seen == [(ep, 9.0), (ep, 12.0)]
    finally:
        await scraper.aclose()


# -- against the simulator -------------------------------------------------------------------------


def poisson(rate: float, n: int, seed: int = 0) -> Iterator[float]:
    rng, t = random.Random(seed), 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        yield t


@pytest.mark.parametrize(("load", "n"), [(0.3, 20), (0.7, 40)])  # about 8 s each
async def test_measured_capacity_is_what_a_simulated_pod_sustains(load: float, n: int) -> None:
    """A simulated H100 pod (bench.sim) at ``load`` of its prefill capacity, fresh 2000-token prompts,
    scraped every 0.05 s: the measured figure is within 15 % of what bench/ramp.py counts one pod to
    sustain (the profile's prefill time per request, as ``kvroute plan`` computes it). At 70 % the
    pod batches prefills often; a sum of per-request times would read about 0.7 of it there."""
    scale = 2.0  # pod time runs at half speed: steps of tens of ms stay well above the host's jitter
    cfg = ramp.RampConfig(pods=1, profile="h100-llama8b", prompt_tokens=2000, output_tokens=4, time_scale=scale)
    per_pod = ramp.capacity_rps(cfg) / ramp.prefill_pods(cfg) * cfg.prompt_tokens  # tokens/s, pod time
    fleet = Fleet(FleetConfig(pods=1, profile=cfg.profile, zmq_base_port=None, time_scale=scale))
    await fleet.start()
    try:
        pod = fleet.pods[0]
        kv = build_config({"pools": {"p": {"endpoints": [{"address": pod.address}]}}, "capacity": {"window_s": 600}})
        tracker = CapacityTracker(Registry(kv), lambda: kv.capacity, lambda: kv.routing.cost)
        scraper = MetricsScraper([pod.address], interval_s=0.05)
        scraper.subscribe(tracker.on_scrape)
        items = workloads.no_reuse(n, cfg.prompt_tokens, cfg.output_tokens, seed=1).items
        at = [t * scale for t in poisson(load * ramp.capacity_rps(cfg), n)]
        await scraper.start()
        try:
            recs = await loadgen.run(pod.url, workloads.specs(items, at, stream=False), timeout=60)
            assert all(r.ok for r in recs)
            await eventually(lambda: tracker.measured("p", "both").prefills >= n, "every first token scraped")
        finally:
            await scraper.aclose()
        got = tracker.measured("p", "both")
        assert got.tokens_per_s is not None
        # The pod's prompts are a little longer than 2000 tokens (the chat template): per token it is the same.
        assert got.tokens_per_s * scale == pytest.approx(per_pod, rel=0.15)
    finally:
        await fleet.stop()


def test_the_router_feeds_its_scrapes_to_the_capacity_tracker() -> None:
    """Wired: a router that scrapes its pods measures their prefill capacity from those scrapes."""
    from extproc.observability import Metrics
    from extproc.router import Router

    cfg = build_config({"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, "scrape": {"enabled": True}})
    r = Router(cfg, Metrics())
    assert r.live.scraper is not None
    now = time.monotonic()
    for at, tokens, ttft, count in [(now - 0.2, 0.0, 0.0, 0.0), (now - 0.1, 4000.0, 0.3, 2.0)]:
        figures = PodMetrics(prompt_tokens=tokens, prefix_cache_hits=0.0, ttft_sum_s=ttft, ttft_count=count)
        r.live.scraper._tell(PODS[0], figures, at)  # what a scrape tells its listeners
    m = r.capacity.measured("p", "both")
    assert (m.prefills, m.tokens) == (2.0, 4000.0) and m.busy_s > 0


def test_the_hold_pace_is_the_inverse_fit_of_pods_faster_than_the_cost_model() -> None:
    """routing.hold's pace: 1 until measured and for pods slower than routing.cost prices them (fit 0.2),
    1 / fit for faster ones (fit 2: half), read at most once per PACE_REFRESH_S."""
    tracker, _, clock = setup({"window_s": 30})
    assert tracker.hold_pace("p", "both") == 1.0  # nothing measured
    feed(tracker, clock, one_at_a_time(40, every=1.0, ttft=0.4), 1040.5)  # fit 0.2
    clock.t += PACE_REFRESH_S
    assert tracker.hold_pace("p", "both") == 1.0
    tracker2, reg, clock2 = setup({"window_s": 30})
    reqs = one_at_a_time(40, every=0.5, ttft=tracker.cost().prefill_s(4000, 0) / 2)  # twice routing.cost's rate
    for r in reqs:  # kvroute sent each one: the cost model prices that mix
        clock2.t = r.arrival
        tracker2.observe("p", reg.pools["p"].endpoints[0], 4000, 4000)
    feed(tracker2, clock2, reqs, 1020.5)
    assert tracker2.hold_pace("p", "both") == pytest.approx(0.5, rel=0.05)
    tracker2._scraped.clear()  # what it rested on gone: read again, the pace is 1
    clock2.t += PACE_REFRESH_S / 2
    assert tracker2.hold_pace("p", "both") == pytest.approx(0.5, rel=0.05)  # not yet read again
    clock2.t += PACE_REFRESH_S / 2
    assert tracker2.hold_pace("p", "both") == 1.0


def test_the_hold_pace_is_read_from_fewer_first_tokens_than_the_fit_on_metrics() -> None:
    """The pace rests on PACE_MIN_PREFILLS first tokens, where kvroute_cost_model_fit waits for
    capacity.measured_min_prefills (20): until the pace is read, every hold counts routing.cost's seconds and
    reserves the pod that long. One first token fewer, and the pace is 1."""
    assert PACE_MIN_PREFILLS < 20
    for n, pace in ((PACE_MIN_PREFILLS, 0.5), (PACE_MIN_PREFILLS - 1, 1.0)):
        tracker, reg, clock = setup({"window_s": 30})
        reqs = one_at_a_time(n, every=0.5, ttft=tracker.cost().prefill_s(4000, 0) / 2)  # twice routing.cost's rate
        for r in reqs:
            clock.t = r.arrival
            tracker.observe("p", reg.pools["p"].endpoints[0], 4000, 4000)
        feed(tracker, clock, reqs, 1000.5 + 0.5 * n)
        assert tracker.cost_fit("p", "both") is None  # the signals' fit: not measured yet
        assert signal(tracker).cost_fit is None
        assert tracker.hold_pace("p", "both") == pytest.approx(pace, rel=0.05), n


def test_the_pace_samples_the_first_pods_with_scrapes_and_the_sent_sums_follow_the_window() -> None:
    """cost_fit(pods=N) measures the role's first N pods that were scraped (hold_pace reads PACE_PODS of them);
    what kvroute sent is summed as it comes and as the window drops it (the same figures as summing the window)."""
    tracker, reg, clock = setup({"window_s": 30, "measured_min_prefills": 5}, roles=("both",) * 3)
    feed(tracker, clock, one_at_a_time(10), 1006, pod=PODS[1])  # 4000 tokens in 0.1 s: 40k/s
    feed(tracker, clock, one_at_a_time(10, ttft=0.2), 1006, pod=PODS[2])  # 20k/s
    linear = 1.0 / tracker.cost().per_token_s  # nothing sent yet: the cost model's linear rate
    assert tracker.cost_fit("p", "both", 1) == (pytest.approx(40_000 / linear, rel=0.02), 10.0)
    assert tracker.cost_fit("p", "both")[0] == pytest.approx(80_000 / 3 / linear, rel=0.02)
    pod = reg.pools["p"].endpoints[0]
    for t in (1001.0, 1010.0, 1020.0):
        clock.t = t
        tracker.observe("p", pod, 1000 * int(t - 1000), 5000)
    s = tracker._series[("p", "both")]
    assert (s.tokens, s.busy_s) == (sum(x[1] for x in s.prefills), pytest.approx(sum(x[2] for x in s.prefills)))
    clock.t = 1035.0  # the first one (at 1001) is out of the 30 s window
    tracker.cost_fit("p", "both")
    assert s.tokens == 30_000 and len(s.prefills) == 2
    clock.t = 1100.0
    tracker.cost_fit("p", "both")
    assert (s.tokens, s.busy_s, len(s.prefills)) == (0, 0.0, 0)
