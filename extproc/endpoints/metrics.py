"""vLLM /metrics: parse the few series routing needs, and keep them fresh for a set of endpoints.

Series (vLLM v1; labels ``model_name`` and ``engine``, one set per engine/DP rank):
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (summed over engines),
``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``; 0..1, *averaged* over engines —
a fraction summed over engines would exceed 1), ``vllm:cache_config_info`` (labels ``block_size``,
``num_gpu_blocks``; blocks summed over engines), counters ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (older: ``vllm:gpu_prefix_cache_*``; tokens, summed), and for the
measured prefill capacity (extproc/capacity.py) ``vllm:prompt_tokens_total`` and the ``_sum`` / ``_count``
of ``vllm:time_to_first_token_seconds`` (both advance at each request's first token, so their changes
from one scrape to the next place the prefills in time; the histogram's buckets are not read).
A missing series is ``None`` in ``PodMetrics``, never a made-up zero. ``subscribe`` tells listeners
of every new set of figures (scraped here or taken from a peer).

With shared state (Redis, or ``--workers N``) replicas split the scraping: each pod is scraped by the
replica that owns it (``ScrapeShare.owns``: rendezvous hashing over the live replicas) and its figures
reach the others through the shared log (``offer``). A replica still scrapes a pod it does not own
when no fresh figures came for ``SHARED_FRESH_INTERVALS`` intervals (the owner died, or the pod stopped
answering it), so a dead pod is noticed by every replica within a few intervals either way.
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

import aiohttp

from extproc.endpoints.tls import PodTLS
from extproc.errors import KVRouteError
from extproc.index.base import EndpointId
from extproc.state.base import ScrapeShare
from extproc.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
DEFAULT_TIMEOUT_S = 0.5
DEFAULT_STALE_AFTER_MISSES = 3  # consecutive failed scrapes before an endpoint's metrics are stale
DEFAULT_MAX_AGE_S = 1.0  # ... or this long since the last good scrape
# Refused scrapes in a row before the pod counts as down (its index entries purged). A refusal means
# nothing listens there (the process died, the pod is gone), never a slow pod: a timeout resets the count.
DEFAULT_PURGE_AFTER_REFUSALS = 2
# With shared scrapes: a pod another replica owns is scraped here too once its figures are this many
# intervals old (covers a lost flush or two; a dead owner is noticed after peer_timeout_s otherwise).
SHARED_FRESH_INTERVALS = 2.5
_GONE = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})
MAX_BODY_BYTES = 8 << 20

_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_CACHE_INFO = ("vllm:cache_config_info",)
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
_PROMPT = ("vllm:prompt_tokens",)
_TTFT_SUM, _TTFT_COUNT = ("vllm:time_to_first_token_seconds_sum",), ("vllm:time_to_first_token_seconds_count",)
_ALL = (*_WAITING, *_RUNNING, *_KV_USAGE, *_CACHE_INFO, *_QUERIES, *_HITS, *_PROMPT, *_TTFT_SUM, *_TTFT_COUNT)
# The lines of the series read here, found by the regex engine in one pass: vLLM's body is ~50 KB of other
# series (histogram buckets, the API server's own), and a Python step per line was most of a scrape's parse.
# Every name starts "vllm:", the pattern's literal start, which the engine searches for at C speed; the name
# must end there (``_total`` aside), so a longer name sharing the prefix and the counters' ``_created``
# samples are not taken (a name alone on its line is, and refused by ``_SAMPLE``).
assert all(n.startswith("vllm:") for n in _ALL)
_LINES = re.compile(
    "\n(vllm:(?:" + "|".join(re.escape(n.removeprefix("vllm:")) for n in _ALL) + ")(?:_total)?(?=[{\\s]|$)[^\n]*)"
)


class MetricsParseError(KVRouteError):
    """The /metrics body is not Prometheus text exposition format."""


@dataclass(frozen=True, slots=True)
class PodMetrics:
    num_requests_waiting: float | None = None
    num_requests_running: float | None = None
    kv_cache_usage_perc: float | None = None  # 0..1
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_cache_queries: float | None = None  # tokens, lifetime counter
    prefix_cache_hits: float | None = None
    # Lifetime counters that advance at each request's first token (extproc/capacity.py's measured capacity).
    prompt_tokens: float | None = None
    ttft_sum_s: float | None = None
    ttft_count: float | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the pod's KV cache holds (cache_config_info: num_gpu_blocks × block_size)."""
        if not self.num_gpu_blocks or not self.block_size:
            return None
        return self.num_gpu_blocks * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


