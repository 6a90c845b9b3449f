"""`python -m bench.sim` as the demo starts it: a subprocess with a ready file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def test_help_explains_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.sim", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    for flag in (
        "--pods",
        "--base-port",
        "--profile",
        "--roles",
        "--zmq-base-port",
        "--block-size",
        "--capacity-blocks",
        "--model",
        "--kv-events-encoding",
        "--time-scale",
        "--ready-file",
        "--fault-error-rate",
        "--fault-slowdown",
        "--tokenizer",
        "--pull-timeout",
    ):
        assert flag in out
    assert "h100-llama8b" in out and "cpu-tiny" in out


def test_bad_flags_exit_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bench.sim", "--roles", "prefill:5", "--pods", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "role spec" in r.stderr


def test_two_pod_fleet_starts_serves_and_stops(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.sim",
            "--pods",
            "2",
            "--base-port",
            "0",
            "--zmq-base-port",
            "0",
            "--roles",
            "prefill:1,decode:1",
            "--ready-file",
            str(ready),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "fleet did not become ready"
            time.sleep(0.05)
        desc = json.loads(ready.read_text())
        assert desc["pid"] == proc.pid and len(desc["pods"]) == 2
        assert [p["role"] for p in desc["pods"]] == ["prefill", "decode"]
        for p in desc["pods"]:
            assert httpx.get(p["url"] + "/health", timeout=5).status_code == 200
            assert p["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
            assert p["replay_endpoint"].startswith("tcp://127.0.0.1:")
        r = httpx.post(desc["pods"][0]["url"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "pod 0 [prefill]" in out and "shutting down" in out
