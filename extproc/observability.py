"""Prometheus metrics and structured (JSON) logs. Never prompt text: ids, sizes, names, numbers."""

from __future__ import annotations

import logging
import os
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.values import MutexValue

from extproc.rests import EAGER_FROM

# A worker of ``kvroute serve --workers N`` has its index here (extproc/workers.py); logs carry it.
WORKER_ENV = "KVROUTE_WORKER"
# kvroute_config_reloads_total{result}: what a config reload did (extproc/reload.py).
RELOAD_RESULTS = ("applied", "unchanged", "invalid", "restart_required")
_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)
_Scalar = TypeVar("_Scalar", Counter, Gauge)  # a metric whose series hold one value each
_DECISION_LABELS = ("pool", "endpoint", "reason")
_INFLIGHT_LABELS = ("endpoint",)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Cell:
    """A metric's value as prometheus_client's value interface has it (inc, set, get, exemplars), but
    without its lock, so the per-request path updates ``v`` in place (a lock and two method calls per
    update were several per cent of a request's CPU). Safe as only the event loop's thread writes the
    metrics that get cells; the /metrics thread reads a float, which is atomic."""

    __slots__ = ("_exemplar", "v")

    def __init__(self, value: float = 0.0) -> None:
        self.v = float(value)
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self.v += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.v = value

    def get(self) -> float:
        return self.v

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self._exemplar


def _unlocked(holder: Any, attr: str = "_value") -> Cell:
    """``holder``'s value (a metric or a labelled child) swapped for a ``Cell`` holding the same
    figure; the metric's own methods and its exposition read and write the cell from then on."""
    cell = _cell_of(getattr(holder, attr))
    setattr(holder, attr, cell)
    return cell


