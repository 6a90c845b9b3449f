"""bench.procs: servers started by tests and benchmarks die with the process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.procs import die_with_parent
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


@pytest.mark.skipif(die_with_parent(["x"]) == ["x"], reason="no setpriv here: children do not die with parents")
def test_a_child_dies_with_the_process_that_started_it() -> None:
    code = ("import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); "
            "from bench.procs import die_with_parent; p = subprocess.Popen(die_with_parent(['sleep', '60'])); "
            "print(p.pid, flush=True); time.sleep(60)")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    # setpriv sets the death signal and then execs sleep: until the exec the signal may not be set yet,
    # and a parent killed in that window (a busy machine) leaves the child behind by design of prctl.
    wait_for(lambda: _comm(child) == "sleep", 10, "setpriv to exec sleep")
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    wait_for(lambda: _gone(child), 10, "the child to get SIGTERM")
