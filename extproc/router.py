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
from extproc.endpoints.live import LiveCollector, LiveView
from extproc.endpoints.pool import EndpointState, Registry
from extproc.errors import ConfigError, UnknownModel
from extproc.hashing import chain_tokens
from extproc.index.approx import ApproxPrefixIndex
from extproc.index.base import PrefixIndex
from extproc.index.precise import precise_seed
from extproc.keys import CHARS_PER_TOKEN, route_id_key, route_keys
from extproc.observability import Metrics
from extproc.request import CHAT_PATH, InferenceRequest, parse_request
from extproc.scheduling.base import Decision
from extproc.scheduling.scheduler import Scheduler
from extproc.tokenize import ModelTokenizer

DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs, when neither config nor the pods say otherwise

log = logging.getLogger("kvroute.router")


@dataclass(frozen=True, slots=True)
class Keys:
    """The request's block keys and the index they are looked up in."""

    keys: list[int]
    index: PrefixIndex
    block_tokens: float  # prompt tokens per block (estimated for character blocks)
    precise: bool = False
    prompt_tokens: int = 0


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
        self.live = LiveView(config)
        metrics.registry.register(LiveCollector(self.live))
        self.tokenizers: dict[str, ModelTokenizer] = {}
        for name, mc in config.models.items():
            if mc.tokenizer is not None:
                try:
                    self.tokenizers[name] = ModelTokenizer.from_dir(mc.tokenizer)
                except (OSError, ValueError) as e:
                    raise ConfigError(f"models.{name}.tokenizer: {e}") from None
        h = config.headers
        self._priority_headers = (h.priority, h.objective)

    async def start(self) -> None:
        await self.live.start()

    async def aclose(self) -> None:
        await self.live.aclose()

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
        self.live.refresh(pool.endpoints)
        k = self.keys(req, pool.endpoints)
        decision = self.scheduler.schedule(
            req, k.keys, pool_name, pool.endpoints, route_id_key(req), subset, k.index, k.block_tokens
        )
        outcome = self._render(req, decision)
        self.registry.acquire(decision.primary.address)
        m = self.metrics
        m.decision_seconds.observe(time.perf_counter() - t0)
        m.decisions.labels(pool_name, decision.primary.address, decision.reason).inc()
        m.inflight.labels(decision.primary.address).set(decision.primary.inflight)
        if decision.matched_blocks:
            m.predicted_cached.labels(pool_name).inc(self.predicted_cached_tokens(k, decision.matched_blocks))
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
                        "predicted_cached_tokens": self.predicted_cached_tokens(k, decision.matched_blocks),
                        "total_blocks": decision.total_blocks,
                        "prompt_chars": req.prompt_chars,
                        "precise": k.precise,
                        "scores": decision.scores,
                        "decision_ms": round((time.perf_counter() - t0) * 1e3, 3),
                    }
                },
            )
        return outcome

    def keys(self, req: InferenceRequest, endpoints: list[EndpointState]) -> Keys:
        """Token-exact keys for the precise index when the pods' events and the tokens are both known;
        otherwise character-block keys for the approximate index."""
        r = self.config.routing
        if not req.is_inference:
            return Keys([], self.index, 0.0)
        precise = self.live.precise
        tok = self.tokenizers.get(req.model or "")
        if precise is not None and (tok is not None or req.prompt_token_ids is not None):
            try:
                ids = self._token_ids(req, tok)
            except Exception as e:  # a template error must not cost the request: route approximately
                self.metrics.errors.labels("tokenize").inc()
                log.warning("tokenize failed", extra={"fields": {"request_id": req.request_id, "error": str(e)}})
            else:
                mc = self.config.models.get(req.model or "")
                bs = (mc.block_size if mc else None) or self.live.block_size(endpoints) or DEFAULT_BLOCK_SIZE
                keys = chain_tokens(precise_seed(req.cache_salt), ids, bs, r.max_token_blocks)
                return Keys(keys, precise, float(bs), precise=True, prompt_tokens=len(ids))
        keys = route_keys(req, r.block_chars, r.max_blocks)
        return Keys(keys, self.index, r.block_chars / CHARS_PER_TOKEN)

    @staticmethod
    def _token_ids(req: InferenceRequest, tok: ModelTokenizer | None) -> list[int] | tuple[int, ...]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        assert tok is not None and req.body is not None
        if req.path == CHAT_PATH:
            return tok.chat_ids(req.body)
        return tok.encode(req.prompt_text, add_special_tokens=True)

    @staticmethod
    def predicted_cached_tokens(k: Keys, matched_blocks: int) -> int:
        if k.precise:
            # vLLM never serves the last prompt token from cache: at most (n - 1) // block_size blocks.
            bs = int(k.block_tokens)
            return min(matched_blocks, max(0, k.prompt_tokens - 1) // bs) * bs
        return int(matched_blocks * k.block_tokens)

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
