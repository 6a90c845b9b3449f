"""Shared fixtures for the benchmark tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench import harness


@pytest.fixture
def open_policy(tmp_path: Path) -> Iterator[Callable[[str], tuple[harness.SimFleet, harness.Router]]]:
    """Start a bench policy's router (``harness.open_router``) in front of two simulated pods on the fast
    profile: ``open_policy(name)`` -> (fleet, router). Both stop when the test ends."""
    with contextlib.ExitStack() as stack:

        def start(policy: str) -> tuple[harness.SimFleet, harness.Router]:
            cfg = harness.RunConfig([policy], pods=2, profile="fast", out=tmp_path, quiet=True)
            fleet = stack.enter_context(harness.SimFleet(cfg))
            return fleet, harness.open_router(policy, fleet, stack, cfg)

        yield start
