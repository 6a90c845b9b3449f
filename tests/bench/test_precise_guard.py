"""kvroute-precise is precise or fails: its kvroute gets the pods' tokenizer, and a run whose kvroute
keyed no request precisely is refused instead of reported under the precise name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from bench import harness, workloads
from extproc.config import build_config
from extproc.observability import Metrics


def metrics_text(precise: int, approx: int) -> str:
    m = Metrics()
    m.index_decisions.labels("precise").inc(precise)
    m.index_decisions.labels("approx").inc(approx)
    return generate_latest(m.registry).decode()


def test_index_decisions_read_and_add_up_replicas() -> None:
    assert harness.index_decisions(metrics_text(0, 0)) == {"precise": 0.0, "approx": 0.0}
    two = metrics_text(5, 1) + metrics_text(2, 0)  # KVRouteReplicas.metrics: the replicas' texts together
    assert harness.index_decisions(two) == {"precise": 7.0, "approx": 1.0}
    assert harness.index_decisions("") == {}


def test_head_decisions_rests_are_read_by_result() -> None:
    m = Metrics()
    m.tokenize_deferred.labels("recorded").inc(3)
    m.tokenize_deferred.labels("skipped").inc()
    text = generate_latest(m.registry).decode()
    assert harness.counter_totals(text + text, "kvroute_tokenize_deferred", "result") == {
        "recorded": 6.0,
        "skipped": 2.0,
    }


def test_decision_time_is_the_mean_over_the_replicas() -> None:
    a, b = Metrics(), Metrics()
    for seconds in (0.001, 0.003):
        a.observe_decision(seconds)
    b.observe_decision(0.008)
    two = generate_latest(a.registry).decode() + generate_latest(b.registry).decode()
    assert harness.decision_ms_mean(two) == pytest.approx(4.0)  # (1 + 3 + 8) / 3
    assert harness.decision_ms_mean(generate_latest(Metrics().registry).decode()) is None  # no decision yet
    assert harness.decision_ms_mean("") is None


@pytest.mark.parametrize(
    "policy", ["kvroute-precise", "kvroute-precise@3", "kvroute-precise@3+redis", "kvroute-precise:authz"]
)
def test_a_precise_run_without_precise_decisions_fails(policy: str) -> None:
    with pytest.raises(harness.NotPreciseError, match=r"no precise decision \(40 approximate"):
        harness.check_precise(policy, harness.index_decisions(metrics_text(0, 40)))
    with pytest.raises(harness.NotPreciseError):
        harness.check_precise(policy, {})  # a kvroute that does not count them cannot pass either
    harness.check_precise(policy, harness.index_decisions(metrics_text(39, 1)))


def test_other_policies_are_not_checked() -> None:
    for policy in ("kvroute-approx", "kvroute-approx@2", "kvroute-pd-always", "round-robin"):
        harness.check_precise(policy, {"approx": 40.0})


def test_precise_config_loads_the_pods_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "PRECISE_TOKENIZER_DIR", tmp_path / "tok")

    class Fleet:
        pods: list[dict[str, Any]] = [
            {"address": "127.0.0.1:8001", "kv_events_endpoint": "tcp://127.0.0.1:7001",
             "replay_endpoint": "tcp://127.0.0.1:7002"},
        ]  # fmt: skip

    raw = harness.precise_config(Fleet(), 32)  # type: ignore[arg-type]
    cfg = build_config(raw)
    model = cfg.models[workloads.MODEL]
    assert model.block_size == 32 and model.tokenizer == tmp_path / "tok"
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert cfg.kv_events.enabled and cfg.pools["default"].endpoints[0].kv_events == "tcp://127.0.0.1:7001"


def test_the_cost_models_fit_is_read_per_pool_and_role_and_averaged_over_replicas() -> None:
    def replica(fits: dict[tuple[str, str], float]) -> str:
        lines = ["# HELP kvroute_cost_model_fit fit", "# TYPE kvroute_cost_model_fit gauge"]
        lines += [f'kvroute_cost_model_fit{{pool="{p}",role="{r}"}} {v}' for (p, r), v in fits.items()]
        return "\n".join(lines) + "\n"

    two = replica({("p", "prefill"): 0.8, ("p", "decode"): 1.2}) + replica({("p", "prefill"): 1.0})
    assert harness.cost_fit(two) == {"p/prefill": pytest.approx(0.9), "p/decode": 1.2}
    assert harness.cost_fit(generate_latest(Metrics().registry).decode()) == {}  # not kvroute's or not measured
