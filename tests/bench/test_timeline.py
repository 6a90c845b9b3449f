"""bench/timeline.py: the figures from request rows and the targets, and one tiny rolling restart
through Envoy + kvroute with cache buckets (file discovery), approximate and precise (token-exact keys
from the pods' KV events): nothing fails, the new pods take over, every session is back in its
bucket."""

import json

import pytest

from bench import results, timeline, workloads
from bench.timeline import TimelineConfig


def row(tag, at, upstream, ok=True, prompt=100, cached=50, ttft=0.1):
    return {"tag": tag, "at_s": at, "ok": ok, "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "upstream": upstream, "error": None if ok else "HTTP 503"}  # fmt: skip


def test_windows_keys_moved_and_recovery():
    rows = [row("a", 1, "p1"), row("b", 2, "p2"), row("a", 12, "p3", cached=0), row("b", 13, "p2", ok=False),
            row("b", 14, "p2", cached=100, ttft=0.3)]  # fmt: skip
    wins = timeline.windows(rows, 10, 20)
    assert [w["requests"] for w in wins] == [2, 3] and [w["failed"] for w in wins] == [0, 1]
    assert wins[0]["hit_rate"] == 0.5 and wins[1]["hit_rate"] == 0.5
    assert wins[1]["ttft_p90_s"] == pytest.approx(0.28)
    # Slots: p3 replaced p1 in bucket b1, so session a did not move; b stayed on p2.
    moved = timeline.keys_moved(rows, {"p1": "b1", "p2": "b2", "p3": "b1"}, start=10, end=11)
    assert moved == {"sessions": 2, "moved": 0, "share": 0.0}
    moved = timeline.keys_moved(rows, {"p1": "b1", "p2": "b2", "p3": "b3"}, start=10, end=11)
    assert moved["share"] == 0.5
    wins = [{"start_s": s, "hit_rate": h} for s, h in [(0, 0.5), (10, 0.6), (20, 0.2), (30, 0.54), (40, 0.59)]]
    assert timeline.recovery_s(wins, start=20, end=25, width=10) == {"steady_hit_rate": 0.55, "recovered_s": 15}
    assert timeline.minimal_share(TimelineConfig("scale-out", [], 1.0, pods=4, delta=2)) == pytest.approx(1 / 3)


def test_targets_apply_per_event_and_unknown_policies_fail_early():
    # Scale-out: moved within 1.2x the minimal share, recovered within 30 s; failures are not a target.
    assert timeline.targets("scale-out", 3, 0.4, 1 / 3, 30.0) == {"no_failures": None, "keys_moved": True,
                                                                  "recovered": True}  # fmt: skip
    assert timeline.targets("scale-out", 0, 0.41, 1 / 3, 31.0) == {"no_failures": None, "keys_moved": False,
                                                                   "recovered": False}  # fmt: skip
    # Graceful events fail nothing; a rolling restart's key movement is reported, not judged.
    assert timeline.targets("rolling-restart", 1, 0.5, 0.0, None) == {"no_failures": False, "keys_moved": None,
                                                                      "recovered": False}  # fmt: skip
    assert results.timeline_targets_text({"targets": timeline.targets("scale-in", 0, None, 0.25, 5.0)}) == "met"
    assert results.timeline_targets_text({"targets": timeline.targets("scale-in", 2, None, 0.25, 40.0)}) == (
        "missed: no failures, recovered"
    )
    timeline.check_policies(timeline.DEFAULT_POLICIES)
    with pytest.raises(ValueError, match="'kvroute-exact', 'nginx'"):
        timeline.check_policies(["kvroute-approx", "kvroute-exact", "nginx"])


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["kvroute-approx-buckets", "kvroute-precise-buckets"])
def test_rolling_restart_with_buckets_fails_nothing(tmp_path, policy):
    cfg = TimelineConfig(event="rolling-restart", policies=[policy], rate=10.0, pods=2,
                         profile="fast", event_at=3.0, duration=9.0, window=2.0, drain_timeout=10.0,
                         timeout=20.0, out=tmp_path, quiet=True)  # fmt: skip
    [res] = timeline.run(cfg, workloads.build("multi-turn", None, None))
    assert "error" not in res, res.get("error")
    assert res["failed"] == 0 and not res["event_problems"]
    assert sum(1 for _t, what in res["marks"] if "replaces" in what) == 2
    rows = [json.loads(line) for line in (tmp_path / f"{policy}.requests.jsonl").read_text().splitlines()]
    # Envoy's pool and kvroute follow the fleet (bench.timeline.FileMembers): a pod leaves both before
    # it stops and a spare joins Envoy before kvroute may name it, so whichever of them picks the pod,
    # requests sent before the event reach the first pods only, and those sent after it the new ones.
    before = {r["upstream"] for r in rows if r["at_s"] < res["event_start_s"]}
    after = {r["upstream"] for r in rows if r["at_s"] > res["event_end_s"] + 0.01}  # marks are rounded to 0.01 s
    assert len(before) == 2 and len(after) == 2 and not before & after, (res["marks"], before, after)
    assert res["keys_moved"]["sessions"] > 0 and res["keys_moved"]["share"] == 0.0  # each back in its bucket
    assert res["targets"]["no_failures"] is True
    if policy == "kvroute-precise-buckets":  # the precise index was fed by the pods (old and new) and used
        assert res["precise_blocks_stored"] > 0
        # keyed with the pods' own tokenizer (harness.precise_tokenizer): nearly every decision is precise
        assert res["index_decisions"].get("precise", 0) >= 0.9 * res["requests"], res["index_decisions"]
    else:
        assert res["index_decisions"].get("precise", 0) == 0
        assert sum(r["cached_tokens"] or 0 for r in rows if r["at_s"] > res["event_end_s"] + 0.5) > 0
    assert (tmp_path / "timeline-rolling-restart.png").stat().st_size > 0
