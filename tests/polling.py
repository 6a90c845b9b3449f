"""Waiting on a condition, not a sleep: the tests' one way to wait (sync and async)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> float:
    """Seconds until ``cond()`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


async def eventually(cond: Callable[[], Any], what: str, timeout: float = 5.0, poll_s: float = 0.01) -> Any:
    """``cond()``'s first truthy value, polled on the event loop; fails the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(poll_s)
    return got
