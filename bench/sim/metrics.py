"""vLLM's Prometheus metrics (names, labels, buckets) on a per-pod registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


class PodMetrics:
    """One pod's metrics; counters are bound to their labels once so updates stay cheap."""

    def __init__(self, model: str, block_size: int, num_blocks: int) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        lv = (model, "0")
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", names, registry=r
        ).labels(*lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", names, registry=r
        ).labels(*lv)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", names, registry=r
        ).labels(*lv)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*names, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        info.labels(*lv, str(block_size), str(num_blocks), "True").set(1)
        # prometheus_client appends _total to counter names itself.
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", names, registry=r
        ).labels(*lv)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", names, registry=r).labels(
            *lv
        )
        self.external_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "External (KV connector) prefix cache queries, in tokens.",
            names,
            registry=r,
        ).labels(*lv)
        self.external_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "External (KV connector) prefix cache hits, in tokens.",
            names,
            registry=r,
        ).labels(*lv)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        ).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        ).labels(*lv)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", names, registry=r
        ).labels(*lv)
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"], registry=r
        )
        self._lv = lv
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token.",
            names,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency.",
            names,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency.",
            names,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(*lv)

    def success(self, finished_reason: str) -> None:
        self._success.labels(*self._lv, finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
