"""deploy/monitoring: the Grafana dashboard and the Prometheus alert rules. Every PromQL expression
parses, the rules validate against the PrometheusRule CRD, the kustomization wraps the dashboard in a
ConfigMap Grafana's sidecar picks up, and every metric an expression names (and every label it
matches or groups by) exists in a live scrape: kvroute's /metrics, Envoy's /stats/prometheus and the
simulated vLLM pods' /metrics, with kvroute in precise mode and P/D so that each family shows."""

from __future__ import annotations

import functools
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser as pql
import pytest
import yaml

from bench.envoy import EnvoyProcess
from bench.harness import precise_tokenizer
from bench.kvroute import KVRouteProcess
from bench.procs import python_module, start_with_ready_file, stop
from tests.deploy.test_manifests import CRD_DIR, build, crd_validator, kubernetes_errors
from tests.polling import wait_for

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
# Grafana's variables, as a query would see them (the dashboard's own: job).
GRAFANA_VARS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "job": "kvroute"}
# Labels Prometheus adds to every scraped series (the Prometheus operator's target labels).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container"}
# Series Prometheus makes itself, in no /metrics.
SYNTHETIC = {"up"}


@functools.cache
def dashboard() -> dict[str, Any]:
    return dict(json.loads((MONITORING / "grafana-dashboard.json").read_text()))


@functools.cache
def rule_doc() -> dict[str, Any]:
    return dict(yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text()))


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_doc()["spec"]["groups"] for r in g["rules"]]


