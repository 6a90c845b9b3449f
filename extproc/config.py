"""Typed configuration: a YAML file (``--config``) and/or quick-start flags.

Every field has a sane default so ``kvroute serve --endpoints a,b`` works with no file at all.
Validation errors are turned into one readable line per problem that names the field.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from extproc.conversation import PodFlags
from extproc.errors import ConfigError
from extproc.keys import CHARS_PER_TOKEN

Role = Literal["both", "prefill", "decode"]
Scheme = Literal["http", "https"]  # how kvroute itself reaches a pod
# routing.hold: less prefill than this queued ahead on a pod is a step in progress, not worth a wait.
HOLD_MIN_AHEAD_S = 0.005


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_address(value: str) -> tuple[str, int]:
    """``ip:port`` (IPv6 as ``[::1]:port``) → (ip, port); raises ValueError with a readable reason."""
    host, sep, port_s = value.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not ip:port")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address (Envoy matches pods by IP)") from None
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"{value!r}: port must be 1..65535")
    return host, int(port_s)


class EndpointConfig(_Strict):
    """One vLLM pod: written in the config (static), in an endpoints file, or made from a Kubernetes pod."""

    address: str = Field(description="ip:port of the vLLM pod, as Envoy will dial it")
    role: Role = "both"
    kv_events: str | None = Field(default=None, description="the pod's ZMQ KV-event PUB address, tcp://ip:port")
    kv_replay: str | None = Field(default=None, description="the pod's ZMQ replay ROUTER address, tcp://ip:port")
    cluster: str | None = Field(
        default=None, description="Envoy cluster that reaches only this pod (cluster mode); default ep_<ip>_<port>"
    )
    metrics: str | None = Field(default=None, description="ip:port of the pod's /metrics; default: address")
    model: str | None = Field(default=None, description="the model the pod serves; set: only that model's requests")
    cache_bucket: str | None = Field(default=None, description="the pod's cache bucket (survives pod rebuilds)")
    ready: bool = Field(default=True, description="false: draining (no new requests, in-flight ones finish)")
    uid: str | None = Field(default=None, description="the pod's identity (Kubernetes UID): a new one is a restart")
    scheme: Scheme | None = Field(
        default=None, description="how kvroute reaches the pod (scrapes, prefill legs); default: https with pods.tls"
    )

    @field_validator("address", "metrics")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None:
            return None
        parse_address(v)
        return v.strip()

    @property
    def cluster_name(self) -> str:
        if self.cluster:
            return self.cluster
        host, port = parse_address(self.address)
        return "ep_" + host.replace(".", "_").replace(":", "_") + f"_{port}"


class PoolConfig(_Strict):
    endpoints: list[EndpointConfig] = Field(
        default=[], description="static discovery: the pool's pods (at least one); other providers fill it"
    )
    cluster: str | None = Field(default=None, description="Envoy cluster for the whole pool (cluster mode)")

    @model_validator(mode="after")
    def _unique(self) -> PoolConfig:
        seen = [e.address for e in self.endpoints]
        dup = {a for a in seen if seen.count(a) > 1}
        if dup:
            raise ValueError(f"duplicate endpoint address(es): {', '.join(sorted(dup))}")
        return self


class PDConfig(_Strict):
    """Prefill/decode disaggregation for a model (or for every model, at the top level)."""

    disaggregation: Literal["never", "always", "conditional"] = "never"
    # conditional: split only when the prompt tokens the chosen decode pod does not hold reach this
    # (the rule llm-d and Dynamo converged on; Dynamo's default is 1000) and the prefill pool has room.
    threshold_tokens: Annotated[int, Field(ge=0)] = 1000
    handoff: Literal["gateway", "sidecar", "cluster"] = Field(
        default="gateway",
        description="gateway: kvroute runs the prefill leg itself; sidecar: x-prefiller-host-port for the "
        "decode pod's sidecar (llm-d); cluster: steer two-stage clients to the prefill/decode Envoy cluster",
    )
    max_split_delay_s: Annotated[float, Field(ge=0)] = Field(
        # 0.25 s: time to first token a split may cost to spare the decode pod's streams a long
        # prefill. At 0.05 s a prefill pool busy 40 % of the time sent a quarter of the documents to
        # decode pods and ITL p99 went from 13 to 118 ms, for 5 % lower TTFT p99 (bench/RESULTS.md).
        default=0.25,
        description="conditional: split only if the prefill pod should finish the prefill (plus the KV "
        "hand-off) at most this much later than the decode pod could itself (both queues estimated from "
        "what kvroute sent them, priced by routing.cost): a busy prefill pool does not hold long "
        "prompts hostage; the cap on split_delay_per_stall's allowance",
    )
    split_delay_per_stall: Annotated[float, Field(ge=0)] = Field(
        # 0.05: a 12k-token document on a pod with 10 streams stalls them ~3.3 stream-seconds, worth
        # up to 0.17 s of its own first token; a 300-token chat there, 0.3 ms.
        default=0.05,
        description="conditional: time to first token a split may cost per second of stall it spares the "
        "decode pod's streams (the local prefill's estimated seconds × requests in flight there), at most "
        "max_split_delay_s; set it high (e.g. 1000) for the flat max_split_delay_s",
    )
    ttft_target_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="conditional: a time-to-first-token objective (s). When the decode pod's own prefill "
        "should meet it, a split may take what is left of it and no more (estimated: the prefill pod's "
        "queue + prefill + hand-off): every split that keeps the target is taken, spare the decode pod's "
        "streams, none that would miss it is; when a local prefill misses it too, split_delay_per_stall "
        "decides. Unset: split_delay_per_stall alone",
    )
    transfer_s_per_token: Annotated[float, Field(ge=0)] = Field(
        default=3e-6,
        description="conditional: what a split costs on top of the prefill, per prompt token the decode pod "
        "pulls: the KV hand-off before its first token (~128 KiB a token for an 8B model over ~47 GB/s "
        "of NIXL/RDMA is ~2.8 us)",
    )
    split_overhead_s: Annotated[float, Field(ge=0)] = Field(
        default=0.02,
        description="conditional: what a split adds to the first token whatever the prompt's length: the "
        "prefill leg's round trip and the decode pod's admission of the pulled request (compare "
        "local_ttft_ms + split_delay_ms in the debug log with measured TTFTs to tune it)",
    )
    prefill_step_tokens: Annotated[int, Field(ge=0)] = Field(
        # 8192: the h100-llama8b profile's max_num_batched_tokens (sourced in bench/sim/profiles.py).
        default=8192,
        description="gateway: the prefill pods' vLLM max_num_batched_tokens. kvroute sends a prefill pod "
        "legs first come first served, only while those in flight there fit one engine step (a longer "
        "leg runs alone; a leg of 1/8 of it or less joins a longer one at once): a document sent beside "
        "another would stretch the earlier one's last chunk to a full step (chunked prefill fills the "
        "budget oldest first). 0: no pacing",
    )
    redirect_decode: bool = Field(
        default=True,
        description="gateway, EPP mode: when the prefill leg returns, move the request to a fallback decode "
        "pod that carries fewer requests if the one picked before the leg has since taken local prefills "
        "that would hold the KV pull back (by more than split_overhead_s)",
    )
    prefill_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0, description="gateway: a prefill leg's deadline, its wait for the pod included"
    )
    prefiller_header: str = "x-prefiller-host-port"
    prefill_cluster: str = "prefill"
    decode_cluster: str = "decode"
    client_kv_transfer_params: Literal["reject", "allow"] = Field(
        default="reject",
        description="a client-sent kv_transfer_params could make a pod pull KV from anywhere: reject "
        "(400) unless the path in front of kvroute is trusted (two-stage clients in cluster handoff)",
    )

    def handoff_s(self, pulled_tokens: int) -> float:
        """What a split adds after its prefill: the decode pod's KV pull and the fixed overhead."""
        return pulled_tokens * self.transfer_s_per_token + self.split_overhead_s


