"""Prefill/decode disaggregation: whether to split a request, and the gateway-orchestrated hand-off.

The decision (conditional, as llm-d and Dynamo do it): the decode pod is chosen first, cache- and
load-aware; the request is split only when the prompt tokens that pod does not already hold reach
``threshold_tokens`` and some prefill pod has room (a pod of role both only if it serves fewer
requests than the decode pod: else prefilling there stalls as many streams, plus a hand-off).
The prefill pod is chosen cache- and load-aware too, and the split must pay: its first token
(the prefill pod's queue plus its share of the prompt, or the decode pod's own queued prefills if
later, plus the KV pull and ``split_overhead_s``) may not come later than the decode pod's own
prefill would give it by more than the stall it spares that pod's streams is worth
(``split_delay_per_stall``, capped by ``max_split_delay_s``), or, with a ``ttft_target_s`` that a
local prefill meets, later than the target (queues as estimated from the prefill work kvroute sent
each pod; Dynamo likewise prefills locally when the prefill queue is long). Hand-off:
- gateway: kvroute sends the prefill leg (``max_tokens=1``, ``kv_transfer_params.do_remote_decode``)
  to the prefill pod itself, pastes the returned ``kv_transfer_params`` into the original body and
  sends that to the decode pod. Any prefill failure → the decode pod prefills locally: the client
  never sees a P/D error. Legs to one prefill pod are paced to its step budget (``LegPacer``);
- sidecar: the decode pod's sidecar (llm-d) runs the prefill leg; kvroute names the prefill pod in
  ``x-prefiller-host-port``;
- cluster: two-stage clients' legs are steered to the prefill/decode Envoy cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
import orjson

from extproc.config import PDConfig, Scheme
from extproc.endpoints.pool import EndpointState
from extproc.endpoints.tls import PodTLS

log = logging.getLogger("kvroute.pd")

# The prefill leg's kv_transfer_params, as vLLM's NixlConnector proxy sends them.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class PDPlan:
    split: bool
    reason: str  # split: uncached|always; local: cached|no-prefill-pod|prefill-saturated|prefill-busy
    handoff: str
    prefill: EndpointState | None = None
    uncached_tokens: int = 0
    prefill_ticket: int = 0  # the leg's place in the prefill pod's queue estimate
    prefill_tokens: int = 0  # what the prefill pod lacks of the prompt: the leg's share of its step budget
    handoff_ticket: int = 0  # the request among the decode pod's expected hand-offs
    # Once both pods were known (estimated): the first token from a local prefill (the decode pod's
    # queue + prefill), how much later a split should deliver it (< 0: sooner), and how much later
    # it may (conditional: the stall it spares, or what is left of the TTFT target).
    local_s: float | None = None
    delay_s: float | None = None
    allowance_s: float | None = None
    target_s: float | None = None  # the TTFT objective that applied (pd.ttft_target_s or the request's)


def split_allowance(cfg: PDConfig, stall_s: float, local_s: float, target_s: float | None) -> float:
    """Conditional mode, once both pods are known: how much later than the decode pod's own prefill
    (estimated to give the first token in ``local_s``) a split may deliver it.
    With a TTFT target (the request's ``x-slo-ttft-ms``, else ``ttft_target_s``) met locally: what
    is left of it, so every split that keeps it is taken (sparing the decode pod's streams costs the
    objective nothing) and none that misses it.
    Otherwise a split spares the decode pod's streams ``stall_s`` (the local prefill's seconds × its
    streams, an idle pod counted as one); it may cost this request ``split_delay_per_stall`` × that,
    at most ``max_split_delay_s``: a 300-token chat does not wait 0.25 s to spare a pod a 6 ms step,
    and a document on an idle pod splits only if the prefill pod is nearly as soon.
    ``always`` splits at any delay."""
    if cfg.disaggregation != "conditional":
        return float("inf")
    if target_s is not None and local_s <= target_s:
        return target_s - local_s
    return min(cfg.max_split_delay_s, cfg.split_delay_per_stall * stall_s)


def plan(
    cfg: PDConfig, uncached_tokens: int, prefill_candidates: list[EndpointState], saturated: Any
) -> tuple[bool, str, list[EndpointState]]:
    """(split?, reason, prefill pods with room). ``saturated(e)`` says whether a pod is past its thresholds."""
    if cfg.disaggregation == "never":
        return False, "never", []
    if cfg.disaggregation == "conditional" and uncached_tokens < cfg.threshold_tokens:
        return False, "cached", []
    healthy = [e for e in prefill_candidates if e.healthy]
    if not healthy:
        return False, "no-prefill-pod", []
    room = [e for e in healthy if not saturated(e)]
    if not room:
        return False, "prefill-saturated", []
    return True, "always" if cfg.disaggregation == "always" else "uncached", room


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg: same request, one token, no streaming, ask the pod to keep the KV for a peer."""
    b = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return orjson.dumps(b)


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The original request (its stream and limits) with the prefill pod's kv_transfer_params pasted in."""
    return orjson.dumps({**body, "kv_transfer_params": params})


