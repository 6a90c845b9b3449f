"""Listening on a configured port, with an error that names the setting when it cannot."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

from extproc.errors import StartupError

T = TypeVar("T")


def bind_or_explain(setting: str, host: str, port: int, bind: Callable[[], T]) -> T:
    """Run ``bind`` (which listens on host:port); a failure becomes a StartupError naming the setting."""
    try:
        return bind()
    except (OSError, RuntimeError) as e:  # RuntimeError: grpc's "Failed to bind to address"
        why = e.strerror if isinstance(e, OSError) and e.strerror else _probe(host, port)
        raise StartupError(f"{setting}: cannot listen on {host}:{port}: {why}") from None


def _probe(host: str, port: int) -> str:
    """Why grpc could not bind host:port (it only says that it failed): try it with a plain socket."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return "grpc could not bind it (GRPC_VERBOSITY=debug shows why)"
