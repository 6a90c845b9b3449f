"""KV-event consumers against a real ZMQ publisher shaped like vLLM's ZmqEventPublisher (loopback)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio

from extproc import hashing
from extproc.endpoints.events import DRAIN_MAX, KVEventListener, KVEventSubscriber, KVIntake, endpoint_from_topic
from extproc.index.precise import PreciseIndex
from extproc.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from extproc.kvevents.encode import encode_batch

BS = 16
POD = "127.0.0.1:8001"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class FakeVLLMPublisher:
    """PUB (XPUB, to see subscriptions arrive) + replay ROUTER with a replay buffer, like vLLM."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = b"kv", connect_to: str | None = None) -> None:
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:
            self.pub.connect(connect_to)
            self.address = connect_to
        else:
            self.pub.bind("tcp://127.0.0.1:*")
            self.address = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self.answer_replays = True
        self.replay_requests: list[int] = []
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def wait_subscribed(self) -> None:
        await asyncio.wait_for(self.pub.recv(), 2.0)  # b"\x01" + filter

    async def publish(self, events: list[KVEvent], *, send: bool = True, payload: bytes | None = None) -> int:
        seq = self.next_seq
        self.next_seq += 1
        data = payload if payload is not None else encode_batch(events, ts=float(seq))
        self.buffer.append((seq, data))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    async def resend_last(self) -> None:
        """The last published message again, to the letter (a duplicate)."""
        seq, data = self.buffer[-1]
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])

    def restart(self) -> None:
        self.buffer.clear()
        self.next_seq = 0

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            if not self.answer_replays:
                continue
            for seq, data in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), data])
            await self.router.send_multipart([client, b"", END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.term()


@pytest.fixture(params=["alone", "intake"])
async def intake(request: pytest.FixtureRequest) -> AsyncIterator[KVIntake | None]:
    """Every consumer test runs both ways: the consumer waiting on its socket alone, and woken by a
    shared intake (as kvroute runs them) with a short window."""
    if request.param == "alone":
        yield None
        return
    shared = KVIntake(window_s=0.005)
    yield shared
    await shared.aclose()


@pytest.fixture
async def pod(ctx: zmq.asyncio.Context) -> AsyncIterator[FakeVLLMPublisher]:
    p = FakeVLLMPublisher(ctx)
    yield p
    await p.close()


async def until(pred: Callable[[], bool], timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def keys_of(tokens: list[int]) -> list[int]:
    return hashing.chain_tokens(hashing.seed_key(""), tokens, BS, 1000)


def store(tokens: list[int], hashes: list[int], parent: int | None = None) -> list[KVEvent]:
    return [BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium="GPU")]


def impatient(
    pod: FakeVLLMPublisher, idx: PreciseIndex, ctx: zmq.asyncio.Context, intake: KVIntake | None
) -> KVEventSubscriber:
    """A subscriber to ``pod`` that gives a replay up after 0.2 s."""
    return KVEventSubscriber(
        POD, idx, pub_address=pod.address, replay_address=pod.replay_address, ctx=ctx, intake=intake,
        replay_timeout_s=0.2,
    )  # fmt: skip


async def started(sub: KVEventSubscriber, pod: FakeVLLMPublisher) -> KVEventSubscriber:
    await sub.start()
    await pod.wait_subscribed()
    return sub


async def test_in_order_batches_are_applied(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, intake: KVIntake | None
) -> None:
    idx = PreciseIndex(10_000)
    sub = await started(KVEventSubscriber(POD, idx, pub_address=pod.address, ctx=ctx, intake=intake), pod)
    try:
        t = prompt(4)
        await pod.publish(store(t[: 2 * BS], [1, 2]))
        await pod.publish(store(t[2 * BS :], [3, 4], parent=2))
        await until(lambda: sub.counters.batches_applied == 2)
        assert idx.match(keys_of(t), [POD]) == {POD: 4}
        assert sub.stats()["gaps"] == 0 and sub.stats()["events_applied"] == 2
    finally:
        await sub.aclose()


async def test_gap_is_filled_by_replay(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, intake: KVIntake | None
) -> None:
    idx = PreciseIndex(10_000)
    sub = KVEventSubscriber(
        POD, idx, pub_address=pod.address, replay_address=pod.replay_address, ctx=ctx, intake=intake
    )
    await started(sub, pod)
    try:
        t = prompt(3)
        await pod.publish(store(t[:BS], [1]))
        await pod.publish(store(t[BS : 2 * BS], [2], parent=1), send=False)  # lost on the wire
        await pod.publish(store(t[2 * BS :], [3], parent=2))
        await until(lambda: sub.counters.batches_applied == 3)
        assert pod.replay_requests == [1]
        assert sub.stats()["gaps"] == 1 and sub.stats()["replays"] == 1 and sub.stats()["resyncs"] == 0
        assert idx.match(keys_of(t), [POD]) == {POD: 3}
    finally:
        await sub.aclose()


async def test_unreplayable_gap_resyncs_the_pod(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, intake: KVIntake | None
) -> None:
    idx = PreciseIndex(10_000)
    pod.answer_replays = False  # the ROUTER never answers: replay times out
    sub = impatient(pod, idx, ctx, intake)
    await started(sub, pod)
    try:
        old, new = prompt(2), prompt(2, start=10_000)
        await pod.publish(store(old, [1, 2]))
        await pod.publish([], send=False)
        await pod.publish(store(new, [5, 6]))
        await until(lambda: sub.counters.batches_applied == 2)
        s = sub.stats()
        assert (s["gaps"], s["replay_failures"], s["resyncs"]) == (1, 1, 1)
        assert idx.match(keys_of(old), [POD]) == {}  # cleared: the lost batch may have removed it
        assert idx.match(keys_of(new), [POD]) == {POD: 2}  # the batch after the gap still counts
    finally:
        await sub.aclose()


async def test_restart_purges_and_catch_up_replays_history(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, intake: KVIntake | None
) -> None:
    idx = PreciseIndex(10_000)
    before, after = prompt(2), prompt(2, start=50_000)
    # Published before kvroute subscribed: only the replay buffer has them.
    await pod.publish(store(before, [1, 2]), send=False)
    sub = KVEventSubscriber(
        POD, idx, pub_address=pod.address, replay_address=pod.replay_address, ctx=ctx, intake=intake
    )
    await started(sub, pod)
    try:
        await pod.publish([])
        await until(lambda: sub.counters.batches_applied == 2)
        assert sub.stats()["catch_ups"] == 1
        assert idx.match(keys_of(before), [POD]) == {POD: 2}
        pod.restart()  # new process: seq starts at 0 again, cache empty
        await pod.publish(store(after, [7, 8]))
        await until(lambda: sub.counters.restarts == 1 and sub.counters.batches_applied == 3)
        assert idx.match(keys_of(before), [POD]) == {}
        assert idx.match(keys_of(after), [POD]) == {POD: 2}
        await pod.publish([AllBlocksCleared()])
        await until(lambda: sub.counters.batches_applied == 4)
        assert idx.match(keys_of(after), [POD]) == {}
    finally:
        await sub.aclose()


async def test_restart_after_batch_0_only_is_no_duplicate(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, intake: KVIntake | None
) -> None:
    """A publisher that restarts when kvroute has seen only its batch 0 sends a batch 0 again: the same
    batch is a duplicate (dropped), another batch under that number is the new process's (purge, apply)."""
    idx = PreciseIndex(10_000)
    sub = await started(KVEventSubscriber(POD, idx, pub_address=pod.address, ctx=ctx, intake=intake), pod)
    try:
        before, after = prompt(2), prompt(2, start=50_000)
        await pod.publish(store(before, [1, 2]))
        await until(lambda: sub.counters.batches_applied == 1)
        await pod.resend_last()
        await until(lambda: sub.counters.duplicates == 1)
        assert sub.counters.batches_applied == 1 and sub.counters.restarts == 0
        pod.restart()  # numbers from 0 again (same ts too: the batches differ only in their events)
        await pod.publish(store(after, [7, 8]))
        await until(lambda: sub.counters.restarts == 1 and sub.counters.batches_applied == 2)
        assert idx.match(keys_of(before), [POD]) == {}  # the old process's blocks are purged
        assert idx.match(keys_of(after), [POD]) == {POD: 2}
        assert sub.counters.duplicates == 1
    finally:
        await sub.aclose()


async def test_undecodable_message_is_counted_and_resyncs(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, intake: KVIntake | None
) -> None:
    idx = PreciseIndex(10_000)
    sub = await started(KVEventSubscriber(POD, idx, pub_address=pod.address, ctx=ctx, intake=intake), pod)
    try:
        t = prompt(2)
        await pod.publish(store(t, [1, 2]))
        await pod.publish([], payload=b"\xc1garbage")
        await pod.pub.send_multipart([b"kv", b"short"])
        await until(lambda: sub.counters.decode_errors == 2)
        assert idx.match(keys_of(t), [POD]) == {}
        await pod.publish(store(t, [1, 2]))  # the consumer keeps going
        await until(lambda: idx.match(keys_of(t), [POD]) == {POD: 2})
    finally:
        await sub.aclose()


async def test_listener_binds_and_names_pods_by_topic(ctx: zmq.asyncio.Context, intake: KVIntake | None) -> None:
    idx = PreciseIndex(10_000)
    listener = KVEventListener("tcp://127.0.0.1:*", idx, ctx=ctx, intake=intake)
    await listener.start()
    assert listener.bound_address is not None
    pods = [
        FakeVLLMPublisher(ctx, topic=f"kv@{ep}".encode(), connect_to=listener.bound_address)
        for ep in ("10.0.0.1:8000", "10.0.0.2:8000")
    ]
    stranger = FakeVLLMPublisher(ctx, topic=b"other", connect_to=listener.bound_address)
    try:
        for p in pods:
            await p.wait_subscribed()
        t1, t2 = prompt(2), prompt(3, start=7_000)
        await pods[0].publish(store(t1, [1, 2]))
        await pods[1].publish(store(t2, [1, 2, 3]))  # same engine hashes, other pod: no clash
        await stranger.pub.send_multipart([b"other", (0).to_bytes(8, "big"), encode_batch([])])
        await until(lambda: listener.counters.batches_applied == 2)
        assert idx.match(keys_of(t1), ["10.0.0.1:8000", "10.0.0.2:8000"]) == {"10.0.0.1:8000": 2}
        assert idx.match(keys_of(t2), ["10.0.0.1:8000", "10.0.0.2:8000"]) == {"10.0.0.2:8000": 3}
        assert listener.stats()["unknown_topics"] == 0  # filtered by the SUB prefix inside ZMQ
    finally:
        for p in [*pods, stranger]:
            await p.close()
        await listener.aclose()


def test_topic_convention() -> None:
    assert endpoint_from_topic(b"kv@10.1.2.3:8000") == "10.1.2.3:8000"
    assert endpoint_from_topic(b"kv@[fd00::1]:8000") == "[fd00::1]:8000"
    assert endpoint_from_topic(b"kv@nohost") is None
    assert endpoint_from_topic(b"other@1.2.3.4:1") is None


class PacedReplayPublisher(FakeVLLMPublisher):
    """Sends each replayed batch only once the subscriber applied the one before (``applied``), and
    gives up (no more replies) if it does not within ``patience_s``; answers the first ``answers`` asks
    (None: every one)."""

    applied: Callable[[], int] = staticmethod(lambda: 0)
    patience_s = 0.5
    answers: int | None = None

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            if self.answers is not None and len(self.replay_requests) > self.answers:
                continue
            for n, (seq, data) in enumerate(b for b in list(self.buffer) if b[0] >= int.from_bytes(start, "big")):
                try:
                    await until(lambda n=n: self.applied() >= n, self.patience_s)
                except AssertionError:
                    break
                await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), data])
            else:
                await self.router.send_multipart([client, b"", END_SEQ, b""])