# A leg this short (a fraction of the step budget) does not wait behind a longer leg running on
# its pod: sharing that leg's step stretches it by this leg's own tokens only (at most 1/8 of
# a full step), while holding chats behind documents costs a busy prefill pod its throughput and the chats
# their first token (bench/RESULTS.md). Behind legs that are all short it queues, so a
# stream of chats cannot starve a document.
SHORT_LEG = 1 / 8


@dataclass(slots=True)
class _Lane:
    budget: int  # the pod's step: prompt tokens
    tokens: int = 0  # prompt tokens of the legs in flight
    legs: int = 0
    long_legs: int = 0  # ... of them longer than SHORT_LEG of the budget
    waiting: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)


class LegPacer:
    """Releases gateway legs to each prefill pod first come first served, so that the legs in flight
    there fit one engine step: at most ``budget`` prompt tokens together (``pd.prefill_step_tokens``,
    the pod's vLLM ``max_num_batched_tokens``; a larger leg runs alone), and a short leg (``SHORT_LEG``)
    beside a longer one at any time. Why: chunked prefill fills a step's token budget oldest first,
    so a document sent while another prefills joins the earlier one's last chunk and stretches that
    step to a full budget: the earlier first token comes up to a step late (~0.2 s for 8k tokens on
    an H100), the later one hardly sooner than had it waited. It is also the order kvroute's queue
    estimate assumes. Per kvroute replica: replicas pace their own legs only."""

    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}

    @staticmethod
    def _fits(lane: _Lane, tokens: int) -> bool:
        return lane.legs == 0 or lane.tokens + tokens <= lane.budget

    @staticmethod
    def _long(lane: _Lane, tokens: int) -> bool:
        return tokens > lane.budget * SHORT_LEG

    def _take(self, lane: _Lane, tokens: int) -> None:
        lane.tokens += tokens
        lane.legs += 1
        lane.long_legs += self._long(lane, tokens)

    def _release(self, pod: str, lane: _Lane, tokens: int) -> None:
        lane.tokens -= tokens
        lane.legs -= 1
        lane.long_legs -= self._long(lane, tokens)
        # Waiting legs go in arrival order (a short one waits only behind legs that are all short).
        while lane.waiting and self._fits(lane, lane.waiting[0][0]):
            t, fut = lane.waiting.popleft()
            if not fut.done():
                self._take(lane, t)
                fut.set_result(None)
        if lane.legs == 0 and not lane.waiting:
            del self._lanes[pod]

    @asynccontextmanager
    async def hold(self, pod: str, tokens: int, budget: int, timeout_s: float) -> AsyncIterator[float]:
        """Wait for ``pod``'s turn for a leg of ``tokens`` (TimeoutError after ``timeout_s``); yields
        the seconds waited, and frees the turn on exit. ``budget`` 0: no pacing."""
        if budget <= 0:
            yield 0.0
            return
        lane = self._lanes.setdefault(pod, _Lane(budget))
        t0 = time.perf_counter()
        if (not lane.waiting and self._fits(lane, tokens)) or (not self._long(lane, tokens) and lane.long_legs):
            self._take(lane, tokens)
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (tokens, fut)
            lane.waiting.append(entry)
            try:
                await asyncio.wait_for(fut, timeout_s)
            except BaseException:
                if entry in lane.waiting:
                    lane.waiting.remove(entry)
                if fut.done() and not fut.cancelled():  # granted as the wait ended: give it back
                    self._release(pod, lane, tokens)
                elif lane.legs == 0 and not lane.waiting:
                    self._lanes.pop(pod, None)
                raise
        try:
            yield time.perf_counter() - t0
        finally:
            self._release(pod, lane, tokens)


