"""routing.hold: a long prompt waits in kvroute for the prefills queued ahead of it on its pod."""

import asyncio
import time

import pytest

from extproc.config import HOLD_MIN_AHEAD_S, HoldConfig, build_config
from extproc.errors import ConfigError
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor
from tests.unit.test_server_stream import PODS, body_msgs, chat, headers_msg, run, set_headers

LONG = "lorem ipsum dolor sit amet " * 800  # ~21.6k characters: ~5.4k tokens at 4 characters a token
SHORT = "hello " * 100  # ~150 tokens
HOLD = 0.25  # seconds of prefill queued on every pod before the request comes


def test_hold_s_thresholds():
    h = HoldConfig(enabled=True, margin=0)  # step 8192 tokens: over 1024 uncached tokens is long
    assert h.holds(8000, scraping=False) and h.holds(1025, scraping=False)
    assert not h.holds(1024, scraping=False)  # an eighth of a step shares it at little cost
    assert not HoldConfig().holds(8000, scraping=False)  # by default only where the pods are scraped ...
    assert HoldConfig().holds(8000, scraping=True)  # ... (their measured pace bounds a misfit routing.cost)
    assert not HoldConfig(enabled=False).holds(8000, scraping=True)
    assert HoldConfig(enabled=True).holds(8000, scraping=False)
    assert HoldConfig(enabled=True, step_tokens=2048).holds(300, scraping=False)
    assert h.hold_s(0.2) == 0.2
    assert h.hold_s(HOLD_MIN_AHEAD_S / 2) == 0.0  # a step in progress, not a queue
    assert h.hold_s(5.0) == h.max_s == 1.0
    assert h.hold_s(0.0, 0.0, 0.15) == 0.15  # nothing queued, but a long prompt sent there is still prefilling
    assert h.hold_s(0.2, 0.2, 0.15) == 0.2


def test_the_margin_scales_with_the_whole_prefills_ahead():
    """0.05 s left of a prefill estimated 0.2 s: 20 % of the estimate is 0.04 s, whatever is left of it."""
    assert HoldConfig().margin == 0.1
    h = HoldConfig(margin=0.2)
    assert h.hold_s(0.05, 0.2) == pytest.approx(0.09)
    assert h.hold_s(0.2) == pytest.approx(0.24)  # the whole queue still ahead
    assert h.hold_s(0.9, 1.0) == h.max_s


def test_pods_faster_than_the_cost_model_are_held_for_at_their_pace():
    """At pace 0.5 the pods take half of each estimate: a queue of 0.2 s estimated, all of it ahead, is
    0.1 s of prefill; one that has run 0.15 s of its 0.2 is done already. The margin is on the real time."""
    h = HoldConfig(margin=0.1)
    assert h.hold_s(0.2, 0.2, 0.0, pace=0.5) == pytest.approx(0.1 + 0.1 * 0.1)
    assert h.hold_s(0.05, 0.2, 0.0, pace=0.5) == 0.0
    assert h.hold_s(0.05, 0.2, 0.08, pace=0.5) == 0.08  # a reservation (real time already) still holds
    assert h.hold_s(0.2, 0.2, 0.0, pace=1.0) == pytest.approx(0.22)


def test_hold_config_is_validated():
    with pytest.raises(ConfigError, match="max_s"):
        build_config({"routing": {"hold": {"max_s": 0}}})
    with pytest.raises(ConfigError, match="step_tokens"):
        build_config({"routing": {"hold": {"step_tokens": 0}}})


MARGIN = {"hold": {"enabled": True, "margin": 0.2}}


def _busy(scrape: bool = False, **routing) -> tuple[ExternalProcessor, Router]:
    """Three pods, each with HOLD seconds of kvroute's prefills queued (as if long prompts just went there);
    ``scrape``: their /metrics scraped (config only: nothing is scraped here)."""
    routing = {"hold": {**MARGIN["hold"], **routing.get("hold", {})}}
    cfg = {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, "routing": routing,
           "scrape": {"enabled": scrape}}  # fmt: skip
    router = Router(build_config(cfg), Metrics())
    now = time.monotonic()
    for e in router.registry.pools["p"].endpoints:
        e.prefills.add(HOLD, now)
    return ExternalProcessor(router), router


def _held(router: Router) -> float:
    return router.metrics.registry.get_sample_value("kvroute_hold_seconds_count") or 0.0


