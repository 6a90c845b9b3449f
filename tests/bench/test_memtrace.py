"""bench/memtrace.py (the soak's ``--memtrace``) and the soak's judgement of its samples."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import memtrace, soak

LEAKY = """\
import os, signal
kept = []
os.kill(os.getpid(), signal.SIGUSR2)  # tracing starts: dump 1
kept.extend(bytearray(1000) for _ in range(3000))  # ~3 MiB that stays
transient = [bytearray(1000) for _ in range(3000)]  # ~3 MiB that goes before the next dump
del transient
os.kill(os.getpid(), signal.SIGUSR2)  # dump 2
"""


def test_dumps_of_a_module_run_under_it_name_what_grew(tmp_path: Path) -> None:
    (tmp_path / "leaky.py").write_text(LEAKY)
    dumps = tmp_path / "dumps"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    subprocess.run([sys.executable, "-m", "bench.memtrace", "--dump-dir", str(dumps), "--frames", "4", "-m",
                    "leaky"], check=True, env=env, timeout=60)  # fmt: skip
    assert sorted(p.name for p in dumps.iterdir()) == [
        "mem-1.json", "mem-1.tracemalloc", "mem-2.json", "mem-2.tracemalloc"]  # fmt: skip
    report = memtrace.diff(str(dumps / "mem-1"), str(dumps / "mem-2"), top=3)
    top = report.split("top 3 allocation sites by bytes gained:\n", 1)[1].splitlines()
    kib = float(top[0].split()[0])
    assert 2900 < kib < 3300 and 'leaky.py", line 4' in top[1]  # the kept bytes, not the transient ones
    assert "resident by mapping" in report and "glibc malloc" in report


def test_allocator_probes_read_this_process() -> None:
    ob = memtrace.obmalloc()
    assert ob["arenas"] >= 1 and ob["allocated"] > 0 and 32 in ob["classes"]
    maps = memtrace.mappings()
    assert maps["file"] > 0 and sum(maps.values()) == pytest.approx(memtrace.rss_kib(), rel=0.2)


def judged(rss_mib: list[float], warmup_s: float = 10.0) -> soak.Report:
    args = argparse.Namespace(warmup_s=warmup_s, max_rss_growth=0.05, fd_slack=8, rate=0.0, minutes=1.0)
    rep = soak.Report(minutes=1.0, rate=0.0)
    samples = [soak.Sample(t=2.0 * i, rss_kib=int(m * 1024), fds=40) for i, m in enumerate(rss_mib)]
    soak.judge(args, rep, samples)
    return rep


def test_soak_judges_growth_after_the_warm_up_and_reports_its_slope() -> None:
    flat = judged([50.0] * 5 + [100.0] * 40)  # the warm-up's growth does not count
    assert flat.failures == [] and flat.rss_slope_mib_min == pytest.approx(0.0)
    creep = judged([100.0 + 0.3 * i for i in range(45)])  # 0.3 MiB per 2 s sample: 9 MiB/min
    assert creep.rss_slope_mib_min == pytest.approx(9.0, rel=1e-3)  # (RSS is whole KiB)
    assert any(f.startswith("RSS grew") for f in creep.failures)