async def test_catch_up_applies_each_batch_as_it_arrives(ctx: zmq.asyncio.Context, intake: KVIntake | None) -> None:
    """A catch-up on a long replay buffer (vLLM keeps 10,000 batches) is applied batch by batch, never
    gathered first: gathered, a pod's whole buffer spiked memory and stalled the loop on every new
    subscription. This ROUTER sends a batch only after the previous one is applied."""
    pod = PacedReplayPublisher(ctx)
    idx = PreciseIndex(10_000)
    sub = KVEventSubscriber(
        POD, idx, pub_address=pod.address, replay_address=pod.replay_address, ctx=ctx, intake=intake
    )
    pod.applied = lambda: sub.counters.batches_applied
    try:
        t = prompt(200)
        for i in range(200):  # one block per batch, each the child of the one before
            await pod.publish(store(t[i * BS : (i + 1) * BS], [i + 1], parent=i or None), send=False)
        await started(sub, pod)
        await pod.publish([])
        await until(lambda: sub.counters.batches_applied == 201, timeout=10)
        assert sub.stats()["catch_ups"] == 1 and sub.stats()["replay_failures"] == 0
        assert idx.match(keys_of(t), [POD]) == {POD: 200}
    finally:
        await sub.aclose()
        await pod.close()


class BlastReplayPublisher(FakeVLLMPublisher):
    """Answers a replay as vLLM's publisher thread does: the whole buffer sent in one loop that never waits
    (here: never yields to the event loop, where the consumer reads)."""

    async def _serve_replay(self) -> None:
        router: zmq.Socket[bytes] = zmq.Socket.shadow(self.router.underlying)
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, data in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    router.send_multipart([client, b"", seq.to_bytes(8, "big"), data])
            router.send_multipart([client, b"", END_SEQ, b""])


