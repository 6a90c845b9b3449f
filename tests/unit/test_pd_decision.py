"""The P/D decision in the router (no network): threshold, roles, and the queue check that keeps a
long prompt local while the prefill pool is busy."""

import time

import orjson
import pytest

from extproc.config import build_config
from extproc.observability import Metrics
from extproc.router import Router
from extproc.scheduling.base import Decision

PREFILL = ["10.0.1.1:8000", "10.0.1.2:8000"]
DECODE = ["10.0.2.1:8000", "10.0.2.2:8000"]


def make(streams: int = 8, **pd):
    """Two prefill and two decode pods; the decode pods already stream ``streams`` requests each
    (a split spares them a stall, so it may cost some time to first token)."""
    eps = [{"address": a, "role": "prefill"} for a in PREFILL] + [{"address": a, "role": "decode"} for a in DECODE]
    cfg = {"pools": {"p": {"endpoints": eps}}, "pd": {"disaggregation": "conditional", **pd}}
    r = Router(build_config(cfg), Metrics())
    for e in r.registry.pools["p"].endpoints:
        if e.role == "decode":
            e.inflight = streams
    return r


def route(router: Router, words: int, seed: str, headers: dict[str, str] | None = None):
    text = " ".join(f"{seed}{i}" for i in range(words))  # ~ words * 1.5 estimated tokens
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "stream": True})
    return router.route(router.parse("/v1/chat/completions", "POST", {"x-request-id": seed, **(headers or {})}, body))


def behind(r: Router, seconds: float) -> Router:
    """Every prefill pod already has ``seconds`` of prefill queued."""
    for e in r.registry.pools["p"].endpoints:
        if e.role == "prefill":
            e.prefills.add(seconds, time.monotonic())
    return r


def test_long_uncached_prompt_splits_to_a_prefill_pod_and_short_stays_local() -> None:
    r = make(threshold_tokens=1000)
    long = route(r, 2000, "doc")
    assert long.pd is not None and long.pd.split and long.pd.reason == "uncached"
    assert long.decision.primary.address in DECODE and long.pd.prefill is not None
    assert long.pd.prefill.address in PREFILL
    short = route(r, 50, "chat")
    assert short.pd is not None and not short.pd.split and short.pd.reason == "cached"
    assert short.decision.primary.address in DECODE  # prefill-only pods never take a whole request


