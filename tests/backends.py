"""Tiny OpenAI-shaped HTTP backends for integration tests: each says who it is and what it got."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Backend:
    port: int
    runner: web.AppRunner
    seen: list[dict] = field(default_factory=list)
    waiting: int = 0  # reported as vllm:num_requests_waiting
    metrics_status: int = 200  # 500 = a pod whose /metrics fails (dead or wedged)
    scrapes: int = 0  # /metrics requests answered (or failed): a test waits on kvroute's next scrapes
    metrics_delay_s: float = 0.0  # a slow or hanging /metrics

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _app(backend_ref: list[Backend]) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        b = backend_ref[0]
        delay = float(request.headers.get("x-test-delay", "0") or 0)
        if delay:
            await asyncio.sleep(min(delay, 5.0))
        info = {
            "backend": b.address,
            "path": request.path,
            "method": request.method,
            "body_len": len(raw),
            "body_sha256": hashlib.sha256(raw).hexdigest(),
            "headers": {k.lower(): v for k, v in request.headers.items()},
        }
        b.seen.append(info)
        stream = False
        with contextlib.suppress(ValueError, AttributeError):
            stream = bool(json.loads(raw).get("stream")) if raw else False
        usage = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}
        if not stream:
            return web.json_response({**info, "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {json.dumps({'choices': [{'delta': {'content': str(i)}}]})}\n\n".encode())
            await asyncio.sleep(0)
        await resp.write(f"data: {json.dumps({'backend': b.address, 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(request: web.Request) -> web.Response:
        b = backend_ref[0]
        b.scrapes += 1
        if b.metrics_delay_s:
            await asyncio.sleep(b.metrics_delay_s)
        if b.metrics_status != 200:
            return web.Response(status=b.metrics_status)
        labels = 'model_name="m",engine="0"'
        return web.Response(
            text=f"vllm:num_requests_waiting{{{labels}}} {b.waiting}\n"
            f"vllm:num_requests_running{{{labels}}} 0\nvllm:kv_cache_usage_perc{{{labels}}} 0.1\n"
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def serve_loopback(app: web.Application) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on a free 127.0.0.1 port: its runner (``cleanup()`` it) and the port. ``cleanup()`` drops
    open connections at once, as a killed pod does: aiohttp's default waits up to 60 s for them, and a
    keep-alive connection that Envoy keeps reusing under load never goes idle (a pod "stopped" under load
    took over 10 s to stop, serving requests meanwhile)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def start_backend() -> Backend:
    ref: list[Backend] = []
    runner, port = await serve_loopback(_app(ref))
    b = Backend(port=port, runner=runner)
    ref.append(b)
    return b


class BackendFleet:
    """N backends on their own event loop in a thread, so sync and async tests can share them."""

    def __init__(self, n: int) -> None:
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.backends: list[Backend] = [self._call(start_backend()) for _ in range(n)]

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    @property
    def addresses(self) -> list[str]:
        return [b.address for b in self.backends]

    def clear(self) -> None:
        for b in self.backends:
            b.seen.clear()

    def by_address(self, addr: str) -> Backend:
        return next(b for b in self.backends if b.address == addr)

    def stop(self, address: str) -> None:
        """Stop one backend (its pod is gone): connections to it are refused from now on."""
        self._call(self.by_address(address).runner.cleanup())

    def close(self) -> None:
        for b in self.backends:
            self._call(b.runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