# A label pair inside {...}: name="value", the value's quotes and backslashes escaped.
# (The value's pattern "unrolled", runs of plain characters between escapes: a character at a time through an
# alternation is several times slower in Python's regex engine.)
_NAME, _VALUE = r"[a-zA-Z_][a-zA-Z0-9_]*", r'[^"\\]*(?:\\.[^"\\]*)*'
_PAIR = rf'{_NAME}\s*=\s*"{_VALUE}"'
_LABEL = re.compile(rf'({_NAME})\s*=\s*"({_VALUE})"')
_UNESCAPE = re.compile(r"\\(.)")
# One sample line, checked whole at C speed: name, its label block (pairs, a trailing comma allowed), value,
# and an optional timestamp (a line may end in CR LF). The labels are taken apart only where they are read
# (cache_config_info).
_SAMPLE = re.compile(
    rf"([^\s{{]+)(?:\{{\s*((?:{_PAIR}(?:\s*,\s*{_PAIR})*\s*,?)?)\s*\}}[ \t]*|[ \t]+)(\S+)(?:[ \t]+\S+)?\s*"
)


def _labels(block: str) -> dict[str, str]:
    """The pairs of a label block ``_SAMPLE`` matched, their values unescaped."""
    return {m[1]: _UNESCAPE.sub(lambda e: "\n" if e[1] == "n" else e[1], m[2]) if "\\" in m[2] else m[2]
            for m in _LABEL.finditer(block)}  # fmt: skip


def parse_vllm_metrics(text: str) -> PodMetrics:
    """Parse a vLLM /metrics body; raises ``MetricsParseError`` on malformed text. Only the series
    read here are parsed (vLLM's histograms are most of the body): the lines that start with a name
    read here, found in one regex search (``_LINES``)."""
    values: dict[str, list[float]] = {}
    info: list[dict[str, str]] = []
    try:
        for line in _LINES.findall("\n" + text):  # not comments (#), nor other series (histogram buckets)
            sample = _SAMPLE.fullmatch(line)
            if sample is None:
                raise ValueError(f"not a sample: {line[:80]!r}")
            name, value = sample[1].removesuffix("_total"), float(sample[3])
            if name in _CACHE_INFO:
                info.append(_labels(sample[2] or ""))
            elif math.isfinite(value):
                values.setdefault(name, []).append(value)
    except ValueError as exc:
        raise MetricsParseError(f"unparsable metrics text: {exc}") from exc

    def pick(names: tuple[str, ...]) -> list[float] | None:
        return next((values[n] for n in names if n in values), None)

    def total(names: tuple[str, ...]) -> float | None:
        v = pick(names)
        return None if v is None else sum(v)

    usage = pick(_KV_USAGE)
    sizes = [s for s in (_int_label(i, "block_size") for i in info) if s]
    blocks = [b for b in (_int_label(i, "num_gpu_blocks") for i in info) if b is not None]
    return PodMetrics(
        num_requests_waiting=total(_WAITING),
        num_requests_running=total(_RUNNING),
        kv_cache_usage_perc=None if not usage else sum(usage) / len(usage),
        block_size=max(sizes) if sizes else None,
        num_gpu_blocks=sum(blocks) if blocks else None,
        prefix_cache_queries=total(_QUERIES),
        prefix_cache_hits=total(_HITS),
        prompt_tokens=total(_PROMPT),
        ttft_sum_s=total(_TTFT_SUM),
        ttft_count=total(_TTFT_COUNT),
    )


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