def test_the_prefill_leg_carries_what_its_pod_lacks_of_the_prompt_for_pacing() -> None:
    """The leg's tokens (its share of the prefill pod's step budget, pd.prefill_step_tokens) are what
    that pod must compute: a pod holding the document's first blocks is picked and needs less."""
    r = make(threshold_tokens=1000)
    fresh = route(r, 3000, "doc").pd
    assert fresh.split and fresh.prefill_tokens == fresh.uncached_tokens > 0
    r = make(threshold_tokens=1000)
    req = r.parse(
        "/v1/chat/completions",
        "POST",
        {"x-request-id": "doc"},
        orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": " ".join(f"doc{i}" for i in range(3000))}]}
        ),
    )
    k = r.keys(req, r.registry.pools["p"].endpoints)
    k.index.record(k.keys[: len(k.keys) // 2], PREFILL[1])  # half the document is cached there
    held = r.route(req).pd
    assert held.split and held.prefill is not None and held.prefill.address == PREFILL[1]
    assert 0 < held.prefill_tokens < held.uncached_tokens


def test_a_decode_pod_that_took_a_local_prefill_during_the_leg_is_swapped_for_a_quieter_one() -> None:
    """When the prefill leg returns, the decode pod chosen before it may have taken a local document
    whose steps would hold the pull and the first token back: the request moves to a fallback that
    carries fewer requests and admits it sooner; in-flight slots, the pending hand-off and the
    destination header move with it."""
    r = make(threshold_tokens=1000)
    out = route(r, 3000, "doc")
    assert out.pd.split
    d1 = out.decision.primary
    (d2,) = [e for e in out.decision.endpoints if e.address in DECODE and e is not d1]
    assert r.redirect(out) is out, "nothing happened on the decode pod: stay"
    d1.prefills.add(0.4, time.monotonic())  # a local document landed there while the leg ran
    before = (d1.inflight, d2.inflight)
    moved = r.redirect(out)
    assert moved.decision.primary is d2 and moved.set_headers["x-gateway-destination-endpoint"] == d2.address
    assert moved.metadata["x-gateway-destination-endpoint"].startswith(d2.address + ",")
    assert (d1.inflight, d2.inflight) == (before[0] - 1, before[1] + 1)
    now = time.monotonic()
    assert d1.handoffs.pending(now) == 0 and d2.handoffs.pending(now) == 1
    sample = r.metrics.registry.get_sample_value
    assert sample("kvroute_pd_decisions_total", {"outcome": "redirect", "reason": "decode-busy"}) == 1
    # The index learns the new decode pod holds the prompt (the keys route() built, not re-derived).
    assert moved.keys is out.keys and out.keys is not None
    assert out.keys.index.match(out.keys.keys, [d2.address])[d2.address] == len(out.keys.keys)
    # pd.redirect_decode: false keeps the pick.
    off = make(threshold_tokens=1000, redirect_decode=False)
    kept = route(off, 3000, "doc")
    kept.decision.primary.prefills.add(0.4, time.monotonic())
    assert off.redirect(kept) is kept
    # A fallback as busy as the pick (counting the request itself) is no better a place to stream.
    r = make(threshold_tokens=1000)
    out = route(r, 3000, "doc")
    out.decision.primary.prefills.add(0.4, time.monotonic())
    for e in out.decision.endpoints[1:]:
        e.inflight = out.decision.primary.inflight
    assert r.redirect(out) is out


def test_busy_prefill_pool_keeps_long_prompts_local() -> None:
    r = make(threshold_tokens=1000, max_split_delay_s=0.05)
    now = time.monotonic()
    for e in r.registry.pools["p"].endpoints:
        if e.role == "prefill":
            e.prefills.add(5.0, now)  # five seconds of prefill already sent to each prefill pod
    out = route(r, 2000, "doc")
    assert out.pd is not None and not out.pd.split and out.pd.reason == "prefill-busy"
    # The decode pod now owns that prefill in its own queue estimate.
    assert out.decision.primary.prefills.wait(time.monotonic()) > 0
    # A generous delay allowance splits anyway.
    r2 = make(threshold_tokens=1000, max_split_delay_s=10.0, split_delay_per_stall=1000)
    for e in r2.registry.pools["p"].endpoints:
        if e.role == "prefill":
            e.prefills.add(5.0, now)
    assert route(r2, 2000, "doc").pd.split


@pytest.mark.usefixtures("still")
def test_a_split_may_cost_first_token_time_in_proportion_to_the_stall_it_spares() -> None:
    """The prefill pod is 60 ms behind. A long document on a pod streaming 10 requests would stall them
    ~0.25 s each: worth that wait, the hand-off and the split's overhead (split). The same document
    on an idle decode pod spares nobody (local), and a 1.5k-token prompt spares 8 streams ~30 ms
    each, worth ~12 ms of its own first token (local)."""

    doc = route(behind(make(streams=10, threshold_tokens=100), 0.06), 5_000, "doc").pd
    assert doc.split and doc.delay_s is not None and 0.06 < doc.delay_s < doc.allowance_s
    cost = build_config({"pools": {"p": {"endpoints": [{"address": PREFILL[0]}]}}}).routing.cost
    assert doc.allowance_s == pytest.approx(0.05 * cost.prefill_s(doc.uncached_tokens) * 10)  # x 10 streams
    idle = route(behind(make(streams=0, threshold_tokens=100), 0.06), 5_000, "doc").pd
    assert not idle.split and idle.reason == "prefill-busy"
    # An idle decode pod counts as one stream: a high weight still gives the flat cap there.
    assert route(behind(make(streams=0, threshold_tokens=100, split_delay_per_stall=1000), 0.06), 5_000, "doc").pd.split
    assert not route(behind(make(threshold_tokens=100), 0.06), 1_000, "chat").pd.split
    # The flat allowance of earlier versions (split_delay_per_stall high): the chat waits for the split.
    assert route(behind(make(threshold_tokens=100, split_delay_per_stall=1000), 0.06), 1_000, "chat").pd.split


@pytest.mark.usefixtures("still")
def test_a_ttft_target_takes_every_split_that_keeps_it_and_none_that_misses_it() -> None:
    """pd.ttft_target_s: while the decode pod's own prefill meets the target, a split may use what is
    left of it, whatever stall it spares; when a local prefill misses it too, the stall rule decides."""
    # A chat spares 8 streams too little for the stall rule to wait 60 ms, but 60 ms keeps a 0.5 s target.
    assert not route(behind(make(threshold_tokens=100), 0.06), 1_000, "chat").pd.split
    chat = route(behind(make(threshold_tokens=100, ttft_target_s=0.5), 0.06), 1_000, "chat").pd
    assert chat.split and chat.allowance_s is not None and chat.delay_s is not None
    assert 0.05 < chat.delay_s <= chat.allowance_s < 0.5  # the target less the chat's local estimate
    # A document the flat rule (0.25 s) would split 0.15 s later than locally: past a 0.3 s target
    # that its own prefill (~0.2 s) keeps, so it stays local.
    flat = {"threshold_tokens": 100, "split_delay_per_stall": 1000}
    assert route(behind(make(**flat), 0.15), 5_000, "doc").pd.split
    doc = route(behind(make(**flat, ttft_target_s=0.3), 0.15), 5_000, "doc").pd
    assert not doc.split and doc.reason == "prefill-busy" and doc.delay_s > doc.allowance_s
    # The request's own objective (x-slo-ttft-ms) overrides the configured one, either way.
    slo = route(behind(make(threshold_tokens=100), 0.06), 1_000, "chat", {"x-slo-ttft-ms": "500"}).pd
    assert slo.split and slo.target_s == 0.5 and slo.allowance_s == pytest.approx(chat.allowance_s)
    tight = {"x-slo-ttft-ms": "300"}
    loose = route(behind(make(**flat, ttft_target_s=0.3), 0.15), 5_000, "doc", {"x-slo-ttft-ms": "2000"}).pd
    assert loose.split and loose.target_s == 2.0
    assert not route(behind(make(**flat, ttft_target_s=2.0), 0.15), 5_000, "doc", tight).pd.split
    # A target nothing can meet leaves the decision to the stall rule (here the flat 0.25 s).
    missed = route(behind(make(**flat, ttft_target_s=0.05), 0.15), 5_000, "doc").pd
    assert missed.split and missed.allowance_s == pytest.approx(0.25)


def test_prefill_estimates_grow_with_the_context_each_token_attends_to() -> None:
    """routing.cost.per_token_context_s: a 12k-token prefill costs more than 12 x a 1k-token one, and
    tokens after a cached prefix cost more than the same tokens at the start."""
    from extproc.config import CostConfig

    c = CostConfig()
    assert c.prefill_s(12_000) > 12 * c.prefill_s(1_000) * 1.2
    assert c.prefill_s(1_000, cached=8_000) > c.prefill_s(1_000)
    linear = CostConfig(per_token_context_s=0)
    assert linear.prefill_s(12_000) == pytest.approx(12 * linear.prefill_s(1_000))


def test_queue_estimates_spread_consecutive_documents_and_early_ends_free_the_queue() -> None:
    r = make(threshold_tokens=100)
    first = route(r, 7_000, "a")  # ~10k estimated tokens x 20 us: ~0.2 s of prefill (+ 31 ms hand-off)
    second = route(r, 7_000, "b")
    assert first.pd.split and second.pd.split
    assert first.pd.prefill is not second.pd.prefill  # the second goes to the idle prefill pod
    pod = first.pd.prefill
    assert pod.prefills.wait(time.monotonic()) > 0.15
    pod.prefills.finished(first.pd.prefill_ticket, time.monotonic())  # the leg came back at once
    assert pod.prefills.wait(time.monotonic()) < 0.01


def test_prefill_queue_moves_up_on_early_ends_and_expires() -> None:
    from extproc.endpoints.pool import PrefillQueue

    q = PrefillQueue()
    a = q.add(1.0, 100.0)
    b = q.add(2.0, 100.0)
    q.add(1.0, 100.0)  # c
    assert q.wait(100.0) == 4.0
    q.finished(a, 100.5)  # half a second early: b and c move up by as much
    assert q.wait(100.5) == 3.0
    q.finished(a, 100.5)  # unknown / already gone: no effect
    assert q.wait(100.5) == 3.0
    q.finished(b, 101.5)  # b too ends early (due 102.5): c now ends at 102.5
    assert q.wait(101.5) == 1.0
    assert q.wait(102.5) == 0.0  # c expired (a local prefill never reports its end)
    q.add(1.0, 104.0)
    assert q.wait(104.0) == 1.0


def test_a_prefill_leg_that_runs_late_holds_the_queue_back_until_it_reports() -> None:
    """A gateway leg reports its end: past its estimated end it is still running, and what is queued
    behind it starts later; past its deadline (the leg's timeout) it is forgotten."""
    from extproc.endpoints.pool import PrefillQueue

    q = PrefillQueue()
    leg = q.add(1.0, 100.0, reports_within=30.0)
    q.add(0.5, 100.0)
    assert q.wait(100.0) == 1.5
    assert q.wait(101.2) == pytest.approx(0.5)  # the leg is 0.2 s late: the next one has not started
    q.finished(leg, 101.3)
    assert q.wait(101.3) == pytest.approx(0.5)
    stuck = PrefillQueue()
    stuck.add(1.0, 100.0, reports_within=5.0)  # never reports
    assert stuck.wait(104.0) == pytest.approx(0.0) and stuck.wait(105.5) == 0.0


def test_handoffs_count_until_due_or_settled() -> None:
    from extproc.endpoints.pool import Handoffs

    h = Handoffs()
    a = h.add(101.0)
    b = h.add(102.0)
    assert h.pending(100.0) == 2
    h.settle(a, None)  # its prefill leg failed: nothing headed here
    h.settle(b, 100.5)  # the leg returned: the pull is due sooner
    h.settle(a, 105.0)  # gone: no effect
    assert h.pending(100.2) == 1 and h.pending(100.5) == 0


def test_a_split_cannot_start_its_pull_before_the_decode_pods_queued_prefills() -> None:
    """vLLM admits the pulled request only from the token budget that running prefills leave: the
    split's first token is estimated after the decode pod's own queue, however idle the prefill pod."""
    r = make(threshold_tokens=100)
    queued_at = time.monotonic()
    for e in r.registry.pools["p"].endpoints:
        if e.role == "decode":
            e.prefills.add(1.0, queued_at)
    doc = route(r, 5_000, "doc").pd
    drained = time.monotonic() - queued_at  # the queue drains on the clock while the request is parsed
    pd = r.config.pd
    handoff = doc.uncached_tokens * pd.transfer_s_per_token + pd.split_overhead_s
    assert doc.local_s is not None and doc.delay_s is not None
    assert 1.0 - drained + handoff - 1e-6 <= doc.local_s + doc.delay_s <= 1.0 + handoff + 1e-6


def test_local_prefills_keep_off_decode_pods_awaiting_a_handoff() -> None:
    """A long prefill on a pod about to pull a split's KV would hold that pull back for as long:
    with the prefill pool busy, the next document prefills on the other decode pod."""
    for awaited in (0, 1):
        r = behind(make(threshold_tokens=100), 5.0)
        decodes = [e for e in r.registry.pools["p"].endpoints if e.role == "decode"]
        decodes[awaited].handoffs.add(time.monotonic() + 10)
        doc = route(r, 5_000, f"doc{awaited}")
        assert not doc.pd.split and doc.decision.primary is decodes[1 - awaited]


def test_never_mode_also_tracks_local_prefills_so_documents_do_not_stack() -> None:
    """Without P/D too, a pod just handed a long document is known to be busy prefilling it: the next
    document goes to a pod that is only streaming chats, though that one has more in flight."""
    eps = [{"address": a, "role": "both"} for a in DECODE]
    r = Router(build_config({"pools": {"p": {"endpoints": eps}}, "pd": {"disaggregation": "never"}}), Metrics())
    idle, chatty = r.registry.pools["p"].endpoints
    chatty.inflight = 3
    first = route(r, 2000, "doc-a")
    assert first.pd is None and first.decision.primary is idle
    assert idle.prefills.wait(time.monotonic()) > 0.03  # ~3k estimated tokens x 20 us
    assert idle.inflight == 1  # routing counted it in flight: by count alone, idle would take the next one too
    assert route(r, 2000, "doc-b").decision.primary is chatty


def test_pods_of_role_both_prefill_for_others_only_when_they_carry_fewer_streams() -> None:
    """One prefill pod and pods that do either: while the prefill pod is busy, a pod of role both
    busier than the decode pod is no prefill target (the split would stall as many streams there,
    plus a hand-off); a quieter one is, unless a split's KV is on its way to it."""
    both = [{"address": a, "role": "both"} for a in (*DECODE, "10.0.2.3:8000")]
    eps = [{"address": PREFILL[0], "role": "prefill"}, *both]
    r = Router(build_config({"pools": {"p": {"endpoints": eps}}, "pd": {"disaggregation": "conditional",
               "threshold_tokens": 1000, "max_split_delay_s": 0.05, "split_overhead_s": 0}}), Metrics())  # fmt: skip
    prefill, b1, b2, b3 = r.registry.pools["p"].endpoints
    prefill.prefills.add(5.0, time.monotonic())  # the prefill pod has seconds of work queued
    b1.inflight, b2.inflight, b3.inflight = 2, 6, 6
    out = route(r, 2000, "doc")
    assert out.decision.primary is b1  # the least-loaded pod decodes
    assert not out.pd.split and out.pd.reason == "prefill-busy"  # b2/b3 stream more than b1: prefill at home
    # A decode pod chosen for its cache can be busier than a pod of role both: that one may prefill.
    b1.inflight, b3.inflight = 7, 1  # b1 now streams more than b2 (and holds the document): b3 only
    k = r.keys(out.request, r.registry.pools["p"].endpoints)
    held = Decision(endpoints=(b2,), pool="p", reason="prefix", matched_blocks=0, total_blocks=len(k.keys))
    work_s = r.config.routing.cost.prefill_s(4000)
    eps = r.registry.pools["p"].endpoints
    plan = r._pd_plan(r.config.pd_for("m"), k, held, 4000, 4000, work_s, None, eps, time.monotonic())
    assert plan.split and plan.prefill is b3
    # ... unless b3 awaits a hand-off: a pull there starts, and its first token comes, only at the
    # end of a step, and each step of someone else's prefill there would take the whole budget.
    b3.handoffs.add(time.monotonic() + 1.0)
    plan = r._pd_plan(r.config.pd_for("m"), k, held, 4000, 4000, work_s, None, eps, time.monotonic())
    assert not plan.split and plan.reason == "prefill-busy"


def test_chars_per_token_sizes_what_the_decode_pod_lacks() -> None:
    """Without a tokenizer the uncached-token estimate (threshold, prefill seconds, hand-off) is
    prompt characters / routing.chars_per_token."""
    eps = [{"address": PREFILL[0], "role": "prefill"}, {"address": DECODE[0], "role": "decode"}]

    def uncached(cpt: float) -> int:
        cfg = {"pools": {"p": {"endpoints": eps}}, "routing": {"chars_per_token": cpt},
               "pd": {"disaggregation": "always"}}  # fmt: skip
        return route(Router(build_config(cfg), Metrics()), 2000, "doc").pd.uncached_tokens

    english, wordy = uncached(4), uncached(8)
    assert english > 3000 and abs(wordy - english / 2) <= 1


def test_documents_on_one_shared_head_spread_over_idle_prefill_pods() -> None:
    """Both prefill pods hold the documents' shared head and have nothing queued: each document ties.
    The tie goes by the first block past the head, so the documents spread over both pods (ordered by
    the first block, every one went to the same pod, which then evicted first)."""
    from extproc.endpoints.pool import PrefillQueue

    r = make(threshold_tokens=1000)
    pods = r.registry.pools["p"].endpoints
    head = " ".join(f"sys{i}" for i in range(600))

    def request(n: int):
        text = head + " " + " ".join(f"doc{n}w{i}" for i in range(2000))
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "stream": True})
        req = r.parse("/v1/chat/completions", "POST", {"x-request-id": f"doc{n}"}, body)
        return req, r.keys(req, pods)

    _, ref = request(-1)
    picks: set[str] = set()
    for n in range(12):
        req, k = request(n)
        shared = next(i for i, (a, b) in enumerate(zip(k.keys, ref.keys, strict=False)) if a != b)
        assert shared > 4
        for a in PREFILL:  # the head, and nothing of the documents routed before
            k.index.remove_endpoint(a)
            k.index.record(k.keys[:shared], a)
        got = r.route(req).pd
        assert got is not None and got.split and got.prefill is not None
        picks.add(got.prefill.address)
        for e in pods:
            e.prefills, e.inflight = PrefillQueue(), 8 if e.role == "decode" else 0
    assert picks == set(PREFILL)


