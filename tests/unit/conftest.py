"""Fixtures shared by the unit tests."""

from __future__ import annotations

import time

import pytest


@pytest.fixture
def still(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock stood still (``time.monotonic``): the queue estimates a test compares are then exact, whatever
    pauses the host takes between its steps (compared to 10-20 ms of wall clock, a pause that long fails them)."""
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now)