class ModelConfig(_Strict):
    pool: str
    enforce_fraction: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="overrides rollout.enforce_fraction for this model's requests"
    )
    pd: PDConfig | None = Field(default=None, description="overrides the top-level pd for this model")
    tokenizer: Path | None = Field(
        default=None, description="HF model dir (tokenizer.json + chat template): token-exact precise keys"
    )
    block_size: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        default=None, description="the pods' KV block size in tokens; default: scraped cache_config_info, else 16"
    )
    chat_template: Path | None = Field(
        default=None, description="the pods' --chat-template file, when they render with it rather than the tokenizer's"
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        default="auto",
        description="the pods' --chat-template-content-format: how messages' content reaches the chat template "
        "(auto: read from the template, as vLLM does)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="the pods' --default-chat-template-kwargs (e.g. {enable_thinking: false}): rendered under "
        "each request's own chat_template_kwargs",
    )
    exclude_tools_when_tool_choice_none: bool = Field(
        default=False, description="the pods' --exclude-tools-when-tool-choice-none"
    )
    anthropic_disabled_thinking_effort: Literal["auto", "none", "low", "medium", "high", "xhigh", "max"] = Field(
        default="auto",
        description="the pods' --anthropic-disabled-thinking-effort (auto: found from the template, as vLLM does)",
    )

    def pod_flags(self) -> PodFlags:
        """How this model's pods render chats (extproc/conversation.py)."""
        return PodFlags(
            self.chat_template_content_format,
            dict(self.chat_template_kwargs),
            self.exclude_tools_when_tool_choice_none,
            self.anthropic_disabled_thinking_effort,
        )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_dir(cls, v: Path | None) -> Path | None:
        if v is not None and not (Path(v) / "tokenizer.json").is_file():
            raise ValueError(f"{v}: no tokenizer.json there")
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, v: Path | None) -> Path | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"{v}: no such file")
        return v


class HeadersConfig(_Strict):
    tenant: str = "x-tenant-id"
    route_id: list[str] = ["x-route-id", "x-session-id"]
    # Body fields read as the route id when no route-id header is set, e.g. OpenAI's prompt_cache_key, which
    # Codex sets to its conversation's id. Off by default: clients may share one key among many conversations
    # (OpenAI's API spreads a key past ~15 requests a minute), and a route id pins every request bearing it.
    route_id_fields: list[str] = []
    request_id: str = "x-request-id"
    destination: str = "x-gateway-destination-endpoint"
    cluster: str = "x-kvroute-cluster"
    objective: str = "x-gateway-inference-objective"
    priority: str = "x-kvroute-priority"
    # A per-request time-to-first-token objective in ms (GIE's SLO header): overrides pd.ttft_target_s.
    ttft_slo: str = "x-slo-ttft-ms"
    # Routing-relevant headers a client must never be able to set (SSRF / cache-steering).
    strip: list[str] = ["x-prefiller-host-port", "x-gateway-destination-endpoint-served", "x-kvroute-pd"]

    @field_validator("tenant", "request_id", "destination", "cluster", "objective", "priority", "ttft_slo")
    @classmethod
    def _lower(cls, v: str) -> str:
        if not v or v != v.strip() or " " in v:
            raise ValueError(f"{v!r} is not a valid header name")
        return v.lower()

    @field_validator("route_id", "strip")
    @classmethod
    def _lower_list(cls, v: list[str]) -> list[str]:
        return [h.strip().lower() for h in v if h.strip()]

    def routing_headers(self) -> list[str]:
        """Headers stripped from every client request before kvroute sets its own."""
        return sorted({self.destination, self.cluster, *self.strip})


class WeightsConfig(_Strict):
    """Scorer weights (GIE-style: named scorers, weighted sum). 0 disables a scorer."""

    prefix: Annotated[float, Field(ge=0)] = 3.0
    load: Annotated[float, Field(ge=0)] = 2.0
    queue: Annotated[float, Field(ge=0)] = 2.0
    kv_usage: Annotated[float, Field(ge=0)] = 1.0


class SaturationConfig(_Strict):
    """A pod is saturated when its queue or its KV cache is past these; when every candidate is,
    sheddable requests (negative priority) get 429 and the rest queue at the pods."""

    queue_threshold: Annotated[int, Field(ge=1)] = 8
    kv_threshold: Annotated[float, Field(gt=0, le=1)] = 0.9


