"""Shadow mode and gradual rollout: the arm a conversation falls in, what a shadowed decision records
(and does not), and the per-arm metrics."""

from __future__ import annotations

import orjson
import pytest

from extproc.config import ConfigError, build_config
from extproc.observability import Metrics
from extproc.rollout import arm_of
from extproc.router import Router

PODS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def make(**cfg) -> Router:
    return Router(build_config({"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, **cfg}), Metrics())


def request(r: Router, doc: str, headers: dict[str, str] | None = None, model: str = "m"):
    text = " ".join(f"{doc}-{i}" for i in range(200))
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}]})
    return r.parse("/v1/chat/completions", "POST", headers or {}, body)


def arm(r: Router, req) -> str:
    k = r.keys(req, r.registry.pools["p"].endpoints)
    return arm_of(r.config, req, None if req.route_id is None else 1, k.keys)


def sample(r: Router, name: str, **labels: str) -> float:
    return r.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_stable_share_of_conversations_is_enforced():
    r = make(rollout={"enforce_fraction": 0.3})
    arms = [arm(r, request(r, f"conversation {i}")) for i in range(2000)]
    enforced = arms.count("enforced")
    assert 500 < enforced < 700  # 600 expected; 3 sigma is 61
    # Every turn of a conversation repeats its first block: same arm, in every replica.
    other = make(rollout={"enforce_fraction": 0.3})
    assert [arm(other, request(other, f"conversation {i}")) for i in range(50)] == arms[:50]
    assert {arm(make(), request(r, f"c{i}")) for i in range(50)} == {"enforced"}
    assert {arm(make(mode="shadow"), request(r, f"c{i}")) for i in range(50)} == {"shadow"}


def test_per_model_fraction_overrides_the_default():
    r = make(rollout={"enforce_fraction": 0.0}, models={"docqa": {"pool": "p", "enforce_fraction": 1.0},
                                                        "chat": {"pool": "p"}})  # fmt: skip
    assert {arm(r, request(r, f"d{i}", model="docqa")) for i in range(30)} == {"enforced"}
    assert {arm(r, request(r, f"d{i}", model="chat")) for i in range(30)} == {"shadow"}


def test_a_shadowed_decision_steers_nothing_and_learns_where_envoy_sent_it():
    r = make(mode="shadow")
    req = request(r, "doc")
    out = r.route(req)
    assert out.arm == "shadow" and out.set_headers == {} and out.metadata == {} and not out.acquired
    assert not out.clear_route_cache  # Envoy keeps its own (balanced) route
    assert all(e.inflight == 0 and e.prefills.wait(0.0) == 0 for e in r.registry.by_address.values())
    would = out.endpoint
    assert r.shadow_index.block_counts() == {would: len(out.keys.keys)}  # the arm's own history
    assert r.index.block_counts() == {}
    # The same conversation again: kvroute would send it to the same pod (its shadow history).
    again = r.route(req)
    assert again.endpoint == would and again.predicted_cached > 0 and again.decision.reason == "prefix"

    # Envoy sent it elsewhere: that pod carries the load and (really) holds the prefix now.
    actual = next(a for a in PODS if a != would)
    assert r.observe_upstream(again, actual) == actual
    assert r.registry.by_address[actual].inflight == 1 and r.index.block_counts()[actual] == len(out.keys.keys)
    r.release(actual)
    assert r.registry.by_address[actual].inflight == 0
    assert sample(r, "kvroute_rollout_agreement_total", arm="shadow", agreed="no") == 1
    assert r.observe_upstream(again, would) == would
    assert sample(r, "kvroute_rollout_agreement_total", arm="shadow", agreed="yes") == 1
    assert r.observe_upstream(again, None) is None
    assert sample(r, "kvroute_rollout_agreement_total", arm="shadow", agreed="unknown") == 1
    assert sample(r, "kvroute_rollout_decisions_total", arm="shadow") == 2
    assert sample(r, "kvroute_decisions_total", pool="p", endpoint=would, reason="prefix") == 0


def test_usage_is_counted_per_arm_beside_the_prediction():
    r = make(rollout={"enforce_fraction": 0.5})
    outs = [r.route(request(r, f"doc {i % 6}")) for i in range(24)]  # 6 conversations, 4 turns each
    assert {o.arm for o in outs} == {"enforced", "shadow"}
    for o in outs:
        r.report_usage(o, 1000, 500)
    for a in ("enforced", "shadow"):
        n = sum(o.arm == a for o in outs)
        assert sample(r, "kvroute_rollout_tokens_total", arm=a, kind="prompt") == 1000 * n
        assert sample(r, "kvroute_rollout_tokens_total", arm=a, kind="reported_cached") == 500 * n
        predicted = sum(o.predicted_cached for o in outs if o.arm == a)
        assert predicted > 0  # later turns of each conversation are predicted as hits, in both arms
        assert sample(r, "kvroute_rollout_tokens_total", arm=a, kind="predicted_cached") == predicted


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"rollout": {"enforce_fraction": 1.5}}, "rollout.enforce_fraction"),
        ({"models": {"m": {"pool": "p", "enforce_fraction": -0.1}}}, "models.m.enforce_fraction"),
        ({"rollout": {"upstream_header": "bad header"}}, "rollout.upstream_header"),
        ({"mode": "mirror"}, "mode"),
    ],
)
def test_rollout_config_errors_name_the_field(cfg, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        make(**cfg)
