"""Helpers for benchmarks that run servers as subprocesses: readiness, CPU accounting, cleanup."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
_SETPRIV = shutil.which("setpriv")


def die_with_parent(args: Sequence[str]) -> list[str]:
    """``args`` run so that the child gets SIGTERM when the process that started it dies (Linux), so a
    killed test or benchmark never leaves an Envoy or a fleet behind: util-linux's setpriv sets
    PR_SET_PDEATHSIG and execs ``args`` in its place (same pid). Not a ``preexec_fn``: that makes
    subprocess fork() instead of vfork(), and gRPC's fork handlers (this process holds gRPC channels:
    kvroute's health checks) deadlocked such a fork. A parent that dies before setpriv has set the
    signal (the few ms between fork and setpriv's prctl) still leaves the child behind: prctl cannot
    notice a death that came first. Without setpriv: ``args`` as they are."""
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *args] if _SETPRIV else [*args]


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command's name (which may hold spaces and parentheses):
    [2] the process group, [11] and [12] user and system CPU in ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its reaped children, from /proc."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_with_ready_file(args: Sequence[str], timeout: float = 30.0) -> tuple[subprocess.Popen[bytes], object]:
    """Start ``args + --ready-file F`` and wait until F holds JSON; returns (process, parsed JSON)."""
    fd, path = tempfile.mkstemp(prefix="kvroute-ready-")
    os.close(fd)
    os.unlink(path)
    proc = subprocess.Popen(
        die_with_parent([*args, "--ready-file", path]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"{' '.join(args[:4])} exited {proc.returncode}: {err[-2000:]}")
        try:
            data = json.loads(Path(path).read_text())
            os.unlink(path)
            return proc, data
        except (OSError, ValueError):
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{' '.join(args[:4])} not ready after {timeout}s")


@contextlib.contextmanager
def ready_process(args: Sequence[str], timeout: float = 30.0) -> Iterator[tuple[subprocess.Popen[bytes], object]]:
    """``start_with_ready_file`` as a context: the process and its ready JSON, stopped on exit."""
    proc, data = start_with_ready_file(args, timeout)
    try:
        yield proc, data
    finally:
        stop(proc)


# free_port() finds a port free a moment before a server binds it, and another process may take it
# meanwhile: a server that exits for that reason is started again on new ports, this many times in all.
START_ATTEMPTS = 3


class ProcessExited(RuntimeError):
    """The process ended before it was ready, for another reason than a taken port (or on the last try)."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited {returncode}")
        self.returncode = returncode


def start_on_free_ports(
    launch: Callable[[], subprocess.Popen[bytes]],
    ready: Callable[[], bool],
    *,
    port_taken: Callable[[subprocess.Popen[bytes]], bool],
    repick: Callable[[], None],
    timeout: float,
    poll_s: float,
) -> bool:
    """``launch()`` a server and wait up to ``timeout`` for ``ready()``; one that exits with
    ``port_taken(proc)`` is launched again after ``repick()`` chose new ports (``START_ATTEMPTS`` in
    all). True when ready, False on a timeout; ProcessExited when it exits otherwise."""
    for attempt in range(1, START_ATTEMPTS + 1):
        proc = launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if attempt < START_ATTEMPTS and port_taken(proc):
                    repick()
                    break
                raise ProcessExited(proc.returncode)
            if ready():
                return True
            time.sleep(poll_s)
        else:
            return False
    raise AssertionError("unreachable: the last attempt returns or raises")


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def machine_busy() -> float:
    """CPU seconds spent busy by every process on the machine (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / CLK_TCK


@dataclass(frozen=True)
class CpuSnapshot:
    machine_s: float  # busy CPU seconds of the whole machine
    own_s: float  # ... of our processes
    at: float


def cpu_snapshot(pgids: Iterable[int], pids: Iterable[int]) -> CpuSnapshot:
    """Busy CPU of the machine and of our processes: members of process groups ``pgids`` (the vLLM
    pods) or ``pids`` (this process, the simulator), from /proc."""
    groups, singles = set(pgids), set(pids)
    own = 0.0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = _stat(d.name)
        except OSError:
            continue
        if int(fields[2]) in groups or int(d.name) in singles:
            own += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return CpuSnapshot(machine_busy(), own, time.monotonic())


def foreign_cores(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """Cores used by other work on the machine between two snapshots."""
    wall = max(after.at - before.at, 1e-9)
    return max((after.machine_s - before.machine_s) - (after.own_s - before.own_s), 0.0) / wall
