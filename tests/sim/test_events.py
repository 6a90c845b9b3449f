"""KV events on the wire, decoded by an independent minimal decoder (msgpack only)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from bench.sim import Fleet, FleetConfig

END = b"\xff" * 8
ARRAY_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int]:
    batch = msgpack.unpackb(payload, raw=False)
    if isinstance(batch, dict):
        ts, events, rank = batch["ts"], batch["events"], batch["data_parallel_rank"]
    else:
        ts, events, rank = batch
    out = []
    for e in events:
        if isinstance(e, list):
            d = dict(zip(ARRAY_FIELDS[e[0]], e[1:], strict=True))
            d["type"] = e[0]
            e = d
        out.append(e)
    return ts, out, rank


async def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        for _ in range(100_000):
            frames = await asyncio.wait_for(sock.recv_multipart(), 5)
            assert frames[0] == b"" and len(frames) == 4
            _, topic, seq, payload = frames
            if seq == END:
                assert topic == b"" and payload == b""
                return got
            got.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError("no end marker")
    finally:
        sock.close()


async def completion(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int = 1) -> Any:
    r = await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


async def test_live_events_store_and_evict(client: httpx.AsyncClient) -> None:
    async with Fleet(FleetConfig(pods=1, capacity_blocks=6)) as fleet:
        pod = fleet.pods[0]
        assert pod.kv_events_endpoint
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pod.kv_events_endpoint)
        await asyncio.sleep(0.3)  # let the subscription reach the publisher (ZMQ slow joiner)
        try:
            a = list(range(1, 65))
            b = list(range(101, 165))
            await completion(client, pod.url, a)
            await completion(client, pod.url, b)
            msgs = []
            while True:
                try:
                    msgs.append(await asyncio.wait_for(sub.recv_multipart(), 1.0))
                except TimeoutError:
                    break
        finally:
            sub.close()
    assert [int.from_bytes(m[1], "big") for m in msgs] == list(range(len(msgs)))
    assert all(m[0] == b"kv" and len(m) == 3 for m in msgs)
    events = [e for m in msgs for e in decode(m[2])[1]]
    stored = [e for e in events if e["type"] == "BlockStored"]
    sa, sb = stored[0], stored[1]
    assert sa["token_ids"] == a and sa["parent_block_hash"] is None and len(sa["block_hashes"]) == 4
    assert sa["block_size"] == 16 and sa["medium"] == "GPU" and sa["lora_id"] is None
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in sa["block_hashes"])
    assert sb["token_ids"] == b
    # b needed 4 blocks with 2 unused: A's two tail blocks are evicted, last block first.
    removed = [e["block_hashes"] for e in events if e["type"] == "BlockRemoved"]
    assert removed == [[sa["block_hashes"][3]], [sa["block_hashes"][2]]]
    assert decode(msgs[0][2])[2] == 0


async def test_parent_chain_across_requests(client: httpx.AsyncClient) -> None:
    async with Fleet(FleetConfig(pods=1)) as fleet:
        pod = fleet.pods[0]
        base = list(range(1, 33))
        await completion(client, pod.url, base)
        await completion(client, pod.url, [*base, *range(200, 216), 7])
        got = await replay(pod.replay_endpoint or "", 0)
    events = [e for _, _, p in got for e in decode(p)[1]]
    first, second = events[0], events[1]
    assert second["parent_block_hash"] == first["block_hashes"][-1]
    assert second["token_ids"] == list(range(200, 216))


@pytest.mark.parametrize("encoding", ["array", "map-batch"])
async def test_other_encodings_and_replay(client: httpx.AsyncClient, encoding: str) -> None:
    async with Fleet(FleetConfig(pods=1, kv_events_encoding=encoding, topic="kvx")) as fleet:
        pod = fleet.pods[0]
        await completion(client, pod.url, list(range(1, 40)))
        await completion(client, pod.url, list(range(50, 90)))
        pod.fault(restart=True)
        got = await replay(pod.replay_endpoint or "", 0)
        later = await replay(pod.replay_endpoint or "", 1)
    assert [s for _, s, _ in got] == [0, 1, 2] and [s for _, s, _ in later] == [1, 2]
    assert all(t == b"kvx" for t, _, _ in got)
    raw = msgpack.unpackb(got[0][2], raw=False)
    if encoding == "array":
        assert isinstance(raw, list) and raw[1][0][0] == "BlockStored" and len(raw[1][0]) == 7
    else:
        assert isinstance(raw, dict) and raw["events"][0]["type"] == "BlockStored"
    events = [decode(p)[1] for _, _, p in got]
    assert events[0][0]["token_ids"] == list(range(1, 33))
    assert events[2] == [{"type": "AllBlocksCleared"}]


async def test_cache_salt_in_extra_keys(client: httpx.AsyncClient) -> None:
    async with Fleet(FleetConfig(pods=1)) as fleet:
        pod = fleet.pods[0]
        body = {"prompt": list(range(1, 40)), "max_tokens": 1}
        await client.post(pod.url + "/v1/completions", json={**body, "cache_salt": "t1"})
        await client.post(pod.url + "/v1/completions", json=body)
        got = await replay(pod.replay_endpoint or "", 0)
    salted, plain = (decode(p)[1][0] for _, _, p in got)
    assert salted["extra_keys"] == [["t1"], None] and "extra_keys" not in plain
    assert salted["token_ids"] == plain["token_ids"]
    assert not set(salted["block_hashes"]) & set(plain["block_hashes"])