async def test_a_catch_up_on_a_whole_replay_buffer_sent_at_once_loses_nothing(intake: KVIntake | None) -> None:
    """vLLM's ROUTER answers a replay with its whole buffer (10,000 batches) at once, and a ROUTER drops what its
    peer has no room for (ZMQ's high-water marks: 1,000 messages a side by default, beyond what the kernel's
    buffers hold): a catch-up got the first few thousand batches, lost the rest and the end marker, and was
    undone. The replay socket takes a whole buffer in. (The pod in a ZMQ context of its own, as vLLM's process
    has: its I/O thread moves its sends while the event loop is held.)"""
    pod_ctx, ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    pod = BlastReplayPublisher(pod_ctx)
    idx = PreciseIndex(1 << 17)
    sub = KVEventSubscriber(POD, idx, pub_address=pod.address, replay_address=pod.replay_address, ctx=ctx,
                            intake=intake)  # fmt: skip
    try:
        n = 10_000
        t = prompt(n)
        # ~1.5 KB a batch, 15 MB in all (past the loopback's socket buffers), as batches of a busy pod are: its
        # block, and removals of blocks no one holds.
        gone: list[KVEvent] = [BlockRemoved(tuple(range(10**12, 10**12 + 150)))]
        for i in range(n):  # one block per batch, each the child of the one before
            await pod.publish(store(t[i * BS : (i + 1) * BS], [i + 1], parent=i or None) + gone, send=False)
        await started(sub, pod)
        await pod.publish([])
        await until(lambda: sub.counters.batches_applied == n + 1 or sub.counters.replay_failures > 0, timeout=30)
        assert sub.stats()["catch_ups"] == 1 and sub.stats()["replay_failures"] == 0, sub.stats()
        assert idx.match(keys_of(t[: 1000 * BS]), [POD]) == {POD: 1000}
    finally:
        await sub.aclose()
        await pod.close()
        pod_ctx.term()
        ctx.term()


