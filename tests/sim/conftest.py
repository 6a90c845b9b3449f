"""Shared fixtures for the simulator tests (loopback only, ephemeral ports)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `bench` is not part of the installed wheel

from bench.sim import Fleet, FleetConfig  # noqa: E402


class VirtualClock:
    """Deterministic time for one engine: sleeping advances the clock instantly."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, dt: float) -> None:
        self.t += dt
        await asyncio.sleep(0)


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with Fleet(FleetConfig(pods=2, profile="fast")) as f:
        yield f


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c