class CostConfig(_Strict):
    """Cost scoring: the estimated time to first token on each pod, lowest wins —
    in-flight × per_inflight_s + the larger of waiting × per_waiting_s (scraped) and the prefills
    kvroute queued there (estimated) + the prefill of the uncached tokens (``prefill_s``). A request
    already running shares the pod's steps (continuous batching) and delays a new one a little; a
    queued one delays it by a whole prefill. Defaults: an 8B model on
    one H100."""

    per_token_s: Annotated[float, Field(gt=0)] = 20e-6
    # Attention makes long prefills superlinear: each new token attends to every token before it.
    # 1.2 ms per million (token, context token) pairs on an H100 for an 8B model puts a 12k-token
    # prefill at ~0.33 s, not the 0.24 s of per_token_s alone: an estimate 30 % short overfills the
    # pod that takes the long documents (bench/RESULTS.md).
    per_token_context_s: Annotated[float, Field(ge=0)] = Field(
        default=1.2e-9,
        description="prefill seconds per uncached token per token of context before it (attention); "
        "0 prices prefill linearly",
    )
    per_inflight_s: Annotated[float, Field(ge=0)] = 0.005
    per_waiting_s: Annotated[float, Field(ge=0)] = 0.05
    # Moving a conversation off the pod holding its history makes the fleet prefill it twice, and the
    # requests queued behind that prefill wait for it (ρ/(1-ρ) of them: 1 at load 0.5, 9 at 0.9). The
    # sweep in bench/affinity.py (0, 1, 3, 4, 6; scrape on, as deployed): 6 held the Mooncake
    # conversation trace's hit rate at sglang-router's (28.0 % at load 0.5, 27.9 % median at 0.9; 3:
    # 27.7 / 27.3 %) with the fewest follow-ups moved, multi-turn unchanged (81-82 %, 0-3 moved).
    recompute_weight: Annotated[float, Field(ge=0, le=100)] = Field(
        default=6.0,
        description="extra weight on prefilling tokens another candidate pod already holds (the fleet "
        "would do it twice); 0 ranks pods by this request's estimated TTFT alone",
    )
    # A prefill stalls every request decoding on its pod: vLLM runs its chunks in the same steps as their
    # next tokens (max_num_batched_tokens a step), so each of them waits about the prefill's time between
    # two tokens. Pricing only this request's TTFT, kvroute put long prefills beside more decodes than
    # sglang-router does, and on the Mooncake traces over 1 % of all inter-token gaps became such stalls
    # (ITL p99 0.1-0.2 s against its 0.02-0.07). Priced: this weight x the prefill there x kvroute's
    # requests in flight on the pod. Off by default (bench/RESULTS.md, Mooncake synthetic: 0.3 took the ITL
    # p99 1.2-6.5x lower, to within 1.7x of sglang-router's or below, at up to +8 % TTFT p90 in the cells
    # tried; the grid is measured without it).
    decode_stall_weight: Annotated[float, Field(ge=0, le=100)] = Field(
        default=0.0,
        description="extra weight on the stall a prefill puts on the requests decoding on its pod: this weight "
        "x the request's own prefill there x kvroute's requests in flight on it; 0 prices this request's "
        "TTFT alone",
    )

    # A new conversation on a shared system prompt or document (a request that branches off a cached
    # prefix rather than continuing its own history: index/ends.py) joins the prefix's pods by the
    # pricing above, every time: the prefix's tokens are priced as recompute on every other pod, so a
    # fleet with fewer hot prefixes than pods idles the rest, and a coding agent's tools and system prompt
    # (one prefix for every session) put every session on the pod that served the first: 96 requests of
    # the agentic workload all on one of 4 pods, its replies decoding in one batch (inter-token 19 ms against
    # 7 ms spread; bench/RESULTS.md). Its requests in flight are decode streams that stay for the
    # conversations' turns, while a copy of the prefix elsewhere is paid once: such a request skips a
    # holding pod that has taken more than this factor times its fair part (1 / pods) of its pool's recent
    # requests while another pod has taken under a quarter of its fair part (scheduling/filters.py,
    # ROOM_SHARE) and has fewer requests in flight (an idle holder serves the prefix from its cache at once):
    # the copy goes to a pod left without work, not onto another prompt's home (4 system prompts on 4 pods:
    # every pod has taken its part, nothing moves). The test it replaces (the holder's extra
    # requests in flight x per_inflight_s against a prefill of the prefix) never fired on the agent's 5k-token
    # prefix: 23 more streams than an idle pod.
    branch_copy_factor: Annotated[float, Field(ge=0, le=100)] | None = Field(
        default=1.0,
        description="a new conversation on a shared cached prefix skips a pod holding it that has taken more "
        "than this many times its fair part of the pool's recent requests while a pod with fewer requests in "
        "flight has taken almost none (the prefix gets a copy there); null: never (priced like any request)",
    )

    # The pods left without a share (ROOM_SHARE) go to the first prefixes that branch: on the grid's multi-turn
    # cell on 8 pods (4 system prompts) the opening's first 8 requests, on 3 of the prompts, copied two of them
    # to a third pod each before the 4th prompt came, which then needed two homes of its own: 10-11 homes where
    # 8 do, each a 1k-token prefill (0.3 points of hit rate against sglang-router's, bench/RESULTS.md).
    branch_fair_homes: bool = Field(
        default=True,
        description="with branch_copy_factor: a shared prefix is copied to a pod left without a share only "
        "while it has fewer homes than the pods over the distinct prefixes recent new conversations branched "
        "off (4 system prompts on 8 pods: 2 each; one agent prompt: every pod); false: whenever one has room",
    )

    # ROOM_SHARE alone (room: a pod under a quarter of its fair part) only spreads the opening: once every
    # pod has taken some requests, a prompt whose first conversation came late keeps all of its own on its
    # first pod. On the grid's multi-turn cell on 8 pods at 0.9 (4 system prompts, 48 conversations opened
    # in 0.76 s) the last prompt's 12 landed on one pod with 3 others (15 homes against 4-6 elsewhere), where
    # the tail queued (bench/RESULTS.md). Room is also a pod this many fair parts below the busiest holder's
    # share, where the holder has more requests in flight than it by the copy's prefill at per_inflight_s each
    # (a 1k-token system prompt: ~4 requests; an 8k-token document: ~40, so documents keep their pods).
    branch_room_gap: Annotated[float, Field(gt=0, le=100)] | None = Field(
        default=0.5,
        description="with branch_copy_factor: a pod also has room for a copy of a shared prefix when its share of "
        "the pool's recent requests is this many fair parts (1 / pods) below the busiest pod holding the prefix, "
        "and that pod has more requests in flight than it by the copy's prefill (at per_inflight_s each); null: "
        "only a pod under a quarter of its fair part has room",
    )

    # Replicas sharing state decide at the same moment on the same view: each sends its request to
    # the cheapest pod, unaware of the others' (their records arrive a flush later), and requests
    # that arrive together queue behind each other there. Pods within peer_spread × this request's
    # own prefill estimate of the cheapest count as equal and the request's hash picks among them,
    # as least-loaded routing with stale load should (random among near-equals): a long prompt,
    # whose collision costs most, spreads widest; a short one or a cached follow-up stays greedy. On
    # the Mooncake conversation trace (3 s timestamps: a bucket's requests arrive together) three
    # replicas put 58 simultaneous pairs on one pod where one replica put 18 (bench/RESULTS.md).
    peer_spread: Annotated[float, Field(ge=0, le=10)] = Field(
        default=0.25,
        description="with peer replicas: pods whose estimated cost is within this share of the request's "
        "own prefill estimate of the cheapest are picked among by the request's hash (0: always the "
        "cheapest); unused by a replica alone",
    )

    def prefill_s(self, uncached: float, cached: float = 0.0) -> float:
        """Estimated seconds to prefill ``uncached`` tokens after ``cached`` tokens already in KV."""
        return uncached * (self.per_token_s + self.per_token_context_s * (cached + uncached / 2))


