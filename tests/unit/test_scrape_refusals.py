"""A pod that refuses its scrapes (nothing listens: it died) is unavailable at once and reported down
after ``purge_after_refusals`` refusals in a row; a slow pod (timeouts) never is."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from extproc.config import Config
from extproc.endpoints.live import LiveView
from extproc.endpoints.metrics import MetricsScraper, connection_refused
from tests.unit.test_metrics_scrape import FakePod, pods, until  # noqa: F401 - the fixture


def scraper(ep: str, purge_after_refusals: int, on_down: Callable[[str], None]) -> MetricsScraper:
    """Fast polls, and staleness only from refusals (100 misses or 60 s would take long)."""
    return MetricsScraper([ep], interval_s=0.02, timeout_s=0.05, stale_after_misses=100, max_age_s=60.0,
                          purge_after_refusals=purge_after_refusals, on_down=on_down)  # fmt: skip


async def serve(fake: FakePod, port: int = 0) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/metrics", fake.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, runner.addresses[0][1]


async def test_refused_scrapes_make_the_pod_unavailable_then_down_once() -> None:
    fake = FakePod()
    runner, port = await serve(fake)
    ep = f"127.0.0.1:{port}"
    down: list[str] = []
    sc = scraper(ep, 3, down.append)
    await sc.start()
    try:
        await until(lambda: sc.get(ep) is not None)
        await runner.cleanup()  # killed: connections are refused from now on
        await until(lambda: sc.stats()["refused"] >= 1)
        assert sc.get(ep) is None  # unavailable at the first refusal, not after 100 misses or 60 s
        await until(lambda: down == [ep])
        refused = sc.stats()["refused"]
        await until(lambda: sc.stats()["refused"] >= refused + 3)
        assert down == [ep] and sc.stats()["downs"] == 1  # reported once per outage
        runner, _ = await serve(fake, port)  # back on the same address
        await until(lambda: sc.get(ep) is not None)
        assert sc.state(ep) is not None and not sc.state(ep).stale  # type: ignore[union-attr]
    finally:
        await sc.aclose()
        await runner.cleanup()


async def test_slow_scrapes_never_report_the_pod_down(pods) -> None:  # noqa: F811
    fakes, eps = pods
    down: list[str] = []
    sc = scraper(eps[0], 1, down.append)
    await sc.start()
    try:
        await until(lambda: sc.get(eps[0]) is not None)
        fakes[0].delay_s = 0.5  # every scrape times out
        await until(lambda: getattr(sc.state(eps[0]), "misses", 0) >= 3)
        assert down == [] and sc.stats()["refused"] == 0
        assert sc.get(eps[0]) is not None  # still usable: few misses (of 100), young metrics
    finally:
        await sc.aclose()


def test_connection_refused_is_only_a_gone_pod() -> None:
    assert connection_refused(ConnectionRefusedError(111, "refused"))
    assert not connection_refused(TimeoutError())
    assert not connection_refused(OSError("no errno"))


async def test_live_view_purges_a_down_pod_and_tells_its_listeners() -> None:
    fake = FakePod()
    runner, port = await serve(fake)
    ep = f"127.0.0.1:{port}"
    config = Config.model_validate({
        "pools": {"p": {"endpoints": [{"address": ep}]}},
        "scrape": {"enabled": True, "interval_s": 0.02, "purge_after_refusals": 2},
        "kv_events": {"enabled": True},
    })  # fmt: skip
    live = LiveView(config)
    told: list[str] = []
    live.subscribe_down(told.append)
    assert live.precise is not None
    live.precise.record([1, 2, 3], ep)
    assert live.precise.match([1, 2, 3], [ep]).get(ep) == 3
    await live.start(config.pools["p"].endpoints)
    try:
        assert live.scraper is not None
        await until(lambda: live.scraper is not None and live.scraper.get(ep) is not None)
        await runner.cleanup()
        await until(lambda: told == [ep])
        assert live.scraper.stats()["downs"] == 1
        assert not live.precise.match([1, 2, 3], [ep]).get(ep)  # its entries went with it
    finally:
        await live.aclose()
