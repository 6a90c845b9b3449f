"""Precise mode's KV events: what a replica pays to take them in, and what it costs a pod that every
replica subscribes (ZMQ PUB fans each message out to all subscribers).

    python -m bench.kv_fanout [--batches 20000] [--subscribers 1,3]
    python -m bench.kv_fanout --shapes [--batches 1000] [--rounds 5] [--subscriber-rounds 2] [--rate 200] [--json PATH]

Measures, on loopback: the publisher's CPU per event batch with 1 and with N subscriber processes
(what a vLLM pod pays per extra kvroute replica), and one replica's CPU to decode a batch and apply
it to the precise index (what each replica pays). A batch is one engine step's BlockStored of 16
blocks of 16 tokens. The alternative, one precise index held in Redis, costs a round trip on every
decision: ``python -m bench.decision --redis-url`` measures that.

``--shapes`` instead measures one replica's intake by the batches a serving pod publishes
(``SHAPES``): a decode step that filled one block of one stream, a step that filled one block of each
of four streams, a turn's prefill (32 new blocks after a cached prefix), a new document (128 blocks
from the root) and an eviction (BlockRemoved of 8 blocks); each decoded and applied to a precise
index already holding the blocks they extend (thread CPU per batch, the median of ``--rounds``
interleaved rounds, and the best). Its last row takes the decode-step batches the way kvroute does:
published by another process over loopback ZMQ at ``--rate`` batches a second to kvroute's
``KVEventSubscriber`` on uvloop, the event loop's CPU per batch received, decoded and applied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import median

import uvloop
import zmq

from bench.envoy import free_port
from bench.procs import die_with_parent
from extproc.endpoints.events import DEFAULT_WINDOW_S, KVEventSubscriber, KVIntake
from extproc.hashing import chain_tokens
from extproc.index.precise import PreciseIndex, precise_seed
from extproc.kvevents.decode import BlockRemoved, BlockStored, KVEvent, decode_message
from extproc.kvevents.encode import encode_batch

BLOCKS, BLOCK_SIZE = 16, 16

# A subscriber process: drains the PUB socket until it has every batch, then says how many.
SUBSCRIBER = """
import sys, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.RCVHWM, 0)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
n, want = 0, int(sys.argv[2])
print("ready", flush=True)
while n < want:
    frames = sock.recv_multipart()
    n += frames[0] != b"ping"
print(n, flush=True)
"""


def batches(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        tokens = [(i * 7919 + j) % 32000 for j in range(BLOCKS * BLOCK_SIZE)]
        ev = BlockStored(tuple(range(i * BLOCKS + 1, (i + 1) * BLOCKS + 1)), None, tuple(tokens), BLOCK_SIZE)
        out.append(encode_batch([ev], ts=float(i)))
    return out


def publisher_cpu_us(payloads: list[bytes], subscribers: int) -> float:
    """Publisher CPU (µs) per batch while ``subscribers`` processes receive every one."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    procs = [subprocess.Popen(die_with_parent([sys.executable, "-c", SUBSCRIBER, f"tcp://127.0.0.1:{port}",
                                               str(len(payloads))]), stdout=subprocess.PIPE, text=True)
             for _ in range(subscribers)]  # fmt: skip
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # PUB drops what it sends before a subscription arrives: let them settle
    for _ in range(20):
        pub.send_multipart([b"ping", b"", b""])
    t0 = time.process_time()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
    cpu = time.process_time() - t0
    got = [int(p.communicate(timeout=120)[0].split()[-1]) for p in procs]
    assert got == [len(payloads)] * subscribers, got
    pub.close(linger=0)
    ctx.term()
    return 1e6 * cpu / len(payloads)


def apply_us(payloads: list[bytes]) -> float:
    """One replica: decode a batch and apply it to the precise index (µs per batch)."""
    index = PreciseIndex(1_000_000)
    runs = []
    for _ in range(3):
        t0 = time.process_time()
        for seq, payload in enumerate(payloads):
            msg = decode_message([b"kv", seq.to_bytes(8, "big"), payload])
            index.apply_batch("127.0.1.1:8000", msg.batch)
        runs.append(1e6 * (time.process_time() - t0) / len(payloads))
    # Sanity: what was applied is what a request with those tokens matches.
    first = decode_message([b"kv", bytes(8), payloads[0]]).batch.events[0]
    assert isinstance(first, BlockStored)
    keys = chain_tokens(precise_seed(), first.token_ids, BLOCK_SIZE, BLOCKS)
    assert index.match(keys, ["127.0.1.1:8000"]) == {"127.0.1.1:8000": BLOCKS}
    return median(runs)


POD = "127.0.1.1:8000"
# (name, events per batch, blocks per event, from the root): what a serving pod publishes.
SHAPES: tuple[tuple[str, int, int, bool], ...] = (
    ("decode step: 1 stream filled a block", 1, 1, False),
    ("decode step: 4 streams filled a block each", 4, 1, False),
    ("turn prefill: 32 new blocks after a cached prefix", 1, 32, False),
    ("new document: 128 blocks from the root", 1, 128, True),
    ("eviction: BlockRemoved of 8 blocks", 1, 8, False),
)

