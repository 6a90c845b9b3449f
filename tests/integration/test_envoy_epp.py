"""Real Envoy + real kvroute (subprocess) + loopback backends: the EPP data path end to end."""

import asyncio
import hashlib
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest

from bench.envoy import CONFIG_DIR, EnvoyProcess, body_mode_patch, validate
from bench.faults import metric_of
from bench.kvroute import KVRouteProcess
from tests.polling import wait_for

pytestmark = pytest.mark.integration
DEST = "x-gateway-destination-endpoint"
MARKER = "SECRET-PROMPT-MARKER-7f3a"


def chat(doc: str, q: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}], **kw}


def doc(i: int, n: int = 300) -> str:
    return f"Document {i}: " + " ".join(f"w{i}-{j}" for j in range(n))


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_envoy_configs_validate(path: Path):
    r = validate(path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_same_prefix_sticks_different_prefixes_spread(envoy, fleet):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        homes = {}
        # Idle pods tie for a new document and rendezvous hashing (seeded by this run's ports) breaks
        # the tie: 8 documents land on at most 2 of 4 pods in 2.3 % of runs, 16 in 0.009 %.
        for d in range(16):
            for q in range(3):
                r = c.post("/v1/chat/completions", json=chat(doc(d), f"question {q}"))
                assert r.status_code == 200, r.text
                homes.setdefault(d, set()).add(r.json()["backend"])
    assert all(len(h) == 1 for h in homes.values()), homes  # follow-ups land on the pod with the doc
    assert len({next(iter(h)) for h in homes.values()}) >= 3  # 16 documents spread over the 4 pods


def test_multi_turn_conversation_sticks(envoy):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        msgs = [{"role": "system", "content": doc(99)}]
        seen = set()
        for turn in range(4):
            msgs.append({"role": "user", "content": f"turn {turn} " * 20})
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs})
            seen.add(r.json()["backend"])
            msgs.append({"role": "assistant", "content": f"answer {turn} " * 20})
    assert len(seen) == 1


def test_spoofed_routing_headers_are_stripped(envoy, fleet):
    fleet.clear()
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        body = chat(doc(1), "q")
        home = c.post("/v1/chat/completions", json=body).json()["backend"]
        victim = next(a for a in fleet.addresses if a != home)
        r = c.post(
            "/v1/chat/completions",
            json=body,
            headers={DEST: victim, "x-prefiller-host-port": "169.254.169.254:80", "x-kvroute-cluster": "evil"},
        )
    got = r.json()
    assert got["backend"] == home
    assert "x-prefiller-host-port" not in got["headers"] and "x-kvroute-cluster" not in got["headers"]
    assert got["headers"][DEST] == home


