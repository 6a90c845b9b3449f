"""Request-level routing: headers + body in, an ``Outcome`` (headers/metadata to set) out.

This is the part of a request that is not about the Envoy stream: parse → pool → keys → schedule →
the override that Envoy applies. ``server.py`` calls ``Router.route`` once per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from typing import NamedTuple

from extproc import responses
from extproc.capacity import CapacityCollector, CapacityTracker
from extproc.config import Config, PDConfig, Role
from extproc.discovery import make_provider
from extproc.discovery.file import FileProvider
from extproc.endpoints.live import IndexCollector, LiveCollector, LiveView, RegistryCollector
from extproc.endpoints.pool import Change, EndpointState, Registry
from extproc.endpoints.tls import PodTLS
from extproc.errors import ConfigError, MalformedBody, NoEndpoint, UnknownModel
from extproc.hashing import chain_tokens
from extproc.index.approx import ApproxPrefixIndex
from extproc.index.base import PrefixIndex
from extproc.index.precise import precise_seed
from extproc.keys import estimated_tokens, route_id_key, route_keys
from extproc.observability import Metrics
from extproc.pd import PDPlan, PrefillClient, decode_body, split_allowance
from extproc.pd import plan as pd_plan
from extproc.request import CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH, InferenceRequest, parse_request, record
from extproc.rollout import Arm, arm_of
from extproc.scheduling.base import Decision, WholePromptNeeded
from extproc.scheduling.pickers import rendezvous_order, tie_key
from extproc.scheduling.scheduler import Scheduler
from extproc.state import make_state
from extproc.tenancy import TenantSalter
from extproc.tokenize import ModelTokenizer, TokenPlan

DEFAULT_BLOCK_SIZE = 16  # vLLM's default on GPUs, when neither config nor the pods say otherwise


def _ms(seconds: float | None) -> float | None:
    """Seconds as rounded milliseconds for the debug log (None when unknown or unbounded)."""
    return round(seconds * 1e3, 1) if seconds is not None and math.isfinite(seconds) else None


log = logging.getLogger("kvroute.router")


@record
class Keys:
    """The request's block keys and the index they are looked up in."""

    keys: list[int]
    index: PrefixIndex
    block_tokens: float  # prompt tokens per block (estimated for character blocks)
    precise: bool = False
    prompt_tokens: int = 0  # the whole prompt (exact, or estimated from its characters), keyed or not
    head: bool = False  # the keys are the prompt's head's (``route``'s head_tokens): not where it ends


class _Derived(NamedTuple):
    config: Config  # what the rest was derived from
    routing_headers: list[str]
    fallback_pool: str | None


class _Books(NamedTuple):
    """What ``Router._account`` keeps of a decision: its metrics and the prefill it sent."""

    pool: str
    decision: Decision
    precise: bool
    predicted: int  # prompt tokens the pick should hold
    decision_s: float  # the decision's time (kvroute_decision_seconds), taken when it was made
    demand: tuple[EndpointState, int, int] | None  # the pod that prefills, its uncached and the prompt's tokens


@record
class Outcome:
    request: InferenceRequest
    decision: Decision
    set_headers: dict[str, str]
    metadata: dict[str, str] = field(default_factory=dict)
    clear_route_cache: bool = False
    pd: PDPlan | None = None
    acquired: bool = True  # kvroute holds an in-flight slot on decision.primary until the stream ends
    local_prefill: int = 0  # its prefill's ticket in decision.primary's queue estimate (0: none)
    keys: Keys | None = None  # what route() keyed the prompt as: a later move re-records it in the index
    arm: Arm = "enforced"  # shadow: decided, not steered (extproc/rollout.py)
    predicted_cached: int = 0  # prompt tokens the pick should hold (for the arm's hit-rate metrics)
    hold_s: float = 0.0  # how long the answer waits for the prefills queued ahead on the pick (routing.hold)
    hold_pace: float = 1.0  # the share of routing.cost's seconds that hold counted (CapacityTracker.hold_pace)
    # The pick's long_prefill_until this decision set, and the value it replaced (``unhold``).
    hold_reserved: tuple[float, float] | None = None

    @property
    def endpoint(self) -> str:
        return self.decision.primary.address


