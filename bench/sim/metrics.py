"""vLLM's Prometheus metrics (names, labels, buckets) of one simulated pod, and their /metrics text.

The text is what vLLM's prometheus_client registry writes (the same families, HELP and TYPE lines,
sorted labels, ``_total`` and ``_created`` samples, float formatting: tests/sim/test_metrics.py holds
it to prometheus_client's own ``generate_latest``), written from plain floats: prometheus_client took
~1 ms of Python per scrape, and a fleet's pods share one process and event loop, so each pod's scrape
held up every pod's steps and streams (40 scrapes a second on 4 pods polled every 0.1 s).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

# Bucket edges as in vllm/v1/metrics/loggers.py.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _labels(pairs: dict[str, str]) -> str:
    """``{k="v",...}``, keys sorted, as prometheus_client writes them (values here need no escaping)."""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items())) + "}"


def _family(name: str, help_text: str, kind: str) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


class Value:
    """A gauge's or counter's current value (``set`` / ``inc``)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def set(self, v: float) -> None:
        self.value = float(v)

    def inc(self, n: float = 1.0) -> None:
        if n < 0:
            raise ValueError("counters only go up")
        self.value += n


class HistogramValue:
    """One histogram series: cumulative bucket counts are made at render time from per-bucket ones."""

    __slots__ = ("counts", "created", "edges", "sum")

    def __init__(self, edges: Sequence[float]) -> None:
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)  # the last: above every edge (+Inf only)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, v: float) -> None:
        self.sum += v
        self.counts[bisect.bisect_left(self.edges, v)] += 1  # le: a value on an edge counts in that bucket


class _Family:
    """One metric family: its series by label values, and how it is written."""

    def __init__(self, name: str, help_text: str, kind: str, labels: dict[str, str]) -> None:
        self.name, self.help, self.kind, self.labels = name, help_text, kind, labels
        self.values: dict[tuple[tuple[str, str], ...], tuple[str, Value]] = {}
        self.histograms: list[tuple[str, list[str], HistogramValue]] = []  # labels, each bucket's labels, series

    def value(self, extra: dict[str, str] | None = None) -> Value:
        """The gauge's or counter's series with these labels besides the family's (made at first use)."""
        key = tuple(sorted((extra or {}).items()))
        got = self.values.get(key)
        if got is None:
            got = self.values[key] = (_labels({**self.labels, **(extra or {})}), Value())
        return got[1]

    def histogram(self, edges: Sequence[float]) -> HistogramValue:
        """The family's one histogram series (the family's labels)."""
        le = [_labels({**self.labels, "le": floatToGoString(e)}) for e in (*edges, float("inf"))]
        h = HistogramValue(edges)
        self.histograms.append((_labels(self.labels), le, h))
        return h

    def write(self, out: list[str]) -> None:
        n, fmt = self.name, floatToGoString
        created: list[tuple[str, float]]
        if self.kind == "gauge":
            out.append(_family(n, self.help, "gauge"))
            out.extend(f"{n}{lab} {fmt(v.value)}\n" for lab, v in self.values.values())
            return
        if self.kind == "counter":
            out.append(_family(f"{n}_total", self.help, "counter"))
            out.extend(f"{n}_total{lab} {fmt(v.value)}\n" for lab, v in self.values.values())
            created = [(lab, v.created) for lab, v in self.values.values()]
        else:
            out.append(_family(n, self.help, "histogram"))
            for lab, le, h in self.histograms:
                total = 0
                for bucket, c in zip(le, h.counts, strict=True):
                    total += c
                    out.append(f"{n}_bucket{bucket} {fmt(total)}\n")
                out.append(f"{n}_count{lab} {fmt(total)}\n{n}_sum{lab} {fmt(h.sum)}\n")
            created = [(lab, h.created) for lab, _, h in self.histograms]
        if created:  # (prometheus_client writes no _created family for a family without series)
            out.append(_family(f"{n}_created", self.help, "gauge"))
            out.extend(f"{n}_created{lab} {fmt(t)}\n" for lab, t in created)


class PodMetrics:
    """One pod's metrics: the series it updates are plain attributes, bound to their labels once."""

    def __init__(self, model: str, block_size: int, num_blocks: int) -> None:
        base = {"model_name": model, "engine": "0"}
        self._families: list[_Family] = []

        def family(name: str, help_text: str, kind: str) -> _Family:
            f = _Family(name, help_text, kind, base)
            self._families.append(f)
            return f

        def one(name: str, help_text: str, kind: str) -> Value:
            return family(name, help_text, kind).value()

        def histogram(name: str, help_text: str, edges: Sequence[float]) -> HistogramValue:
            return family(name, help_text, "histogram").histogram(edges)

        self.running = one("vllm:num_requests_running", "Requests in model execution batches.", "gauge")
        self.waiting = one("vllm:num_requests_waiting", "Requests waiting to be processed.", "gauge")
        self.kv_usage = one("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge")
        info = family("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
        info.value({"block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
                    "enable_prefix_caching": "True"}).set(1)  # fmt: skip
        # Counters are named without _total; it is written as vLLM's prometheus_client writes it.
        self.prefix_queries = one("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "counter")
        self.prefix_hits = one("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "counter")
        self.external_queries = one(
            "vllm:external_prefix_cache_queries", "External (KV connector) prefix cache queries, in tokens.", "counter"
        )
        self.external_hits = one(
            "vllm:external_prefix_cache_hits", "External (KV connector) prefix cache hits, in tokens.", "counter"
        )
        self.prompt_tokens = one("vllm:prompt_tokens", "Number of prefill tokens processed.", "counter")
        self.generation_tokens = one("vllm:generation_tokens", "Number of generation tokens processed.", "counter")
        self.preemptions = one("vllm:num_preemptions", "Cumulative number of preemptions.", "counter")
        self._success = family("vllm:request_success", "Count of successfully processed requests.", "counter")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", E2E_BUCKETS)

    def success(self, finished_reason: str) -> None:
        self._success.value({"finished_reason": finished_reason}).inc()

    def render(self) -> bytes:
        out: list[str] = []
        for f in self._families:
            f.write(out)
        return "".join(out).encode()
