"""bench.kvroute.KVRouteProcess: a port taken between free_port() and kvroute's bind is retried on new ports."""

from __future__ import annotations

import itertools
import socket

import pytest

from bench import kvroute
from bench.envoy import free_port


def test_a_port_taken_before_kvroute_binds_it_is_retried_on_new_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # The first pick's metrics port is the taken one (gRPC, health, metrics are picked in that order).
        picks = itertools.chain([free_port(), free_port(), taken], iter(free_port, None))
        monkeypatch.setattr(kvroute, "free_port", lambda: next(picks))
        with kvroute.KVRouteProcess(["127.0.0.1:9"]) as k:
            assert k.metrics_port != taken and "--metrics-port" in k.args
            assert k.args[k.args.index("--metrics-port") + 1] == str(k.metrics_port)
            assert k.health() == "SERVING" and "kvroute_decisions" in k.metrics()


def test_a_port_that_stays_taken_fails_with_kvroutes_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(kvroute, "free_port", lambda: taken)
        monkeypatch.setattr(kvroute, "START_ATTEMPTS", 2)  # the retry picks the same taken port again
        k = kvroute.KVRouteProcess(["127.0.0.1:9"])
        why = r"exited 3: .*cannot start: server\.metrics_port: .*Address already in use"
        with pytest.raises(RuntimeError, match=why):
            k.start()
        k.stop()