_FIELDS = len(fields(PodMetrics))
# Figures of one scrape, ``scraped_at`` on the scraper's clock: told to ``MetricsScraper.subscribe``'s listeners.
ScrapeListener = Callable[[EndpointId, PodMetrics, float], None]


@dataclass(frozen=True, slots=True)
class ScrapeState:
    metrics: PodMetrics | None
    scraped_at: float | None  # scraper clock (monotonic) of the last good scrape
    misses: int  # consecutive failed scrapes
    stale: bool
    down: bool = False  # known dead or unreachable (scrapes refused, TLS failing), not just slow


@dataclass(slots=True)
class _Entry:
    metrics: PodMetrics | None = None
    scraped_at: float | None = None
    misses: int = 0
    task: asyncio.Task[None] | None = None
    refusals: int = 0  # consecutive refused scrapes (the pod is down while > 0)
    tls_error: str | None = None  # the TLS failure last logged (once, until a scrape succeeds)


class MetricsScraper:
    """Polls each endpoint's /metrics every ``interval_s``; ``get`` returns fresh metrics or None."""

    def __init__(
        self,
        endpoints: Iterable[EndpointId] = (),
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        stale_after_misses: int = DEFAULT_STALE_AFTER_MISSES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        url_for: Callable[[EndpointId], str] | None = None,
        tls: PodTLS | None = None,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        purge_after_refusals: int = DEFAULT_PURGE_AFTER_REFUSALS,
        on_down: Callable[[EndpointId], None] | None = None,
    ) -> None:
        """``on_down(endpoint)``: called once when ``purge_after_refusals`` scrapes in a row were refused."""
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_after_misses = stale_after_misses
        self.max_age_s = max_age_s
        self.purge_after_refusals = purge_after_refusals
        self._on_down = on_down
        self._url_for = url_for or (lambda ep: f"http://{ep}/metrics")
        self._tls = tls or PodTLS(None)
        self._session = session
        self._own_session = session is None
        self._clock = clock
        self._entries: dict[EndpointId, _Entry] = {ep: _Entry() for ep in endpoints}
        # What ``take_changed`` hands the decision path: pods whose figures or state changed, and when
        # each good scrape turns stale by age, so a decision copies only those (not every pod's).
        self._changed: set[EndpointId] = set(self._entries)
        self._expiry: list[tuple[float, EndpointId]] = []
        self._running = False
        self.share: ScrapeShare | None = None  # set when replicas split the scraping
        self.shared = 0  # figures taken from another replica's scrape
        self.left_to_owner = 0  # scrapes skipped: another replica owns the pod and its figures are fresh
        self.scrapes = 0
        self.failures = 0
        self.parse_errors = 0
        self.tls_errors = 0
        self.refused = 0
        self.downs = 0
        self._listeners: list[ScrapeListener] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._running:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self._running = True
        for ep in self._entries:
            self._spawn(ep)

    async def aclose(self) -> None:
        self._running = False
        tasks = [e.task for e in self._entries.values()]
        for e in self._entries.values():
            e.task = None
        await cancel_and_wait(tasks)
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def set_endpoints(self, endpoints: Iterable[EndpointId]) -> None:
        """Follow pool changes: new endpoints start being scraped, removed ones are forgotten."""
        wanted = set(endpoints)
        for ep in [ep for ep in self._entries if ep not in wanted]:
            task = self._entries.pop(ep).task
            if task is not None:
                task.cancel()
        for ep in wanted - self._entries.keys():
            self._entries[ep] = _Entry()
            self._changed.add(ep)
            if self._running:
                self._spawn(ep)

    def subscribe(self, listener: ScrapeListener) -> None:
        """``listener(endpoint, metrics, scraped_at)`` at every new set of figures, in scrape order per pod."""
        self._listeners.append(listener)

    def _tell(self, ep: EndpointId, metrics: PodMetrics, at: float) -> None:
        for listener in self._listeners:
            try:
                listener(ep, metrics, at)
            except Exception:  # a listener's bug must not stop this pod's polling
                log.exception("scrape listener failed for %s", ep)

    # -- reads -------------------------------------------------------------------------------------
    def take_changed(self) -> set[EndpointId]:
        """The pods whose ``state`` may differ from when this was last called: new figures, a failed or
        refused scrape, a new entry, or a good scrape older than ``max_age_s`` now. O(changes), not
        O(pods): the decision path calls it every time."""
        expiry, changed = self._expiry, self._changed
        if expiry:
            # Past the deadline by a microsecond, so _is_stale (now - scraped_at > max_age_s) agrees.
            now = self._clock() - 1e-6
            while expiry and expiry[0][0] < now:
                changed.add(heapq.heappop(expiry)[1])
        self._changed = set()
        return changed

    def mark_changed(self, endpoints: Iterable[EndpointId]) -> None:
        """Hand these pods to the next ``take_changed`` (their registry state was made anew)."""
        self._changed.update(endpoints)

    def _fresh(self, ep: EndpointId, at: float) -> None:
        """``ep`` has new figures scraped at ``at``: changed now, and again when they age out."""
        self._changed.add(ep)
        heapq.heappush(self._expiry, (at + self.max_age_s, ep))

    def get(self, endpoint: EndpointId) -> PodMetrics | None:
        """Latest metrics of ``endpoint``; None if unknown, never scraped, or stale."""
        e = self._entries.get(endpoint)
        if e is None or self._is_stale(e):
            return None
        return e.metrics

    def kv_capacity_tokens(self, endpoint: EndpointId) -> int | None:
        """The pod's KV cache size in tokens as last scraped, stale or not: it is fixed for the pod's
        life (a restarted pod is followed anew, so its old value is gone). None until reported."""
        e = self._entries.get(endpoint)
        return None if e is None or e.metrics is None else e.metrics.kv_capacity_tokens

    def state(self, endpoint: EndpointId) -> ScrapeState | None:
        e = self._entries.get(endpoint)
        if e is None:
            return None
        return ScrapeState(
            e.metrics, e.scraped_at, e.misses, self._is_stale(e), e.refusals > 0 or e.tls_error is not None
        )

    def stats(self) -> dict[str, int]:
        stale = sum(1 for e in self._entries.values() if self._is_stale(e))
        return {
            "endpoints": len(self._entries),
            "stale": stale,
            "scrapes": self.scrapes,
            "failures": self.failures,
            "parse_errors": self.parse_errors,
            "tls_errors": self.tls_errors,
            "refused": self.refused,
            "downs": self.downs,
            "shared": self.shared,
            "left_to_owner": self.left_to_owner,
        }

    def offer(self, endpoint: EndpointId, figures: Sequence[Any], age_s: float) -> bool:
        """Figures another replica scraped ``age_s`` ago (``ScrapeShare``): taken if newer than what is
        here. A peer that reached the pod means it answers, whatever this replica saw before."""
        e = self._entries.get(endpoint)
        if e is None or not figures or not 0 <= age_s <= self.max_age_s:
            return False
        # PodMetrics' fields are only ever appended: a peer a version apart sends fewer (unknown here:
        # None) or more (dropped), so replicas keep sharing their scrapes through a rolling upgrade.
        figures = (*figures[:_FIELDS], *(None,) * (_FIELDS - len(figures)))
        if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in figures):
            return False
        at = self._clock() - age_s
        if e.scraped_at is not None and at <= e.scraped_at:
            return False
        metrics = PodMetrics(*figures)
        e.metrics, e.scraped_at, e.misses, e.refusals, e.tls_error = metrics, at, 0, 0, None
        self._fresh(endpoint, at)
        self.shared += 1
        self._tell(endpoint, metrics, at)
        return True

    # -- internals ---------------------------------------------------------------------------------
    def _is_stale(self, e: _Entry) -> bool:
        return (
            e.metrics is None
            or e.scraped_at is None
            or e.misses >= self.stale_after_misses
            or e.refusals > 0
            or self._clock() - e.scraped_at > self.max_age_s
        )

    def _spawn(self, ep: EndpointId) -> None:
        self._entries[ep].task = asyncio.get_running_loop().create_task(self._poll(ep), name=f"metrics:{ep}")

    async def _poll(self, ep: EndpointId) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                if self._left_to_owner(ep):
                    self.left_to_owner += 1
                else:
                    await self.scrape_once(ep)
            except Exception:  # a bug in one scrape must not end the endpoint's polling for good
                log.exception("metrics scrape of %s failed unexpectedly", ep)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    def _left_to_owner(self, ep: EndpointId) -> bool:
        """Another replica owns ``ep`` and its figures are fresh: no scrape from here."""
        e = self._entries.get(ep)
        if self.share is None or e is None or e.scraped_at is None or self.share.owns(ep):
            return False
        return self._clock() - e.scraped_at < SHARED_FRESH_INTERVALS * self.interval_s

    async def scrape_once(self, ep: EndpointId) -> bool:
        """One scrape of ``ep`` (the poll loop's step; callable directly). True on success."""
        entry = self._entries.get(ep)
        if entry is None or self._session is None:
            return False
        self.scrapes += 1
        url = self._url_for(ep)
        try:
            async with self._session.get(
                url, timeout=aiohttp.ClientTimeout(total=self.timeout_s), **self._tls.request_options(url)
            ) as resp:
                if resp.status != 200 or (resp.content_length or 0) > MAX_BODY_BYTES:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                body = await resp.read()
            metrics = parse_vllm_metrics(body.decode("utf-8", "replace"))
        except MetricsParseError as exc:
            self.parse_errors += 1
            self._miss(ep, entry, exc, url)
            return False
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._miss(ep, entry, exc, url)
            self._count_refusal(ep, entry, exc)
            return False
        entry.refusals = 0
        at = self._clock()
        entry.metrics, entry.scraped_at, entry.misses, entry.tls_error = metrics, at, 0, None
        self._fresh(ep, at)
        if self.share is not None:
            self.share.publish(ep, astuple(metrics))
        self._tell(ep, metrics, at)
        return True

    def _miss(self, ep: EndpointId, entry: _Entry, exc: BaseException, url: str) -> None:
        self.failures += 1
        entry.misses += 1
        self._changed.add(ep)  # (a refusal, counted after this, changes no more than this marks)
        tls = self._tls.failure(exc)
        if tls is not None:
            # A configuration problem, not a blip: said at once, and once (the pod stays unscraped,
            # hence stale and unhealthy, until it is fixed).
            self.tls_errors += 1
            if entry.tls_error != tls:
                entry.tls_error = tls
                log.error("metrics of %s: TLS failed, not scraped until fixed: %s", ep, tls)
        elif entry.misses == self.stale_after_misses:
            hint = self._tls.hint(url, exc)
            log.warning("metrics of %s stale after %d failed scrapes: %r%s", ep, entry.misses, exc, hint)

    def _count_refusal(self, ep: EndpointId, entry: _Entry, exc: BaseException) -> None:
        """A refused scrape makes the pod unavailable at once (``_is_stale``); ``purge_after_refusals``
        in a row call ``on_down``. Any other failure (timeout, 5xx) ends the run: the pod is there."""
        if not connection_refused(exc):
            entry.refusals = 0
            return
        self.refused += 1
        entry.refusals += 1
        if entry.refusals != self.purge_after_refusals:
            return
        self.downs += 1
        log.warning("metrics of %s: %d scrapes refused in a row, the pod is down: %r", ep, entry.refusals, exc)
        if self._on_down is not None:
            try:
                self._on_down(ep)
            except Exception:  # the listener's bug must not stop this pod's polling
                log.exception("pod-down listener failed for %s", ep)


def connection_refused(exc: BaseException) -> bool:
    """Nothing listens at the address, or it is unreachable: the pod is gone (not slow)."""
    os_error = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else exc
    return isinstance(os_error, OSError) and os_error.errno in _GONE
