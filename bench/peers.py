"""Peer routers (full HTTP proxies, no Envoy) run side by side with kvroute in benchmarks.

Installed in their own venv by ``make peers`` (``.venv-peers``): ``sglang-router`` (module
``sglang_router.launch_router``) and ``vllm-router`` (console script). Each instance gets its own
HTTP and Prometheus ports (both default to 30000/29000 otherwise).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.envoy import ROOT, free_port
from bench.procs import die_with_parent, stop

PEERS_VENV = ROOT / ".venv-peers"
PEERS = ("sglang-router", "vllm-router")


class PeerUnavailable(RuntimeError):
    """The peer is not installed (run ``make peers``)."""


def peer_command(
    name: str,
    policy: str,
    worker_urls: Sequence[str],
    port: int,
    metrics_port: int,
    pd: tuple[Sequence[str], Sequence[str]] | None = None,
) -> list[str]:
    """``pd``: (prefill URLs, decode URLs) for vllm-router's vLLM P/D mode instead of ``worker_urls``."""
    workers = ["--worker-urls", *worker_urls]
    if pd is not None:
        if name != "vllm-router":
            raise ValueError(f"{name}: P/D mode is wired for vllm-router only")
        workers = ["--vllm-pd-disaggregation"]
        workers += [a for u in pd[0] for a in ("--prefill", u)] + [a for u in pd[1] for a in ("--decode", u)]
    common = [
        *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1",
    ]  # fmt: skip
    if name == "sglang-router":
        return [str(PEERS_VENV / "bin" / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    if name == "vllm-router":
        return [str(PEERS_VENV / "bin" / "vllm-router"), *common, "--log-level", "warning"]
    raise ValueError(f"unknown peer {name!r}; peers are {PEERS}")


class PeerRouter:
    """One peer router on loopback; ``url`` is its OpenAI endpoint. Context manager."""

    def __init__(
        self, name: str, policy: str, worker_urls: Sequence[str], pd: tuple[Sequence[str], Sequence[str]] | None = None
    ) -> None:
        self.name, self.policy = name, policy
        self.port, self.metrics_port = free_port(), free_port()
        self.args = peer_command(name, policy, worker_urls, self.port, self.metrics_port, pd)
        self._dir = tempfile.TemporaryDirectory(prefix=f"kvroute-{name}-")
        self.log_path = Path(self._dir.name) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> PeerRouter:
        if not Path(self.args[0]).exists():
            raise PeerUnavailable(f"{self.args[0]} missing: run `make peers`")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(die_with_parent(self.args), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # /readiness: both routers answer 200 only once their workers are registered.
                with urllib.request.urlopen(self.url + "/readiness", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop(self.proc)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> PeerRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