class Leg(NamedTuple):
    params: dict[str, Any] | None  # kv_transfer_params, or None: the caller prefills locally
    why: str  # ok | timeout | unreachable | tls | http-NNN | bad-response | no-params
    wait_s: float  # paced: how long the leg waited for its prefill pod


class PrefillClient:
    """Runs gateway-orchestrated prefill legs over one pooled HTTP session, paced per prefill pod;
    https as ``tls`` (pods.tls) says."""

    def __init__(self, tls: PodTLS | None = None) -> None:
        self._session: aiohttp.ClientSession | None = None
        self.pacer = LegPacer()
        self.tls = tls or PodTLS(None)
        self._tls_failing: dict[str, str] = {}  # pod -> the TLS failure logged (once, until a leg succeeds)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def prefill(
        self,
        address: str,
        path: str,
        body: dict[str, Any],
        request_id: str,
        timeout_s: float,
        tokens: int = 0,
        step_tokens: int = 0,
        scheme: Scheme = "http",
    ) -> Leg:
        """Wait for ``address``'s turn for a leg of ``tokens`` prompt tokens (paced to ``step_tokens``),
        then run it; ``timeout_s`` covers both."""
        t0 = time.perf_counter()
        wait_s = 0.0
        url = f"{scheme}://{address}{path}"
        try:
            async with self.pacer.hold(address, tokens, step_tokens, timeout_s) as wait_s:
                params, why = await self._leg(address, url, body, request_id, max(timeout_s - wait_s, 1e-3))
        except TimeoutError:  # no turn within the timeout
            params, why, wait_s = None, "timeout", time.perf_counter() - t0
        log.debug(
            "prefill leg",
            extra={
                "fields": {
                    "request_id": request_id,
                    "pod": address,
                    "result": why,
                    "wait_ms": round(wait_s * 1e3, 2),
                    "ms": round((time.perf_counter() - t0) * 1e3, 2),
                }
            },
        )
        return Leg(params, why, wait_s)

    async def _leg(
        self, address: str, url: str, body: dict[str, Any], request_id: str, timeout_s: float
    ) -> tuple[dict[str, Any] | None, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
        headers = {"content-type": "application/json"}
        if request_id:
            headers["x-request-id"] = request_id
        try:
            async with self._session.post(
                url,
                data=prefill_body(body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                **self.tls.request_options(url),
            ) as r:
                self._tls_failing.pop(address, None)
                data = await r.read()
                if r.status != 200:
                    return None, f"http-{r.status}"
        except TimeoutError:
            return None, "timeout"
        except (aiohttp.ClientError, OSError) as e:
            tls = self.tls.failure(e)
            if tls is not None:
                if self._tls_failing.get(address) != tls:  # a setting to fix: said once per pod
                    self._tls_failing[address] = tls
                    log.error("prefill leg: TLS failed", extra={"fields": {"pod": address, "error": tls}})
                return None, "tls"
            log.info(
                "prefill leg failed",
                extra={"fields": {"request_id": request_id, "pod": address, "error": str(e) + self.tls.hint(url, e)}},
            )
            return None, "unreachable"
        try:
            params = orjson.loads(data).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            return None, "bad-response"
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            # vLLM omits the params when the one token was EOS/stop: nothing to hand off.
            return None, "no-params"
        return params, "ok"