@contextlib.asynccontextmanager
async def breaking_off(
    ctx: zmq.asyncio.Context, intake: KVIntake | None, answers: int | None
) -> AsyncIterator[tuple[KVEventSubscriber, PreciseIndex, PacedReplayPublisher, list[int], list[int]]]:
    """A pod holding ten batches whose replay answers break off after six (answering its first ``answers``
    asks), a subscriber started on it and a live batch sent: (subscriber, index, pod, the ten batches' tokens,
    the live batch's)."""
    pod = PacedReplayPublisher(ctx)
    idx = PreciseIndex(10_000)
    sub = impatient(pod, idx, ctx, intake)
    pod.applied = lambda: min(sub.counters.batches_applied, 5)  # stalls after five batches
    pod.patience_s = 0.05
    pod.answers = answers
    try:
        old, new = prompt(10), prompt(1, start=90_000)
        for i in range(10):
            await pod.publish(store(old[i * BS : (i + 1) * BS], [i + 1], parent=i or None), send=False)
        await started(sub, pod)
        await pod.publish(store(new, [99]))
        yield sub, idx, pod, old, new
    finally:
        await sub.aclose()
        await pod.close()


async def test_a_catch_up_cut_short_is_undone(ctx: zmq.asyncio.Context, intake: KVIntake | None) -> None:
    """The ROUTER stops answering half-way and answers no second ask: what the catch-up applied goes again (a
    later batch of the lost part may have removed it), the live batch still counts."""
    async with breaking_off(ctx, intake, answers=1) as (sub, idx, _, old, new):
        await until(lambda: sub.counters.replay_failures == 1 and sub.counters.batches_applied == 7)
        assert sub.stats()["catch_ups"] == 0
        assert idx.match(keys_of(old), [POD]) == {}
        assert idx.match(keys_of(new), [POD]) == {POD: 1}