class HoldConfig(_Strict):
    """Holding a long prompt in kvroute until the prefills queued ahead of it on its pod are done.

    vLLM runs a step's running requests first, then admits waiting ones into what is left of the step's
    token budget (max_num_batched_tokens). A long prompt sent to a pod that is prefilling fills that
    prefill's last step with its own first chunk, and the request that came first waits for it: on an
    H100 with 8192 tokens a step an 8k-token prompt's first token came ~0.2 s late, twice its time
    alone, and a chat's 0.1-0.15 s instead of 0.03 (the grid's shared-prefix cells, bench/RESULTS.md).
    Held until the queue ahead is done (kvroute's estimate, the one cost scoring prices), the long
    prompt starts about when it would have anyway, the pod being busy, and the earlier ones keep their
    time. Prompts of at most an eighth of a step are never held: beside a prefill they cost it little
    (the gateway P/D legs are paced alike, pd.prefill_step_tokens).

    A hold is as long as routing.cost says the prefills ahead take, in seconds, so cost scoring's
    per_token_s and per_token_context_s should fit the pods (their defaults: an 8B model on one H100, as
    the bench's simulated pods). Cost scoring only compares pods, and a figure off by a factor ranks them
    alike; a hold too long keeps the pod idle that long. Pods measured prefilling faster than routing.cost
    prices them (kvroute_cost_model_fit over 1.1, from the scraped /metrics) are held for at that pace
    (``hold_s``'s ``pace``, CapacityTracker.hold_pace); slower ones are not held for longer (a hold too
    short lands the prompt in the last step ahead, as without holding). So by default kvroute holds where it
    scrapes the pods (``on``): a misfit then costs only the seconds before the pace is measured (8 first
    tokens), where without scraping it would cost every hold."""

    enabled: bool | None = Field(
        default=None,
        description="hold long prompts until the prefills queued ahead of them on their pod should be done; "
        "null (default): where scrape.enabled (the pods' measured pace bounds a routing.cost that misprices them)",
    )
    step_tokens: Annotated[int, Field(ge=1)] = Field(
        # 8192: the h100-llama8b profile's max_num_batched_tokens (sourced in bench/sim/profiles.py).
        default=8192,
        description="the pods' vLLM max_num_batched_tokens: a request is held when its uncached prompt is "
        "over an eighth of it and prefills are queued ahead of it on its pod",
    )
    # An estimate off by a share is off by that share of each whole prefill queued ahead, however little of
    # it is left. Let go early, the request lands in the last step of the prefill ahead, which then waits a
    # whole step (as without holding); late, it waits the lateness, the pod idle meanwhile. The default cost
    # figures price an 8k-token prompt at 0.21 s where the h100-llama8b profile's two steps take 0.23
    # (bench/sim/profiles.py): 0.1 and 0.2 side by side on the grid's shared-prefix cell at load 0.9, TTFT
    # p99 0.36-0.37 s and 0.41 s, 0.50 without holding (bench/RESULTS.md, routing.hold).
    margin: Annotated[float, Field(ge=0, le=2)] = Field(
        default=0.1,
        description="hold this share of the queued prefills' whole estimates longer than they are estimated to take",
    )
    # Envoy passes a request on unrouted when its answer comes past the filter's timeout: a held answer asks
    # ext_proc to wait the hold + 1 s (override_message_timeout, honoured up to max_message_timeout: 120 s
    # in kvroute envoy-config's configs, which refuses a config holding longer; unset elsewhere, so then
    # message_timeout, 200 ms by Envoy's default), and an ext_authz Check waits its timeout.
    max_s: Annotated[float, Field(gt=0, le=30)] = Field(
        default=1.0,
        description="the longest a request is held (s); under what Envoy waits for the answer (ext_proc's "
        "max_message_timeout less 1 s where set, else its message_timeout; an ext_authz Check's timeout)",
    )

    def on(self, scraping: bool) -> bool:
        """Whether prompts are held, with the pods' /metrics scraped or not (``enabled`` null: where they are)."""
        return scraping if self.enabled is None else self.enabled

    def holds(self, uncached_tokens: int, scraping: bool) -> bool:
        """A prompt this long may be held (more than an eighth of a step to prefill), holding ``on``."""
        return uncached_tokens * 8 > self.step_tokens and self.on(scraping)

    def hold_s(self, ahead_s: float, whole_s: float | None = None, reserved_s: float = 0.0, pace: float = 1.0) -> float:
        """How long to hold a long prompt: ``ahead_s`` of prefill queued ahead of it, made of prefills
        estimated ``whole_s`` in all (default ``ahead_s``), lengthened by the margin; or ``reserved_s``, the
        time left until the long prompts sent there before should be done, margin included, if later.
        ``pace``: the pods take this share of each estimate (at most 1): of the ``whole_s`` queued, the
        queue ran ``whole_s - ahead_s`` in real seconds already, and the rest takes ``pace * whole_s`` less that."""
        whole = ahead_s if whole_s is None else whole_s
        queued = ahead_s - (1.0 - pace) * whole + self.margin * pace * whole
        wait = queued if queued > reserved_s else reserved_s
        return 0.0 if wait < HOLD_MIN_AHEAD_S else min(wait, self.max_s)


class BucketsConfig(_Strict):
    """Cache-bucket routing (extproc/scheduling/buckets.py): keys map to the pods' cache buckets by
    bounded-load rendezvous hashing over bucket names, then to a pod in the bucket; a pod rebuilt in
    its bucket takes the bucket's keys back. Only pools whose pods carry a cache bucket use it."""

    enabled: bool = False
    # A bucket may carry this much more than its pods' fair share of in-flight requests before a key
    # spills to its next bucket.
    load_factor: Annotated[float, Field(ge=0, le=10)] = 0.25
    slack: Annotated[int, Field(ge=0)] = 2  # in flight above the cap at low load (keeps keys home)
    key_blocks: Annotated[int, Field(ge=1, le=1024)] = Field(
        default=1, description="leading blocks that name a prompt's bucket (a route/session id wins)"
    )


class RoutingConfig(_Strict):
    # 256 characters ≈ 64 tokens per block: fine enough to tell prefixes apart, coarse enough that
    # hashing + matching an 8k-token chat costs ~0.1 ms. 1024 blocks ≈ the first 64k tokens: a
    # cached conversation history is credited in full (at 256 blocks a 20k-token history counted
    # as 16k at most and, with attention priced, load outweighed it: hit rate 22-23 % vs 29 % at
    # 1024 on the Mooncake conversation trace, bench/RESULTS.md); hashing grows with the prompt.
    block_chars: Annotated[int, Field(ge=8, le=4096)] = 256
    # Prompt characters per token when the tokens are not known (no tokenizer configured): sizes the
    # prefill work in cost scoring and the P/D decision. ~4 for English with Llama-3/GPT tokenizers;
    # ~1-2 for Chinese or Japanese; measure yours as prompt characters / usage.prompt_tokens.
    chars_per_token: Annotated[float, Field(ge=0.5, le=32)] = CHARS_PER_TOKEN
    max_blocks: Annotated[int, Field(ge=1, le=8192)] = 1024
    index_capacity_blocks: Annotated[int, Field(ge=16)] = 31_250
    # A pod's approximate index remembers what its KV cache holds, in approximate blocks (block_chars /
    # chars_per_token tokens each): the pod's scraped cache_config_info (num_gpu_blocks × block_size)
    # when known, else this, else index_capacity_blocks. Remembering more credits evicted prefixes.
    index_capacity_tokens: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="KV tokens one pod caches, for the approximate index when /metrics does not say "
        "(scrape disabled, or no vllm:cache_config_info); null: index_capacity_blocks",
    )
    route_table_size: Annotated[int, Field(ge=16)] = 100_000
    # Bounded load (no pod above ⌈(1+ε)·mean⌉ + slack in flight) guards weighted scoring, whose min-max
    # load scores cannot tell a pod with a long queue from one a request ahead. Cost scoring prices
    # in-flight work in seconds, and there the bound only pushed conversations off the pods holding
    # their history once a pod held more of them than its share: on the grid's cells (bench/RESULTS.md,
    # "Bounded load under cost scoring") lifting it raised the hit rate to the ideal (multi-turn on 8
    # pods 79.9-80.2 -> 81.8 %) at the same TTFT or better. Saturation (below) still takes full pods out.
    load_epsilon: Annotated[float, Field(ge=0, le=10)] | None = Field(
        default=None,
        description="bounded load: no pod above ceil((1 + eps) * mean in-flight) + load_slack; null: 0.5 "
        "with weighted scoring, no bound with cost scoring (which prices the pods' in-flight work)",
    )
    load_slack: Annotated[int, Field(ge=0)] = 2
    fallback_endpoints: Annotated[int, Field(ge=1, le=16)] = 3
    # cost won the side-by-side runs (bench/RESULTS.md "Scoring"): multi-turn hit rate 80.1% vs 71.8%
    scoring: Literal["weighted", "cost"] = "cost"
    weights: WeightsConfig = WeightsConfig()
    cost: CostConfig = CostConfig()
    saturation: SaturationConfig = SaturationConfig()
    buckets: BucketsConfig = BucketsConfig()
    hold: HoldConfig = HoldConfig()
    max_token_blocks: Annotated[int, Field(ge=1, le=65536)] = 4096

    @property
    def bounded_load_epsilon(self) -> float | None:
        """The bound's ε in force: ``load_epsilon``, or its default for the scoring (None: no bound)."""
        if self.load_epsilon is not None:
            return self.load_epsilon
        return 0.5 if self.scoring == "weighted" else None


