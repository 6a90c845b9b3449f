"""The admin gRPC service (protos/kvroute/v1/admin.proto): Explain, ListEndpoints, IndexStats.

Explain runs the live decision's own code (``Router.route`` with ``dry_run``), so what it shows
cannot drift from what kvroute does; a dry run records nothing (no index entry, pin, in-flight slot or
queue estimate)."""

from __future__ import annotations

import time

import grpc

from extproc.admin.proto import admin_pb2 as pb
from extproc.admin.proto import admin_pb2_grpc as pb_grpc
from extproc.endpoints.pool import EndpointState
from extproc.errors import RequestError
from extproc.index.approx import ApproxPrefixIndex
from extproc.request import CHAT_PATH
from extproc.router import Router


def state_of(e: EndpointState) -> str:
    return "draining" if e.draining else "ready" if e.healthy else "unhealthy"


def explain(router: Router, request: pb.ExplainRequest) -> pb.ExplainResponse:
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        req = router.parse(request.path or CHAT_PATH, request.method or "POST", headers, request.body or None)
        outcome = router.route(req, dry_run=True)
    except RequestError as err:
        return pb.ExplainResponse(http_status=err.status, error=err.message)
    d, k = outcome.decision, outcome.keys
    trace = d.trace
    assert trace is not None  # a dry run always traces
    out = pb.ExplainResponse(
        pool=d.pool,
        model=req.model or "",
        reason=d.reason,
        total_blocks=d.total_blocks,
        precise=bool(k and k.precise),
        prompt_tokens=k.prompt_tokens if k else 0,
        http_status=200,
        hold_s=outcome.hold_s,
        hold_pace=outcome.hold_pace if outcome.hold_s else 0.0,
    )
    ranked = {e.address: i for i, e in enumerate(trace.ranked)}
    for e in sorted(trace.considered, key=lambda e: ranked.get(e.address, len(ranked))):
        matched = trace.matches.get(e.address, 0)
        x = out.endpoints.add(
            address=e.address,
            rank=ranked.get(e.address, -1),
            role=e.role,
            state=state_of(e),
            total_score=d.scores.get(e.address, 0.0),
            matched_blocks=matched,
            predicted_cached_tokens=router.predicted_cached_tokens(k, matched) if k else 0,
            inflight=e.inflight,
        )
        for name, passed in trace.verdicts.get(e.address, ()):
            x.filters.add(filter=name, passed=passed)
        x.scores.update(trace.scores.get(e.address, {}))
        if e.queue is not None:
            x.queue = e.queue
        if e.kv_usage is not None:
            x.kv_usage = e.kv_usage
        if e.address in trace.estimates:
            x.estimated_ttft_s = trace.estimates[e.address]
    plan = outcome.pd
    if plan is not None:
        pd = pb.PDExplanation(
            split=plan.split,
            reason=plan.reason,
            handoff=plan.handoff,
            prefill=plan.prefill.address if plan.prefill else "",
            uncached_tokens=plan.uncached_tokens,
        )
        for name in ("local_s", "delay_s", "allowance_s", "target_s"):
            value = getattr(plan, name)
            if value is not None:
                setattr(pd, name, value)
        out.pd.CopyFrom(pd)
    return out


def list_endpoints(router: Router, pool_name: str = "") -> pb.ListEndpointsResponse:
    live = router.live
    blocks = router.index.block_counts() if isinstance(router.index, ApproxPrefixIndex) else {}
    precise = live.precise.block_counts() if live.precise is not None else {}
    out = pb.ListEndpointsResponse()
    now = time.monotonic()
    for pool in router.registry.pools.values():
        if pool_name and pool.name != pool_name:
            continue
        for e in pool.endpoints:
            x = out.endpoints.add(
                pool=pool.name,
                address=e.address,
                role=e.role,
                state=state_of(e),
                model=e.model or "",
                cache_bucket=e.cache_bucket or "",
                inflight=e.inflight,
                index_blocks=blocks.get(e.address, 0) + precise.get(e.address, 0),
            )
            for name in ("queue", "running", "kv_usage"):
                value = getattr(e, name)
                if value is not None:
                    setattr(x, name, value)
            scraped = live.scraper.state(e.address) if live.scraper is not None else None
            if scraped is not None and scraped.scraped_at is not None:
                x.scrape_age_s = now - scraped.scraped_at
            sub = live.subscribers.get(e.address)
            if sub is not None:
                x.kv_events.update(sub.stats())
        for role in sorted({e.role for e in pool.endpoints}):
            if (got := router.capacity.cost_fit(pool.name, role)) is not None:
                out.cost_fits.add(pool=pool.name, role=role, fit=got[0], measured_prefills=got[1])
    return out


def index_stats(router: Router) -> pb.IndexStatsResponse:
    out = pb.IndexStatsResponse()
    if isinstance(router.index, ApproxPrefixIndex):
        out.approximate_blocks.update(router.index.block_counts())
    if router.live.precise is not None:
        out.precise.update(router.live.precise.stats())
    if router.live.intake is not None:  # the KV-event windows drained: against batches applied, how many shared one
        out.precise["kv_intake_windows"] = router.live.intake.windows
    return out


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Explain(self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext) -> pb.ExplainResponse:
        return explain(self.router, request)

    async def ListEndpoints(
        self, request: pb.ListEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEndpointsResponse:
        if request.pool and request.pool not in self.router.registry.pools:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool named {request.pool!r}")
        return list_endpoints(self.router, request.pool)

    async def IndexStats(
        self, request: pb.IndexStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.IndexStatsResponse:
        return index_stats(self.router)


def add_to_server(router: Router, server: grpc.aio.Server) -> None:
    pb_grpc.add_AdminServicer_to_server(AdminService(router), server)
