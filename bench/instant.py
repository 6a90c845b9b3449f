"""Instant OpenAI-shaped backends (no model, no delay): isolate router overhead from pod time.

``python -m bench.instant --ports 8101,8102 [--ready-file F]`` serves them all in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from pathlib import Path

from aiohttp import web

REPLY = json.dumps(
    {
        "id": "cmpl-0",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


async def _reply(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=REPLY, content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def app() -> web.Application:
    a = web.Application(client_max_size=64 << 20)
    a.router.add_get("/health", _health)
    a.router.add_route("*", "/{tail:.*}", _reply)
    return a


async def serve(ports: list[int], ready_file: str | None) -> None:
    runners = []
    bound = []
    for p in ports:
        r = web.AppRunner(app(), access_log=None)
        await r.setup()
        site = web.TCPSite(r, "127.0.0.1", p)
        await site.start()
        runners.append(r)
        bound.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    if ready_file:
        Path(ready_file).write_text(json.dumps([f"127.0.0.1:{p}" for p in bound]))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for r in runners:
        await r.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.instant", description=__doc__)
    ap.add_argument("--ports", default="0,0", help="comma-separated ports (0 = any free port)")
    ap.add_argument("--ready-file", help="write the bound addresses here as JSON once listening")
    a = ap.parse_args()
    asyncio.run(serve([int(p) for p in a.ports.split(",")], a.ready_file))


if __name__ == "__main__":
    main()
