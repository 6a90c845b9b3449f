"""Scrapes split among replicas: the owner of a pod (rendezvous hashing over the live replicas)
scrapes it and publishes its figures, the others take them (``MetricsScraper.offer``) and scrape it
themselves only when none came for a few intervals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import astuple
from typing import Any

import msgpack

from extproc.endpoints.metrics import SHARED_FRESH_INTERVALS, MetricsScraper, PodMetrics
from extproc.state import replicated
from extproc.state.replicated import FIGURES_HOLD_S, _Peer
from tests.unit.test_metrics_scrape import FakePod, pods, until  # noqa: F401 - the fixture
from tests.unit.test_shared_state import _state

FIGURES = astuple(PodMetrics(1.0, 2.0, 0.5, 16, 1000, 10.0, 5.0))


def test_offers_are_taken_when_newer_and_well_formed() -> None:
    now = [100.0]
    sc = MetricsScraper(["p:1"], max_age_s=1.0, clock=lambda: now[0])
    assert sc.offer("p:1", FIGURES, 0.1)
    got = sc.get("p:1")
    assert got is not None and got.num_requests_waiting == 1.0 and got.kv_capacity_tokens == 16000
    assert not sc.offer("p:1", FIGURES, 0.2)  # older than what is here
    assert not sc.offer("p:1", ("x", *FIGURES[1:]), 0.0)  # not a number
    assert not sc.offer("p:1", FIGURES, 5.0)  # older than max_age_s: would be stale anyway
    assert not sc.offer("p:9", FIGURES, 0.0)  # a pod this replica does not follow
    assert not sc.offer("p:1", (), 0.0)
    assert sc.stats()["shared"] == 1


def test_a_peer_a_version_apart_still_shares_its_scrapes() -> None:
    """Fields are only appended: an older peer's shorter figures leave the new fields unknown, a newer
    peer's extra ones are dropped (a rolling upgrade keeps the scraping split)."""
    now = [100.0]
    sc = MetricsScraper(["p:1"], max_age_s=1.0, clock=lambda: now[0])
    assert sc.offer("p:1", FIGURES[:7], 0.3)  # an older replica: no prompt-token or TTFT counters
    got = sc.get("p:1")
    assert got is not None and got.prefix_cache_hits == 5.0 and got.ttft_count is None
    assert sc.offer("p:1", (*FIGURES, 99.0, 7.0), 0.2)  # a newer one: two fields this one does not know
    got = sc.get("p:1")
    assert got is not None and astuple(got) == FIGURES


def test_the_pods_split_among_replicas_one_owner_each_and_a_leaver_moves_only_its_own() -> None:
    states = [_state() for _ in range(3)]
    for i, s in enumerate(states):  # fixed names: random ones left a replica under 10 pods about once in 100 runs
        s.replica = f"replica-{i}"
    for s in states:
        s._peers = {o.replica: _Peer(seen=time.monotonic()) for o in states if o is not s}
    addresses = [f"10.0.0.{i}:8000" for i in range(60)]
    owners = {p: [s for s in states if s.owns(p)] for p in addresses}
    assert all(len(o) == 1 for o in owners.values())
    assert all(sum(o[0] is s for o in owners.values()) >= 10 for s in states)  # a share each (of ~20)
    gone = states[2]
    for s in states[:2]:
        del s._peers[gone.replica]
    for p in addresses:
        now = [s for s in states[:2] if s.owns(p)]
        assert len(now) == 1 and (owners[p][0] is gone or now[0] is owners[p][0])


def test_figures_wait_for_a_flush_and_travel_with_their_age() -> None:
    taken: list[tuple[str, Sequence[Any], float]] = []
    s = _state()

    def offer(ep: str, figures: Sequence[Any], age: float) -> bool:
        taken.append((ep, figures, age))
        return True

    assert s.share_scrapes(offer) is s
    s.publish("10.0.0.1:8000", FIGURES)
    assert not s._figures  # not connected: nothing queued (the peers scrape for themselves)
    s.up = True
    now = time.monotonic()
    s.publish("10.0.0.1:8000", (9.0, *FIGURES[1:]))
    s.publish("10.0.0.1:8000", FIGURES)  # the latest per pod only
    assert s._batch(now, force_loads=False) is None  # figures alone wait for FIGURES_HOLD_S
    batch = s._batch(now + FIGURES_HOLD_S + 0.01, force_loads=False)
    assert batch is not None and batch.ops == []  # not history: a resync does not replay them
    ((entry_op,),) = [e["o"] for e in batch.entries]
    assert entry_op[:3] == ["m", "10.0.0.1:8000", list(FIGURES)] and entry_op[3] >= FIGURES_HOLD_S
    assert not s._figures
    s.publish("10.0.0.2:8000", FIGURES)
    s.emit(["p", 1, "10.0.0.2:8000"])  # a record goes at once, and the figures with it
    batch = s._batch(time.monotonic(), force_loads=False)
    assert batch is not None and [op[0] for op in batch.entries[-1]["o"]] == ["p", "m"]
    peer = _state()
    peer.share_scrapes(offer)
    peer.apply({b"r": s.replica.encode(), b"m": msgpack.packb({"o": [entry_op], "t": time.time()})})
    ((ep, figures, age),) = taken
    assert ep == "10.0.0.1:8000" and tuple(figures) == FIGURES and FIGURES_HOLD_S <= age < 1  # held time counts
    assert peer.counters["received_scrapes"] == 1


