"""vLLM /metrics: parse the few series routing needs, and keep them fresh for a set of endpoints.

Series (vLLM v1; labels ``model_name`` and ``engine``, one set per engine/DP rank):
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (summed over engines),
``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``; 0..1, *averaged* over engines —
a fraction summed over engines would exceed 1), ``vllm:cache_config_info`` (labels ``block_size``,
``num_gpu_blocks``; blocks summed over engines), counters ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (older: ``vllm:gpu_prefix_cache_*``; tokens, summed).
A missing series is ``None`` in ``PodMetrics``, never a made-up zero.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.errors import KVRouteError
from extproc.index.base import EndpointId
from extproc.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
DEFAULT_TIMEOUT_S = 0.5
DEFAULT_STALE_AFTER_MISSES = 3  # consecutive failed scrapes before an endpoint's metrics are stale
DEFAULT_MAX_AGE_S = 1.0  # ... or this long since the last good scrape
MAX_BODY_BYTES = 8 << 20

_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_CACHE_INFO = ("vllm:cache_config_info",)
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
_ALL = (*_WAITING, *_RUNNING, *_KV_USAGE, *_CACHE_INFO, *_QUERIES, *_HITS)


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

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


def _relevant_lines(text: str) -> str:
    """Keep only the series we read (and their # lines): vLLM's histograms are most of the body, and
    the pure-Python parser would spend milliseconds on them at every scrape."""
    keep = []
    for line in text.splitlines():
        body = line[7:] if line.startswith(("# TYPE ", "# HELP ")) else line
        if body.startswith(_ALL):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_vllm_metrics(text: str) -> PodMetrics:
    """Parse a vLLM /metrics body; raises ``MetricsParseError`` on malformed text."""
    values: dict[str, list[float]] = {}
    info: list[dict[str, str]] = []
    try:
        for family in text_string_to_metric_families(_relevant_lines(text)):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if sample.name.endswith("_created") or name not in _ALL:
                    continue
                if name in _CACHE_INFO:
                    info.append(sample.labels)
                elif math.isfinite(sample.value):
                    values.setdefault(name, []).append(sample.value)
    except ValueError as exc:  # the parser's only error type for malformed input
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
    )


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ScrapeState:
    metrics: PodMetrics | None
    scraped_at: float | None  # scraper clock (monotonic) of the last good scrape
    misses: int  # consecutive failed scrapes
    stale: bool


@dataclass(slots=True)
class _Entry:
    metrics: PodMetrics | None = None
    scraped_at: float | None = None
    misses: int = 0
    task: asyncio.Task[None] | None = None


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
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_after_misses = stale_after_misses
        self.max_age_s = max_age_s
        self._url_for = url_for or (lambda ep: f"http://{ep}/metrics")
        self._session = session
        self._own_session = session is None
        self._clock = clock
        self._entries: dict[EndpointId, _Entry] = {ep: _Entry() for ep in endpoints}
        self._running = False
        self.scrapes = 0
        self.failures = 0
        self.parse_errors = 0

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
            if self._running:
                self._spawn(ep)

    # -- reads -------------------------------------------------------------------------------------
    def get(self, endpoint: EndpointId) -> PodMetrics | None:
        """Latest metrics of ``endpoint``; None if unknown, never scraped, or stale."""
        e = self._entries.get(endpoint)
        if e is None or self._is_stale(e):
            return None
        return e.metrics

    def state(self, endpoint: EndpointId) -> ScrapeState | None:
        e = self._entries.get(endpoint)
        if e is None:
            return None
        return ScrapeState(e.metrics, e.scraped_at, e.misses, self._is_stale(e))

    def stats(self) -> dict[str, int]:
        stale = sum(1 for e in self._entries.values() if self._is_stale(e))
        return {
            "endpoints": len(self._entries),
            "stale": stale,
            "scrapes": self.scrapes,
            "failures": self.failures,
            "parse_errors": self.parse_errors,
        }

    # -- internals ---------------------------------------------------------------------------------
    def _is_stale(self, e: _Entry) -> bool:
        return (
            e.metrics is None
            or e.scraped_at is None
            or e.misses >= self.stale_after_misses
            or self._clock() - e.scraped_at > self.max_age_s
        )

    def _spawn(self, ep: EndpointId) -> None:
        self._entries[ep].task = asyncio.get_running_loop().create_task(self._poll(ep), name=f"metrics:{ep}")

    async def _poll(self, ep: EndpointId) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.scrape_once(ep)
            except Exception:  # a bug in one scrape must not end the endpoint's polling for good
                log.exception("metrics scrape of %s failed unexpectedly", ep)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def scrape_once(self, ep: EndpointId) -> bool:
        """One scrape of ``ep`` (the poll loop's step; callable directly). True on success."""
        entry = self._entries.get(ep)
        if entry is None or self._session is None:
            return False
        self.scrapes += 1
        try:
            async with self._session.get(
                self._url_for(ep), timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                if resp.status != 200 or (resp.content_length or 0) > MAX_BODY_BYTES:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                body = await resp.read()
            metrics = parse_vllm_metrics(body.decode("utf-8", "replace"))
        except MetricsParseError as exc:
            self.parse_errors += 1
            self._miss(ep, entry, exc)
            return False
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._miss(ep, entry, exc)
            return False
        entry.metrics, entry.scraped_at, entry.misses = metrics, self._clock(), 0
        return True

    def _miss(self, ep: EndpointId, entry: _Entry, exc: BaseException) -> None:
        self.failures += 1
        entry.misses += 1
        if entry.misses == self.stale_after_misses:
            log.warning("metrics of %s stale after %d failed scrapes: %r", ep, entry.misses, exc)
