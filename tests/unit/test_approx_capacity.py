"""The approximate index remembers per pod what the pod's KV cache holds: its scraped
``vllm:cache_config_info`` (num_gpu_blocks × block_size), else ``routing.index_capacity_tokens``, else
``routing.index_capacity_blocks``, in approximate blocks (block_chars / chars_per_token tokens each)."""

from __future__ import annotations

from typing import Any

from extproc.config import Config
from extproc.index.approx import ApproxPrefixIndex
from extproc.observability import Metrics
from extproc.router import Router
from tests.unit.test_metrics_scrape import VLLM_TEXT, FakePod, pods, until  # noqa: F401 - the fixture

# 256 characters a block at 4 characters a token: one approximate block stands for 64 tokens.
ROUTING = {"block_chars": 256, "chars_per_token": 4.0, "max_blocks": 1024}


def cache_info(num_gpu_blocks: int, block_size: int = 16) -> str:
    """VLLM_TEXT (two engines) with each engine's cache_config_info set to these values."""
    return VLLM_TEXT.replace('block_size="16"', f'block_size="{block_size}"').replace(
        'num_gpu_blocks="27000"', f'num_gpu_blocks="{num_gpu_blocks}"'
    )


def chat(i: int, blocks: int) -> bytes:
    """A chat whose text is ``blocks`` approximate blocks long, distinct per ``i`` from its first block."""
    import orjson

    text = f"{i:08d}" + "x" * (blocks * 256)
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def route(router: Router, i: int, blocks: int) -> str:
    out = router.route(router.parse("/v1/chat/completions", "POST", {}, chat(i, blocks)))
    router.release(out.endpoint)
    return out.endpoint


def test_the_index_evicts_at_each_pods_own_capacity() -> None:
    caps: dict[str, int] = {"a": 10}
    index = ApproxPrefixIndex(capacity_blocks=100, capacity_of=caps.get)
    keys = list(range(1000, 1040))
    index.record(keys, "a")
    index.record(keys, "b")  # no capacity known for b: the default
    assert index.blocks("a") == 10 and index.capacity("a") == 10
    assert index.blocks("b") == 40 and index.capacity("b") == 100
    assert index.match(keys, ["a", "b"]) == {"a": 10, "b": 40}  # a keeps the prompt's leading blocks
    caps["a"] = 4  # learnt later (a scrape): the next record trims to it
    index.record([7, 8], "a")
    assert index.blocks("a") == 4
    index.record(list(range(200)), "b")
    assert index.blocks("b") == 100


def config(**routing: Any) -> Config:
    return Config.model_validate({"pools": {"p": {"endpoints": [{"address": "127.0.0.1:9"}]}},
                                  "routing": {**ROUTING, **routing}})  # fmt: skip


def test_the_configured_kv_size_applies_when_nothing_is_scraped() -> None:
    assert Router(config(), Metrics()).approx_capacity("127.0.0.1:9") is None  # index_capacity_blocks then
    router = Router(config(index_capacity_tokens=640), Metrics())
    assert router.approx_capacity("127.0.0.1:9") == 10  # 640 tokens / 64 tokens a block
    route(router, 0, 30)
    assert router.index.blocks("127.0.0.1:9") == 10  # type: ignore[attr-defined]
    # A different characters-per-token estimate changes how many blocks the same tokens are.
    assert Router(config(index_capacity_tokens=640, chars_per_token=8.0), Metrics()).approx_capacity("x") == 20


async def test_capacity_follows_the_pods_scraped_cache_config_info(pods) -> None:  # noqa: F811
    fakes, eps = pods
    # Two engines of 40 blocks × 16 tokens: 1280 tokens, 20 approximate blocks; the config says
    # otherwise (3200 tokens) and the pod's own figure wins.
    fakes[0].text = cache_info(40)
    cfg = Config.model_validate({
        "pools": {"p": {"endpoints": [{"address": eps[0]}]}},
        "routing": {**ROUTING, "index_capacity_tokens": 3200},
        "scrape": {"enabled": True, "interval_s": 0.02},
    })  # fmt: skip
    router = Router(cfg, Metrics())
    await router.start()
    try:
        await until(lambda: router.approx_capacity(eps[0]) == 20)
        for i in range(3):  # 3 × 15 blocks: past the pod's 20, under twice it (or the config's 50)
            route(router, i, 15)
        assert router.index.blocks(eps[0]) == 20  # type: ignore[attr-defined]
        fakes[0].text = cache_info(80)  # the pod grew (a new config): 40 blocks
        await until(lambda: router.approx_capacity(eps[0]) == 40)
        for i in range(3, 6):
            route(router, i, 15)
        assert router.index.blocks(eps[0]) == 40  # type: ignore[attr-defined]
        # A stale pod (its scrapes fail) keeps its known capacity: a pod's cache size is fixed for its life.
        fakes[0].status = 500
        await until(lambda: router.live.scraper is not None and router.live.scraper.get(eps[0]) is None)
        assert router.approx_capacity(eps[0]) == 40
    finally:
        await router.aclose()
