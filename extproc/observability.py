"""Prometheus metrics and structured (JSON) logs. Never prompt text: ids, sizes, names, numbers."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# kvroute_config_reloads_total{result}: what a config reload did (extproc/reload.py).
RELOAD_RESULTS = ("applied", "unchanged", "invalid", "restart_required")
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvroute_decisions", "Routing decisions", ["pool", "endpoint", "reason"], registry=r)
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds",
            "Time from end of request body to the routing answer (parse, hash, index, score)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("kvroute_inflight_requests", "Requests in flight per endpoint", ["endpoint"], registry=r)
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
        """A pod left the fleet: its per-endpoint gauge goes (pods come and go; labels must not pile up)."""
        with contextlib.suppress(KeyError):
            self.inflight.remove(address)

    def serve(self, port: int, addr: str) -> Callable[[], None]:
        """Serve /metrics on ``addr:port`` (OSError if it cannot bind); returns what stops it."""
        httpd, _ = start_http_server(port, addr=addr, registry=self.registry)

        def close() -> None:
            httpd.shutdown()
            httpd.server_close()

        return close


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
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
    # grpc's own debug chatter (loop loaded, RPC cancelled at every stream end) is noise here.
    logging.getLogger("grpc").setLevel(logging.WARNING)
