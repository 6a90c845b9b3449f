"""bench.affinity: moved follow-ups found from the per-request records, and their causes from kvroute's decisions."""

import json
from pathlib import Path

from bench import affinity

A, B, C = "10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"


def _request(i: int, tag: str, pod: str, prompt: int, cached: int) -> str:
    return json.dumps({"request_id": f"bench-{i}", "tag": tag, "at_s": i * 0.1, "status": 200, "upstream": pod,
                       "prompt_tokens": prompt, "cached_tokens": cached})  # fmt: skip


def _routed(i: int, pod: str, matches: dict[str, int], est: dict[str, list[float]], predicted: int) -> str:
    d = {"msg": "routed", "request_id": f"bench-{i}", "endpoint": pod, "matches": matches, "estimates_ms": est,
         "block_tokens": 100.0, "predicted_cached_tokens": predicted}  # fmt: skip
    return json.dumps(d, separators=(",", ":"))


def test_moved_follow_ups_and_their_causes(tmp_path: Path) -> None:
    reqs = [
        _request(0, "s1", A, 1000, 0),
        _request(1, "s2", B, 2000, 0),
        _request(2, "s3", C, 500, 0),
        _request(3, "s4", A, 800, 0),
        _request(4, "s1", B, 1500, 100),  # outweighed: A held 1000 of it, its queue cost more
        _request(5, "s2", B, 2500, 2000),  # stayed
        _request(6, "s3", A, 600, 0),  # filtered: C was not eligible
        _request(7, "s4", C, 900, 0),  # forgotten: A credited with nothing
        json.dumps({"request_id": "bench-8", "tag": "s1", "at_s": 0.8, "status": 503, "upstream": C}),  # failed
    ]
    log = [
        _routed(4, B, {A: 10, B: 1}, {A: [500.0, 10.0, 0.0, 510.0], B: [0.0, 30.0, 20.0, 50.0]}, 100),
        _routed(5, B, {B: 20}, {B: [0.0, 10.0, 0.0, 10.0]}, 2000),
        _routed(6, A, {}, {A: [0.0, 12.0, 0.0, 12.0], B: [5.0, 12.0, 0.0, 17.0]}, 0),
        _routed(7, C, {}, {A: [9.0, 18.0, 0.0, 27.0], C: [0.0, 18.0, 0.0, 18.0]}, 0),
    ]
    (tmp_path / "kvroute-approx.requests.jsonl").write_text("\n".join(reqs))
    (tmp_path / "kvroute-approx.kvroute.log").write_text('{"msg":"started"}\n' + "\n".join(log))
    (tmp_path / "sglang-router.requests.jsonl").write_text("\n".join(reqs[:5]))
    kv, peer = affinity.collect(tmp_path)
    assert (kv.policy, kv.follow_ups, len(kv.moved)) == ("kvroute-approx", 4, 3)
    assert [m.cause for m in kv.moved] == ["outweighed", "filtered", "forgotten"]
    out = kv.moved[0]
    assert (out.prev_pod, out.pod, out.held_prev, out.held_pick) == (A, B, 1000, 100)
    assert out.wait_gap_s == 0.5 and out.saved_s == 0.02
    assert kv.predicted_cached == 2100 and kv.reported_cached == 2100
    assert (peer.follow_ups, len(peer.moved), peer.causes, peer.predicted_cached) == (1, 1, {}, None)
    table = affinity.table([kv, peer])
    assert "| kvroute-approx | 4 | 3 | 3.0k | 0.1k | 2.3k | 1 | 1 | 1 | 0 | 0.500 / 0.020 | 2k / 2k |" in table
    assert "| sglang-router | 1 | 1 | 1.5k | 0.1k | 1.0k | – | – | – | – | – | – |" in table
    assert affinity.main([str(tmp_path / "nothing")]) == 2


def _timed(i: int, tag: str, pod: str, ttft: float | None, status: int = 200) -> str:
    return json.dumps({"request_id": f"bench-{i}", "tag": tag, "at_s": i * 0.1, "status": status, "upstream": pod,
                       "ttft_s": ttft, "prompt_tokens": 100, "cached_tokens": 0})  # fmt: skip


def test_placement_counts_each_sessions_first_pod_and_the_ttft_by_a_pods_homes(tmp_path: Path, capsys) -> None:
    """Sessions s1-s3 start on A and s4 on B; s1's next turn moves to B (its home stays A). Each pod's
    requests' median TTFT is grouped by how many sessions it homes; failed requests count for nothing."""
    reqs = [
        _timed(0, "s1", A, 0.030),
        _timed(1, "s2", A, 0.034),
        _timed(2, "s3", A, 0.032),
        _timed(3, "s4", B, 0.020),
        _timed(4, "s1", B, 0.024),
        _timed(5, "s5", C, None, status=503),  # failed: homes nothing
        _timed(6, "s2", A, None),  # no first token recorded: not in the TTFTs
    ]
    run = tmp_path / "run-1"
    run.mkdir()
    (run / "kvroute-approx.requests.jsonl").write_text("\n".join(reqs))
    (p,) = affinity.placements(tmp_path)
    assert p.policy == "run-1/kvroute-approx"
    assert p.homes == {A: 3, B: 1}
    assert p.by_homes() == {1: 0.022, 3: 0.032}
    assert affinity.main([str(tmp_path), "--placement"]) == 0
    assert "| run-1/kvroute-approx | 2 | [1, 3] | [2, 3] | 1: 0.0220, 3: 0.0320 |" in capsys.readouterr().out
    assert affinity.main([str(tmp_path / "nothing"), "--placement"]) == 2
