"""Background tasks' one shared ending."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel every task and wait until each has ended: a stop that returns leaves nothing running
    (a cancelled task's CancelledError is its normal end; any other error it raised is dropped)."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    await asyncio.gather(*live, return_exceptions=True)
