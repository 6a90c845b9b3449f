"""Precise mode with several kvroute replicas: what it costs that every replica subscribes to every
pod's KV events (ZMQ PUB fans each message out to all subscribers).

    python -m bench.kv_fanout [--batches 20000] [--subscribers 1,3]

Measures, on loopback: the publisher's CPU per event batch with 1 and with N subscriber processes
(what a vLLM pod pays per extra kvroute replica), and one replica's CPU to decode a batch and apply
it to the precise index (what each replica pays). A batch is one engine step's BlockStored of 16
blocks of 16 tokens. The alternative, one precise index held in Redis, costs a round trip on every
decision: ``python -m bench.decision --redis-url`` measures that.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from statistics import median

import zmq

from bench.envoy import free_port
from bench.procs import die_with_parent
from extproc.hashing import chain_tokens
from extproc.index.precise import PreciseIndex, precise_seed
from extproc.kvevents.decode import BlockStored, decode_message
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


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_fanout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--subscribers", default="1,3", help="comma-separated subscriber counts")
    a = ap.parse_args()
    payloads = batches(a.batches)
    print(f"{a.batches} batches of {BLOCKS} blocks x {BLOCK_SIZE} tokens ({len(payloads[0])} bytes each)\n")
    print("| what | CPU µs per batch |")
    print("|---|---|")
    for n in (int(x) for x in a.subscribers.split(",")):
        print(f"| publisher (vLLM pod), {n} subscriber(s) | {publisher_cpu_us(payloads, n):.1f} |")
    print(f"| one replica: decode + apply to the precise index | {apply_us(payloads):.1f} |")


if __name__ == "__main__":
    main()
