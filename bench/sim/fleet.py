"""Many simulated pods in one asyncio process, with P/D peers resolved inside the fleet."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

from bench.sim.engine import Engine
from bench.sim.events import ENCODINGS
from bench.sim.pod import ROLES, PodConfig, SimPod, TLSFiles
from bench.sim.profiles import LatencyProfile, get_profile, with_overrides


def parse_roles(spec: str | None, pods: int) -> list[str]:
    """``"prefill:2,decode:6"`` -> one role per pod, in order; unnamed pods get ``both``."""
    if not spec:
        return ["both"] * pods
    roles: list[str] = []
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r} in {spec!r}; roles are {ROLES}")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"bad count in role spec {part!r}") from None
        if n < 0:
            raise ValueError(f"bad count in role spec {part!r}")
        roles += [name] * n
    if len(roles) > pods:
        raise ValueError(f"role spec {spec!r} names {len(roles)} pods but the fleet has {pods}")
    return roles + ["both"] * (pods - len(roles))


@dataclass
class FleetConfig:
    """Fleet options; ports of 0 mean "any free port" (use them in tests)."""

    pods: int = 1
    profile: str = "fast"
    host: str = "127.0.0.1"
    base_port: int = 0  # pod i listens on base_port + i
    zmq_base_port: int | None = 0  # pod i: PUB zmq_base_port + 2i, replay + 2i + 1; None: no events
    roles: str | None = None
    block_size: int | None = None
    capacity_blocks: int | None = None
    model: str = "sim-model"
    kv_events_encoding: str = "map"
    topic: str = "kv"
    time_scale: float = 1.0
    default_max_tokens: int = 16
    tokenizer: str | None = None
    pull_timeout_s: float = 30.0
    error_rate: float = 0.0
    slowdown: float = 1.0
    seed: int = 0
    profile_overrides: dict[str, float] = field(default_factory=dict)  # e.g. a host calibration
    tls: TLSFiles | None = None  # every pod serves https
    auto_tool_choice: bool = True  # PodConfig's

    def latency_profile(self) -> LatencyProfile:
        return with_overrides(get_profile(self.profile), self.profile_overrides)

    def validate(self) -> None:
        if self.pods < 1:
            raise ValueError("pods must be >= 1")
        self.latency_profile()
        if self.kv_events_encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {ENCODINGS}")
        if self.time_scale <= 0 or self.slowdown <= 0:
            raise ValueError("time_scale and slowdown must be positive")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.capacity_blocks is not None and self.capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        parse_roles(self.roles, self.pods)
        if self.tls is not None:
            try:
                self.tls.server_context()
            except OSError as e:  # ssl.SSLError is one; a missing file is FileNotFoundError
                raise ValueError(f"TLS certificate/key/client CA: {getattr(e, 'reason', None) or e}") from None

    def pod_config(self, i: int, role: str) -> PodConfig:
        def port(base: int | None, offset: int) -> int | None:
            return None if base is None else (base + offset if base else 0)

        return PodConfig(
            index=i,
            host=self.host,
            port=port(self.base_port, i) or 0,
            model=self.model,
            profile=self.latency_profile(),
            role=role,
            block_size=self.block_size,
            capacity_blocks=self.capacity_blocks,
            time_scale=self.time_scale,
            zmq_port=port(self.zmq_base_port, 2 * i),
            replay_port=port(self.zmq_base_port, 2 * i + 1),
            topic=self.topic,
            kv_events_encoding=self.kv_events_encoding,
            default_max_tokens=self.default_max_tokens,
            tokenizer=self.tokenizer,
            pull_timeout_s=self.pull_timeout_s,
            error_rate=self.error_rate,
            slowdown=self.slowdown,
            seed=self.seed,
            tls=self.tls,
            auto_tool_choice=self.auto_tool_choice,
        )


class Fleet:
    """``async with Fleet(FleetConfig(pods=4)) as fleet: fleet.pods[0].url ...``"""

    def __init__(self, config: FleetConfig | None = None, **overrides: Any) -> None:
        cfg = config or FleetConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.config.validate()
        roles = parse_roles(self.config.roles, self.config.pods)
        self.pods = [SimPod(self.config.pod_config(i, r), peers=self._peer) for i, r in enumerate(roles)]

    def _peer(self, engine_id: str) -> Engine | None:
        for p in self.pods:
            if p.engine_id == engine_id:
                return p.engine
        return None

    def pod(self, address_or_engine_id: str) -> SimPod | None:
        for p in self.pods:
            if address_or_engine_id in (p.address, p.engine_id, p.url):
                return p
        return None

    async def start(self) -> None:
        try:
            for p in self.pods:
                await p.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for p in self.pods:
            with contextlib.suppress(Exception):
                await p.stop()

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def describe(self) -> list[dict[str, Any]]:
        """What each pod listens on (also the --ready-file JSON)."""
        return [p.info() for p in self.pods]

    def stats(self) -> dict[str, Any]:
        pods = [p.stats() for p in self.pods]
        keys = (
            "requests",
            "finished",
            "failed",
            "busy_s",
            "prefix_queries_tokens",
            "prefix_hits_tokens",
            "external_hits_tokens",
            "prompt_tokens",
            "generation_tokens",
            "preemptions",
            "transfers",
        )
        total = {k: sum(s[k] for s in pods) for k in keys}
        q = total["prefix_queries_tokens"]
        total["prefix_hit_rate"] = total["prefix_hits_tokens"] / q if q else 0.0
        return {"pods": pods, "total": total}

    async def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no pod has running, waiting or transferring requests."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(p.engine.running or p.engine.waiting or p.engine.transferring for p in self.pods):
            if loop.time() > deadline:
                raise TimeoutError("fleet did not go idle")
            await asyncio.sleep(0.005)
