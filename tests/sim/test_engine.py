"""Engine loop shape: cache hits are faster, load queues, chunked prefill, preemption, events."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from bench.sim.cache import PrefixCache
from bench.sim.engine import Engine, Finished, RemoteKV, SimRequest, Token
from bench.sim.events import BlockRemoved, BlockStored
from bench.sim.metrics import PodMetrics
from bench.sim.profiles import H100_LLAMA8B, LatencyProfile
from bench.sim.tokenizer import SimTokenizer
from tests.sim.conftest import VirtualClock


class Capture:
    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, events: list[Any]) -> None:
        self.batches.append(list(events))


def make_engine(
    vclock: Any, profile: LatencyProfile = H100_LLAMA8B, capacity: int = 4096, block_size: int = 16
) -> tuple[Engine, Capture]:
    cap = Capture()
    eng = Engine(
        profile,
        PrefixCache(capacity, block_size),
        SimTokenizer(),
        PodMetrics("m", block_size, capacity),
        cap,  # type: ignore[arg-type]
        now=vclock.now,
        sleep=vclock.sleep,
    )
    eng.start()
    return eng, cap


async def run(eng: Engine, req: SimRequest) -> list[int]:
    eng.submit(req)
    out = []
    while True:
        item = await req.out.get()
        if isinstance(item, Finished):
            return out
        assert isinstance(item, Token)
        out.append(item.token_id)


async def test_hit_is_much_faster_than_miss(vclock: Any) -> None:
    eng, _ = make_engine(vclock)
    prompt = list(range(1000, 5000))
    a = SimRequest("a", prompt, 4)
    await run(eng, a)
    b = SimRequest("b", prompt, 4)
    await run(eng, b)
    miss, hit = a.first_token_at - a.arrival, b.first_token_at - b.arrival
    assert a.cached_tokens == 0 and b.cached_tokens == 3984  # last block recomputed
    # 4000-token prefill on the H100 profile ~100 ms; 16 tokens on a 3984-token prefix ~7 ms.
    assert 0.08 < miss < 0.13
    assert hit < 0.1 * miss
    await eng.stop()


async def test_queueing_under_load(vclock: Any) -> None:
    eng, _ = make_engine(vclock, replace(H100_LLAMA8B, max_num_seqs=2))
    reqs = [SimRequest(str(i), [i + 100] * 200, 8) for i in range(6)]
    for r in reqs:
        eng.submit(r)
    assert len(eng.waiting) == 6
    for r in reqs:
        while not isinstance(await r.out.get(), Finished):
            pass
    ttft = [r.first_token_at - r.arrival for r in reqs]
    # Two at a time: the third pair waits for the first two pairs to finish decoding.
    assert ttft[4] > ttft[2] > ttft[0]
    assert eng.stats.finished == 6
    await eng.stop()


async def test_each_requests_wait_and_ttft_are_kept_by_id(vclock: Any) -> None:
    """One sequence at a time: b waits out a's whole run before its first step; a starts at once. The per-request
    timings add up to the TTFT sum the pod reports."""
    eng, _ = make_engine(vclock, replace(H100_LLAMA8B, max_num_seqs=1))
    a, b = SimRequest("a", [5] * 300, 8), SimRequest("b", [6] * 300, 8)
    eng.submit(a)
    eng.submit(b)
    for r in (a, b):
        while not isinstance(await r.out.get(), Finished):
            pass
    (wait_a, ttft_a), (wait_b, ttft_b) = eng.timings["a"], eng.timings["b"]
    assert wait_a == 0.0 and ttft_a == pytest.approx(a.first_token_at - a.arrival)
    assert wait_b >= a.last_token_at - b.arrival > 0  # a decoded all 8 tokens first
    assert ttft_b > wait_b and ttft_b == pytest.approx(b.first_token_at - b.arrival)
    assert eng.stats.ttft_sum_s == pytest.approx(ttft_a + ttft_b)
    await eng.stop()


async def test_chunked_prefill_splits_long_prompts(vclock: Any) -> None:
    eng, _ = make_engine(vclock, capacity=2048)
    req = SimRequest("long", list(range(10_000)), 1)
    await run(eng, req)
    assert eng.stats.steps == 2  # 8192 + 1808 tokens
    await eng.stop()


async def test_decodes_share_steps_with_prefill(vclock: Any) -> None:
    eng, _ = make_engine(vclock)
    a = SimRequest("a", [7] * 100, 20)
    eng.submit(a)
    await a.out.get()  # a is decoding now
    b = SimRequest("b", [8] * 100, 1)
    await run(eng, b)
    # b's prefill ran in a step together with one of a's decodes: a kept going.
    assert a.num_outputs >= 2
    await eng.stop()


async def test_preemption_when_kv_runs_out(vclock: Any) -> None:
    eng, _ = make_engine(vclock, capacity=10)
    a = SimRequest("a", [1] * 64, 40)  # grows from 4 to 7 blocks
    b = SimRequest("b", [2] * 64, 40)
    eng.submit(a)
    eng.submit(b)
    for r in (a, b):
        while not isinstance(await r.out.get(), Finished):
            pass
    assert eng.stats.preemptions >= 1
    assert a.num_outputs == b.num_outputs == 40
    assert eng.cache.pinned == 0
    await eng.stop()


async def test_waits_for_kv_instead_of_failing(vclock: Any) -> None:
    eng, _ = make_engine(vclock, capacity=8)
    a = SimRequest("a", [1] * 100, 2)  # 7 blocks
    b = SimRequest("b", [2] * 100, 2)
    eng.submit(a)
    eng.submit(b)
    await run(eng, SimRequest("c", [3] * 10, 1))
    for r in (a, b):
        while not isinstance(await r.out.get(), Finished):
            pass
    assert b.first_token_at > a.first_token_at
    await eng.stop()


async def test_events_store_full_blocks_with_parent_chain(vclock: Any) -> None:
    eng, cap = make_engine(vclock, capacity=6, block_size=4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    await run(eng, SimRequest("a", prompt, 3))  # the output fills block 3 (10 + 2 computed tokens)
    stored = [e for b in cap.batches for e in b if isinstance(e, BlockStored)]
    assert stored[0].token_ids == prompt[:8] and stored[0].parent_block_hash is None
    assert len(stored[0].block_hashes) == 2
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[1].token_ids[:2] == prompt[8:]
    # A different prompt evicts LRU blocks: one BlockRemoved per block.
    await run(eng, SimRequest("b", [50] * 20, 1))
    removed = [e for b in cap.batches for e in b if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) == 1 for e in removed)
    assert removed[0].block_hashes[0] in stored[1].block_hashes + stored[0].block_hashes
    await eng.stop()


async def test_abort_frees_blocks(vclock: Any) -> None:
    eng, _ = make_engine(vclock)
    a = SimRequest("a", [1] * 64, 1000)
    eng.submit(a)
    await a.out.get()
    eng.abort(a)
    assert eng.cache.pinned == 0 and not eng.running
    await eng.stop()


async def test_a_prompt_waits_until_its_whole_sequence_fits(vclock: Any) -> None:
    """vLLM 0.32 (scheduler_reserve_full_isl) admits a request only when KV holds all its prompt,
    though it prefills in chunks: with room for b's first chunk but not for its whole prompt, b waits
    for a to finish instead of starting a prefill that would run the cache out and preempt."""
    eng, _ = make_engine(vclock, replace(H100_LLAMA8B, max_num_batched_tokens=64), capacity=20)
    a = SimRequest("a", [1] * 200, 30)  # 13 blocks, 15 at its end
    b = SimRequest("b", [2] * 200, 30)  # its 64-token chunks need 4 blocks each, 13 in all
    eng.submit(a)
    await a.out.get()  # a is decoding: 7 blocks free, b's first chunk would fit
    eng.submit(b)
    for r in (a, b):
        while not isinstance(await r.out.get(), Finished):
            pass
    assert eng.stats.preemptions == 0
    assert b.first_token_at > a.last_token_at  # b's prefill started only after a freed its blocks
    assert eng.cache.pinned == 0
    await eng.stop()


async def test_gauges_report_the_last_finished_step_as_vllm_does(vclock: Any) -> None:
    """vLLM sets running/waiting/KV use from each step's outputs: while a request's first step runs, a
    scrape still reads the idle engine; once that step is done it reads the request running."""
    eng, _ = make_engine(vclock)
    gauges = (eng.metrics.running, eng.metrics.waiting, eng.metrics.kv_usage)
    a = SimRequest("a", list(range(1000, 5000)), 4)
    eng.submit(a)
    while eng.stats.steps == 0:
        await asyncio.sleep(0)
    assert not a.num_outputs  # inside the prefill step
    assert [g.value for g in gauges] == [0, 0, 0]
    b = SimRequest("b", list(range(6000, 6100)), 1)
    eng.submit(b)  # arrives during the step: vLLM's engine core takes it in after the step's stats
    assert isinstance(await a.out.get(), Token)
    assert b in eng.running and not b.num_outputs  # taken in by the next step, now running
    assert [g.value for g in gauges[:2]] == [1, 0] and gauges[2].value > 0
    while not isinstance(await b.out.get(), Finished):
        pass
    while not isinstance(await a.out.get(), Finished):
        pass
    assert [g.value for g in gauges] == [0, 0, 0]
    await eng.stop()


class LateClock(VirtualClock):
    """Virtual time whose sleeps wake ``late`` seconds after they were due (a busy host's event loop),
    and ``stall`` seconds later still on the ``stall_at``-th sleep (a pause of the host)."""

    def __init__(self, late: float, stall: float = 0.0, stall_at: int = -1) -> None:
        super().__init__()
        self.late, self.stall, self.stall_at, self.sleeps = late, stall, stall_at, 0

    async def sleep(self, dt: float) -> None:
        self.sleeps += 1
        await super().sleep(dt + self.late + (self.stall if self.sleeps == self.stall_at else 0.0))


async def _decode_span(clock: Any, outputs: int) -> tuple[float, float]:
    """(first token -> finished, one decode step as modelled) for one short request alone."""
    eng, _ = make_engine(clock)
    req = SimRequest("a", [7] * 100, outputs)
    eng.submit(req)
    first = None
    while not isinstance(item := await req.out.get(), Finished):
        assert isinstance(item, Token)
        first = clock.now() if first is None else first
    assert first is not None
    span = clock.now() - first
    await eng.stop()
    return span, H100_LLAMA8B.step_seconds([], 1, 100 + outputs)


async def test_a_late_wake_up_does_not_stretch_the_steps_after_it() -> None:
    """A step ends when the model says, counted from when the last one ended as modelled: the loop
    waking 2 ms late on every sleep makes each token that much late, not every step that much longer
    (a real engine core never sleeps between steps)."""
    late = 0.002
    span, step = await _decode_span(LateClock(late), 50)
    # 49 decode steps after the first token: each modelled step (<= ``step``), the lateness once.
    assert span <= 49 * step + late + 1e-9
    assert span > 49 * (step - 0.001)


async def test_a_stall_longer_than_a_step_is_lost_not_made_up() -> None:
    """A stall past a whole step (a pause of the host) delays every later token by its length: the
    steps after it are not squeezed to catch up."""
    stall = 0.1
    span, step = await _decode_span(LateClock(0.0, stall=stall, stall_at=10), 50)
    assert span > 49 * (step - 0.001) + stall


async def test_a_decode_legs_pulled_blocks_are_announced_like_computed_ones(vclock: Any) -> None:
    """P/D: the blocks a decode leg pulls are cached on its pod and reported in BlockStored events, as
    vLLM's decode instance does, so a KV-event index sees them where the conversation now lives."""
    prefill, _ = make_engine(vclock, block_size=4)
    eng, cap = make_engine(vclock, block_size=4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens: the remote's 2 blocks are pulled
    leg = SimRequest("p", prompt, 1, prefill_only=True)
    await run(prefill, leg)
    assert leg.kv_transfer_params is not None
    req = SimRequest("d", prompt, 2)
    req.remote = RemoteKV(peer=prefill, remote_request_id="p", block_ids=leg.kv_transfer_params["block_ids"])
    await run(eng, req)
    assert eng.stats.external_hits == 8 and eng.stats.transfers == 1
    stored = [e for b in cap.batches for e in b if isinstance(e, BlockStored)]
    assert stored[0].token_ids == prompt[:8] and len(stored[0].block_hashes) == 2
    assert stored[0].parent_block_hash is None
    await eng.stop()
    await prefill.stop()
