"""Hot reload: what a reloaded config changes in a running router (and what it keeps), and the
reloader's refusals (invalid, restart required), metrics, file polling and SIGHUP."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import Config, load_config
from extproc.discovery import DiscoveryError
from extproc.observability import Metrics
from extproc.reload import ConfigReloader, changed_fields, config_hash, error_fields, record_running, requires_restart
from extproc.request import InferenceRequest
from extproc.router import Router

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


def cfg(endpoints: tuple[str, ...] = (A, B, C), **extra: Any) -> dict[str, Any]:
    return {"pools": {"default": {"endpoints": [{"address": a} for a in endpoints]}}, **extra}


def chat(doc: str = "a shared document " * 40, route_id: str | None = None) -> InferenceRequest:
    return InferenceRequest(
        path="/v1/chat/completions",
        method="POST",
        request_id="r",
        tenant="t",
        model="m",
        prompt_text=doc,
        route_id=route_id,
        body={"model": "m", "messages": [{"role": "user", "content": doc}]},
    )


def addresses(router: Router, pool: str = "default") -> list[str]:
    return [e.address for e in router.registry.pools[pool].endpoints]


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# -- what a reload changes ------------------------------------------------------------------------


def test_changed_fields_name_each_setting_and_which_need_a_restart():
    old = load_config(None, cfg())
    new = load_config(None, cfg((A, D), routing={"weights": {"prefix": 5}}, server={"grpc_port": 1}))
    assert changed_fields(old, new) == ["pools.default.endpoints", "routing.weights.prefix", "server.grpc_port"]
    assert changed_fields(old, load_config(None, cfg())) == []
    assert [f for f in changed_fields(old, new) if requires_restart(f)] == ["server.grpc_port"]
    assert requires_restart("kv_events.enabled") and requires_restart("redis.url") and requires_restart("server.tls")
    assert not requires_restart("pd.threshold_tokens") and not requires_restart("discovery.file.path")
    assert not requires_restart("server.log_level") and not requires_restart("mode_x")


def test_error_fields_from_config_errors():
    src = "/etc/kvroute.yaml"
    assert error_fields(f"{src}: routing.weights.prefix: Input should be >= 0\n{src}: mode: bad", src) == [
        "routing.weights.prefix",
        "mode",
    ]
    # A check across fields names its field first in the message.
    assert error_fields(f"{src}: (top level): models.m.pool: no pool named 'x'", src) == ["models.m.pool"]
    assert error_fields(f"{src}: not valid YAML: mapping values are not allowed", src) == ["(file)"]


def test_reconfigure_applies_routing_and_keeps_index_and_pins():
    router = Router(load_config(None, cfg(routing={"scoring": "weighted"})), Metrics())
    index, routes = router.index, router.scheduler.routes
    pinned = router.route(chat("one conversation " * 40, route_id="conv-1")).endpoint
    held = router.route(chat()).endpoint
    new = load_config(None, cfg(routing={"scoring": "weighted", "weights": {"prefix": 7, "queue": 0},
                                         "saturation": {"queue_threshold": 3}, "fallback_endpoints": 2}))  # fmt: skip
    router.reconfigure(new)
    assert router.config is new
    sch = router.scheduler
    assert {type(s).__name__: w for s, w in sch.scorers} == {"PrefixScorer": 7.0, "InflightScorer": 2.0,
                                                             "KVUsageScorer": 1.0}  # fmt: skip
    assert sch.saturation.queue_threshold == 3 and sch.fallbacks == 2
    assert router.index is index and sch.routes is routes and sch.index is index
    # The routing history and the pin survive: same pods, for the same reasons.
    again = router.route(chat())
    assert again.endpoint == held and again.decision.reason == "prefix" and again.decision.matched_blocks > 0
    follow_up = router.route(chat("another question entirely " * 40, route_id="conv-1"))
    assert follow_up.endpoint == pinned and follow_up.decision.reason == "route-id"
    assert len(again.decision.endpoints) == 2


def test_reconfigure_publishes_static_endpoints_and_pools():
    router = Router(load_config(None, cfg()), Metrics())
    held = router.route(chat()).endpoint  # in flight there, and its prefix recorded there
    kept = [a for a in (A, B, C) if a != held]
    other = {"other": {"endpoints": [{"address": "10.0.1.1:8000"}]}}
    router.reconfigure(load_config(None, {"pools": {"default": {"endpoints": [{"address": a} for a in (*kept, D)]},
                                                    **other}, "default_pool": "default"}))  # fmt: skip
    assert addresses(router) == [*kept, D] and addresses(router, "other") == ["10.0.1.1:8000"]
    # The removed pod and its routing history are gone; the request in flight there just ends.
    assert held not in router.registry.by_address and held not in router.index.block_counts()  # type: ignore[attr-defined]
    router.release(held)
    router.registry.acquire(kept[0])
    # A pool dropped from the config is gone, its pods too; in-flight counts carry on.
    router.reconfigure(load_config(None, cfg(tuple(kept))))
    assert list(router.registry.pools) == ["default"] and "10.0.1.1:8000" not in router.registry.by_address
    assert router.registry.by_address[kept[0]].inflight == 1
    assert addresses(router) == kept and router.route(chat()).endpoint in kept


async def test_reconfigure_follows_a_new_endpoints_file(tmp_path):
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    one.write_text(yaml.safe_dump(cfg((A, B))))
    two.write_text(yaml.safe_dump({"pools": {"other": {"endpoints": [{"address": C}]}}}))

    def file_config(path: Path) -> Config:
        file = {"path": str(path), "poll_interval_s": 0.02}
        return load_config(None, {"discovery": {"provider": "file", "file": file}})

    router = Router(file_config(one), Metrics())
    await router.start()
    try:
        assert addresses(router) == [A, B]
        with pytest.raises(DiscoveryError, match=r"missing\.yaml"):
            router.reconfigure(file_config(tmp_path / "missing.yaml"))
        assert addresses(router) == [A, B] and router.discovery.path == one  # type: ignore[attr-defined]
        router.reconfigure(file_config(two))
        assert addresses(router) == [] and addresses(router, "other") == [C]  # the old file's pool is emptied
        # The new file is the one followed from now on.
        two.write_text(yaml.safe_dump({"pools": {"other": {"endpoints": [{"address": D}]}}}))
        await wait_for(lambda: addresses(router, "other") == [D])
    finally:
        await router.aclose()


# -- the reloader -----------------------------------------------------------------------------------


class Reloading:
    """A router and a reloader on a config file in ``tmp``."""

    def __init__(self, tmp: Path, data: dict[str, Any], overrides: dict[str, Any] | None = None, **kw: Any):
        self.path = tmp / "kvroute.yaml"
        self.write(data)
        self.metrics = Metrics()
        self.overrides = overrides or {}
        self.router = Router(load_config(self.path, self.overrides), self.metrics)
        record_running(self.metrics, self.router.config)

        async def apply(config: Config) -> None:
            self.router.reconfigure(config)

        self.reloader = ConfigReloader(self.path, self.overrides, self.router.config, apply, self.metrics, **kw)

    def write(self, data: dict[str, Any] | str) -> None:
        self.path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))

    def count(self, result: str) -> float | None:
        return sample(self.metrics, "kvroute_config_reloads_total", result=result)

    def refused(self) -> dict[str, str]:
        return {
            s.labels["field"]: s.labels["reason"]
            for fam in self.metrics.registry.collect()
            if fam.name == "kvroute_config_refused_fields"
            for s in fam.samples
        }

    def running_hash(self) -> str:
        fam = next(f for f in self.metrics.registry.collect() if f.name == "kvroute_config_info")
        (s,) = fam.samples
        return s.labels["hash"]


async def test_reload_applies_a_valid_change(tmp_path):
    r = Reloading(tmp_path, cfg())
    before = sample(r.metrics, "kvroute_config_last_reload_timestamp_seconds")
    r.write(cfg((A, B, D), routing={"weights": {"prefix": 5}}, pd={"threshold_tokens": 10}))
    assert await r.reloader.reload() == "applied"
    assert r.router.config.routing.weights.prefix == 5 and r.router.config.pd.threshold_tokens == 10
    assert addresses(r.router) == [A, B, D] and r.reloader.config is r.router.config
    assert r.count("applied") == 1 and sample(r.metrics, "kvroute_config_valid") == 1
    assert r.running_hash() == config_hash(r.router.config)
    assert sample(r.metrics, "kvroute_config_last_reload_timestamp_seconds") >= before  # type: ignore[operator]
    # The same content again: nothing to do.
    assert await r.reloader.reload() == "unchanged" and r.count("unchanged") == 1


async def test_invalid_config_is_refused_naming_the_field(tmp_path, caplog):
    r = Reloading(tmp_path, cfg())
    running, running_hash = r.router.config, r.running_hash()
    r.write(cfg((A, D), routing={"weights": {"prefix": -1}}))
    with caplog.at_level(logging.WARNING, logger="kvroute.reload"):
        assert await r.reloader.reload() == "invalid"
    assert r.router.config is running and addresses(r.router) == [A, B, C]  # nothing of it applied
    assert r.count("invalid") == 1 and sample(r.metrics, "kvroute_config_valid") == 0
    assert r.refused() == {"routing.weights.prefix": "invalid"} and r.running_hash() == running_hash
    (rec,) = [x for x in caplog.records if x.name == "kvroute.reload"]
    assert rec.fields["fields"] == ["routing.weights.prefix"]  # type: ignore[attr-defined]
    assert "routing.weights.prefix" in rec.fields["error"]  # type: ignore[attr-defined]

    r.write("pools: [unclosed")
    assert await r.reloader.reload() == "invalid" and r.refused() == {"(file)": "invalid"}
    r.write({**cfg(), "models": {"m": {"pool": "nope"}}})
    assert await r.reloader.reload() == "invalid" and r.refused() == {"models.m.pool": "invalid"}
    # Valid again: the refusal clears.
    r.write(cfg((A, B)))
    assert await r.reloader.reload() == "applied"
    assert sample(r.metrics, "kvroute_config_valid") == 1 and r.refused() == {}


async def test_unloadable_tokenizer_is_refused(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("not json")
    r = Reloading(tmp_path, cfg())
    r.write({**cfg(), "models": {"m": {"pool": "default", "tokenizer": str(tmp_path / "tok")}}})
    assert await r.reloader.reload() == "invalid"
    assert r.refused() == {"models.m.tokenizer": "invalid"} and r.router.config.models == {}


async def test_restart_required_change_is_refused_whole(tmp_path, caplog):
    r = Reloading(tmp_path, cfg())
    running = r.router.config
    r.write(cfg((A, D), mode="cluster", kv_events={"enabled": True}, routing={"weights": {"prefix": 9}}))
    with caplog.at_level(logging.WARNING, logger="kvroute.reload"):
        assert await r.reloader.reload() == "restart_required"
    # All or nothing: not even the weights or the endpoints changed.
    assert r.router.config is running and addresses(r.router) == [A, B, C]
    assert r.count("restart_required") == 1 and sample(r.metrics, "kvroute_config_valid") == 1
    assert r.refused() == {"mode": "restart_required", "kv_events.enabled": "restart_required"}
    (rec,) = [x for x in caplog.records if x.name == "kvroute.reload"]
    assert "restart" in rec.fields["why"] and rec.fields["fields"] == ["kv_events.enabled", "mode"]  # type: ignore[attr-defined]


async def test_flags_keep_overriding_the_file(tmp_path):
    # --grpc-port 7000 --endpoints D: the file's own port and pools never take over.
    flags = {"server": {"grpc_port": 7000}, "pools": {"default": {"endpoints": [{"address": D}]}}}
    r = Reloading(tmp_path, cfg(), overrides=flags)
    assert addresses(r.router) == [D]
    r.write(cfg((A, B), server={"grpc_port": 9999}, routing={"load_slack": 5}))
    assert await r.reloader.reload() == "applied"
    assert r.router.config.server.grpc_port == 7000 and addresses(r.router) == [D]
    assert r.router.scheduler.bounded.slack == 5


async def test_file_change_is_polled_and_sighup_reloads_at_once(tmp_path):
    r = Reloading(tmp_path, cfg(), interval_s=0.02)
    await r.reloader.start()
    try:
        r.write(cfg((A, B)))
        await wait_for(lambda: r.count("applied") == 1)
        assert addresses(r.router) == [A, B]
        await asyncio.sleep(0.1)
        assert r.count("unchanged") == 0  # an unchanged file is not reloaded again
    finally:
        await r.reloader.aclose()

    r = Reloading(tmp_path, cfg(), interval_s=3600)  # polling would never see it in time
    await r.reloader.start()
    try:
        r.write(cfg((C,)))
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_for(lambda: r.count("applied") == 1)
        assert addresses(r.router) == [C]
    finally:
        await r.reloader.aclose()


async def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_models_chat_template_settings_load_with_its_tokenizer(tmp_path):
    """models.<name>.chat_template (the pods' --chat-template), chat_template_content_format and
    chat_template_kwargs reach the model's tokenizer; a missing template file is refused by name."""
    from bench.harness import precise_tokenizer

    tok_dir = str(precise_tokenizer(tmp_path / "tok"))
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ greeting }}{% endfor %}{% if add_generation_prompt %}"
        "[assistant]{% endif %}"
    )
    r = Reloading(tmp_path, cfg())
    model = {"pool": "default", "tokenizer": tok_dir, "chat_template": str(tmp_path / "t.jinja")}
    r.write({**cfg(), "models": {"m": {**model, "chat_template_kwargs": {"greeting": "!"}}}})
    assert await r.reloader.reload() == "applied"
    tok = r.router.tokenizers["m"]
    assert tok.render_chat({"messages": [{"role": "user", "content": "hi"}]}) == "[user]hi![assistant]"
    assert tok.chat_shape is not None and tok.chat_shape.content_format == "string"
    r.write({**cfg(), "models": {"m": {**model, "chat_template_content_format": "openai"}}})
    assert await r.reloader.reload() == "applied"
    tok = r.router.tokenizers["m"]
    assert tok.chat_shape is not None and tok.chat_shape.content_format == "openai"
    # The template file rewritten: a reload (of another field) takes its new text, not the tokenizer loaded before.
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    r.write({**cfg(routing={"load_slack": 3}), "models": {"m": {**model, "chat_template_content_format": "openai"}}})
    assert await r.reloader.reload() == "applied"
    assert r.router.tokenizers["m"].render_chat({"messages": [{"role": "user", "content": "hi"}]}) == "<user>"
    r.write({**cfg(), "models": {"m": {**model, "chat_template": str(tmp_path / "nowhere.jinja")}}})
    assert await r.reloader.reload() == "invalid"
    assert r.refused() == {"models.m.chat_template": "invalid"}