class Router:
    def __init__(self, config: Config, metrics: Metrics, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = Registry(config)
        # What replicas share (in-process alone, or through Redis); decisions read local state only.
        self.state = make_state(config, metrics.registry)
        local = index or ApproxPrefixIndex(config.routing.index_capacity_blocks, self.approx_capacity)
        self.index = self.state.share_index("approx", local)
        # The shadow arm's routing history: where kvroute would have sent its requests (extproc/rollout.py).
        shadow = ApproxPrefixIndex(config.routing.index_capacity_blocks, self.approx_capacity)
        self.shadow_index = self.state.share_index("shadow", shadow)
        self.scheduler = Scheduler(
            config.routing, self.index, self.state.route_table(config.routing.route_table_size), self.state.peers
        )
        self.pod_tls = PodTLS(config.pods.tls)  # kvroute's own HTTP to the pods: scrapes, prefill legs
        self.live = LiveView(config, self.pod_tls)
        self.precise = None if self.live.precise is None else self.state.share_index("precise", self.live.precise)
        self.state.bind_pods(self.registry.by_address)
        if self.live.scraper is not None and config.scrape.shared:
            self.live.scraper.share = self.state.share_scrapes(self.live.scraper.offer)
        metrics.registry.register(LiveCollector(self.live))
        self.discovery = make_provider(config)
        metrics.registry.register(RegistryCollector(self.registry, self.discovery))
        # Autoscaling signals (kvroute_desired_replicas); the lambdas follow a reloaded config.
        self.capacity = CapacityTracker(self.registry, lambda: self.config.capacity, lambda: self.config.routing.cost)
        metrics.registry.register(CapacityCollector(self.capacity))
        if self.live.scraper is not None:  # measured prefill capacity (capacity.measured)
            self.live.scraper.subscribe(self.capacity.on_scrape)
        if isinstance(local, ApproxPrefixIndex):
            metrics.registry.register(IndexCollector(local.block_counts))
        # The live view first: a restarted pod's events are cut off before its entries are purged.
        self.registry.subscribe(self.live.on_change)
        self.registry.subscribe(self._on_change)
        self.live.subscribe_down(self._forget_history)  # a pod that refuses scrapes died: purge
        self.tokenizers: dict[str, ModelTokenizer] = {}
        self.tokenizers = self.load_tokenizers(config)
        h = config.headers
        self._priority_headers = (h.priority, h.objective)
        self._derived_cache: _Derived | None = None
        # The bookkeeping of decisions made with ``defer_record`` (metrics, autoscaling demand): what no
        # answer needs, done by ``settle`` once the answers are on their way.
        self._books: list[_Books] = []

        self.prefill_client = PrefillClient(self.pod_tls)
        self.salter = TenantSalter(config.tenancy)  # restart-only (extproc/reload.py): holds the secret

    async def start(self) -> None:
        await self.live.start(self.registry.configs.values())
        await self.discovery.start(self.registry.apply)
        await self.state.start()

    async def aclose(self) -> None:
        await self.discovery.aclose()
        await self.state.aclose()
        await self.live.aclose()
        await self.prefill_client.aclose()

    def load_tokenizers(self, config: Config) -> dict[str, ModelTokenizer]:
        """``config``'s models' tokenizers (one loaded already from the same directory, template and pod flags is
        reused); ConfigError naming the model if one cannot be loaded."""
        loaded = {t.loaded_from: t for t in self.tokenizers.values()}
        out: dict[str, ModelTokenizer] = {}
        for name, mc in config.models.items():
            if mc.tokenizer is not None:
                try:
                    template = mc.chat_template.read_text() if mc.chat_template else None
                    args = (mc.tokenizer, mc.pod_flags(), template)
                    out[name] = loaded.get(ModelTokenizer.origin(*args)) or ModelTokenizer.from_dir(*args)
                except Exception as e:  # the tokenizers package raises a bare Exception for a bad file
                    raise ConfigError(f"models.{name}.tokenizer: {e}") from None
        return out

    def reconfigure(self, config: Config, tokenizers: dict[str, ModelTokenizer] | None = None) -> None:
        """Run with a reloaded ``config`` that differs only in what applies live (extproc/reload.py
        refuses the rest): routing, P/D, headers, models, static endpoints, the endpoints file. One
        synchronous step on the event loop, so no decision sees half of it; the index, route pins,
        in-flight counts and what the pods report stay. ``tokenizers``: ``load_tokenizers(config)``,
        loaded beforehand off the event loop. Raises ConfigError or DiscoveryError (a tokenizer, or
        a new endpoints file, cannot be loaded) having changed nothing."""
        tokenizers = self.load_tokenizers(config) if tokenizers is None else tokenizers
        old = self.config
        if isinstance(self.discovery, FileProvider) and config.discovery.file != old.discovery.file:
            assert config.discovery.file is not None
            self.discovery.retarget(config.discovery.file, self.registry.apply)  # the first change
        self.config = self.live.config = config
        self.tokenizers = tokenizers
        self._priority_headers = (config.headers.priority, config.headers.objective)
        self.scheduler.reconfigure(config.routing)
        if config.discovery.provider == "static":
            for name in old.pools.keys() - config.pools.keys():
                self.registry.apply(name, [])
                self.registry.pools.pop(name, None)
            for name, pc in config.pools.items():
                self.registry.apply(name, pc.endpoints)

    def _derived(self) -> _Derived:
        """What the hot path reads of ``self.config`` that takes work to compute: once per config (frozen)."""
        d = self._derived_cache
        if d is None or d.config is not self.config:
            c = self.config
            d = self._derived_cache = _Derived(c, c.headers.routing_headers(), c.fallback_pool)
        return d

    @property
    def routing_headers(self) -> list[str]:
        return self._derived().routing_headers

    def parse(self, path: str, method: str, headers: Mapping[str, str], body: bytes | None) -> InferenceRequest:
        h = self.config.headers
        req = parse_request(
            path=path,
            method=method,
            headers=headers,
            raw_body=body,
            max_body_bytes=self.config.server.max_body_bytes,
            tenant_header=h.tenant,
            route_id_headers=h.route_id,
            route_id_fields=h.route_id_fields,
            request_id_header=h.request_id,
            priority_headers=self._priority_headers,
            ttft_slo_header=h.ttft_slo,
        )
        return self.salter.apply(req)

    def _forget_history(self, addr: str) -> None:
        """What kvroute routed to ``addr``: both arms' prefix history and the route-id pins."""
        self.scheduler.forget_endpoint(addr)
        self.shadow_index.remove_endpoint(addr)

    def _on_change(self, change: Change) -> None:
        """A pod gone or replaced: kvroute's routing history and pins to it go (its cache went with it)."""
        for addr in (*change.removed, *(ec.address for ec in change.restarted)):
            self._forget_history(addr)
        for addr in change.removed:
            self.metrics.forget_endpoint(addr)
        log.info(
            "endpoints changed",
            extra={
                "fields": {
                    "pool": change.pool,
                    "added": [ec.address for ec in change.added],
                    "removed": list(change.removed),
                    "restarted": [ec.address for ec in change.restarted],
                    "draining": list(change.drained),
                    "ready_again": list(change.undrained),
                }
            },
        )

    def pool_for(self, req: InferenceRequest) -> str:
        cfg = self.config
        if req.model is not None and req.model in cfg.models:
            return cfg.models[req.model].pool
        if req.model is not None and (labelled := self.registry.pool_serving(req.model)) is not None:
            return labelled
        fallback = self._derived().fallback_pool
        if fallback is None and len(self.registry.pools) == 1:  # e.g. an endpoints file's only pool
            fallback = next(iter(self.registry.pools))
        if req.model is not None and req.is_inference and cfg.models and cfg.unknown_model == "reject":
            raise UnknownModel(f"The model `{req.model}` does not exist.", param="model")
        if fallback is None:
            if req.model is not None and req.is_inference:
                raise UnknownModel(f"The model `{req.model}` does not exist.", param="model")
            if not self.registry.pools:
                raise NoEndpoint("no pool discovered yet")
            return next(iter(self.registry.pools))
        return fallback

    def route(
        self, req: InferenceRequest, subset: set[str] | None = None, dry_run: bool = False, shadow: bool = False,
        token_ids: Sequence[int] | None = None, started: float | None = None, head_tokens: int | None = None,
        defer_record: bool = False,
    ) -> Outcome:  # fmt: skip
        """``dry_run``: the same decision, traced (``decision.trace``), with nothing recorded: no index
        entry, pin, in-flight slot, queue estimate or metric (the explain API). ``shadow``: Envoy's route
        says shadow this request (``kvroute envoy-config --route PREFIX:shadow``), whatever its arm.
        ``token_ids``: the prompt's tokens from ``token_plan``, encoded already (else encoded here).
        ``started``: when the request's decision began (``time.perf_counter``; default now), for
        ``kvroute_decision_seconds``. ``head_tokens``: ``token_ids`` are only the prompt's first tokens
        (``ModelTokenizer.heads``) and this the whole prompt's estimate; ``WholePromptNeeded`` (before
        anything is recorded) when a pod may hold blocks past them. ``defer_record``: the pick's prefix
        is left for ``settle`` (the server calls it once the answer is sent; the next decision does
        first if it comes sooner)."""
        t0 = time.perf_counter() if started is None else started
        pool_name = self.pool_for(req)
        pool = self.registry.pools.get(pool_name)
        if pool is None:  # a file provider's pool named in the config but not (yet) in the file
            raise NoEndpoint(f"no endpoint in pool {pool_name!r}")
        pd = self.config.pd_for(req.model)
        kvp = req.body.get("kv_transfer_params") if req.body else None
        if kvp is not None and pd.client_kv_transfer_params == "reject":
            raise MalformedBody("kv_transfer_params is set by the gateway, not by clients", param="kv_transfer_params")
        self.live.refresh(self.registry.by_address)
        k = self.keys(req, pool.endpoints, token_ids, head_tokens)
        # Prefill-only pods never take a whole request; a two-stage client's prefill leg goes to them.
        prefill_leg = isinstance(kvp, dict) and bool(kvp.get("do_remote_decode"))
        role: Role = "prefill" if prefill_leg else "decode"
        candidates = self.registry.candidates(pool, req.model, role)
        route_key = route_id_key(req)
        if not dry_run and (shadow or arm_of(self.config, req, route_key, k.keys) == "shadow"):
            return self._shadow(req, pool_name, candidates, route_key, subset)
        decision = self.scheduler.schedule(
            req,
            k.keys,
            pool_name,
            candidates,
            route_key,
            subset,
            k.index,
            k.block_tokens,
            k.prompt_tokens,
            dry_run=dry_run,
            whole=not k.head,
            head_holders=self._head_holders(k, pd),
            defer_record=defer_record,
        )
        predicted = self.predicted_cached_tokens(k, decision.matched_blocks)
        demand: tuple[EndpointState, int, int] | None = None  # (pod, uncached tokens, prompt tokens)
        if pd.handoff == "cluster" and pd.disaggregation != "never":
            cluster = pd.prefill_cluster if prefill_leg else pd.decode_cluster
            outcome = Outcome(
                req, decision, {self.config.headers.cluster: cluster}, clear_route_cache=True, acquired=False,
                predicted_cached=0 if dry_run else predicted,
            )  # fmt: skip
        else:
            plan, local_prefill, hold_s, reserved, pace = None, 0, 0.0, None, 1.0
            if req.is_inference:
                prompt = k.prompt_tokens
                uncached = max(0, prompt - predicted)
                work_s = self._prefill_s(prompt, predicted)
                now = time.monotonic()
                target_s = req.ttft_slo_s if req.ttft_slo_s is not None else pd.ttft_target_s
                # Only chat and completion requests are split: the prefill leg speaks those APIs.
                plan = None if req.path in (MESSAGES_PATH, RESPONSES_PATH) else self._pd_plan(
                    pd, k, decision, prompt, uncached, work_s, target_s, pool.endpoints, now, dry_run
                )  # fmt: skip
                if plan is None or not plan.split:
                    e, hold = decision.primary, self.config.routing.hold
                    gap_s = 0.0
                    if hold.holds(uncached, self.config.scrape.enabled):
                        # A long prompt waits here for the prefills queued ahead of it there (HoldConfig).
                        ahead_s, whole_s = e.prefills.ahead(now)
                        pace = self.capacity.hold_pace(pool_name, e.role)
                        hold_s = hold.hold_s(ahead_s, whole_s, e.long_prefill_until - now, pace)
                        # Held past the queue's estimated end, it starts that much later (the pod idle or
                        # decoding meanwhile): the queue holds that gap too, or the next hold ends too soon.
                        gap_s = hold_s - ahead_s if hold_s > ahead_s else 0.0
                        if not dry_run:
                            until = now + hold_s + work_s * pace * (1 + hold.margin)
                            reserved, e.long_prefill_until = (until, e.long_prefill_until), until
                    if not dry_run:
                        # The pod prefills what it lacks itself: the next decisions see it queued there
                        # until its estimated end, or the end of the exchange if that comes first.
                        local_prefill = e.prefills.add(work_s + gap_s, now)
                if not dry_run:  # autoscaling demand: what the pod that prefills lacks of the prompt
                    if plan is not None and plan.split and plan.prefill is not None:
                        demand = (plan.prefill, plan.prefill_tokens, prompt)
                    else:
                        demand = (decision.primary, uncached, prompt)
            outcome = self._render(req, decision, plan, local_prefill, k, 0 if dry_run else predicted)
            if hold_s:
                outcome = replace(outcome, hold_s=hold_s, hold_reserved=reserved, hold_pace=pace)
            if dry_run:
                return replace(outcome, acquired=False)
            self.registry.acquire(decision.primary.address)
        if dry_run:
            return outcome
        books = _Books(pool_name, decision, k.precise, predicted, time.perf_counter() - t0, demand)
        if defer_record:
            self._books.append(books)
        else:
            self._account(books)
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
                        "continues": decision.continues,
                        "predicted_cached_tokens": predicted,
                        "total_blocks": decision.total_blocks,
                        "prompt_chars": req.prompt_chars,
                        "precise": k.precise,
                        "head": k.head,  # decided on the prompt's head (its rest encoded after)
                        "hold_ms": _ms(outcome.hold_s),  # the answer waits this long (routing.hold)
                        "hold_pace": outcome.hold_pace,  # at this share of routing.cost's seconds
                        "pd": None
                        if outcome.pd is None
                        else {
                            "split": outcome.pd.split,
                            "reason": outcome.pd.reason,
                            "prefill": outcome.pd.prefill.address if outcome.pd.prefill else None,
                            "uncached_tokens": outcome.pd.uncached_tokens,
                            "local_ttft_ms": _ms(outcome.pd.local_s),
                            "split_delay_ms": _ms(outcome.pd.delay_s),
                            "allowance_ms": _ms(outcome.pd.allowance_s),
                            "ttft_target_ms": _ms(outcome.pd.target_s),
                        },
                        "scores": decision.scores,
                        "prompt_tokens": k.prompt_tokens,
                        "block_tokens": k.block_tokens,
                        "matches": decision.matches,  # blocks each eligible pod holds
                        # cost terms per pod, ms: wait, own prefill, recompute, ranking cost (bench/affinity.py)
                        "estimates_ms": {a: [_ms(x) for x in v] for a, v in decision.estimates.items()},
                        "decision_ms": round((time.perf_counter() - t0) * 1e3, 3),
                    }
                },
            )
        return outcome

    def _shadow(
        self,
        req: InferenceRequest,
        pool: str,
        candidates: list[EndpointState],
        route_key: int | None,
        subset: set[str] | None,
    ) -> Outcome:
        """The shadow arm: decide as if enforcing, against the arm's own routing history (where
        kvroute would have sent each request: character-block keys, whatever the index mode), and
        steer nothing; no in-flight slot or queue estimate for a pod the request may not reach. The
        response headers tell kvroute where Envoy sent it (``observe_upstream``)."""
        k = replace(self.approximate_keys(req), index=self.shadow_index)
        decision = self.scheduler.schedule(req, k.keys, pool, candidates, route_key, subset, k.index,
                                           k.block_tokens, k.prompt_tokens)  # fmt: skip
        predicted = self.predicted_cached_tokens(k, decision.matched_blocks)
        self.metrics.rollout_decisions.labels("shadow").inc()
        return Outcome(req, decision, {}, acquired=False, keys=k, arm="shadow", predicted_cached=predicted)

    def observe_upstream(self, outcome: Outcome, upstream: str | None) -> str | None:
        """The response named the pod Envoy used. A shadowed request's load and prefix are recorded
        there (it is real, wherever kvroute would have sent it): returns the pod whose in-flight slot
        it now holds, released with the stream."""
        agreed = "unknown" if upstream is None else "yes" if upstream == outcome.endpoint else "no"
        self.metrics.rollout_agreement.labels(outcome.arm, agreed).inc()
        st = self.registry.by_address.get(upstream or "")
        if outcome.arm != "shadow" or st is None:
            return None
        self.registry.acquire(st.address)
        if outcome.keys is not None and outcome.keys.keys:
            self.index.record(outcome.keys.keys, st.address)
        return st.address

    def approx_capacity(self, endpoint: str) -> int | None:
        """The approximate index's capacity for ``endpoint`` in its blocks: the pod's KV cache size
        (scraped, else ``routing.index_capacity_tokens``) over the tokens one block stands for; None
        when neither is known. Asked at each record: needs ``self.live``, made after the index."""
        r = self.config.routing
        scraper = self.live.scraper
        tokens = scraper.kv_capacity_tokens(endpoint) if scraper is not None else None
        if tokens is None:
            tokens = r.index_capacity_tokens
        return None if tokens is None else math.ceil(tokens * r.chars_per_token / r.block_chars)

    def approximate_keys(self, req: InferenceRequest) -> Keys:
        r = self.config.routing
        keys = route_keys(req, r.block_chars, r.max_blocks, r.chars_per_token)
        return Keys(
            keys, self.index, r.block_chars / r.chars_per_token, prompt_tokens=estimated_tokens(req, r.chars_per_token)
        )

    def keys(
        self, req: InferenceRequest, endpoints: list[EndpointState], token_ids: Sequence[int] | None = None,
        head_tokens: int | None = None,
    ) -> Keys:  # fmt: skip
        """Token-exact keys for the precise index when the pods' events and the tokens are both known;
        otherwise character-block keys for the approximate index. ``token_ids``, ``head_tokens``: see
        ``route``."""
        r = self.config.routing
        if not req.is_inference:
            return Keys([], self.index, 0.0)
        precise = self.precise
        tok = self.tokenizers.get(req.model or "")
        if precise is not None and (tok is not None or req.prompt_token_ids is not None):
            try:
                ids = token_ids if token_ids is not None else self._token_ids(req, tok)
            except Exception as e:  # a template error must not cost the request: route approximately
                self.metrics.errors.labels("tokenize").inc()
                log.warning("tokenize failed", extra={"fields": {"request_id": req.request_id, "error": str(e)}})
            else:
                mc = self.config.models.get(req.model or "")
                bs = (mc.block_size if mc else None) or self.live.block_size(endpoints) or DEFAULT_BLOCK_SIZE
                keys = chain_tokens(precise_seed(req.cache_salt), ids, bs, r.max_token_blocks)
                if head_tokens is not None:
                    if not keys:
                        raise WholePromptNeeded  # not one full block: nothing to look up
                    return Keys(keys, precise, float(bs), precise=True, prompt_tokens=head_tokens, head=True)
                return Keys(keys, precise, float(bs), precise=True, prompt_tokens=len(ids))
        return self.approximate_keys(req)

    def _head_holders(self, k: Keys, pd: PDConfig) -> int | None:
        """How many pods may hold the whole of a head's keys for a decision on them to stand (the
        scheduler's ``head_holders``). A pod's match is a leading run: only a pod holding all of the head
        can match past it. None of them: the head's keys match as the whole prompt's would. One: more
        blocks could only add to its match, so a decision that picks it stands; but not where the
        request may split, whose plan weighs the uncached tokens that pod's longer match would cut.
        None: the whole prompt's keys, or as many as a prompt gets (routing.max_token_blocks)."""
        if not k.head or len(k.keys) >= self.config.routing.max_token_blocks:
            return None
        return 1 if pd.disaggregation == "never" else 0

    def token_plan(self, req: InferenceRequest) -> tuple[ModelTokenizer, TokenPlan] | None:
        """The precise keys' tokenization, planned (``ModelTokenizer.plan``) so that its encoding can
        run off the event loop; None when ``route`` would not tokenize ``req`` (no precise index, no
        tokenizer for its model, token ids in the request) or the plan fails (``route`` meets the same
        error, counts it and routes approximately)."""
        tok = self.tokenizers.get(req.model or "")
        if self.precise is None or tok is None or not req.is_inference or req.prompt_token_ids is not None:
            return None
        try:
            return tok, tok.plan(*self._prompt_text(req, tok))
        except Exception:
            return None

    @classmethod
    def _token_ids(cls, req: InferenceRequest, tok: ModelTokenizer | None) -> Sequence[int]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        assert tok is not None
        return tok.encode(*cls._prompt_text(req, tok))

    @staticmethod
    def _prompt_text(req: InferenceRequest, tok: ModelTokenizer) -> tuple[str, bool]:
        """What vLLM encodes, and whether with special tokens (the request's ``add_special_tokens``, by default
        none for a chat, whose template holds them, and the tokenizer's for a completion)."""
        assert req.body is not None
        if req.path == CHAT_PATH:
            return tok.render_chat(req.body), req.body.get("add_special_tokens") is True
        if req.path == MESSAGES_PATH:
            return tok.render_chat(tok.anthropic_chat(req.body)), False
        if req.path == RESPONSES_PATH:
            chat = req.chat if req.chat is not None else responses.to_chat(req.body)  # (made once when parsed)
            return tok.render_chat(chat, validated=False), False
        return req.prompt_text, req.body.get("add_special_tokens") is not False

    def settle(self) -> None:
        """Record the prefixes of the decisions made with ``defer_record`` (Scheduler.settle), then their
        metrics and autoscaling demand."""
        self.scheduler.settle()
        if self._books:
            books, self._books = self._books, []
            for b in books:
                self._account(b)

    def _account(self, b: _Books) -> None:
        """A decision's metrics and the prefill it sent (autoscaling demand, ``CapacityTracker.observe``)."""
        if b.demand is not None:
            self.capacity.observe(b.pool, *b.demand)
        m, decision = self.metrics, b.decision
        primary = decision.primary
        m.observe_decision(b.decision_s)
        m.cell(m.decisions, b.pool, primary.address, decision.reason).v += 1
        m.cell(m.index_decisions, "precise" if b.precise else "approx").v += 1
        m.cell(m.rollout_decisions, "enforced").v += 1
        m.cell(m.inflight, primary.address).v = primary.own_inflight
        if decision.matched_blocks:
            m.cell(m.predicted_cached, b.pool).v += b.predicted

    def record_whole(self, outcome: Outcome, token_ids: Sequence[int]) -> Outcome:
        """A prompt decided on its head (``route``'s ``head_tokens``): its whole keys, once encoded,
        recorded where the request went (the decode pod and, after a split, the prefill pod), as a
        decision on the whole prompt records them. Returns the outcome, revised where the pick holds all
        of the head (``_revise``)."""
        head = outcome.keys
        if head is None or not head.precise:
            return outcome
        self.settle()  # the head's record first: only the rest's keys are added below
        pool = self.registry.pools.get(outcome.decision.pool)
        whole = self.keys(outcome.request, pool.endpoints if pool is not None else [], token_ids)
        if not whole.precise:
            return outcome
        n = len(head.keys)
        # The decision recorded the head's keys on its pick: with the same keys leading the whole prompt's
        # (the block size unchanged since) and no split that moved it, only the rest's are new there (the
        # last key at least, which notes where the prompt ended).
        kept = head.head and 0 < n <= len(whole.keys) and whole.keys[n - 1] == head.keys[-1]
        if kept and outcome.decision.matched_blocks >= n:
            outcome = self._revise(outcome, head, whole, n)  # the pick holds all of the head
        if kept and (outcome.pd is None or not outcome.pd.split):
            whole.index.record(whole.keys[n:] or whole.keys[-1:], outcome.endpoint)
            return outcome
        pods = [outcome.endpoint]
        if outcome.pd is not None and outcome.pd.split and outcome.pd.prefill is not None:
            pods.append(outcome.pd.prefill.address)
        for pod in pods:
            whole.index.record(whole.keys, pod)
        return outcome

    def _revise(self, outcome: Outcome, head: Keys, whole: Keys, n: int) -> Outcome:
        """A decision on a head that picked the one pod holding all of it (its ``n`` keys) counted only the
        head's blocks there; that pod may hold more of the prompt (another replica routed the turns this
        replica's tokenizer cache lacks). With the whole prompt's keys (before they are recorded): the
        cached tokens predicted, and the prefill queued there, as the whole prompt's decision has them."""
        pod = outcome.endpoint
        held = n + whole.index.match(whole.keys[n:], [pod]).get(pod, 0)
        predicted = self.predicted_cached_tokens(whole, held)
        more = predicted - outcome.predicted_cached
        if more <= 0:
            return outcome
        self.metrics.cell(self.metrics.predicted_cached, outcome.decision.pool).v += more
        st = self.registry.by_address.get(pod)
        if outcome.local_prefill and st is not None:
            queued = self._prefill_s(head.prompt_tokens, outcome.predicted_cached)  # as ``route`` queued it
            revised = self._prefill_s(whole.prompt_tokens, predicted)
            st.prefills.shorten(outcome.local_prefill, queued - revised, time.monotonic())
        return replace(outcome, predicted_cached=predicted)

    def _prefill_s(self, prompt_tokens: int, predicted_cached: int) -> float:
        """The pick's prefill of a ``prompt_tokens`` prompt of which it holds ``predicted_cached``, in
        seconds (cost scoring's model): what ``route`` queues on it, and ``_revise`` takes back."""
        uncached = max(0, prompt_tokens - predicted_cached)
        return self.config.routing.cost.prefill_s(uncached, prompt_tokens - uncached)

    @staticmethod
    def predicted_cached_tokens(k: Keys, matched_blocks: int) -> int:
        if k.precise:
            # vLLM never serves the last prompt token from cache: at most (n - 1) // block_size blocks.
            bs = int(k.block_tokens)
            return min(matched_blocks, max(0, k.prompt_tokens - 1) // bs) * bs
        return int(matched_blocks * k.block_tokens)

    def _pd_plan(
        self,
        pd: PDConfig,
        k: Keys,
        decision: Decision,
        prompt: int,
        uncached: int,
        local_work_s: float,
        target_s: float | None,
        endpoints: list[EndpointState],
        now: float,
        dry_run: bool = False,
    ) -> PDPlan | None:
        """Split or not, once the decode pod is chosen: what it lacks of the ``prompt`` tokens
        (``uncached``, ``local_work_s`` of prefill) decides (conditional mode), and whether a
        prefill pod would finish that soon enough for the stall it spares the decode pod."""
        if pd.disaggregation == "never":
            return None
        decode = decision.primary
        # A pod that also decodes (role both) is worth prefilling on only if it carries fewer requests
        # than the decode pod (otherwise the split stalls as many streams there, plus a hand-off), and
        # awaits no hand-off itself: a pull there starts, and its first token comes, only at the end
        # of a step, and each step of this prefill would take the whole token budget.
        others = [
            e
            for e in endpoints
            if e.serves("prefill")
            and e.available
            and e is not decode
            and (e.role == "prefill" or (e.inflight < decode.inflight and not e.handoffs.pending(now)))
        ]
        split, reason, room = pd_plan(pd, uncached, others, self.scheduler.saturation.saturated)
        prefill, ticket, handoff, local_s, delay_s, allowance_s = None, 0, 0, None, None, None
        leg_tokens = 0
        if split:
            prefill, work_s, leg_tokens = self._pick_prefill(k, prompt, room, now)
            local_s = decode.prefills.wait(now) + local_work_s
            # The decode pod pulls what it lacks once the prefill is done, and not before the prefill
            # work already queued there has left it token budget to admit the pull (vLLM).
            pulled_s = max(prefill.prefills.wait(now) + work_s, decode.prefills.wait(now))
            split_s = pulled_s + pd.handoff_s(uncached)
            delay_s = split_s - local_s
            # What a local prefill would cost the decode pod's streams (an idle pod counts as one: what
            # streams join it during a long prefill wait too), or the TTFT target, decides what the
            # split may cost.
            allowance_s = split_allowance(pd, local_work_s * max(decode.inflight, 1), local_s, target_s)
            if delay_s > allowance_s:
                split, reason, prefill = False, "prefill-busy", None
            elif not dry_run:
                # A gateway leg reports its end (within its timeout): a prefill pod running late is seen late.
                leg_s = pd.prefill_timeout_s + 1.0 if pd.handoff == "gateway" else None
                ticket = prefill.prefills.add(work_s, now, reports_within=leg_s)
                handoff = decode.handoffs.add(now + split_s)
                if k.keys:
                    k.index.record(k.keys, prefill.address, not k.head)
        if not dry_run:
            self.metrics.pd_decisions.labels("split" if split else "local", reason).inc()
        return PDPlan(
            split,
            reason,
            pd.handoff,
            prefill,
            uncached,
            prefill_ticket=ticket,
            prefill_tokens=leg_tokens,
            handoff_ticket=handoff,
            local_s=local_s,
            delay_s=delay_s,
            allowance_s=allowance_s,
            target_s=target_s,
        )

    def _pick_prefill(
        self, k: Keys, prompt: int, room: list[EndpointState], now: float
    ) -> tuple[EndpointState, float, int]:
        """The prefill pod expected to finish this prompt first (its queue, then what it lacks of the
        prompt), fewest in flight among equals, then a stable hash order; with the prefill work (s)
        this prompt adds to its queue and the tokens it lacks."""
        cost = self.config.routing.cost
        matches = k.index.match(k.keys, [e.address for e in room]) if k.keys else {}
        tie = tie_key(k.keys, matches) if k.keys else 0
        order = {e.address: i for i, e in enumerate(rendezvous_order(room, tie))}

        def cached(e: EndpointState) -> int:
            return min(prompt, self.predicted_cached_tokens(k, matches.get(e.address, 0)))

        def work(e: EndpointState) -> float:
            c = cached(e)
            return cost.prefill_s(prompt - c, c)

        best = min(room, key=lambda e: (e.prefills.wait(now) + work(e), e.inflight, order[e.address]))
        return best, work(best), prompt - cached(best)

    def _render(
        self,
        req: InferenceRequest,
        d: Decision,
        plan: PDPlan | None = None,
        local_prefill: int = 0,
        keys: Keys | None = None,
        predicted_cached: int = 0,
    ) -> Outcome:
        h = self.config.headers
        extra: dict[str, str] = {}
        if plan is not None and plan.split and plan.prefill is not None and plan.handoff == "sidecar":
            extra[self.config.pd_for(req.model).prefiller_header] = plan.prefill.address
        if self.config.mode == "epp":
            # Header: the pick. Metadata: the ranked fallback list (routing.fallback_endpoints long) that
            # Envoy's override_host policy walks on retry (EPP protocol).
            return Outcome(
                request=req,
                decision=d,
                set_headers={h.destination: d.primary.address, **extra},
                metadata={h.destination: ",".join([e.address for e in d.endpoints])},
                clear_route_cache=True,  # re-match routes (a config may route on the header)
                pd=plan,
                local_prefill=local_prefill,
                keys=keys,
                predicted_cached=predicted_cached,
            )
        return Outcome(
            request=req,
            decision=d,
            set_headers={h.cluster: d.primary.cluster, **extra},
            clear_route_cache=True,
            pd=plan,
            local_prefill=local_prefill,
            keys=keys,
            predicted_cached=predicted_cached,
        )

    async def prefill(self, outcome: Outcome) -> bytes | None:
        """Gateway hand-off: run the prefill leg; the decode pod's new body, or None (prefill locally)."""
        plan, req = outcome.pd, outcome.request
        if plan is None or not plan.split or plan.prefill is None or plan.handoff != "gateway" or req.body is None:
            return None
        pd = self.config.pd_for(req.model)
        pod = plan.prefill.address
        self.registry.acquire(pod)
        t0 = time.perf_counter()
        try:
            leg = await self.prefill_client.prefill(
                pod,
                req.path,
                req.body,
                req.request_id,
                pd.prefill_timeout_s,
                tokens=plan.prefill_tokens,
                step_tokens=pd.prefill_step_tokens,
                scheme=self.pod_tls.scheme(self.registry.configs.get(pod)),
            )
        except asyncio.CancelledError:  # the client gave up: no KV is headed for the decode pod
            outcome.decision.primary.handoffs.settle(plan.handoff_ticket, None)
            raise
        finally:
            self.release(pod)
            plan.prefill.prefills.finished(plan.prefill_ticket, time.monotonic())
        # The decode pod pulls the KV next; after a failed leg nothing is headed its way.
        due = time.monotonic() + pd.handoff_s(plan.uncached_tokens)
        outcome.decision.primary.handoffs.settle(plan.handoff_ticket, due if leg.params is not None else None)
        self.metrics.pd_prefill_seconds.labels("ok" if leg.params else "failed").observe(time.perf_counter() - t0)
        self.metrics.pd_prefill_wait_seconds.observe(leg.wait_s)
        if leg.params is None:
            self.metrics.errors.labels("prefill_" + leg.why.replace("-", "_")).inc()
            self.metrics.pd_decisions.labels("fallback-local", leg.why).inc()
            return None
        return decode_body(req.body, leg.params)

    def redirect(self, outcome: Outcome) -> Outcome:
        """After a gateway prefill leg that returned KV: the decode pod was chosen before the leg ran
        (0.1-0.5 s ago) and may have taken local prefills since, each step of which would hold the
        pull back, then the first token (vLLM starts a pull, and admits the pulled request, only at
        a step's end). Any decode pod can pull the KV, and the destination is only sent now: move the
        request to a fallback of the same decision that carries fewer requests and should admit it
        sooner by more than ``split_overhead_s``. Not for pinned conversations (route id)."""
        plan, d, req = outcome.pd, outcome.decision, outcome.request
        pd = self.config.pd_for(req.model)
        if (
            plan is None
            or not plan.split
            or not pd.redirect_decode
            or self.config.mode != "epp"
            or d.reason == "route-id"
        ):
            return outcome
        now = time.monotonic()
        decode = d.primary
        held_s = decode.prefills.wait(now)
        room = [
            e
            for e in d.endpoints[1:]
            if self.registry.by_address.get(e.address) is e  # not gone while the leg ran
            and e.available
            and e.serves("decode")
            and e.inflight < decode.inflight
            and not self.scheduler.saturation.saturated(e)
        ]
        best = min(room, key=lambda e: (e.prefills.wait(now), e.inflight), default=None)
        if best is None or best.prefills.wait(now) + pd.split_overhead_s >= held_s:
            return outcome
        self.release(decode.address)
        self.registry.acquire(best.address)
        self.metrics.inflight.labels(best.address).set(best.own_inflight)
        decode.handoffs.settle(plan.handoff_ticket, None)
        ticket = best.handoffs.add(now + pd.handoff_s(plan.uncached_tokens))
        k = outcome.keys
        if k is not None and k.keys:
            k.index.record(k.keys, best.address, not k.head)
        self.metrics.pd_decisions.labels("redirect", "decode-busy").inc()
        log.debug(
            "redirected",
            extra={
                "fields": {
                    "request_id": req.request_id,
                    "from": decode.address,
                    "to": best.address,
                    "held_ms": _ms(held_s),
                    "new_ms": _ms(best.prefills.wait(now)),
                }
            },
        )
        decision = replace(d, endpoints=(best, *(e for e in d.endpoints if e is not best)))
        return self._render(req, decision, replace(plan, handoff_ticket=ticket), outcome.local_prefill, k)

    def release(self, address: str, local_prefill: int = 0) -> None:
        """A request to ``address`` ended: its in-flight slot, and its prefill if still in the queue estimate."""
        self.registry.release(address)
        st = self.registry.by_address.get(address)
        if st is not None:
            self.metrics.cell(self.metrics.inflight, address).v = st.own_inflight
            if local_prefill:
                st.prefills.finished(local_prefill, time.monotonic())

    def abandon(self, outcome: Outcome) -> None:
        """A gateway split whose prefill leg never ran (its stream ended first): its prefill pod's queue
        is not held back for it (a leg that never reports would be, until its timeout) and nothing is
        headed for its decode pod."""
        plan = outcome.pd
        if plan is not None and plan.split and plan.handoff == "gateway" and plan.prefill is not None:
            plan.prefill.prefills.finished(plan.prefill_ticket, time.monotonic())
            outcome.decision.primary.handoffs.settle(plan.handoff_ticket, None)

    def unhold(self, outcome: Outcome) -> None:
        """A held request's stream ended before its answer: it never reaches its pod, so the pod is not
        reserved for its prefill (unless a long prompt sent there since reserved it further: kept)."""
        st = self.registry.by_address.get(outcome.endpoint)
        if st is not None and outcome.hold_reserved is not None:
            until, before = outcome.hold_reserved
            if st.long_prefill_until == until:
                st.long_prefill_until = before

    def report_usage(self, outcome: Outcome, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """What the pod reported (usage), per pool and per rollout arm beside what kvroute predicted."""
        m, pool, arm = self.metrics, outcome.decision.pool, outcome.arm
        if prompt_tokens is not None:
            m.reported_prompt.labels(pool).inc(prompt_tokens)
            m.rollout_tokens.labels(arm, "prompt").inc(prompt_tokens)
            m.rollout_tokens.labels(arm, "predicted_cached").inc(outcome.predicted_cached)
        if cached_tokens is not None:
            m.reported_cached.labels(pool).inc(cached_tokens)
            m.rollout_tokens.labels(arm, "reported_cached").inc(cached_tokens)