# Bodies kvroute refuses: (body, status, part of the message); every transport answers them alike.
BAD_BODIES = [
    (b'{"model": "m", "messages": [', 400, "not valid JSON"),
    (orjson.dumps(chat("x", "y") | {"model": "gpt-unknown"}), 404, "does not exist"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}', 400, "not valid JSON"),
    (b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": "many"}', 400, "max_tokens"),
]


@pytest.mark.parametrize("body,status,needle", BAD_BODIES)
def test_errors_come_back_openai_shaped(envoy, body, status, needle):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status


def test_get_and_passthrough_paths_are_routed(envoy):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["path"] == "/v1/models"
        r = c.post("/v1/embeddings", json={"model": "m", "input": "x"})
        assert r.status_code == 200 and r.json()["path"] == "/v1/embeddings"


def test_streaming_sse_and_usage_metrics(kvroute, fleet):
    mode = {"response_header_mode": "SEND", "response_body_mode": "STREAMED"}
    body = chat(doc(5), "s", stream=True)
    reported = metric_of(kvroute, "kvroute_reported_prompt_tokens_total", pool="default")
    with (
        EnvoyProcess("epp.yaml", kvroute_port=kvroute.ext_proc_port, pods=fleet.addresses, processing_mode=mode) as env,
        httpx.Client(base_url=env.url, timeout=10) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        text = r.read().decode()
    assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    # kvroute reads the response's usage from the stream's last chunk, a moment after the client has it.
    wait_for(lambda: metric_of(kvroute, "kvroute_reported_prompt_tokens_total", pool="default") > reported, 10,
             "kvroute to read the usage")  # fmt: skip
    m = kvroute.metrics()
    assert 'kvroute_reported_cached_tokens_total{pool="default"}' in m
    assert "kvroute_decisions_total{" in m and 'reason="prefix"' in m


def test_no_prompt_text_in_logs_or_metrics(envoy, kvroute):
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        c.post("/v1/chat/completions", json=chat(MARKER * 50, MARKER))
        c.post("/v1/chat/completions", content=b'{"model": "m", "messages": [' + MARKER.encode())
    assert MARKER not in kvroute.metrics()
    assert MARKER not in kvroute.log()


@pytest.mark.parametrize(
    "mode,extra",
    [
        ({"request_body_mode": "BUFFERED"}, {}),
        ({"request_body_mode": "STREAMED"}, {"send_body_without_waiting_for_header_response": True}),
        ({"request_body_mode": "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND"}, {"failure_mode_allow": False}),
    ],
    ids=["buffered", "streamed", "full-duplex"],
)
def test_large_chunked_bodies_every_mode(kvroute, fleet, mode, extra):
    big = "é" + "Große Dokumente 😀 " * 20_000  # ~420 KB, multibyte characters across chunk boundaries
    payload = orjson.dumps(chat(big, "q"))

    def chunks():
        for i in range(0, len(payload), 7_777):
            yield payload[i : i + 7_777]

    with (
        EnvoyProcess(
            "epp.yaml", kvroute_port=kvroute.ext_proc_port, pods=fleet.addresses, processing_mode=mode, ext_proc=extra
        ) as env,
        httpx.Client(base_url=env.url, timeout=20) as c,
    ):
        backends = set()
        for _ in range(3):
            r = c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text[:300]
            got = r.json()
            assert got["body_len"] == len(payload)
            assert got["body_sha256"] == hashlib.sha256(payload).hexdigest()
            backends.add(got["backend"])
        assert len(backends) == 1


def statuses_through_a_kill(url: str, k: KVRouteProcess) -> Counter:
    """120 chats in waves of 10 through ``url``, kvroute SIGKILLed before the fifth wave: each status."""

    async def load() -> Counter:
        statuses: Counter = Counter()
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:

            async def one(i: int) -> None:
                r = await c.post("/v1/chat/completions", json=chat(doc(i % 5), str(i)))
                statuses[r.status_code] += 1

            for wave in range(12):
                if wave == 4:
                    assert k.proc is not None
                    k.proc.kill()  # SIGKILL mid-run: no goodbye to Envoy
                await asyncio.gather(*(one(wave * 10 + i) for i in range(10)))
                await asyncio.sleep(0.05)
        return statuses

    return asyncio.run(load())


def test_killed_kvroute_fails_open_and_loses_nothing(fleet):
    with (
        KVRouteProcess(fleet.addresses) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.grpc_port, pods=fleet.addresses) as env,
    ):
        assert statuses_through_a_kill(env.url, k) == Counter({200: 120})


def test_inflight_held_for_the_whole_exchange(envoy, kvroute, fleet):
    """No response messages in the default config: the slot is released when the stream ends."""
    held_for_the_exchange(envoy.url, kvroute)


@pytest.mark.parametrize("body_mode", ["STREAMED", "FULL_DUPLEX_STREAMED"])
def test_inflight_held_for_the_whole_exchange_in_the_streamed_modes(kvroute, fleet, body_mode):
    """The streamed body modes as kvroute envoy-config sets them: Envoy would end the ext_proc stream with the
    request (the pod's slot released while the pod still works) but for the response trailers' event."""
    patch = body_mode_patch(body_mode)  # kvroute envoy-config's settings for the mode
    ext = patch["ext_proc"]
    assert ext["send_body_without_waiting_for_header_response" if body_mode == "STREAMED" else "failure_mode_allow"] \
        is (body_mode == "STREAMED")  # fmt: skip
    with EnvoyProcess("epp.yaml", kvroute_port=kvroute.ext_proc_port, pods=fleet.addresses, **patch) as env:
        held_for_the_exchange(env.url, kvroute)


def held_for_the_exchange(url: str, kvroute: KVRouteProcess) -> None:
    """A request the pod holds for a second is counted in flight all along, and released after."""

    def inflight() -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in kvroute.metrics().splitlines()
            if line.startswith("kvroute_inflight_requests{")
        )

    async def until(value: float, while_running: asyncio.Task | None = None) -> None:
        """Conditions, not sleeps: on a busy machine routing or the stream's end can lag."""
        deadline = time.monotonic() + 10
        while inflight() != value:
            assert while_running is None or not while_running.done(), "the request ended before it was counted"
            assert time.monotonic() < deadline, f"in flight never reached {value}"
            await asyncio.sleep(0.01)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            task = asyncio.create_task(
                c.post("/v1/chat/completions", json=chat(doc(7), "slow"), headers={"x-test-delay": "2.5"})
            )
            await until(1.0, while_running=task)  # counted while the pod holds it
            await asyncio.sleep(0.5)  # the pod still works: still counted (the stream did not end with the request)
            assert task.done() or inflight() == 1.0
            assert (await task).status_code == 200
        await until(0.0)  # and released once the exchange is over

    asyncio.run(go())


