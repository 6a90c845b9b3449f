"""Request-level routing: headers + body in, an ``Outcome`` (headers/metadata to set) out.

This is the part of a request that is not about the Envoy stream: parse → pool → keys → schedule →
the override that Envoy applies. ``server.py`` calls ``Router.route`` once per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.config import Config
from extproc.endpoints.pool import Registry
from extproc.errors import UnknownModel
from extproc.index.approx import ApproxPrefixIndex
from extproc.index.base import PrefixIndex
from extproc.keys import CHARS_PER_TOKEN, route_id_key, route_keys
from extproc.observability import Metrics
from extproc.request import InferenceRequest, parse_request
from extproc.scheduling.base import Decision
from extproc.scheduling.scheduler import Scheduler

log = logging.getLogger("kvroute.router")


@dataclass(frozen=True, slots=True)
class Outcome:
    request: InferenceRequest
    decision: Decision
    set_headers: dict[str, str]
    metadata: dict[str, str] = field(default_factory=dict)
    clear_route_cache: bool = False

    @property
    def endpoint(self) -> str:
        return self.decision.primary.address


class Router:
    def __init__(self, config: Config, metrics: Metrics, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = Registry(config)
        self.index = index or ApproxPrefixIndex(config.routing.index_capacity_blocks)
        self.scheduler = Scheduler(config.routing, self.index)
        h = config.headers
        self._priority_headers = (h.priority, h.objective)

    @property
    def routing_headers(self) -> list[str]:
        return self.config.headers.routing_headers()

    def parse(self, path: str, method: str, headers: Mapping[str, str], body: bytes | None) -> InferenceRequest:
        h = self.config.headers
        return parse_request(
            path=path,
            method=method,
            headers=headers,
            raw_body=body,
            max_body_bytes=self.config.server.max_body_bytes,
            tenant_header=h.tenant,
            route_id_headers=h.route_id,
            request_id_header=h.request_id,
            priority_headers=self._priority_headers,
        )

    def pool_for(self, req: InferenceRequest) -> str:
        cfg = self.config
        if req.model is not None and req.model in cfg.models:
            return cfg.models[req.model].pool
        fallback = cfg.fallback_pool
        if req.model is not None and req.is_inference and cfg.models and cfg.unknown_model == "reject":
            raise UnknownModel(f"The model `{req.model}` does not exist.", param="model")
        if fallback is None:
            if req.model is not None and req.is_inference:
                raise UnknownModel(f"The model `{req.model}` does not exist.", param="model")
            return next(iter(cfg.pools))
        return fallback

    def route(self, req: InferenceRequest, subset: set[str] | None = None) -> Outcome:
        t0 = time.perf_counter()
        pool_name = self.pool_for(req)
        pool = self.registry.pools[pool_name]
        r = self.config.routing
        keys = route_keys(req, r.block_chars, r.max_blocks) if req.is_inference else []
        decision = self.scheduler.schedule(req, keys, pool_name, pool.endpoints, route_id_key(req), subset)
        outcome = self._render(req, decision)
        self.registry.acquire(decision.primary.address)
        m = self.metrics
        m.decision_seconds.observe(time.perf_counter() - t0)
        m.decisions.labels(pool_name, decision.primary.address, decision.reason).inc()
        m.inflight.labels(decision.primary.address).set(decision.primary.inflight)
        if decision.matched_blocks:
            m.predicted_cached.labels(pool_name).inc(decision.matched_blocks * r.block_chars // CHARS_PER_TOKEN)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "routed",
                extra={
                    "fields": {
                        "request_id": req.request_id,
                        "model": req.model,
                        "tenant": req.tenant,
                        "pool": pool_name,
                        "endpoint": decision.primary.address,
                        "reason": decision.reason,
                        "matched_blocks": decision.matched_blocks,
                        "total_blocks": decision.total_blocks,
                        "prompt_chars": req.prompt_chars,
                        "scores": decision.scores,
                        "decision_ms": round((time.perf_counter() - t0) * 1e3, 3),
                    }
                },
            )
        return outcome

    def _render(self, req: InferenceRequest, d: Decision) -> Outcome:
        h = self.config.headers
        if self.config.mode == "epp":
            # Header: the pick (Envoy's ORIGINAL_DST reads one address). Metadata: the ranked fallback
            # list for proxies that walk it on retry (EPP protocol).
            return Outcome(
                request=req,
                decision=d,
                set_headers={h.destination: d.primary.address},
                metadata={h.destination: ",".join(e.address for e in d.endpoints)},
                clear_route_cache=True,  # re-match routes: the header selects the original_dst route
            )
        return Outcome(
            request=req,
            decision=d,
            set_headers={h.cluster: d.primary.cluster},
            clear_route_cache=True,
        )

    def release(self, address: str) -> None:
        self.registry.release(address)
        st = self.registry.by_address.get(address)
        if st is not None:
            self.metrics.inflight.labels(address).set(st.inflight)

    def report_usage(self, pool: str, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        if prompt_tokens is not None:
            self.metrics.reported_prompt.labels(pool).inc(prompt_tokens)
        if cached_tokens is not None:
            self.metrics.reported_cached.labels(pool).inc(cached_tokens)
