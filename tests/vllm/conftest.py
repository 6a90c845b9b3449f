"""Fixtures for the real-vLLM tests. Collected only under ``make test-vllm`` (it sets
``KVROUTE_VLLM_PYTHON`` and ``KVROUTE_VLLM_MODEL``); plain ``make test`` never imports them."""

from __future__ import annotations

import asyncio
import atexit
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from bench.sim.tokenizer import HFTokenizer
from bench.vllm_pods import VLLMPod, start_pods
from extproc.endpoints.events import KVEventSubscriber
from extproc.index.precise import PreciseIndex
from tests.vllm.recorder import RecordingSink, subscriber_for

VLLM_PYTHON = os.environ.get("KVROUTE_VLLM_PYTHON")
VLLM_MODEL = os.environ.get("KVROUTE_VLLM_MODEL")

if not (VLLM_PYTHON and VLLM_MODEL):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def model_dir() -> str:
    assert VLLM_MODEL and Path(VLLM_MODEL, "config.json").exists(), "run `make test-vllm` (builds the model)"
    return VLLM_MODEL


@pytest.fixture(scope="session")
def pods(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VLLMPod]]:
    assert VLLM_PYTHON
    # Request chat templates trusted and the render endpoint on: test_chat_render renders its own templates.
    started = start_pods(
        VLLM_PYTHON,
        model_dir,
        n=2,
        workdir=tmp_path_factory.mktemp("vllm"),
        extra_args=["--trust-request-chat-template", "--enable-scale-out"],
    )

    def stop_all() -> None:
        for p in started:
            p.stop()

    atexit.register(stop_all)  # also if pytest dies between the fixture and its finalizer
    try:
        yield started
    finally:
        stop_all()


@dataclass
class KV:
    """One precise index fed by both pods' KV events for the whole session."""

    index: PreciseIndex
    sink: RecordingSink
    subscribers: list[KVEventSubscriber]

    def subscriber(self, endpoint: str) -> KVEventSubscriber:
        return next(s for s in self.subscribers if s.endpoint == endpoint)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def kv(pods: list[VLLMPod]) -> AsyncIterator[KV]:
    index = PreciseIndex(capacity_blocks=1 << 16)
    sink = RecordingSink(index)
    subs = [subscriber_for(p.address, p.pub_address, p.replay_address, sink) for p in pods]
    for s in subs:
        await s.start()
    await asyncio.sleep(0.5)  # ZMQ subscriptions propagate asynchronously
    try:
        yield KV(index, sink, subs)
    finally:
        for s in subs:
            await s.aclose()


@pytest.fixture(scope="session")
def tok(model_dir: str) -> HFTokenizer:
    return HFTokenizer(model_dir)


@pytest_asyncio.fixture(loop_scope="session")
async def aclient() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0) as c:
        yield c


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "restarts_pods: kills and restarts a vLLM pod (runs last)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that restart pods run last, so the others share warm pods."""
    items.sort(key=lambda it: it.get_closest_marker("restarts_pods") is not None)