def _cell_of(value: Any) -> Cell:
    if isinstance(value, Cell):
        return value
    if type(value) is not MutexValue:  # e.g. prometheus_client's multiprocess mode, which kvroute does not use
        raise TypeError(f"unexpected prometheus_client value {type(value).__name__}: cannot unlock it")
    return Cell(value.get())


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._cells: dict[tuple[Any, tuple[str, ...]], Cell] = {}
        self.decisions = Counter("kvroute_decisions", "Routing decisions", _DECISION_LABELS, registry=r)
        self.index_decisions = Counter(
            "kvroute_index_decisions",
            "Routing decisions by the index that keyed them: precise (token blocks, the pods' KV events) or "
            "approx (character blocks: no precise index, no tokenizer for the model, or tokenizing failed)",
            ["index"],
            registry=r,
        )
        for index in ("precise", "approx"):  # both exported from the start: 0 precise is an answer too
            self.index_decisions.labels(index)
        self.tokenize_off_loop = Counter(
            "kvroute_tokenize_off_loop",
            "Precise decisions whose prompt had so much new text that it was encoded in a thread, "
            "the event loop serving other streams meanwhile",
            registry=r,
        )
        self.tokenize_deferred = Counter(
            "kvroute_tokenize_deferred",
            "Precise decisions made on the prompt's head (no pod held its last block, or only the pod picked), the "
            "rest encoded after the answer: recorded (cached and in the index), skipped (too many waiting), "
            "failed; held: left unencoded while prompts reuse little (kvroute_prompt_reuse), then asked (a later "
            "prompt's new text was in it: encoded then) or dropped (aged out); waited: decisions that waited for "
            "another request's rest holding their new text",
            ["result"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds",
            "Time from end of request body to the routing answer (parse, tokenize, hash, index, score)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # observe_decision's view of it: the buckets' upper bounds (+Inf last) and their unlocked values.
        h = self.decision_seconds
        self._decision_bounds: list[float] = h._upper_bounds
        self._decision_sum = _unlocked(h, "_sum")
        h._buckets = self._decision_buckets = [_cell_of(b) for b in h._buckets]
        self.inflight = Gauge(
            "kvroute_inflight_requests", "Requests in flight per endpoint", _INFLIGHT_LABELS, registry=r
        )
        # Series labelled with a pod: dropped when it leaves (forget_endpoint).
        self._per_endpoint: tuple[tuple[Counter | Gauge, tuple[str, ...]], ...] = (
            (self.inflight, _INFLIGHT_LABELS),
            (self.decisions, _DECISION_LABELS),
        )
        self.predicted_cached = Counter(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens kvroute expected the chosen pod to have cached (chars/4 for the approximate index)",
            ["pool"],
            registry=r,
        )
        self.reported_cached = Counter(
            "kvroute_reported_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens reported by pods",
            ["pool"],
            registry=r,
        )
        self.reported_prompt = Counter(
            "kvroute_reported_prompt_tokens", "usage.prompt_tokens reported by pods", ["pool"], registry=r
        )
        self.pd_decisions = Counter(
            "kvroute_pd_decisions",
            "Prefill/decode split decisions by outcome and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.pd_prefill_seconds = Histogram(
            "kvroute_pd_prefill_seconds",
            "Gateway-orchestrated prefill legs",
            ["result"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.pd_prefill_wait_seconds = Histogram(
            "kvroute_pd_prefill_wait_seconds",
            "Time gateway prefill legs waited for their prefill pod's turn (pd.prefill_step_tokens)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.hold_seconds = Histogram(
            "kvroute_hold_seconds",
            "Time long prompts were held for the prefills queued ahead of them on their pod (routing.hold)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.gc_pause_seconds = Histogram(
            "kvroute_gc_pause_seconds",
            "Python's cyclic garbage collections in the serving process by generation: each one stops the "
            "event loop, every stream's decision waiting (extproc/heap.py)",
            ["generation"],
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.errors = Counter(
            "kvroute_errors", "Requests answered with an error, or internal faults", ["kind"], registry=r
        )
        self.rollout_decisions = Counter(
            "kvroute_rollout_decisions", "Decisions by rollout arm (shadow: decided, not steered)", ["arm"], registry=r
        )
        self.rollout_agreement = Counter(
            "kvroute_rollout_agreement",
            "Responses whose pod (the upstream header) was kvroute's pick: yes, no, or unknown (no header)",
            ["arm", "agreed"],
            registry=r,
        )
        self.rollout_tokens = Counter(
            "kvroute_rollout_tokens",
            "Per arm: prompt tokens reported, cached tokens reported, and cached tokens kvroute predicted at its "
            "pick (predicted_cached / prompt: the hit rate kvroute expects; reported_cached / prompt: the real one)",
            ["arm", "kind"],
            registry=r,
        )
        self.streams = Gauge("kvroute_open_streams", "ext_proc streams currently open", registry=r)
        self.open_streams = _unlocked(self.streams)  # the servicer's per-stream inc/dec
        self.prompt_reuse = _unlocked(Gauge(
            "kvroute_prompt_reuse",
            "Share of recent precise prompts' characters known before each came (cached, or in a rest); below "
            f"{EAGER_FROM} the rests of head-decided prompts are held until a later prompt needs them "
            "(extproc/rests.py)",
            registry=r,
        ))  # fmt: skip
        self.streams_limited = Counter(
            "kvroute_streams_limited",
            "ext_proc streams refused (reason max_streams: server.max_streams open) or closed (reason idle: "
            "no message for server.stream_idle_timeout_s; authz_unlogged: an ext_authz request whose access log "
            "entry never came in that time)",
            ["reason"],
            registry=r,
        )
        self.authz_logged = Counter(
            "kvroute_authz_access_log_entries",
            "ext_authz transport: finished requests Envoy's access log reported, by result: released (this process "
            "held the request's pod slot) or unknown (not routed here: another worker or replica routed it, or it "
            "was refused or passed on unrouted)",
            ["result"],
            registry=r,
        )
        self.stripped = Counter(
            "kvroute_stripped_headers", "Client-sent routing headers removed", ["header"], registry=r
        )
        # Hot reload (extproc/reload.py).
        self.config_reloads = Counter(
            "kvroute_config_reloads",
            "Config file reloads by result: applied, unchanged, invalid or restart_required (both refused)",
            ["result"],
            registry=r,
        )
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        self.config_valid = Gauge(
            "kvroute_config_valid", "1 if the config file last read was valid (an invalid one is refused)", registry=r
        )
        self.config_valid.set(1)
        self.config_last_reload = Gauge(
            "kvroute_config_last_reload_timestamp_seconds",
            "When the running config was applied (start or reload), Unix time",
            registry=r,
        )
        self.config_info = Gauge(
            "kvroute_config_info", "The running config: a hash of its effective settings", ["hash"], registry=r
        )
        self.config_refused = Gauge(
            "kvroute_config_refused_fields",
            "Settings of the config file last read that are not running: invalid, or restart_required",
            ["field", "reason"],
            registry=r,
        )

    def forget_endpoint(self, address: str) -> None:
        """A pod left the fleet: every series labelled with it goes (its in-flight gauge, its decision
        counts), and the children remembered for it. Pods come and go, each restart under a new IP
        in Kubernetes: series kept for gone pods would pile up without bound."""
        for metric, names in self._per_endpoint:
            for labels in _label_sets(metric, names, address):
                metric.remove(*labels)
        self._children = {k: c for k, c in self._children.items() if address not in k[1]}
        self._cells = {k: c for k, c in self._cells.items() if address not in k[1]}

    def child(self, metric: _Metric, *labels: str) -> _Metric:
        """``metric.labels(*labels)``, remembered: the per-request path skips prometheus_client's
        lock and label checks (event-loop only; a removed endpoint's children are forgotten)."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def cell(self, metric: _Scalar, *labels: str) -> Cell:
        """The unlocked value of ``metric.labels(*labels)``, remembered like ``child``: the per-request
        path adds to (or sets) its ``v``. Event-loop thread only, as every writer of such a series."""
        key = (metric, labels)
        c = self._cells.get(key)
        if c is None:
            c = self._cells[key] = _unlocked(self.child(metric, *labels))
        return c

    def observe_decision(self, seconds: float) -> None:
        """``decision_seconds.observe(seconds)`` on the unlocked values (event-loop thread only)."""
        self._decision_sum.v += seconds
        self._decision_buckets[bisect_left(self._decision_bounds, seconds)].v += 1

    def serve(self, port: int, addr: str) -> Callable[[], None]:
        """Serve /metrics on ``addr:port`` (OSError if it cannot bind); returns what stops it."""
        httpd, _ = start_http_server(port, addr=addr, registry=self.registry)

        def close() -> None:
            httpd.shutdown()
            httpd.server_close()

        return close


def _label_sets(metric: Counter | Gauge, names: tuple[str, ...], endpoint: str) -> set[tuple[str, ...]]:
    """The label values (in ``names``' order, as ``remove`` takes them) of ``metric``'s series whose
    ``endpoint`` label is ``endpoint``."""
    out: set[tuple[str, ...]] = set()
    for family in metric.collect():
        for sample in family.samples:
            if sample.labels.get("endpoint") == endpoint:
                out.add(tuple(sample.labels[n] for n in names))
    return out


# How ``--workers``' supervisor merges its workers' metrics into one endpoint. Counters and histograms
# add up. Gauges of one process's own traffic add up too; the rest describe what every worker sees
# alike (endpoints, config, index, discovery): the largest counts, and up/valid flags the smallest
# (one worker cut off from Redis is what an alert must see).
SUMMED_GAUGES = frozenset({
    "kvroute_open_streams",
    "kvroute_inflight_requests",
    "kvroute_capacity_demand",
    "kvroute_capacity_utilization",
    "kvroute_desired_replicas",
    "kvroute_redis",
    "kvroute_relay",
})  # fmt: skip
MIN_GAUGES = frozenset({"kvroute_redis_up", "kvroute_relay_up", "kvroute_config_valid"})


def merge_metrics(texts: Iterable[str]) -> list[Metric]:
    """Several processes' exposition texts as one set of metric families (the policy above);
    ``_created`` samples are left out (each process has its own)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):
                continue
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                values[fam.name] = {}
            if fam.type in ("counter", "histogram", "summary") or fam.name in SUMMED_GAUGES:
                combine = float.__add__
            else:
                combine = min if fam.name in MIN_GAUGES else max
            got = values[fam.name]
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = got.get(key)
                got[key] = float(sample.value) if old is None else combine(old, float(sample.value))
    for name, fam in families.items():
        for (sample_name, labels), value in values[name].items():
            fam.add_sample(sample_name, dict(labels), value)
    return list(families.values())


_WORKER = os.environ.get(WORKER_ENV)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if _WORKER is not None:
            out["worker"] = _WORKER
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc's own debug chatter (loop loaded, RPC cancelled at every stream end) is noise here, as is hpack's
    # (a few lines per header block kvroute's HTTP/2 server decodes: more than the decisions' own at debug).
    for chatty in ("grpc", "hpack"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