async def test_a_long_prompt_is_answered_once_the_queue_ahead_is_done():
    proc, router = _busy()
    t0 = time.monotonic()
    out = await run(proc, [headers_msg(), *body_msgs(chat(LONG))])
    waited = time.monotonic() - t0
    # Envoy is asked to wait past the hold (its message_timeout may be shorter), then the answer comes
    assert [r.WhichOneof("response") for r in out] == ["request_headers", None, "request_body"]
    assert HOLD < out[1].override_message_timeout.ToTimedelta().total_seconds() <= HOLD * 1.2 + 1.0
    assert set_headers(out[2].request_body.response)["x-gateway-destination-endpoint"] in PODS
    assert waited >= HOLD * 0.9  # the queue ahead, as estimated when the request came (asyncio's clock is coarse)
    assert _held(router) == 1
    held_s = router.metrics.registry.get_sample_value("kvroute_hold_seconds_sum")
    assert HOLD * 0.9 < held_s <= HOLD * 1.2  # what was left ahead, and the margin on the whole of it
    assert all(e.inflight == 0 for e in router.registry.pools["p"].endpoints)  # released at the stream's end


async def test_short_prompts_and_idle_pods_are_not_held():
    proc, router = _busy()
    await run(proc, [headers_msg(), *body_msgs(chat(SHORT))])
    assert _held(router) == 0
    proc, router = _busy(hold={"enabled": False})  # holding off
    await run(proc, [headers_msg(), *body_msgs(chat(LONG))])
    assert _held(router) == 0
    proc, router = _busy(hold={"enabled": None})  # the default, without scraping: off
    await run(proc, [headers_msg(), *body_msgs(chat(LONG))])
    assert _held(router) == 0
    cfg = {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, "routing": MARGIN}
    router = Router(build_config(cfg), Metrics())
    await run(ExternalProcessor(router), [headers_msg(), *body_msgs(chat(LONG))])  # nothing queued anywhere
    assert _held(router) == 0


async def test_holding_is_on_by_default_where_the_pods_are_scraped():
    proc, router = _busy(scrape=True, hold={"enabled": None})
    await run(proc, [headers_msg(), *body_msgs(chat(LONG))])
    assert _held(router) == 1
    proc, router = _busy(scrape=True, hold={"enabled": False})
    await run(proc, [headers_msg(), *body_msgs(chat(LONG))])
    assert _held(router) == 0


async def test_a_held_request_whose_stream_ends_frees_its_pod():
    """The client gives up (Envoy resets the stream) while the request is held: nothing is sent and the
    pod's slot is released."""
    proc, router = _busy(hold={"max_s": 5})
    for e in router.registry.pools["p"].endpoints:
        e.prefills.add(10.0, time.monotonic())  # a long wait ahead
    task = asyncio.create_task(run(proc, [headers_msg(), *body_msgs(chat(LONG))]))

    async def held() -> None:
        while not any(e.inflight for e in router.registry.pools["p"].endpoints):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(held(), 5)
    (pod,) = [e for e in router.registry.pools["p"].endpoints if e.inflight]
    assert pod.long_prefill_until > time.monotonic() + 4  # reserved for its prefill, held max_s (5 s)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(e.inflight == 0 for e in router.registry.pools["p"].endpoints)
    assert all(e.prefills.wait(time.monotonic()) < 10.5 for e in router.registry.pools["p"].endpoints)
    assert pod.long_prefill_until == 0.0  # the reservation undone: the request never reached the pod


async def test_a_held_check_cancelled_frees_its_pod():
    """The same over ext_authz: Envoy cancels the Check while its answer is held."""
    proc, router = _busy(hold={"max_s": 5})
    pods = router.registry.pools["p"].endpoints
    for e in pods:
        e.prefills.add(10.0, time.monotonic())
    st = proc.whole_request({":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "r1"},
                            chat(LONG), None)  # fmt: skip
    got = proc.decide_whole(st, chat(LONG))
    assert not isinstance(got, list)  # held: a coroutine to await
    task = asyncio.ensure_future(got)
    await asyncio.sleep(0.05)
    (pod,) = [e for e in pods if e.inflight]
    assert pod.long_prefill_until > time.monotonic() + 4
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(e.inflight == 0 for e in pods) and st.released
    assert pod.long_prefill_until == 0.0


@pytest.mark.usefixtures("still")
def test_a_reservation_extended_since_is_kept():
    """A held request given up after another long prompt was sent to its pod: the later reservation,
    made behind it, stays (the later prompt is already held for it)."""
    cfg = {"pools": {"p": {"endpoints": [{"address": PODS[0]}]}}, "routing": MARGIN}
    router = Router(build_config(cfg), Metrics())
    (pod,) = router.registry.pools["p"].endpoints
    pod.prefills.add(HOLD, time.monotonic())
    first = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(LONG)))
    assert first.hold_s > 0 and first.hold_reserved == (pod.long_prefill_until, 0.0)
    other = "consectetur adipiscing elit sed do " * 700
    second = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(other)))
    later = pod.long_prefill_until
    assert second.hold_reserved is not None and later > first.hold_reserved[0]
    router.unhold(first)
    assert pod.long_prefill_until == later
    router.unhold(second)
    assert pod.long_prefill_until == first.hold_reserved[0]


