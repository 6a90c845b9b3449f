"""bench.index_churn: records into a full approximate index, timed, and the largest dict they left."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.index_churn import (
    COLUMNS,
    ENDS_COLUMNS,
    LRU_COLUMNS,
    ends_row,
    lru_row,
    measure,
    measure_ends,
    measure_lru,
    row,
)
from extproc.index.approx import SHARDS


def test_index_churn_fills_every_pod_and_reports_the_largest_dict():
    r = measure(pods=3, blocks=50, fill=1.5)
    assert r["index_blocks"] == 3 * 31_250  # every pod's LRU full: the records went on past capacity
    assert r["records"] == -(-int(1.5 * 3 * 31_250) // 50)
    assert r["record_ms_p50"] <= r["record_ms_p99"] <= r["record_ms_max"]
    assert r["records_over_10ms"] <= r["records_over_1ms"] <= r["records"]
    # A pod's LRU (31,250 blocks) is the largest dict: the reverse map's parts hold a share each.
    assert r["largest_dict"] == 31_250 > 3 * 31_250 * 2 // SHARDS
    assert len(row(r, "this")) == len(COLUMNS)


def test_index_churn_cli_writes_a_table_headline(tmp_path):
    out = tmp_path / "churn.json"
    cmd = [sys.executable, "-m", "bench.index_churn", "--pods", "2", "--blocks", "20", "--fill", "0.05",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "2 pods:" in done.stdout
    h = json.loads(out.read_text())
    assert h["kind"] == "table" and h["columns"] == list(COLUMNS) and len(h["rows"]) == 1
    bad = subprocess.run([*cmd[:3], "--pods", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "comma-separated whole numbers" in bad.stderr


def test_index_churn_times_prompt_ends_per_window():
    rows = measure_ends(2500, window=1000)
    assert [r["notes"] for r in rows] == [1000, 2000, 2500]
    assert [r["held"] for r in rows] == [1000, 2000, 2500]  # distinct prompts, under the capacity
    assert all(0 < r["note_us_mean"] <= 1e3 * r["note_ms_max"] for r in rows)
    assert len(ends_row(rows[0], "this")) == len(ENDS_COLUMNS)


def test_index_churn_times_each_lru_beside_the_ordered_dict_it_was():
    rows = measure_lru(fill=2, pins_n=2000, cache_bytes=4 << 20)
    assert [(r["table"], r["kind"]) for r in rows] == [
        ("route pins", "ShardedLRU"), ("route pins", "OrderedDict"),
        ("chunk cache", "ShardedLRU"), ("chunk cache", "OrderedDict"),
    ]  # fmt: skip
    pins, chunks = rows[0], rows[2]
    assert pins["ops"] == rows[1]["ops"] == 4000 and pins["held"] == rows[1]["held"] == 2000  # full, evicting
    assert chunks["ops"] == 2 * chunks["capacity"] and 0.9 * chunks["capacity"] <= chunks["held"] <= chunks["capacity"]
    assert all(0 < r["op_us_p50"] <= 1e3 * r["op_ms_max"] for r in rows)
    assert len(lru_row(pins)) == len(LRU_COLUMNS)