def panels() -> Iterator[dict[str, Any]]:
    for p in dashboard()["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row's panels


def promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables put in."""
    out = re.sub(r"\$\{?(\w+)\}?", lambda m: GRAFANA_VARS.get(m[1], m[0]), expr)
    assert "$" not in out, f"unknown Grafana variable in {expr!r}"
    return out


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard target and every alert rule."""
    out = [(f"panel {p['title']!r} {t['refId']}", promql(t["expr"])) for p in panels() for t in p.get("targets", [])]
    out += [(f"alert {r['alert']}", r["expr"]) for r in rules()]
    return out


def selectors(node: Any) -> list[Any]:
    found: list[Any] = []
    pql.walk(node, lambda n: found.append(n) if isinstance(n, pql.VectorSelector) else None)
    return found


def metric_name(sel: Any) -> str:
    if sel.name:
        return str(sel.name)
    (name,) = [m.value for m in sel.matchers.matchers if m.name == "__name__"]
    return str(name)


def label_uses(expr: Any) -> Iterator[tuple[str, list[Any]]]:
    """(label, the selectors it must come from) for every matcher, by/without and on/ignoring label."""

    def visit(n: Any) -> None:
        if isinstance(n, pql.VectorSelector):
            uses.extend((m.name, [n]) for m in n.matchers.matchers if m.name != "__name__")
        elif isinstance(n, pql.AggregateExpr) and n.modifier is not None:
            uses.extend((label, selectors(n.expr)) for label in n.modifier.labels)
        elif isinstance(n, pql.BinaryExpr) and n.modifier is not None and n.modifier.matching is not None:
            for side in (n.lhs, n.rhs):
                uses.extend((label, selectors(side)) for label in n.modifier.matching.labels)

    uses: list[tuple[str, list[Any]]] = []
    pql.walk(expr, visit)
    yield from uses


# --- the files ------------------------------------------------------------------------------------


def test_every_expression_parses() -> None:
    errors = []
    for where, expr in expressions():
        try:
            pql.parse(expr)
        except ValueError as e:
            errors.append(f"{where}: {e}\n  {expr}")
    assert not errors, "\n".join(errors)
    assert len(expressions()) > 40


def test_the_parse_check_refuses_mistakes() -> None:
    for bad in ("sum(rate(kvroute_decisions_total[5m])", "rate(kvroute_decisions_total)", "a +", "sum by (x y) (a)"):
        with pytest.raises(ValueError):
            pql.parse(bad)
    with pytest.raises(AssertionError, match="unknown Grafana variable"):
        promql("rate(x[$nope])")


def test_dashboard_is_a_grafana_dashboard() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied: dict[tuple[int, int], str] = {}
    for p in panels():
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in occupied, f"{p['title']!r} overlaps {occupied[cell]!r}"
            occupied[cell] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p.get("description"), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_dashboard_covers_what_the_issue_lists() -> None:
    """Hit rate predicted vs reported, decisions by reason, P/D, decision latency, per-pod load and KV
    use, index size, KV-event health, errors, and the fail-open rate Envoy sees."""
    exprs = " ".join(e for _, e in expressions())
    for metric in (
        "kvroute_predicted_cached_tokens_total",
        "vllm:prefix_cache_hits_total",
        "kvroute_decisions_total",
        "kvroute_pd_decisions_total",
        "kvroute_decision_seconds_bucket",
        "kvroute_inflight_requests",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "kvroute_index_blocks",
        "kvroute_kv_events",
        "kvroute_errors_total",
        "envoy_http_ext_proc_failure_mode_allowed",
    ):
        assert metric in exprs, metric


def test_alerts_cover_what_the_issue_lists() -> None:
    names = {r["alert"] for r in rules()}
    assert {"KVRouteDown", "EnvoyFailingOpen", "KVRouteHitRateCollapse", "KVRouteKVEventsStalled",
            "KVRouteAllPodsSaturated"} <= names  # fmt: skip
    for r in rules():
        pql.parse_duration(r["for"])
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_rules_validate_against_the_prometheusrule_crd() -> None:
    if not CRD_DIR.is_dir():
        pytest.skip(f"the upstream CRDs are absent: no {CRD_DIR} (../shared/crds beside the repository)")
    doc = rule_doc()
    validator = crd_validator(doc["apiVersion"], doc["kind"])
    assert validator is not None
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    errors += kubernetes_errors({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]})
    assert not errors, "\n".join(errors)
    # ...and the check can fail.
    bad = {**doc, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": 5}]}]}}
    assert not validator.is_valid(bad)


def test_kustomization_wraps_the_dashboard_for_grafana() -> None:
    docs = build("monitoring")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvroute.json"]) == dashboard()
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == rule_doc()["spec"]


# --- against live scrapes -------------------------------------------------------------------------


class Scrape:
    """Metric names, each one's label names and values, from Prometheus text exposition."""

    def __init__(self) -> None:
        self.labels: dict[str, set[str]] = {}
        self.values: dict[tuple[str, str], set[str]] = {}
        self.sampled: set[str] = set()

    def add(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith("# TYPE "):  # declared, even before its first sample
                _, _, name, kind = line.split(maxsplit=3)
                counter = (name, name.removesuffix("_total") + "_total")
                histogram = (name + "_bucket", name + "_sum", name + "_count")
                series = {"counter": counter, "histogram": histogram}.get(kind, (name,))
                for n in series:
                    self.labels.setdefault(n, set())
            elif line and not line.startswith("#"):
                m = re.match(r"([^\s{]+)(?:\{(.*)\})?\s", line)
                assert m, line
                for label, value in re.findall(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"', m[2] or ""):
                    self.labels.setdefault(m[1], set()).add(label)
                    self.values.setdefault((m[1], label), set()).add(value)
                self.labels.setdefault(m[1], set())
                self.sampled.add(m[1])


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    """One prefill and one decode pod (simulated vLLM, KV events on), kvroute in precise mode (the pods'
    tokenizer, bench.harness.precise_tokenizer) with scraping and gateway P/D, and Envoy in front; a few
    requests through it (one long new prompt, decided on its head, its rest encoded after), then every
    scrape."""
    sim, info = start_with_ready_file(python_module(
        "bench.sim", "--pods", "2", "--roles", "prefill:1,decode:1", "--base-port", "0", "--zmq-base-port", "0",
        "--profile", "fast", "--model", "m"))  # fmt: skip
    pods = info["pods"]
    eps = [{"address": p["address"], "role": p["role"], "kv_events": p["kv_events_endpoint"],
            "kv_replay": p["replay_endpoint"]} for p in pods]  # fmt: skip
    tmp = tmp_path_factory.mktemp("monitoring")
    cfg = tmp / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump({
        "pools": {"default": {"endpoints": eps}},
        "models": {
            "m": {"pool": "default", "tokenizer": str(precise_tokenizer(tmp / "tokenizer")), "block_size": 16},
            "n": {"pool": "default"},  # no tokenizer: keyed approximately (kvroute_index_blocks)
        },
        "kv_events": {"enabled": True},
        "scrape": {"enabled": True},
        "pd": {"disaggregation": "always", "handoff": "gateway"},
        "capacity": {"measured_min_prefills": 1},  # so a few requests measure the pods (kvroute_cost_model_fit)
    }))  # fmt: skip
    try:
        with (
            KVRouteProcess(config=str(cfg)) as kv,
            EnvoyProcess(
                "epp.yaml",
                kvroute_port=kv.grpc_port,
                pods=[p["address"] for p in pods],
                processing_mode={"response_body_mode": "STREAMED"},  # kvroute reads usage.cached_tokens
            ) as env,
            httpx.Client(base_url=env.url, timeout=30) as client,
        ):

            def chat(i: int, content: str | None = None, model: str = "m") -> httpx.Response:
                text = content or f"doc {i} " * 200
                body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
                return client.post("/v1/chat/completions", json=body)

            for i in range(4):
                assert chat(i % 2).status_code == 200
            # model n, keyed approximately and routed; the pods serve only m and answer as vLLM does
            assert chat(0, model="n").status_code == 404
            # 7.5k characters of new text, none repeated: decided on its first ~256 (no pod holds them), the
            # rest encoded after the answer (kvroute_tokenize_deferred{result="recorded"})
            assert chat(2, " ".join(f"part {j} of doc 2." for j in range(400))).status_code == 200
            recorded = re.compile(r'^kvroute_tokenize_deferred_total\{result="recorded"\} [1-9]', re.M)
            wait_for(lambda: bool(recorded.search(kv.metrics())), what="the long prompt's rest recorded")
            assert client.post("/v1/chat/completions", content=b"{not json").status_code == 400  # an error kind
            fit = re.compile(r"^kvroute_cost_model_fit\{", re.M)  # the pods' first tokens seen by a scrape
            wait_for(lambda: bool(fit.search(kv.metrics())), what="the pods' prefill rate measured")
            s = Scrape()
            s.add(kv.metrics())
            for p in pods:
                s.add(urllib.request.urlopen(p["url"] + "/metrics", timeout=5).read().decode())
            s.add(envoy_stats(env))
            # kvroute gone: Envoy fails open, and says so in the counter the dashboard and alerts read.
            kv.stop()
            assert chat(9).status_code == 200
            allowed = re.search(r"^envoy_http_ext_proc_failure_mode_allowed\{[^}]*\} (\d+)", envoy_stats(env), re.M)
            assert allowed and int(allowed[1]) >= 1
            yield s
    finally:
        stop(sim)


def envoy_stats(env: EnvoyProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{env.admin_port}/stats/prometheus", timeout=5) as r:
        return str(r.read().decode())


@pytest.mark.integration
def test_every_metric_and_label_exists_in_a_live_scrape(scrape: Scrape) -> None:
    missing, unknown_labels = [], []
    for where, expr in expressions():
        ast = pql.parse(expr)
        for sel in selectors(ast):
            name = metric_name(sel)
            if name not in scrape.labels and name not in SYNTHETIC:
                missing.append(f"{where}: {name}")
        for label, sels in label_uses(ast):
            have = set(TARGET_LABELS)
            for sel in sels:
                have |= scrape.labels.get(metric_name(sel), set())
            known = any(metric_name(s) in scrape.sampled for s in sels)  # a family with samples
            if known and label not in have:
                unknown_labels.append(f"{where}: {label} (on {', '.join(sorted({metric_name(s) for s in sels}))})")
    assert not missing, "metrics in no live scrape:\n" + "\n".join(missing)
    assert not unknown_labels, "labels in no live scrape:\n" + "\n".join(unknown_labels)


@pytest.mark.integration
def test_every_label_value_matched_exists_in_a_live_scrape(scrape: Scrape) -> None:
    """``{stat="messages"}``, ``{stat=~"gaps|resyncs"}``: values kvroute's own collectors always export."""
    unknown = []
    for where, expr in expressions():
        for sel in selectors(pql.parse(expr)):
            name = metric_name(sel)
            for m in sel.matchers.matchers:
                if name not in scrape.sampled or m.name in TARGET_LABELS | {"__name__"}:
                    continue
                if m.op == pql.MatchOp.Equal:
                    wanted = {m.value}
                elif m.op == pql.MatchOp.Re and re.fullmatch(r"[\w|]+", m.value):
                    wanted = set(m.value.split("|"))
                else:
                    continue
                for value in sorted(wanted - scrape.values.get((name, m.name), set())):
                    unknown.append(f"{where}: {name}{{{m.name}={value!r}}}")
    assert not unknown, "label values in no live scrape:\n" + "\n".join(unknown)


@pytest.mark.integration
def test_the_traffic_made_every_series_show(scrape: Scrape) -> None:
    """So the label checks above had samples to check: all but the refused config fields (a reload's)."""
    names = {metric_name(s) for _, e in expressions() for s in selectors(pql.parse(e))} - SYNTHETIC
    assert names - scrape.sampled == {"kvroute_config_refused_fields"}