class KVEventsConfig(_Strict):
    """Subscribe to the pods' vLLM KV events: the precise index knows what each pod really caches."""

    enabled: bool = False
    port: Annotated[int, Field(gt=0, lt=65536)] | None = Field(
        default=5557, description="PUB port on each pod's IP when an endpoint sets no kv_events address"
    )
    replay_port: Annotated[int, Field(gt=0, lt=65536)] | None = Field(
        default=5558, description="replay ROUTER port on each pod's IP when an endpoint sets no kv_replay"
    )
    topic: str = ""
    capacity_blocks: Annotated[int, Field(ge=1024)] = Field(
        default=1_000_000,
        description="slots of the precise index's block tables (the KV blocks it can know of, all pods together): "
        "53 bytes each, written at startup so they are resident from the start (1,000,000: 53 MB)",
    )
    speculative_ttl_s: Annotated[float, Field(ge=0)] = 2.0
    batch_window_s: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.02,
        description="the pods' event batches are taken in together: the first after a quiet spell starts a "
        "window this long, then every pod's queued batches are applied (one wake-up, warm caches); the index "
        "learns of a block up to this much later (what kvroute routed there counts meanwhile). 0: at once",
    )


class ScrapeConfig(_Strict):
    """Poll each pod's vLLM /metrics for queue, running and KV-cache use."""

    enabled: bool = False
    interval_s: Annotated[float, Field(gt=0)] = 0.1
    timeout_s: Annotated[float, Field(gt=0)] = 0.5
    stale_after_misses: Annotated[int, Field(ge=1)] = 3
    max_age_s: Annotated[float, Field(gt=0)] = 1.0
    purge_after_refusals: Annotated[int, Field(ge=1)] = Field(
        default=2,
        description="a refused scrape (nothing listens: the pod died) makes the pod unavailable at once; this "
        "many in a row purge its index entries too (a slow or timed-out scrape never does)",
    )
    shared: bool = Field(
        default=True,
        description="with shared state (redis.url, or --workers N), each pod is scraped by one replica and its "
        "figures reach the others; a replica scrapes a pod itself when none came for 2.5 intervals",
    )


class TLSConfig(_Strict):
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = Field(default=None, description="set to require client certs (mTLS)")

    def ssl_context(self) -> ssl.SSLContext:
        """A server context with this certificate (and, with client_ca_file, client certificates required)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file is not None:
            ctx.load_verify_locations(cafile=self.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    @model_validator(mode="after")
    def _exist(self) -> TLSConfig:
        for name in ("cert_file", "key_file", "client_ca_file"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"{name}: {p} does not exist")
        # Load them as the server will, so a wrong file fails here (check-config, exit 2) with a
        # reason, not as grpc's "cannot bind" at start.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except OSError as e:  # ssl.SSLError is one
            raise ValueError(
                f"cert_file {self.cert_file} / key_file {self.key_file}: not a PEM certificate chain and its "
                f"unencrypted private key ({getattr(e, 'reason', None) or e})"
            ) from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except OSError as e:
                why = getattr(e, "reason", None) or e
                raise ValueError(f"client_ca_file {self.client_ca_file}: not PEM CA certificates ({why})") from None
        return self


class PodFieldsConfig(_Strict):
    """Where a Kubernetes pod says what kvroute needs: each name is looked up in the pod's labels, then
    its annotations. Label values cannot hold '/', so the model name defaults to an annotation."""

    role: str = Field(default="llm-d.ai/role", description="prefill | decode | both (llm-d's label); absent: both")
    model: str = Field(default="kvroute.io/model", description="the model the pod serves; absent: any model")
    cache_bucket: str = "cache-bucket"
    kv_events_port: str = Field(
        default="kvroute.io/kv-events-port", description="ZMQ KV-event PUB port; absent: kv_events.port"
    )
    kv_replay_port: str = Field(
        default="kvroute.io/kv-replay-port", description="ZMQ replay ROUTER port; absent: kv_events.replay_port"
    )
    metrics_port: str = Field(default="kvroute.io/metrics-port", description="/metrics port; absent: the serving port")
    scheme: str = Field(
        default="kvroute.io/scheme", description="http | https, how kvroute reaches the pod; absent: pods.tls says"
    )
    port: str = Field(
        default="kvroute.io/port",
        description="the pod's serving port when it is not the pool's (hostNetwork pods sharing a node); "
        "absent: the pool's target port(s)",
    )


class KubernetesPoolConfig(_Strict):
    """One kvroute pool made of the pods a label selector (or an InferencePool) picks in a namespace."""

    name: str = Field(description="the kvroute pool name (models.<m>.pool, default_pool refer to it)")
    namespace: str | None = Field(default=None, description="default: discovery.kubernetes.namespace")
    inference_pool: str | None = Field(
        default=None,
        description="an InferencePool (inference.networking.k8s.io/v1) to follow: its selector and targetPorts "
        "pick the pods, and changes to it are followed",
    )
    selector: dict[str, str] | None = Field(default=None, description="matchLabels of the pods (without a pool)")
    target_port: Annotated[int, Field(gt=0, lt=65536)] | None = Field(
        default=None, description="the pods' serving port (without an InferencePool)"
    )
    cluster: str | None = Field(default=None, description="Envoy cluster for the whole pool (cluster mode)")

    @model_validator(mode="after")
    def _source(self) -> KubernetesPoolConfig:
        if self.inference_pool is None and (not self.selector or self.target_port is None):
            raise ValueError(f"pool {self.name!r}: set inference_pool, or selector and target_port")
        if self.inference_pool is not None and (self.selector or self.target_port is not None):
            raise ValueError(f"pool {self.name!r}: inference_pool gives selector and target port; set only one")
        return self


class KubernetesDiscoveryConfig(_Strict):
    namespace: str | None = Field(
        default=None,
        description="default namespace; unset: the service account's namespace in a cluster, else the kubeconfig "
        "context's, else default",
    )
    kubeconfig: Path | None = Field(
        default=None, description="unset: in-cluster service account if present, else $KUBECONFIG or ~/.kube/config"
    )
    context: str | None = Field(default=None, description="kubeconfig context; unset: its current context")
    pools: list[KubernetesPoolConfig] = Field(min_length=1)
    pod_fields: PodFieldsConfig = PodFieldsConfig()
    backoff_initial_s: Annotated[float, Field(gt=0)] = 0.5
    backoff_max_s: Annotated[float, Field(gt=0)] = 10.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    watch_timeout_s: Annotated[int, Field(ge=1)] = Field(
        default=60,
        description="each watch's timeoutSeconds: the API server ends it then and kvroute watches on from where "
        "it was; a watch silent for this plus request_timeout_s is taken for a dead connection",
    )

    @model_validator(mode="after")
    def _unique(self) -> KubernetesDiscoveryConfig:
        names = [p.name for p in self.pools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate pool name(s): {', '.join(sorted(dup))}")
        return self


class FileDiscoveryConfig(_Strict):
    path: Path = Field(description="YAML/JSON file: {pools: {<name>: {endpoints: [<endpoint>...]}}}, re-read on change")
    poll_interval_s: Annotated[float, Field(gt=0)] = 0.5


class DiscoveryConfig(_Strict):
    """Where the pods come from: the config's own pools (static), a file, or the Kubernetes API."""

    provider: Literal["static", "file", "kubernetes"] = "static"
    file: FileDiscoveryConfig | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None

    @model_validator(mode="after")
    def _settings(self) -> DiscoveryConfig:
        if self.provider == "file" and self.file is None:
            raise ValueError("provider file needs discovery.file.path")
        if self.provider == "kubernetes" and self.kubernetes is None:
            raise ValueError("provider kubernetes needs discovery.kubernetes (pools)")
        return self