@pytest.mark.usefixtures("still")
def test_the_dry_run_reports_the_hold_and_queues_nothing():
    _, router = _busy()
    req = router.parse("/v1/chat/completions", "POST", {}, chat(LONG))
    pods = router.registry.pools["p"].endpoints
    before = [e.prefills.wait(time.monotonic()) for e in pods]
    outcome = router.route(req, dry_run=True)
    assert 0 < outcome.hold_s <= HOLD * 1.2
    after = [e.prefills.wait(time.monotonic()) for e in pods]
    assert all(a <= b for a, b in zip(after, before, strict=True))  # nothing added (only run down)


@pytest.mark.usefixtures("still")
def test_a_hold_past_the_queue_is_queued_too():
    """Held for the margin past the queue's estimated end, the prompt starts that much later: the pod's
    queue holds that gap, so the next long prompt is held until this one's end, not the margin sooner."""
    cfg = {"pools": {"p": {"endpoints": [{"address": PODS[0]}]}}, "routing": MARGIN}
    router = Router(build_config(cfg), Metrics())
    (pod,) = router.registry.pools["p"].endpoints
    pod.prefills.add(HOLD, time.monotonic())
    req = router.parse("/v1/chat/completions", "POST", {}, chat(LONG))
    first = router.route(req)
    work = router._prefill_s(first.keys.prompt_tokens, 0)
    assert first.hold_s == pytest.approx(HOLD * 1.2)  # HOLD left of HOLD, and 20 % of it
    ahead, whole = pod.prefills.ahead(time.monotonic())
    gap = first.hold_s - HOLD
    assert ahead == pytest.approx(HOLD + gap + work)
    assert whole == pytest.approx(HOLD + gap + work)
    other = "consectetur adipiscing elit sed do " * 700  # another long prompt (nothing of it cached)
    second = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(other)))
    assert second.hold_s == pytest.approx(ahead + 0.2 * whole)
    router.release(first.endpoint)
    router.release(second.endpoint)


@pytest.mark.usefixtures("still")
def test_a_long_prompt_waits_out_the_margin_of_the_one_before():
    """The queue estimate drops a prefill at its estimated end, but a long prompt let go then would land
    in its last step if the estimate was short: until the margin of the long prompt sent there before
    is over, the next one is held (the queue emptied here as if its estimate were spent)."""
    router = Router(build_config({"pools": {"p": {"endpoints": [{"address": PODS[0]}]}}, "routing": MARGIN}),
                    Metrics())  # fmt: skip
    (pod,) = router.registry.pools["p"].endpoints
    first = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(LONG)))
    assert first.hold_s == 0  # nothing ahead
    work = router._prefill_s(first.keys.prompt_tokens, 0)
    assert pod.long_prefill_until - time.monotonic() == pytest.approx(work * 1.2)
    pod.prefills = type(pod.prefills)()  # its estimate spent
    other = "consectetur adipiscing elit sed do " * 700
    second = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(other)))
    assert second.hold_s == pytest.approx(work * 1.2)
    short = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(SHORT)))
    assert short.hold_s == 0  # a short prompt is never held
    for o in (first, second, short):
        router.release(o.endpoint)


@pytest.mark.usefixtures("still")
@pytest.mark.parametrize(("fit", "pace"), [(None, 1.0), (0.5, 1.0), (1.05, 1.0), (2.0, 0.5)])
def test_the_hold_reads_the_pods_measured_pace(fit: float | None, pace: float):
    """The router holds at CapacityTracker.hold_pace: pods measured at twice routing.cost's rate (fit 2)
    are held for half the queue and reserved for half the prefill; a fit under 1, within the measurement's
    error over it (PACE_ABOVE_FIT), or none yet, changes nothing."""
    cfg = {"pools": {"p": {"endpoints": [{"address": PODS[0]}]}}, "routing": MARGIN}
    router = Router(build_config(cfg), Metrics())
    router.capacity.cost_fit = lambda pool, role, pods=None, min_prefills=None: None if fit is None else (fit, 100.0)  # type: ignore[method-assign]
    (pod,) = router.registry.pools["p"].endpoints
    pod.prefills.add(HOLD, time.monotonic())
    req = router.parse("/v1/chat/completions", "POST", {}, chat(LONG))
    out = router.route(req)
    work = router._prefill_s(out.keys.prompt_tokens, 0)
    assert out.hold_s == pytest.approx(HOLD * pace * 1.2)  # pace x (what is ahead + the 20 % margin)
    assert pod.long_prefill_until - time.monotonic() == pytest.approx(out.hold_s + work * pace * 1.2)
    router.release(out.endpoint)