# --shapes' publisher process: one PUB socket per pod; reads (pod, payload) records from a file, then
# on "go" (stdin) sends them in order, each pod's numbered from 0, at a steady rate over all pods.
PUBLISHER = """
import struct, sys, time, zmq
path, rate, ports = sys.argv[1], float(sys.argv[2]), [int(p) for p in sys.argv[3].split(",")]
data = open(path, "rb").read()
records, off = [], 0
while off < len(data):
    pod, n = struct.unpack_from(">BI", data, off)
    records.append((pod, data[off + 5 : off + 5 + n]))
    off += 5 + n
ctx = zmq.Context()
socks = []
for port in ports:
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    socks.append(sock)
seqs = [0] * len(socks)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for i, (pod, payload) in enumerate(records):
    wait = t0 + i / rate - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
    socks[pod].send_multipart([b"kv", seqs[pod].to_bytes(8, "big"), payload])
    seqs[pod] += 1
print("sent", flush=True)
sys.stdin.readline()
"""


class _Pod:
    """One pod's block chains, as its KV events would extend them: fresh tokens for every block."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_hash = 1
        self.stored: list[int] = []  # engine hashes stored and not yet removed, oldest first

    def stored_event(self, blocks: int, parent: int | None) -> BlockStored:
        hashes = tuple(range(self.next_hash, self.next_hash + blocks))
        self.next_hash += blocks
        self.stored += hashes
        tokens = tuple(self.rng.randrange(32000) for _ in range(blocks * BLOCK_SIZE))
        return BlockStored(hashes, parent, tokens, BLOCK_SIZE)

    def removed_event(self, blocks: int) -> BlockRemoved:
        gone, self.stored = self.stored[:blocks], self.stored[blocks:]
        return BlockRemoved(tuple(gone))


def shape_batches(pod: _Pod, n: int, events: int, blocks: int, root: bool) -> tuple[list[bytes], list[bytes]]:
    """(setup, timed) payloads: ``n`` batches of ``events`` events of ``blocks`` blocks each, every stream
    a chain (a child of the previous batch's last block; ``root``: each event a new root)."""
    parents: list[int | None] = [None] * events
    setup: list[bytes] = []
    if not root:  # the streams' cached prefixes
        first: list[KVEvent] = []
        for i in range(events):
            ev = pod.stored_event(16, None)
            parents[i] = ev.block_hashes[-1]
            first.append(ev)
        setup.append(encode_batch(first))
    timed: list[bytes] = []
    for _ in range(n):
        evs: list[KVEvent] = []
        for i in range(events):
            ev = pod.stored_event(blocks, None if root else parents[i])
            parents[i] = ev.block_hashes[-1]
            evs.append(ev)
        timed.append(encode_batch(evs))
    return setup, timed


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload]


