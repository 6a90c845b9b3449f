"""bench.overhead's ``uds`` variant: Envoy reaches the do-nothing ext_proc server on its Unix socket."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from bench.envoy import EnvoyProcess
from bench.procs import python_module, start_with_ready_file, stop
from extproc.envoyconfig import UPSTREAM_HEADER

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_envoy_routes_through_the_server_on_its_unix_socket(tmp_path: Path) -> None:
    backends, addrs = start_with_ready_file(python_module("bench.instant", "--ports", "0,0,0"))
    assert isinstance(addrs, list)
    sock = tmp_path / "noop.sock"
    try:
        noop, ready = start_with_ready_file(python_module(
            "bench.noop_extproc", "--target", addrs[2], "--server", "uvloop", "--unix", str(sock)))  # fmt: skip
        assert isinstance(ready, dict)
        try:
            # kvroute_port names a port no one listens on, and the pipe replaces it: every request lands on
            # the server's one target only if Envoy reached the server on the socket (failing open, Envoy
            # would spread them over the pool).
            with EnvoyProcess("epp.yaml", kvroute_port=_closed_port(), pods=addrs, kvroute_pipe=str(sock)) as env:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                with httpx.Client(timeout=10) as client:
                    got = [client.post(env.url + "/v1/chat/completions", json=body) for _ in range(6)]
        finally:
            stop(noop)
    finally:
        stop(backends)
    assert [r.status_code for r in got] == [200] * 6
    assert {r.headers[UPSTREAM_HEADER] for r in got} == {addrs[2]}