async def test_a_catch_up_cut_short_is_asked_again_for_the_rest(
    ctx: zmq.asyncio.Context, intake: KVIntake | None
) -> None:
    """Each answer breaks off after six batches (as an answer whose end the ROUTER dropped): the rest is asked
    for again, from the first batch missing, until it has come."""
    async with breaking_off(ctx, intake, answers=None) as (sub, idx, pod, old, new):
        await until(lambda: sub.counters.catch_ups == 1 or sub.counters.replay_failures > 0, timeout=10)
        assert sub.stats()["catch_ups"] == 1 and sub.stats()["replay_failures"] == 0, sub.stats()
        assert sub.stats()["replay_resumes"] >= 1 and pod.replay_requests[:2] == [0, 6]  # (0-5 came first)
        assert idx.match(keys_of(old), [POD]) == {POD: 10}
        assert idx.match(keys_of(new), [POD]) == {POD: 1}


async def test_intake_takes_several_pods_batches_in_one_window(ctx: zmq.asyncio.Context) -> None:
    """What two pods send within a window is applied in one drain, each pod's batches in order."""
    intake = KVIntake(window_s=0.5)
    pods = [FakeVLLMPublisher(ctx), FakeVLLMPublisher(ctx)]
    idx = PreciseIndex(10_000)
    names = ["127.0.0.1:8001", "127.0.0.1:8002"]
    subs = [
        KVEventSubscriber(n, idx, pub_address=p.address, ctx=ctx, intake=intake)
        for n, p in zip(names, pods, strict=True)
    ]
    try:
        for sub, p in zip(subs, pods, strict=True):
            await started(sub, p)
        t = prompt(6)
        for p in pods:  # three chained batches each, well within one window
            await p.publish(store(t[: 2 * BS], [1, 2]))
            await p.publish(store(t[2 * BS : 4 * BS], [3, 4], parent=2))
            await p.publish(store(t[4 * BS :], [5, 6], parent=4))
        await until(lambda: sum(s.counters.batches_applied for s in subs) == 6)
        assert intake.windows <= 2  # one, or two if the host stalled across the window's end
        assert idx.match(keys_of(t), names) == {names[0]: 6, names[1]: 6}
        assert all(s.stats()["gaps"] == 0 for s in subs)
    finally:
        for sub in subs:
            await sub.aclose()
        for p in pods:
            await p.close()
        await intake.aclose()


async def two_pods(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher, idx: PreciseIndex, intake: KVIntake
) -> tuple[KVEventSubscriber, FakeVLLMPublisher, KVEventSubscriber]:
    """``pod``'s subscriber, a second pod (127.0.0.1:8002) and its subscriber, both woken by ``intake``."""
    first = await started(KVEventSubscriber(POD, idx, pub_address=pod.address, ctx=ctx, intake=intake), pod)
    other = FakeVLLMPublisher(ctx)
    second = KVEventSubscriber("127.0.0.1:8002", idx, pub_address=other.address, ctx=ctx, intake=intake)
    return first, other, await started(second, other)


async def test_intake_applies_nothing_of_a_cancelled_consumer(ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher) -> None:
    """A pod purged while its batches wait for the window (cancel) gets none of them applied."""
    intake = KVIntake(window_s=1.0)
    idx = PreciseIndex(10_000)
    sub, other, kept = await two_pods(ctx, pod, idx, intake)
    try:
        t = prompt(2)
        await pod.publish(store(t, [1, 2]))
        await other.publish(store(t, [1, 2]))
        await until(lambda: intake.waiting == 2)  # both woke the intake: the window runs
        sub.cancel()
        assert not sub.running
        await until(lambda: kept.counters.batches_applied == 1)
        assert sub.counters.batches_applied == 0
        assert idx.match(keys_of(t), [POD, "127.0.0.1:8002"]) == {"127.0.0.1:8002": 2}
    finally:
        await sub.aclose()
        await kept.aclose()
        await other.close()
        await intake.aclose()


