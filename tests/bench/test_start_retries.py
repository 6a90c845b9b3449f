"""bench.kvroute.KVRouteProcess and bench.envoy.EnvoyProcess: a port taken between free_port() and the
process's bind is retried on new ports (a long sweep lost a run to it)."""

from __future__ import annotations

import itertools
import socket

import pytest

from bench import envoy, kvroute, procs
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
        monkeypatch.setattr(procs, "START_ATTEMPTS", 2)  # the retry picks the same taken port again
        k = kvroute.KVRouteProcess(["127.0.0.1:9"])
        why = r"exited 3: .*cannot start: server\.metrics_port: .*Address already in use"
        with pytest.raises(RuntimeError, match=why):
            k.start()
        k.stop()


def test_envoy_whose_listener_port_was_taken_starts_again_on_new_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = itertools.chain([taken], iter(free_port, None))  # the listener is picked first
        monkeypatch.setattr(envoy, "free_port", lambda: next(picks))
        with envoy.EnvoyProcess("epp.yaml", kvroute_port=None, pods=["127.0.0.1:9"], without_ext_proc=True) as e:
            assert e.port != taken and f"port_value: {e.port}" in e.config_path.read_text()
            assert e.stats("server.state")  # the admin port of the new config answers


def test_envoy_failing_for_another_reason_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    starts = []
    real = envoy.EnvoyProcess._pick_ports
    monkeypatch.setattr(envoy.EnvoyProcess, "_pick_ports", lambda self: (starts.append(1), real(self)))
    e = envoy.EnvoyProcess("epp.yaml", kvroute_port=None, pods=["127.0.0.1:9"], without_ext_proc=True)
    e.config_path.write_text("static_resources: {listeners: [{name: x}]}\n")  # invalid: no address
    with pytest.raises(RuntimeError, match="envoy exited with 1"):
        e.start()
    e.stop()
    assert len(starts) == 1
