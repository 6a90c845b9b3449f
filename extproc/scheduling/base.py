"""Scheduler plugin interfaces (GIE/llm-d style): Filters narrow, Scorers rate 0..1, a Picker ranks.

A new policy is one class implementing one of these plus an entry in ``scheduler.SCORERS``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from extproc.endpoints.pool import EndpointState
from extproc.index.base import EndpointId
from extproc.request import InferenceRequest, record


class WholePromptNeeded(Exception):
    """A decision was asked on a prompt's first tokens only (``Router.route``'s ``head_tokens``), and
    the rest could change it: a pod may hold blocks past them. Route again with the whole prompt's
    tokens. Raised before anything is recorded."""


class Estimate(NamedTuple):
    """One pod's cost-scoring terms for one request, in seconds (see ``CostScorer``)."""

    wait_s: float  # what the request waits behind there: requests in flight, the pod's queue, prefills sent
    work_s: float  # its own prefill there: the tokens the pod lacks (held back by hand-offs headed there)
    recompute_s: float  # prefill of tokens another eligible pod holds: work the fleet would do twice
    cost_s: float  # what ranks the pods: the estimated TTFT plus the recompute (and decode stall), weighted

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.work_s


@dataclass(slots=True)
class SchedulingContext:
    request: InferenceRequest
    keys: Sequence[int]
    # Leading blocks of ``keys`` each endpoint holds (absent = 0).
    matches: dict[EndpointId, int] = field(default_factory=dict)
    # One clock reading for every pod's queue estimate (looked up when made: a test may stand the clock still).
    now: float = field(default_factory=lambda: time.monotonic())
    block_tokens: float = 64.0  # prompt tokens per key (estimated for character blocks)
    # The whole prompt's tokens (exact, or estimated from its characters), which may run past the
    # keyed blocks (routing.max_blocks): every prefill estimate for this request prices this one size.
    prompt_tokens: float = 0.0
    # Whether the held run continues an earlier prompt (a conversation's next turn; index/ends.py) rather
    # than branching off a shared prefix (which the branch spread may copy elsewhere). None: not asked.
    continues: bool | None = None
    # Cost scoring: each pod's estimate, as it was weighed (the decision's record; filled by CostScorer).
    estimates: dict[EndpointId, Estimate] = field(default_factory=dict)


class Filter(Protocol):
    name: str

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]: ...


class Scorer(Protocol):
    name: str

    def score(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> dict[EndpointId, float]: ...


@dataclass(slots=True)
class SchedulingTrace:
    """How a decision came about, endpoint by endpoint (a dry run's: the explain API shows it)."""

    considered: list[EndpointState] = field(default_factory=list)  # the candidates, before any filter
    verdicts: dict[EndpointId, list[tuple[str, bool]]] = field(default_factory=dict)  # filter, passed
    scores: dict[EndpointId, dict[str, float]] = field(default_factory=dict)  # scorer -> weighted score
    estimates: dict[EndpointId, float] = field(default_factory=dict)  # cost scoring: estimated TTFT (s)
    matches: dict[EndpointId, int] = field(default_factory=dict)
    ranked: list[EndpointState] = field(default_factory=list)  # every eligible endpoint, best first

    def judge(self, name: str, before: list[EndpointState], after: list[EndpointState]) -> None:
        kept = {id(e) for e in after}
        for e in before:
            self.verdicts.setdefault(e.address, []).append((name, id(e) in kept))


@record
class Decision:
    """Where one request goes, and why (for metrics, debug logs and the explain API)."""

    endpoints: tuple[EndpointState, ...]  # preference order: first is the pick, the rest fallbacks
    pool: str
    reason: str  # prefix | hash | route-id | load
    matched_blocks: int = 0
    total_blocks: int = 0
    scores: dict[EndpointId, float] = field(default_factory=dict)
    trace: SchedulingTrace | None = None  # dry runs only
    # What was weighed (no copies: the scheduler's own dicts): blocks each eligible pod holds, and
    # cost scoring's terms per pod (empty for a pinned request or weighted scoring).
    matches: dict[EndpointId, int] = field(default_factory=dict)
    estimates: dict[EndpointId, Estimate] = field(default_factory=dict)
    continues: bool | None = None  # SchedulingContext.continues: a held prefix continued, or branched off

    @property
    def primary(self) -> EndpointState:
        return self.endpoints[0]