def shapes_us(n: int, rounds: int) -> list[tuple[str, float, float]]:
    """Per ``SHAPES`` entry: (name, median, best) thread CPU µs per batch decoded and applied."""
    index = PreciseIndex(1_000_000)
    pod = _Pod(7)
    times: dict[str, list[float]] = {name: [] for name, *_ in SHAPES}
    seq = 0
    for _ in range(rounds):
        for name, events, blocks, root in SHAPES:
            if name.startswith("eviction"):  # remove blocks a document stored (not timed)
                for payload in shape_batches(pod, n * blocks // 128 + 1, 1, 128, True)[1]:
                    index.apply_batch(POD, decode_message(_frames(seq, payload)).batch)
                    seq += 1
                timed = [encode_batch([pod.removed_event(blocks)]) for _ in range(n)]
                setup: list[bytes] = []
            else:
                setup, timed = shape_batches(pod, n, events, blocks, root)
            for payload in setup:
                index.apply_batch(POD, decode_message(_frames(seq, payload)).batch)
                seq += 1
            frames = [_frames(seq + i, p) for i, p in enumerate(timed)]
            seq += len(frames)
            t0 = time.thread_time()
            for f in frames:
                index.apply_batch(POD, decode_message(f).batch)
            times[name].append(1e6 * (time.thread_time() - t0) / n)
    assert index.counters["unknown_parent"] == 0 and index.counters["malformed"] == 0, index.counters
    return [(name, median(ts), min(ts)) for name, ts in times.items()]


def subscriber_us(n: int, rate: float, pods: int = 1, window_s: float | None = None) -> float:
    """The event loop's CPU per decode-step batch (``n`` in all) sent by ``pods`` pods of another process
    at ``rate`` batches a second in all, received by kvroute's ``KVEventSubscriber`` (one per pod, on
    uvloop), decoded and applied: each on its own (``window_s`` None) or through a shared ``KVIntake``."""
    made = [shape_batches(_Pod(11 + pod), n // pods, 1, 1, False) for pod in range(pods)]
    records = [(pod, p) for pod, (setup, _) in enumerate(made) for p in setup]
    records += [(pod, b) for batches in zip(*(t for _, t in made), strict=True) for pod, b in enumerate(batches)]
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        for pod, payload in records:
            f.write(pod.to_bytes(1, "big") + len(payload).to_bytes(4, "big") + payload)
        f.flush()
        ports = [free_port() for _ in range(pods)]
        proc = subprocess.Popen(die_with_parent([sys.executable, "-c", PUBLISHER, f.name, str(rate),
                                                 ",".join(map(str, ports))]),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "ready"
            return uvloop.run(_subscribe(ports, len(records), window_s, proc.stdin.write, proc.stdin.flush))
        finally:
            proc.kill()
            proc.wait()


async def _subscribe(
    ports: list[int], total: int, window_s: float | None, write: Callable[[str], int], flush: Callable[[], None]
) -> float:
    index = PreciseIndex(1_000_000)
    intake = KVIntake(window_s) if window_s is not None else None
    subs = [KVEventSubscriber(f"127.0.1.{i + 1}:8000", index, pub_address=f"tcp://127.0.0.1:{port}",
                              catch_up=False, intake=intake)
            for i, port in enumerate(ports)]  # fmt: skip
    for sub in subs:
        await sub.start()
    await asyncio.sleep(0.5)  # PUB drops what it sends before the subscription reaches it
    t0 = time.thread_time()
    write("go\n")
    flush()
    deadline = time.monotonic() + 60 + total
    while (applied := sum(s.counters.batches_applied for s in subs)) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"subscribers got {applied} of {total} batches: {[s.stats() for s in subs]}")
        await asyncio.sleep(0.05)
    cpu = time.thread_time() - t0
    for sub in subs:
        await sub.aclose()
    if intake is not None:
        await intake.aclose()
    assert all(s.counters.gaps == 0 for s in subs) and index.counters["unknown_parent"] == 0, index.counters
    return 1e6 * cpu / total


def shape_rows(a: argparse.Namespace) -> Iterator[list[object]]:
    for name, med, best in shapes_us(a.batches, a.rounds):
        yield [f"decode + apply: {name}", round(med, 1), round(best, 1)]
    ways = [(pods, window) for pods in (1, 4) for window in (None, DEFAULT_WINDOW_S)]
    runs: dict[tuple[int, float | None], list[float]] = {w: [] for w in ways}
    for _ in range(a.subscriber_rounds):  # interleaved: the host's drift spreads over every way
        for pods, window in ways:
            runs[(pods, window)].append(subscriber_us(a.batches, a.rate, pods, window))
    for (pods, window), us in runs.items():
        how = "each batch as it arrives" if window is None else f"through a KVIntake ({1e3 * window:g} ms window)"
        yield [f"received from {pods} pod(s) at {a.rate:g} batches/s in all, {how}: decode step, 1 block",
               round(median(us), 1), round(min(us), 1)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_fanout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batches", type=int, default=None,
                    help="batches per measurement (default 20000; with --shapes 1000 per shape and round)")  # fmt: skip
    ap.add_argument("--subscribers", default="1,3", help="comma-separated subscriber counts")
    ap.add_argument(
        "--shapes",
        action="store_true",
        help="one replica's CPU per batch by the shapes a serving pod publishes (module docstring)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="--shapes: interleaved rounds (median and best)")
    ap.add_argument(
        "--rate",
        type=float,
        default=200.0,
        help="--shapes: batches per second the publisher process sends to the subscriber",
    )
    ap.add_argument("--subscriber-rounds", type=int, default=2, help="--shapes: runs of each receiving row")
    ap.add_argument("--json", type=Path, default=None, help="--shapes: also write the rows here, for bench.results")
    a = ap.parse_args()
    if a.shapes:
        a.batches = a.batches or 1000
        rows = list(shape_rows(a))
        print(f"{a.batches} batches per shape and round, {a.rounds} rounds, blocks of {BLOCK_SIZE} tokens\n")
        print("| what | CPU µs per batch (median) | best |\n|---|---|---|")
        for r in rows:
            print("| " + " | ".join(map(str, r)) + " |")
        if a.json is not None:
            a.json.write_text(json.dumps({"command": "python -m bench.kv_fanout " + " ".join(sys.argv[1:]),
                                          "columns": ["what", "cpu_us_median", "cpu_us_best"], "rows": rows},
                                         indent=1) + "\n")  # fmt: skip
        return
    a.batches = a.batches or 20_000
    payloads = batches(a.batches)
    print(f"{a.batches} batches of {BLOCKS} blocks x {BLOCK_SIZE} tokens ({len(payloads[0])} bytes each)\n")
    print("| what | CPU µs per batch |")
    print("|---|---|")
    for n in (int(x) for x in a.subscribers.split(",")):
        print(f"| publisher (vLLM pod), {n} subscriber(s) | {publisher_cpu_us(payloads, n):.1f} |")
    print(f"| one replica: decode + apply to the precise index | {apply_us(payloads):.1f} |")


if __name__ == "__main__":
    main()