async def test_intake_drains_a_backlog_longer_than_one_turn(ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher) -> None:
    """More batches than one drain takes (DRAIN_MAX) arrive at once: the rest come in the next windows,
    in order, none lost, and the socket is watched again after (a later batch is applied too)."""
    intake = KVIntake(window_s=0.001)
    idx = PreciseIndex(100_000)
    sub = await started(KVEventSubscriber(POD, idx, pub_address=pod.address, ctx=ctx, intake=intake), pod)
    try:
        n = DRAIN_MAX + 100
        t = prompt(n + 1)
        await pod.publish(store(t[:BS], [1]))
        for i in range(1, n):
            await pod.publish(store(t[i * BS : (i + 1) * BS], [i + 1], parent=i), send=True)
        await until(lambda: sub.counters.batches_applied == n, timeout=10.0)
        assert intake.windows >= 2 and sub.stats()["gaps"] == 0
        await pod.publish(store(t[n * BS : (n + 1) * BS], [n + 1], parent=n))
        await until(lambda: sub.counters.batches_applied == n + 1)
        assert idx.match(keys_of(t), [POD]) == {POD: n + 1}
    finally:
        await sub.aclose()
        await intake.aclose()


def test_intake_window_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="window_s"):
        KVIntake(window_s=-0.1)


async def test_intake_goes_on_when_one_socket_fails(ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher) -> None:
    """An unexpected error draining one pod's socket is counted and logged; the others' batches, and
    that pod's later ones, still come in."""
    intake = KVIntake(window_s=0.01)
    idx = PreciseIndex(10_000)
    broken, other, fine = await two_pods(ctx, pod, idx, intake)
    real = broken._on_frames

    async def fail_once(frames: list[bytes]) -> None:
        broken._on_frames = real  # type: ignore[method-assign]
        raise RuntimeError("boom")

    broken._on_frames = fail_once  # type: ignore[method-assign]
    try:
        t = prompt(4)
        await pod.publish(store(t[: 2 * BS], [1, 2]))
        await other.publish(store(t[: 2 * BS], [1, 2]))
        await until(lambda: fine.counters.batches_applied == 1 and broken.counters.socket_errors == 1)
        # Batch 0 was lost to the error: this one still comes in.
        await pod.publish(store(t[2 * BS :], [3, 4], parent=2))
        await until(lambda: broken.counters.messages == 1)
        assert fine.counters.batches_applied == 1 and idx.match(keys_of(t), ["127.0.0.1:8002"]) == {"127.0.0.1:8002": 2}
    finally:
        await broken.aclose()
        await fine.aclose()
        await other.close()
        await intake.aclose()


async def test_intake_takes_in_other_pods_while_one_waits_on_a_replay(
    ctx: zmq.asyncio.Context, pod: FakeVLLMPublisher
) -> None:
    """A gap on one pod waits for its replay (here one that never answers, up to its 2 s timeout): the
    other pods' batches are applied meanwhile, as with a consumer per pod; the waiting pod is resynced
    after, and its later batches come in."""
    intake = KVIntake(window_s=0.005)
    idx = PreciseIndex(10_000)
    pod.answer_replays = False
    slow = KVEventSubscriber(
        POD, idx, pub_address=pod.address, replay_address=pod.replay_address, ctx=ctx, intake=intake,
        replay_timeout_s=2.0,
    )  # fmt: skip
    await started(slow, pod)
    other = FakeVLLMPublisher(ctx)
    fine = await started(
        KVEventSubscriber("127.0.0.1:8002", idx, pub_address=other.address, ctx=ctx, intake=intake), other
    )
    try:
        t = prompt(6)
        await pod.publish(store(t[: 2 * BS], [1, 2]))
        await until(lambda: slow.counters.batches_applied == 1)
        await pod.publish(store(t[2 * BS : 4 * BS], [3, 4], parent=2), send=False)  # lost: a gap
        await pod.publish(store(t[4 * BS :], [5, 6], parent=4))
        await until(lambda: len(pod.replay_requests) == 1)  # the slow pod now waits on its replay
        await other.publish(store(t[: 2 * BS], [1, 2]))
        await until(lambda: fine.counters.batches_applied == 1)
        assert slow.counters.resyncs == 0  # still waiting: the other pod was not held back
        await until(lambda: slow.counters.resyncs == 1, timeout=5.0)
        await pod.publish(store(t[: 2 * BS], [7, 8]))
        await until(lambda: slow.counters.batches_applied == 3)
    finally:
        await slow.aclose()
        await fine.aclose()
        await other.close()
        await intake.aclose()