class Share:
    def __init__(self, owns: bool) -> None:
        self.mine = owns
        self.published: list[str] = []

    def owns(self, endpoint: str) -> bool:
        return self.mine

    def publish(self, endpoint: str, figures: Sequence[Any]) -> None:
        self.published.append(endpoint)


async def test_a_pod_another_replica_owns_is_scraped_only_when_its_figures_stop_coming(pods) -> None:  # noqa: F811
    fakes, eps = pods
    interval = 0.02
    sc = MetricsScraper(eps[:1], interval_s=interval, timeout_s=0.2, max_age_s=5.0)
    share = Share(owns=False)
    sc.share = share
    await sc.start()
    try:
        await until(lambda: fakes[0].hits >= 1)  # nothing shared yet: it scrapes
        assert share.published == [eps[0]]  # and hands the figures on
        hits = fakes[0].hits
        for _ in range(40):  # the owner's figures keep coming, twice an interval: no scrape from here
            sc.offer(eps[0], FIGURES, 0.0)
            await asyncio.sleep(interval / 2)
        assert fakes[0].hits <= hits + 4  # (none at all unless the loop stalled past 2.5 intervals)
        assert sc.stats()["left_to_owner"] >= 10 and sc.stats()["shared"] >= 30
        hits = fakes[0].hits
        await until(lambda: fakes[0].hits > hits, timeout=SHARED_FRESH_INTERVALS * interval + 2)  # they stopped
        share.mine = True
        hits = fakes[0].hits
        await until(lambda: fakes[0].hits >= hits + 3)  # the owner scrapes every interval
    finally:
        await sc.aclose()


async def test_an_idle_writer_wakes_when_held_figures_are_due(monkeypatch) -> None:
    monkeypatch.setattr(replicated, "IDLE_FLUSH_S", 30.0)  # a wait no busy host could mistake for "at once"
    s = _state()
    s._wake = asyncio.Event()  # as _start_loops makes it
    s._figures["10.0.0.1:8000"] = (time.monotonic() - FIGURES_HOLD_S, list(FIGURES))  # due now
    t = time.monotonic()
    assert await s._idle()
    assert time.monotonic() - t < replicated.IDLE_FLUSH_S / 2  # not the whole idle wait


def test_a_decision_copies_only_the_pods_whose_scrape_state_changed() -> None:
    """``take_changed``: new entries, new figures, and good figures turning stale by age, each once."""
    now = [100.0]
    sc = MetricsScraper(["p:1", "p:2"], max_age_s=1.0, clock=lambda: now[0])
    assert sc.take_changed() == {"p:1", "p:2"}  # never scraped: stale, to be copied once
    assert sc.take_changed() == set()
    assert sc.offer("p:1", FIGURES, 0.0)
    assert sc.take_changed() == {"p:1"}
    now[0] += 0.9
    assert sc.take_changed() == set()  # still fresh: nothing to copy
    now[0] += 0.2  # past max_age_s with no new scrape: stale now, and handed over once
    assert sc.take_changed() == {"p:1"}
    state = sc.state("p:1")
    assert state is not None and state.stale
    assert sc.take_changed() == set()
    sc.set_endpoints(["p:1", "p:2", "p:3"])
    sc.mark_changed(["p:2"])
    assert sc.take_changed() == {"p:2", "p:3"}


def test_live_view_refresh_follows_changes_and_age_without_scanning_every_pod() -> None:
    from extproc.config import build_config
    from extproc.endpoints.live import LiveView
    from extproc.endpoints.pool import EndpointState

    now = [100.0]
    cfg = {"pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}}, "scrape": {"enabled": True}}
    live = LiveView(build_config(cfg))
    assert live.scraper is not None
    sc = live.scraper = MetricsScraper(["p:1", "p:2"], max_age_s=1.0, clock=lambda: now[0])
    st = {a: EndpointState(address=a, role="both", cluster="c", pool="p") for a in ("p:1", "p:2")}
    live.refresh(st)
    assert not st["p:1"].healthy and not st["p:2"].healthy  # never scraped
    assert sc.offer("p:1", FIGURES, 0.0)
    live.refresh(st)
    assert st["p:1"].healthy and st["p:1"].queue == 1.0 and not st["p:2"].healthy
    st["p:1"].queue = 7.0  # nothing changed in the scraper: the next refresh leaves the pod alone
    live.refresh(st)
    assert st["p:1"].queue == 7.0
    now[0] += 1.5
    live.refresh(st)  # aged out: unhealthy, its gauges gone
    assert not st["p:1"].healthy and st["p:1"].queue is None
