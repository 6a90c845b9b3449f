"""A shortened ``make demo``: real Envoy, real kvroute, simulated pods; kvroute must win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import demo

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_kvroute_beats_round_robin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = demo.main(["--documents", "12", "--users", "3", "--questions", "2", "--doc-tokens", "4000",
                    "--rate", "8", "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["policy"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    rr, kv = rows["round-robin"], rows[demo.POLICIES[1]]
    assert rr["errors"] == 0 and kv["errors"] == 0
    assert kv["hit_rate"] > rr["hit_rate"] + 0.1
    assert kv["ttft_p50_s"] < rr["ttft_p50_s"]
    assert "kvroute / round robin" in out