async def test_a_prefill_leg_cancelled_midway_leaves_nothing_queued_or_expected() -> None:
    """The client gives up while the gateway leg runs: the prefill pod's slot and queued prefill are
    freed, and the decode pod expects no KV (a handoff that never comes would keep local prefills off it)."""
    import asyncio

    r = make(threshold_tokens=1000, handoff="gateway")
    out = route(r, 3000, "doc")
    assert out.pd is not None and out.pd.split and out.pd.prefill is not None
    started = asyncio.Event()

    async def never(*args, **kwargs):
        started.set()
        await asyncio.sleep(3600)

    r.prefill_client.prefill = never  # type: ignore[method-assign]
    leg = asyncio.ensure_future(r.prefill(out))
    await asyncio.wait_for(started.wait(), 5)
    prefill, decode = out.pd.prefill, out.decision.primary
    assert prefill.inflight == 1 and decode.handoffs.pending(time.monotonic()) == 1
    leg.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leg
    now = time.monotonic()
    assert prefill.inflight == 0 and prefill.prefills.wait(now) == 0
    assert decode.handoffs.pending(now) == 0


def test_anthropic_messages_requests_are_never_split() -> None:
    """/v1/messages (extproc/anthropic.py) goes whole to a decode pod: the gateway's prefill leg speaks the
    OpenAI API. The same long prompt over /v1/chat/completions splits."""
    r = make(threshold_tokens=1000)
    text = " ".join(f"doc{i}" for i in range(2000))
    body = orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]})
    out = r.route(r.parse("/v1/messages", "POST", {"x-request-id": "a"}, body))
    assert out.pd is None and out.decision.primary.address in DECODE
    assert route(r, 2000, "other").pd.split