class RedisTLSConfig(_Strict):
    """TLS to Redis (a ``rediss://`` url): a private CA, and a client certificate if Redis asks for one."""

    ca_file: Path | None = Field(default=None, description="CA that signed Redis's certificate; default: the system's")
    cert_file: Path | None = Field(default=None, description="client certificate (Redis tls-auth-clients)")
    key_file: Path | None = Field(default=None, description="the client certificate's unencrypted key")
    check_hostname: bool = Field(default=True, description="Redis's certificate must name the url's host")

    @model_validator(mode="after")
    def _files(self) -> RedisTLSConfig:
        client_tls_context(self.ca_file, self.cert_file, self.key_file)
        return self


def client_tls_context(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> ssl.SSLContext:
    """A verifying TLS client context: ``ca_file`` the only trusted CAs (None: the system's), and a
    client certificate when given. ValueError naming the missing or unreadable file."""
    for name, p in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
        if p is not None and not Path(p).is_file():
            raise ValueError(f"{name}: {p} does not exist")
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except OSError as e:  # ssl.SSLError is one
        raise ValueError(f"ca_file {ca_file}: not PEM CA certificates ({getattr(e, 'reason', None) or e})") from None
    if cert_file is not None:
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except OSError as e:
            raise ValueError(
                f"cert_file {cert_file} / key_file {key_file}: not a PEM certificate chain and its unencrypted "
                f"private key ({getattr(e, 'reason', None) or e})"
            ) from None
    return ctx


class PodTLSConfig(_Strict):
    """TLS from kvroute to the pods: its /metrics scrapes and gateway prefill legs (Envoy's own
    connections to the pods are set in Envoy's config)."""

    enabled: bool = Field(
        default=True,
        description="every pod speaks https; false: only endpoints whose scheme says https (these settings apply "
        "to them)",
    )
    ca_file: Path | None = Field(
        default=None, description="CA(s) that signed the pods' certificates; default: the system's"
    )
    cert_file: Path | None = Field(default=None, description="client certificate, for pods that require one (mTLS)")
    key_file: Path | None = Field(default=None, description="the client certificate's unencrypted key")
    server_name: str | None = Field(
        default=None,
        description="the name the pods' certificates must carry (and SNI); default: the pod's IP address, which "
        "its certificate must then list (IP SAN)",
    )
    insecure_skip_verify: bool = Field(
        default=False,
        description="encrypt without checking the pods' certificates: anyone on the path can pose as a pod "
        "(testing only; logged loudly)",
    )

    @model_validator(mode="after")
    def _files(self) -> PodTLSConfig:
        if self.insecure_skip_verify and (self.ca_file is not None or self.server_name is not None):
            raise ValueError("insecure_skip_verify checks no certificate: ca_file / server_name would be ignored")
        if self.server_name is not None and (not self.server_name.strip() or " " in self.server_name):
            raise ValueError(f"server_name: {self.server_name!r} is not a host name")
        self.context()
        return self

    def context(self) -> ssl.SSLContext:
        ctx = client_tls_context(self.ca_file, self.cert_file, self.key_file)
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


class PodsConfig(_Strict):
    """How kvroute itself talks to the pods."""

    tls: PodTLSConfig | None = None


def parse_host_port(value: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (a name or an IP, IPv6 in brackets) → (host, port); ValueError naming the problem."""
    host, sep, port_s = value.strip().rpartition(":")
    if not sep or "]" in port_s:
        host, port_s = value.strip(), str(default_port)
    host = host.strip("[]")
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"{value!r} is not host:port")
    return host, int(port_s)


class RedisConfig(_Strict):
    """Shared state across kvroute replicas through Redis: routing history (the
    approximate index, precise mode's expected blocks), route-id pins, in-flight counts and
    prefill-queue estimates. Decisions read local state only; this replica's changes are written
    behind and peers' read from a shared log, so Redis being down, slow or restarted empty costs
    sharing, never a request. Unset ``url``: every process keeps its own state."""

    url: str | None = Field(
        default=None,
        description="redis://[user[:password]@]host:port/db (rediss:// for TLS); cluster mode: any node; "
        "sentinel mode: a sentinel",
    )
    mode: Literal["standalone", "cluster", "sentinel"] = "standalone"
    sentinel_master: str | None = Field(default=None, description="sentinel mode: the monitored master's name")
    sentinels: list[str] = Field(default=[], description="sentinel mode: more sentinels (host:port) than the url's")
    key_prefix: str = Field(default="kvroute:", description="prefix of every key kvroute writes: one per deployment")
    username: str | None = Field(default=None, description="ACL user; default: the url's, else Redis's default user")
    password: SecretStr | None = Field(
        default=None, description="prefer password_env, which keeps the secret out of config files"
    )
    password_env: str = Field(
        default="KVROUTE_REDIS_PASSWORD",
        description="environment variable read for the password when neither password nor the url gives one",
    )
    tls: RedisTLSConfig | None = None
    timeout_s: Annotated[float, Field(gt=0, le=10)] = Field(
        default=0.2,
        description="the longest any Redis command (connecting included) may take; past it Redis counts as down "
        "and routing goes on with local state (decisions never wait on Redis)",
    )
    flush_interval_s: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.005,
        description="write-behind: this replica's new records and load changes go out this often, one "
        "pipelined write each; also how stale peers' in-flight counts may be",
    )
    heartbeat_s: Annotated[float, Field(gt=0)] = Field(
        default=1.0, description="loads are re-sent at least this often (and Redis checked for a lost log)"
    )
    peer_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=3.0,
        description="a replica not heard from for this long (stopped, or Redis down) stops counting: its in-flight "
        "requests and prefill estimates are dropped",
    )
    retry_max_s: Annotated[float, Field(gt=0, le=5)] = Field(
        default=1.0, description="longest wait between reconnection attempts: sharing resumes this soon after Redis"
    )
    log_maxlen: Annotated[int, Field(ge=100)] = Field(
        default=20_000,
        description="the shared log (a Redis stream of batches) is trimmed to about this many: what a new replica "
        "replays to warm up, and Redis's memory bound",
    )
    ttl_s: Annotated[int, Field(ge=60)] = Field(
        default=3600, description="the shared log expires after this long without writes (an abandoned prefix)"
    )
    outbox_records: Annotated[int, Field(ge=100)] = Field(
        default=20_000, description="records kept while Redis is unreachable (oldest dropped past this), sent on return"
    )
    resync_records: Annotated[int, Field(ge=0)] = Field(
        default=5_000, description="this replica's latest records, written again when Redis comes back empty"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return None
        u = urlsplit(v.strip())
        if u.scheme not in ("redis", "rediss"):
            raise ValueError(f"{v!r}: use redis://host:port/db or rediss:// (TLS)")
        try:
            port = u.port
        except ValueError:
            raise ValueError(f"{v!r}: port must be 1..65535") from None
        if not u.hostname or port == 0:
            raise ValueError(f"{v!r}: no host" if not u.hostname else f"{v!r}: port must be 1..65535")
        if u.path.strip("/") and not u.path.strip("/").isdigit():
            raise ValueError(f"{v!r}: the database is a number (/0)")
        return v.strip()

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"{v!r}: a non-empty prefix without spaces")
        return v

    @field_validator("sentinels")
    @classmethod
    def _sentinels(cls, v: list[str]) -> list[str]:
        for s in v:
            parse_host_port(s, 26379)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RedisConfig:
        if self.url is None:
            if self.mode != "standalone" or self.sentinels:
                raise ValueError(f"mode {self.mode}: needs url")
            return self
        if self.tls is not None and not self.url.startswith("rediss://"):
            raise ValueError("tls: needs a rediss:// url")
        if self.mode == "sentinel" and not self.sentinel_master:
            raise ValueError("mode sentinel: needs sentinel_master (the master's name)")
        if self.mode == "cluster" and urlsplit(self.url).path.strip("/") not in ("", "0"):
            raise ValueError("mode cluster: Redis Cluster has database 0 only")
        if self.heartbeat_s >= self.peer_timeout_s:
            raise ValueError("heartbeat_s must be shorter than peer_timeout_s (peers would time out between beats)")
        return self

    @property
    def enabled(self) -> bool:
        return self.url is not None


class RolloutConfig(_Strict):
    """Trying kvroute on live traffic before trusting it. A shadowed request is decided (against the
    shadow arm's own routing history: where kvroute would have sent each request) but not steered:
    Envoy's own load balancing picks the pod, and the response headers tell kvroute which one. Needs
    response processing on (kvroute envoy-config --read-responses) and Envoy adding the upstream header
    (--upstream-header); per arm, kvroute_rollout_* metrics compare predicted and reported cached tokens."""

    enforce_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        default=1.0,
        description="share of route keys (conversations, by hash: all of one in or out) whose decision is "
        "enforced; the rest are shadowed. mode: shadow is 0 for every request",
    )
    upstream_header: str = Field(
        default="x-kvroute-upstream", description="the response header in which Envoy names the pod it used"
    )
    expose_upstream_header: bool = Field(
        default=False, description="leave that header on responses to clients (debugging: it shows pod addresses)"
    )

    @field_validator("upstream_header")
    @classmethod
    def _header(cls, v: str) -> str:
        if not v or v != v.strip() or " " in v:
            raise ValueError(f"{v!r} is not a valid header name")
        return v.lower()


class TenancyConfig(_Strict):
    """Tenant isolation down to vLLM: a per-tenant ``cache_salt`` (HMAC of the tenant header with a
    server-side secret) set in each request body, so the pods never share KV blocks across tenants
    (vLLM's mitigation for prefix-cache timing side channels). Restart to change."""

    cache_salt: Literal["off", "inject"] = Field(
        default="off", description="inject: set cache_salt = HMAC-SHA256(secret, tenant) in every inference request"
    )
    secret_env: str = Field(
        default="KVROUTE_CACHE_SALT_SECRET", description="environment variable holding the secret (≥ 16 bytes)"
    )
    secret_file: Path | None = Field(default=None, description="file holding the secret instead (a mounted Secret)")
    client_cache_salt: Literal["keep", "replace", "refuse"] = Field(
        default="replace",
        description="a cache_salt the client sent: keep it as it is (inject: that request is not salted by "
        "kvroute, its isolation is the client's), replace it with the tenant's (inject; off: kept), or refuse "
        "the request (400, also with cache_salt off)",
    )

    @model_validator(mode="after")
    def _secret(self) -> TenancyConfig:
        if self.cache_salt == "inject":
            self.read_secret()
        return self

    def read_secret(self) -> bytes:
        """The HMAC key; ValueError (naming where it was looked for, never its value) if absent or short."""
        if self.secret_file is not None:
            try:
                secret = Path(self.secret_file).read_bytes().strip()
            except OSError as e:
                raise ValueError(f"secret_file: cannot read {self.secret_file}: {e.strerror}") from None
            where = f"secret_file {self.secret_file}"
        else:
            secret = os.environ.get(self.secret_env, "").encode()
            where = f"environment variable {self.secret_env}"
        if len(secret) < 16:
            raise ValueError(f"cache_salt inject: {where} must hold a secret of at least 16 bytes")
        return secret


class CapacityConfig(_Strict):
    """Autoscaling signals (extproc/capacity.py): per pool and pod role, demand against one pod's
    capacity and a desired replica count (kvroute_desired_replicas). Applies live on reload."""

    enabled: bool = True
    window_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        default=30.0, description="demand is averaged over this many seconds"
    )
    trend_z: Annotated[float, Field(ge=0)] | None = Field(
        default=2.0,
        description="while the prefill rate climbs by more than this many standard errors over the window, "
        "demand is the rate now on its linear trend, not the window's mean (which lags a ramp by half the "
        "window); null: always the mean",
    )
    target_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.7, description="desired replicas keep each pod at most this busy (headroom for bursts)"
    )
    max_streams_per_pod: Annotated[int, Field(ge=1)] = Field(
        default=64, description="streams (requests in flight) one pod carries within its ITL objective"
    )
    prefill_tokens_per_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="uncached prompt tokens one pod prefills per second; unset: routing.cost's estimate at the "
        "prompt mix seen in the window",
    )
    queue_target_s: Annotated[float, Field(gt=0)] | None = Field(
        default=0.5, description="mean prefill queue wait above this: at least one pod more than are ready"
    )
    scale_down_delay_s: Annotated[float, Field(ge=0)] = Field(
        default=120.0, description="the count falls only to the highest wanted over this many seconds"
    )
    measured: bool | None = Field(
        default=None,
        description="prefill capacity measured from the pods' /metrics (uncached prompt tokens per second of "
        "prefill busy time) once measured_min_prefills are in the window; null: on when the pods are scraped; "
        "false: routing.cost's estimate. prefill_tokens_per_s, when set, wins over both",
    )
    measured_min_prefills: Annotated[int, Field(ge=1)] = Field(
        default=20, description="first tokens the role's pods must report within window_s before the measured "
        "capacity replaces routing.cost's estimate",
    )  # fmt: skip


class ServerConfig(_Strict):
    listen: str = "0.0.0.0"
    grpc_port: Annotated[int, Field(ge=0, lt=65536)] = 9002
    health_port: Annotated[int, Field(ge=0, lt=65536)] = 9003
    metrics_port: Annotated[int, Field(ge=0, lt=65536)] = 9090
    admin_port: Annotated[int, Field(ge=0, lt=65536)] = Field(
        default=0, description="the admin gRPC service (explain, endpoints; protos/kvroute/v1): 0 = off"
    )
    admin_listen: str = Field(default="127.0.0.1", description="the admin service's address (loopback by default)")
    max_body_bytes: Annotated[int, Field(ge=1024)] = 16 * 1024 * 1024
    grace_period_s: Annotated[float, Field(ge=0)] = 10.0
    max_streams: Annotated[int, Field(ge=1)] = Field(
        default=10_000, description="ext_proc streams open at once; past it a new one is refused (Envoy fails open)"
    )
    stream_idle_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0,
        description="an ext_proc stream with no message for this long is closed (Envoy abandoned it), so stuck "
        "streams cannot hold memory. Without response processing a stream is silent for its whole generation: "
        "closing it then only ends kvroute's in-flight count early (the request goes on), so keep it above the "
        "longest generation. Over ext_authz: a routed request Envoy's access log has not reported finished after "
        "this long has its pod slot released",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    event_loop: Literal["uvloop", "asyncio"] = Field(
        default="uvloop", description="the event loop kvroute serves on: uvloop spends less CPU per request "
        "(python -m bench.overhead --variants floor); asyncio: the standard library's",
    )  # fmt: skip
    tls: TLSConfig | None = None
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        default=1,
        description="ext_proc worker processes on the same port (SO_REUSEPORT) under one supervisor, sharing "
        "state (through Redis when redis.url is set, else the supervisor's relay); auto: one per CPU this "
        "process may use (its affinity and cgroup quota). Default 1: one process, no supervisor",
    )
    authz_http_port: Annotated[int, Field(ge=0, lt=65536)] = Field(
        default=0,
        description="serve Envoy's ext_authz filter over HTTP/1.1 on this port (kvroute envoy-config --api "
        "ext_authz_http): the cheapest transport, plain HTTP (no server.tls), one process (workers 1). 0 = off",
    )

    h2_port: Annotated[int, Field(ge=0, lt=65536)] = Field(
        default=0,
        description="also serve ext_proc on this port with kvroute's own HTTP/2 gRPC server (extproc/h2.py) "
        "instead of grpcio: the same protocol and answers at about half grpcio's CPU per request "
        "(bench/RESULTS.md, The transports); point Envoy's ext_proc cluster here (deploy/ does). server.tls "
        "applies. It answers ext_proc and the gRPC health check (grpc.health.v1.Health/Check, what Envoy's "
        "cluster and a gateway probe); Health/Watch, admin and ext_authz stay on grpc_port. 0 = off",
    )

    @property
    def ext_proc_port(self) -> int:
        """The port Envoy's ext_proc stream should dial: h2_port when set, else grpc_port."""
        return self.h2_port or self.grpc_port

    @model_validator(mode="after")
    def _authz_http(self) -> ServerConfig:
        if self.authz_http_port and self.tls is not None:
            raise ValueError("authz_http_port serves plain HTTP: with server.tls use the gRPC transports (ext_proc, "
                             "ext_authz)")  # fmt: skip
        if self.authz_http_port and self.workers != 1:
            raise ValueError("authz_http_port: one process only (workers 1); with workers use ext_proc")
        others = (("grpc_port", self.grpc_port), ("health_port", self.health_port),
                  ("metrics_port", self.metrics_port), ("authz_http_port", self.authz_http_port))  # fmt: skip
        same = [k for k, v in others if self.h2_port and v == self.h2_port]
        if same:
            raise ValueError(f"h2_port {self.h2_port}: the same port as {same}")
        return self


class Config(_Strict):
    # shadow: decide every request, steer none (Envoy balances); rollout.* says what is recorded.
    mode: Literal["epp", "cluster", "shadow"] = "epp"
    server: ServerConfig = ServerConfig()
    pools: dict[str, PoolConfig] = {}
    default_pool: str | None = Field(default=None, description="pool for requests naming no configured model")
    models: dict[str, ModelConfig] = {}
    unknown_model: Literal["reject", "passthrough"] = "reject"
    headers: HeadersConfig = HeadersConfig()
    routing: RoutingConfig = RoutingConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    pd: PDConfig = PDConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    rollout: RolloutConfig = RolloutConfig()
    redis: RedisConfig = RedisConfig()
    tenancy: TenancyConfig = TenancyConfig()
    capacity: CapacityConfig = CapacityConfig()
    pods: PodsConfig = PodsConfig()

    @property
    def pool_names(self) -> list[str]:
        """Every pool known before discovery runs: the config's, then the Kubernetes provider's."""
        names = list(self.pools)
        k8s = self.discovery.kubernetes
        if self.discovery.provider == "kubernetes" and k8s is not None:
            names += [p.name for p in k8s.pools if p.name not in self.pools]
        return names

    @model_validator(mode="after")
    def _refs(self) -> Config:
        provider = self.discovery.provider
        if provider == "static":
            if not self.pools:
                raise ValueError("pools: no endpoints configured (use --endpoints, a config file or discovery)")
            for name, pc in self.pools.items():
                if not pc.endpoints:
                    raise ValueError(f"pools.{name}.endpoints: a static pool needs at least one endpoint")
        elif any(pc.endpoints for pc in self.pools.values()):
            raise ValueError(f"pools: endpoints are listed here only with discovery.provider static (not {provider})")
        # A file's pools are known only once it is read: references to them are checked then.
        names = self.pool_names
        if provider != "file":
            for name, m in self.models.items():
                if m.pool not in names:
                    raise ValueError(f"models.{name}.pool: no pool named {m.pool!r} (have: {', '.join(names)})")
            if self.default_pool is not None and self.default_pool not in names:
                raise ValueError(f"default_pool: no pool named {self.default_pool!r}")
        tls = self.pods.tls
        if tls is not None and tls.enabled:
            plain = [e.address for p in self.pools.values() for e in p.endpoints if e.scheme == "http"]
            if plain:
                raise ValueError(f"pods.tls is enabled: endpoint(s) {', '.join(plain)} cannot be scheme http")
        addrs = [e.address for p in self.pools.values() for e in p.endpoints]
        dup = {a for a in addrs if addrs.count(a) > 1}
        if dup:
            raise ValueError(f"pools: endpoint(s) in more than one pool: {', '.join(sorted(dup))}")
        return self

    def enforce_fraction_for(self, model: str | None) -> float:
        """Share of this model's route keys whose decision is enforced (0 in shadow mode)."""
        if self.mode == "shadow":
            return 0.0
        m = self.models.get(model or "")
        return m.enforce_fraction if m is not None and m.enforce_fraction is not None else self.rollout.enforce_fraction

    def pd_for(self, model: str | None) -> PDConfig:
        m = self.models.get(model or "")
        return m.pd if m is not None and m.pd is not None else self.pd

    @property
    def fallback_pool(self) -> str | None:
        """Pool for models not listed: the default pool, or the only pool when there is just one."""
        if self.default_pool:
            return self.default_pool
        names = self.pool_names
        return names[0] if len(names) == 1 else None


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {loc}: {msg}")
    return "\n".join(lines)


def build_config(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read YAML (if given), deep-merge quick-start ``overrides`` on top, validate."""
    data: dict[str, Any] = {}
    source = "flags"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        data = _merge(data, overrides)
    disc = data.get("discovery")
    provider = disc.get("provider", "static") if isinstance(disc, dict) else "static"
    if "pools" not in data and provider == "static":
        raise ConfigError(f"{source}: pools: no endpoints configured (use --endpoints, a config file or discovery)")
    return build_config(data, source)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
