"""Open-loop load generator with a real streaming HTTP client (aiohttp).

Requests are sent at their scheduled arrival times whether or not earlier ones finished (open loop:
a slow router shows up as latency, not as a politely reduced rate). For SSE responses TTFT is the
first content chunk and inter-token latency the gaps between later chunks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass(frozen=True, slots=True)
class RequestSpec:
    body: bytes
    path: str = "/v1/chat/completions"
    headers: tuple[tuple[str, str], ...] = ()
    at: float = 0.0  # seconds from start (open-loop arrival time)
    tag: str = ""  # workload-specific label (e.g. group id), never sent
    request_id: str = ""  # sent as x-request-id when set: the router's logs name the request by it


@dataclass(slots=True)
class Record:
    tag: str
    request_id: str = ""
    status: int = 0
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_chunks: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    upstream: str | None = None
    error: str | None = None
    # The serving pod's own figures for this request (from the receipt of its HTTP handler), where the pods report
    # them (the simulator's GET /sim/requests; the bench joins them in): its wait before the first engine step
    # that took it in, and its TTFT. The client's TTFT less pod_ttft is the request's path.
    pod_wait: float | None = None
    pod_ttft: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _has_content(obj: dict) -> bool:
    """A chunk that carries generated text. vLLM opens a chat stream with a role-only chunk
    (``delta: {"role": "assistant"}``) that can precede prefill: it is not the first token; the Messages
    API's text is in ``content_block_delta`` events, the Responses API's in ``response.output_text.delta``."""
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        return bool(obj.get("delta"))
    if kind == "content_block_delta":
        delta = obj.get("delta")
        return isinstance(delta, dict) and bool(delta.get("text") or delta.get("thinking"))
    for c in obj.get("choices") or ():
        delta = c.get("delta")
        if (delta.get("content") if isinstance(delta, dict) else None) or c.get("text"):
            return True
    return False


def _usage(rec: Record, obj: dict) -> None:
    u = obj.get("usage")
    if obj.get("type") == "message_start" and isinstance(obj.get("message"), dict):
        u = obj["message"].get("usage")
    elif obj.get("type") == "response.completed" and isinstance(obj.get("response"), dict):
        u = obj["response"].get("usage")
    if isinstance(u, dict) and isinstance(details := u.get("input_tokens_details"), dict):
        # the Responses API's: input_tokens is the whole prompt, the cached part among its details
        rec.prompt_tokens = u.get("input_tokens", rec.prompt_tokens)
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = details["cached_tokens"]
    elif isinstance(u, dict) and "input_tokens" in u:  # the Messages API's: input_tokens are the uncached ones
        cached = u.get("cache_read_input_tokens") or 0
        rec.prompt_tokens = u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0)
        rec.cached_tokens = cached
    elif isinstance(u, dict):
        rec.prompt_tokens = u.get("prompt_tokens", rec.prompt_tokens)
        d = u.get("prompt_tokens_details")
        if isinstance(d, dict) and d.get("cached_tokens") is not None:
            rec.cached_tokens = d["cached_tokens"]


async def _one(session: aiohttp.ClientSession, base: str, spec: RequestSpec, t0: float, timeout: float) -> Record:
    rec = Record(tag=spec.tag, request_id=spec.request_id)
    delay = t0 + spec.at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.start = start = time.perf_counter()
    try:
        async with session.post(
            base + spec.path,
            data=spec.body,
            headers={
                "content-type": "application/json",
                **({"x-request-id": spec.request_id} if spec.request_id else {}),
                **dict(spec.headers),
            },
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            rec.status = r.status
            rec.upstream = r.headers.get("x-kvroute-upstream") or r.headers.get("x-sim-pod")
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                last = None
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if event.startswith(b"event: "):  # the Messages and Responses APIs name each event
                            event = event.partition(b"\n")[2]
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        now = time.perf_counter()
                        obj = orjson.loads(event[6:])
                        if _has_content(obj):
                            if rec.ttft is None:
                                rec.ttft = now - start
                            elif last is not None:
                                rec.itl.append(now - last)
                            last = now
                            rec.output_chunks += 1
                        _usage(rec, obj)
            else:
                data = await r.read()
                rec.ttft = time.perf_counter() - start
                if data[:1] == b"{":
                    try:
                        obj = orjson.loads(data)
                        _usage(rec, obj)
                        if r.status >= 400:
                            rec.error = str(obj.get("error", {}).get("message", ""))[:200] or f"HTTP {r.status}"
                    except orjson.JSONDecodeError:
                        pass
                elif r.status >= 400:
                    rec.error = f"HTTP {r.status}"
        rec.e2e = time.perf_counter() - start
    except (TimeoutError, aiohttp.ClientError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
        rec.e2e = time.perf_counter() - start
    return rec


async def run(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    timeout: float = 120.0,
    max_connections: int = 256,
    on_done: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Send every spec at its ``at`` time; returns records in spec order."""
    conn = aiohttp.TCPConnector(limit=max_connections, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter() + 0.05

        async def go(s: RequestSpec) -> Record:
            rec = await _one(session, base_url, s, t0, timeout)
            if on_done is not None:
                on_done(rec)
            return rec

        return list(await asyncio.gather(*(go(s) for s in specs)))


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