def test_sigterm_drains_and_exits(fleet):
    k = KVRouteProcess(fleet.addresses).start()
    try:
        assert k.health("readiness") == "SERVING"
        k.signal(signal.SIGTERM)
        assert k.proc.wait(15) == 0
        assert "kvroute stopped" in k.log()
    finally:
        k.stop()


def test_health_services(kvroute):
    for svc in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert kvroute.health(svc) == "SERVING"
    assert kvroute.health("nope") == "error:NOT_FOUND"


def test_a_held_prompt_outlasting_envoys_message_timeout_is_still_routed(fleet, tmp_path):
    """routing.hold past Envoy's ext_proc message_timeout (0.2 s here, Envoy's own default): kvroute asks
    Envoy to wait (override_message_timeout, within epp.yaml's max_message_timeout), so the held request
    gets its answer rather than going on unrouted when the timeout fires."""
    pod = fleet.addresses[:1]
    cfg = tmp_path / "kvroute.yaml"  # prefills priced slow: a 5k-token prompt queued ahead holds ~0.6 s
    cfg.write_text("routing: {hold: {enabled: true}, cost: {per_token_s: 1.0e-4}}\n")
    long_a, long_b = "alpha beta gamma delta " * 1000, "one two three four five " * 900

    def inflight(k: KVRouteProcess) -> float:
        return metric_of(k, "kvroute_inflight_requests")

    async def go(url: str, k: KVRouteProcess) -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            first = asyncio.create_task(
                c.post("/v1/chat/completions", json=chat(long_a, "q"), headers={"x-test-delay": "2"})
            )
            deadline = time.monotonic() + 10
            while inflight(k) < 1:  # the first is routed: its prefill is queued on the pod
                assert time.monotonic() < deadline and not first.done()
                await asyncio.sleep(0.01)
            second = await c.post("/v1/chat/completions", json=chat(long_b, "q"))
            return (await first).status_code, second.status_code

    with (
        KVRouteProcess(pod, config=str(cfg)) as k,
        EnvoyProcess("epp.yaml", kvroute_port=k.ext_proc_port, pods=pod, ext_proc={"message_timeout": "0.2s"}) as env,
    ):
        assert asyncio.run(go(env.url, k)) == (200, 200)
        held = metric_of(k, "kvroute_hold_seconds_sum")
        assert metric_of(k, "kvroute_hold_seconds_count") == 1 and held > 0.3  # past the timeout
        stats = env.stats("ext_proc")
        timeouts = sum(v for s, v in stats.items() if s.endswith("ext_proc.message_timeouts"))
        overrides = sum(v for s, v in stats.items() if s.endswith("ext_proc.override_message_timeout_received"))
        assert (timeouts, overrides) == (0, 1), stats
