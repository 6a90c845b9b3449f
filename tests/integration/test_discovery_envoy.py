"""Discovery end to end: real Envoy + kvroute + loopback pods while load runs. Pods appear, turn
NotReady (drained), are deleted and replaced at a new address; no client request fails, a drained pod
gets nothing new, and a deleted pod's index entries are gone. Run once with the endpoints file and
once with the Kubernetes provider against the API stand-in (tests/kubeapi.py)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import httpx
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.kvroute import KVRouteProcess
from tests.backends import BackendFleet
from tests.kubeapi import KubeAPI
from tests.load import Load as ClientLoad
from tests.polling import wait_for

pytestmark = pytest.mark.integration

SENT = "x-test-sent"  # the client's clock when it sent the request, echoed in the backend's record
CHANGE_WITHIN_S = 1.0  # the bound: a discovery event reaches the routing within 1 s


class Pods(Protocol):
    """How a test changes the fleet: the endpoints file, or the Kubernetes API stand-in."""

    def set(self, ready: dict[str, bool]) -> None:
        """The fleet is exactly these pods (address -> Ready)."""


@dataclass
class FilePods:
    path: Path

    def set(self, ready: dict[str, bool]) -> None:
        eps = [{"address": a, "ready": r} for a, r in ready.items()]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"pools": {"default": {"endpoints": eps}}}))
        tmp.replace(self.path)  # atomic, as a ConfigMap update is


class KubePods:
    """The fleet as pods in the API stand-in (on its own event loop in a thread): each backend is a
    pod on 127.0.0.1 whose serving port is its kvroute.io/port annotation. A pod leaving the set is
    terminated first (NotReady with a deletionTimestamp), then deleted, as Kubernetes does it."""

    NS = "llm"
    LABELS: ClassVar[dict[str, str]] = {"app": "vllm"}

    def __init__(self, tmp_path: Path) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.api = KubeAPI()
        self._call(self.api.__aenter__())
        self.kubeconfig = self.api.write_kubeconfig(tmp_path / "kubeconfig", namespace=self.NS)
        self._names: dict[str, str] = {}  # address -> pod name

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def _run(self, fn: Callable[[], object]) -> None:
        async def call() -> None:
            fn()

        self._call(call())

    def set(self, ready: dict[str, bool]) -> None:
        def apply() -> None:
            for addr in [a for a in self._names if a not in ready]:
                self.api.terminate(self.NS, self._names[addr])
                self.api.delete_pod(self.NS, self._names.pop(addr))
            for addr, r in ready.items():
                if addr in self._names:
                    self.api.set_ready(self.NS, self._names[addr], r)
                else:
                    name = self._names[addr] = f"vllm-{len(self._names)}-{addr.rsplit(':', 1)[1]}"
                    self.api.add_pod(self.NS, name, "127.0.0.1", self.LABELS,
                                     {"kvroute.io/port": addr.rsplit(":", 1)[1]}, ready=r)  # fmt: skip

        self._run(apply)

    def close(self) -> None:
        self._call(self.api.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def metric(kv: KVRouteProcess, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in kv.metrics().splitlines():
        m = re.match(r"^(\w+)\{([^}]*)\} (\S+)$", line)
        if m and m[1] == name and ",".join(sorted(m[2].split(","))) == want:
            return float(m[3])
    return None


class Load(ClientLoad):
    """Four client threads through Envoy: known documents (affinity) and fresh ones (spread), a third
    of them held 0.2 s at the pod so some are always in flight when the fleet changes."""

    def request(self, c: httpx.Client, worker: int, i: int, sent: float) -> httpx.Response:
        doc = f"document {(i * 7 + worker) % 10} " if i % 3 else f"fresh {worker}-{i} "
        body = {"model": "m", "messages": [{"role": "user", "content": doc * 80}]}
        headers = {SENT: repr(sent), "x-test-delay": "0.2" if i % 3 == 1 else "0"}
        return c.post("/v1/chat/completions", json=body, headers=headers)


def arrivals_after(fleet: BackendFleet, address: str, t: float) -> int:
    """Requests that reached ``address`` although the client sent them after ``t``."""
    return sum(1 for s in fleet.by_address(address).seen if float(s["headers"][SENT]) > t)


@pytest.fixture
def fleet() -> Iterator[BackendFleet]:
    f = BackendFleet(5)
    yield f
    f.close()


def run_lifecycle(fleet: BackendFleet, pods: Pods, kvroute_args: list[str]) -> None:
    p0, p1, p2, p3, p4 = fleet.addresses
    pods.set({p0: True, p1: True, p2: True})
    with (
        KVRouteProcess(extra_args=kvroute_args) as kv,
        EnvoyProcess("epp.yaml", kvroute_port=kv.grpc_port, pods=fleet.addresses) as env,
        Load(env.url) as load,
    ):

        def ready() -> float | None:
            return metric(kv, "kvroute_endpoints", pool="default", state="ready")

        assert ready() == 3
        load.settle()
        held = {a for a in (p0, p1, p2) if metric(kv, "kvroute_index_blocks", endpoint=a)}
        assert held, "the load recorded prefixes on the pods"

        # A new pod: scraped, subscribed, and sent requests.
        pods.set({p0: True, p1: True, p2: True, p3: True})
        assert wait_for(lambda: ready() == 4, what="the new pod") < CHANGE_WITHIN_S
        wait_for(lambda: len(fleet.by_address(p3).seen) > 0, 20, "a request on the new pod")

        # p1 turns NotReady: drained. Nothing sent after kvroute applied it reaches p1; what was in
        # flight there finishes (no failures below).
        pods.set({p0: True, p1: False, p2: True, p3: True})
        took = wait_for(lambda: metric(kv, "kvroute_endpoints", pool="default", state="draining") == 1)
        drained_at = time.monotonic()
        assert took < CHANGE_WITHIN_S
        load.settle(40)
        assert arrivals_after(fleet, p1, drained_at) == 0

        # p1 deleted, replaced by p4 (a new address): p1's index entries go, p4 takes requests. The
        # old pod's process stops only once it is out of the set (a graceful Kubernetes deletion).
        blocks_before = metric(kv, "kvroute_index_blocks", endpoint=p1)
        pods.set({p0: True, p2: True, p3: True, p4: True})
        assert wait_for(lambda: ready() == 4 and metric(kv, "kvroute_endpoints", pool="default",
                                                        state="draining") == 0) < CHANGE_WITHIN_S  # fmt: skip
        assert metric(kv, "kvroute_index_blocks", endpoint=p1) is None, f"p1 still holds {blocks_before} blocks"
        fleet.stop(p1)
        wait_for(lambda: len(fleet.by_address(p4).seen) > 0, 20, "a request on the replacement pod")
        load.settle(40)

    failed = load.failed()
    assert not failed, f"{len(failed)} of {len(load.results)} requests failed: {failed[:5]}"
    assert len(load.results) >= 100  # the settles above
    served = {r[1] for r in load.results}
    assert {p0, p2, p3, p4} <= served


def test_file_discovery_lifecycle_under_load(fleet, tmp_path):
    path = tmp_path / "endpoints.yaml"
    config = tmp_path / "kvroute.yaml"
    config.write_text(yaml.safe_dump({"discovery": {"provider": "file",
                                                    "file": {"path": str(path), "poll_interval_s": 0.1}}}))  # fmt: skip
    run_lifecycle(fleet, FilePods(path), ["--config", str(config)])


def test_kubernetes_discovery_lifecycle_under_load(fleet, tmp_path):
    pods = KubePods(tmp_path)
    try:
        args = ["--selector", "app=vllm", "--target-port", "8000", "--pool-namespace", KubePods.NS,
                "--kubeconfig", str(pods.kubeconfig)]  # fmt: skip
        run_lifecycle(fleet, pods, args)
    finally:
        pods.close()
