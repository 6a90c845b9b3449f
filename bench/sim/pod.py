"""One simulated vLLM pod: the OpenAI-compatible HTTP surface (aiohttp) over an ``Engine``.

Shapes follow vLLM's OpenAI server: errors are ``{"error": {"message", "type", "param", "code"}}``,
unknown models 404 ``NotFoundError``, streams are SSE ending in ``data: [DONE]``, usage carries
``prompt_tokens_details.cached_tokens``, ``X-Request-Id`` is echoed and becomes the request id.
Admin endpoints under ``/sim/`` inject faults and expose counters.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from bench.sim import anthropic
from bench.sim import responses as sim_responses
from bench.sim.cache import PrefixCache
from bench.sim.chat import ChatFront
from bench.sim.engine import Engine, Failed, Finished, RemoteKV, SimRequest
from bench.sim.events import KVEventPublisher
from bench.sim.metrics import PodMetrics
from bench.sim.profiles import LatencyProfile, get_profile
from bench.sim.refusals import (
    VALIDATION,
    BadRequest,
    check_list,
    check_messages,
    check_object,
    check_prompt,
    empty_chat,
    error_body,
    lax_bool,
    lax_int,
    not_an_object,
    read_json,
    refused,
)
from bench.sim.tokenizer import ChatError, Tokenizer, make_tokenizer

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
# Names the pod in every response: a client behind a router that does not say where it went (the
# peer routers) still sees which pod served it (bench/timeline.py's share of keys moved).
POD_HEADER = "X-Sim-Pod"
PeerLookup = Callable[[str], Engine | None]
KV_FAULTS = ("kv_lose", "kv_publisher_restart", "kv_replay_down")


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    client_ca: str | None = None  # set: clients must present a certificate it signed (mTLS)

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            ctx.load_verify_locations(cafile=self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass
class PodConfig:
    index: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    model: str = "sim-model"
    profile: str | LatencyProfile = "fast"
    role: str = "both"
    block_size: int | None = None  # None: the profile's
    capacity_blocks: int | None = None
    time_scale: float = 1.0
    zmq_port: int | None = 0  # None: no KV events
    replay_port: int | None = 0  # None: no replay socket
    topic: str = "kv"
    kv_events_encoding: str = "map"
    default_max_tokens: int = 16
    tokenizer: str | None = None  # path to a tokenizer.json directory; None: SimTokenizer
    kv_side_port: int | None = None  # reported as remote_port in P/D params; None: 5600 + index
    pull_timeout_s: float = 30.0
    error_rate: float = 0.0
    slowdown: float = 1.0
    seed: int = 0
    tls: TLSFiles | None = None  # serve https (vLLM's --ssl-certfile/--ssl-keyfile/--ssl-ca-certs)
    # As vLLM started with --enable-auto-tool-choice and a --tool-call-parser (an agent deployment); False: as
    # vLLM without them, a chat or Messages request whose tool_choice needs a parser is answered 400.
    auto_tool_choice: bool = True


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _err(e: BadRequest) -> web.Response:
    return _json(error_body(e.message, e.err_type, e.status, e.param), e.status)


# Where a chat request holds its output limit, first found first: an agent API's conversion writes it under the
# name vLLM's own conversion gives it (a Messages request's max_tokens is its chat's max_completion_tokens).
OUTPUT_LIMITS = {
    "openai": ("max_completion_tokens", "max_tokens"),
    "messages": ("max_completion_tokens",),
    "responses": ("max_output_tokens",),
}


def _request_model(body: dict[str, Any]) -> None:
    """The typed fields vLLM's request model refuses before anything else looks at the request (a chat or
    completion request, or the chat an agent API's request was converted into)."""
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        lax_int(body, key)
    lax_bool(body, "stream")
    check_object(body, "stream_options", model=True)
    check_object(body, "kv_transfer_params")


class SimPod:
    """A simulated vLLM server. ``start()`` binds its ports; ``peers`` resolves P/D engine ids."""

    def __init__(self, config: PodConfig, peers: PeerLookup | None = None) -> None:
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.config = c = config
        self.profile = c.profile if isinstance(c.profile, LatencyProfile) else get_profile(c.profile)
        self.block_size = c.block_size or self.profile.block_size
        self.capacity_blocks = c.capacity_blocks or self.profile.capacity_blocks
        self.max_model_len = min(self.profile.max_model_len, self.capacity_blocks * self.block_size)
        self.engine_id = str(uuid.uuid4())
        self.role = c.role
        self.tokenizer: Tokenizer = make_tokenizer(c.tokenizer)
        self.chat = ChatFront(self.tokenizer)
        self.metrics = PodMetrics(c.model, self.block_size, self.capacity_blocks)
        self.cache = PrefixCache(self.capacity_blocks, self.block_size)
        self.publisher: KVEventPublisher | None = None
        self.engine = Engine(
            self.profile,
            self.cache,
            self.tokenizer,
            self.metrics,
            None,
            engine_id=self.engine_id,
            time_scale=c.time_scale,
            pull_timeout_s=c.pull_timeout_s,
        )
        self.engine.slowdown = c.slowdown
        self.error_rate = c.error_rate
        self.down_until = 0.0
        self._rng = random.Random(c.seed * 7919 + c.index)
        self._peers = peers
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.kv_side_port = c.kv_side_port if c.kv_side_port is not None else 5600 + c.index
        self.http_requests = 0
        self.http_errors = 0

    # -- addresses -----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.config.tls else 'http'}://{self.address}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher else None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        if c.zmq_port is not None:
            self.publisher = KVEventPublisher(c.host, c.zmq_port, c.replay_port, c.topic, c.kv_events_encoding)
            self.publisher.start()
            self.engine.publisher = self.publisher
        self.engine.start()
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/messages", self._messages)
        r.add_post("/v1/responses", self._responses)
        r.add_post("/v1/completions/render", self._render_completion)
        r.add_post("/v1/chat/completions/render", self._render_chat)
        r.add_post("/tokenize", self._tokenize)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/sim/info", self._info)
        r.add_get("/sim/stats", self._stats)
        r.add_get("/sim/requests", self._requests)
        r.add_post("/sim/fault", self._fault)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        ssl_context = c.tls.server_context() if c.tls is not None else None
        site = web.TCPSite(self._runner, c.host, c.port, reuse_address=True, ssl_context=ssl_context)
        await site.start()
        server: Any = site._server  # aiohttp exposes the bound port only here (port 0)
        self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            await self.publisher.close()

    # -- faults and introspection --------------------------------------------------------------
    def fault(
        self,
        *,
        restart: bool = False,
        down_s: float = 0.0,
        stall_s: float = 0.0,
        error_rate: float | None = None,
        slowdown: float | None = None,
    ) -> None:
        if restart:
            self.engine.restart()
            self.down_until = time.monotonic() + down_s
        if stall_s > 0:
            self.engine.stall(stall_s)
        if error_rate is not None:
            self.error_rate = error_rate
        if slowdown is not None:
            self.engine.slowdown = slowdown

    def info(self) -> dict[str, Any]:
        return {
            "index": self.config.index,
            "engine_id": self.engine_id,
            "role": self.role,
            "model": self.config.model,
            "profile": self.profile.name,
            "url": self.url,
            "address": self.address,
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
            "max_model_len": self.max_model_len,
            "kv_events_endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "kv_events_encoding": self.config.kv_events_encoding,
            "kv_side_port": self.kv_side_port,
            "time_scale": self.config.time_scale,
            "faults": {
                "error_rate": self.error_rate,
                "slowdown": self.engine.slowdown,
                "stalled_s": max(self.engine.stall_until - self.engine.now(), 0.0),
                "down_s": max(self.down_until - time.monotonic(), 0.0),
            },
        }

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats
        return {
            "address": self.address,
            "role": self.role,
            "requests": s.requests,
            "finished": s.finished,
            "failed": s.failed,
            "aborted": s.aborted,
            "http_requests": self.http_requests,
            "http_errors": self.http_errors,
            "busy_s": s.busy_s,
            "steps": s.steps,
            "prefix_queries_tokens": s.prefix_queries,
            "prefix_hits_tokens": s.prefix_hits,
            "external_hits_tokens": s.external_hits,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "preemptions": s.preemptions,
            "transfers": s.transfers,
            "ttft_sum_s": s.ttft_sum_s,
            "ttft_count": s.ttft_count,
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting) + len(self.engine.transferring),
            "kv_usage": self.cache.usage,
            "cached_blocks": self.cache.num_cached,
            "kv_batches_sent": self.publisher.sent if self.publisher is not None else 0,
            "pending_pulls": len(self.engine.pending_pulls),
        }

    # -- HTTP plumbing -------------------------------------------------------------------------
    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not request.path.startswith("/sim/") and time.monotonic() < self.down_until:
            # Restarting: the port is up but nothing behind it is ready yet.
            return _json(error_body("engine is restarting", "ServiceUnavailableError", 503), 503)
        try:
            resp = await handler(request)
        except web.HTTPNotFound:
            resp = _json({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            resp = _json({"detail": "Method Not Allowed"}, 405)
        except BadRequest as e:
            resp = _err(e)
        rid = request.headers.get("X-Request-Id")
        if rid and not resp.prepared:
            resp.headers["X-Request-Id"] = rid
        if not resp.prepared:
            resp.headers[POD_HEADER] = self.address
        return resp

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = read_json(await request.read())
        if not isinstance(body, dict):
            raise not_an_object(body)
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise BadRequest(f"The model `{model}` does not exist. Valid aliases: {self.config.model}.", "model", 404,
                             "NotFoundError")  # fmt: skip
        return body

    def _prompt_tokens(self, body: dict[str, Any]) -> tuple[list[int], bool]:
        """A completion's prompt as token ids, and whether they came as ids (not text)."""
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if prompt == []:
            raise refused("You must pass at least one prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), False
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if (bad := next((t for t in prompt if t < 0 or t >= self.tokenizer.vocab_size), None)) is not None:
                raise refused(f"Token id {bad} is out of vocabulary")
            if not prompt:
                raise refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            return list(prompt), True
        raise BadRequest("the simulator serves one prompt per request (batched prompts are not supported)", "prompt")

    def _chat_tokens(self, body: dict[str, Any]) -> list[int]:
        try:
            return self.chat.tokens(body)
        except ChatError as e:
            raise BadRequest(str(e), "messages") from None

    # -- generation ----------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        received = self.engine.now()
        body = await self._body(request)
        _request_model(body)
        check_prompt(body.get("prompt"))
        tokens, ids = self._prompt_tokens(body)
        return await self._generate(request, body, tokens, chat=False, received=received, exact_length=ids)

    def _tool_choice(self, tools: Any, choice: Any) -> None:
        """vLLM's refusal of a tool choice its pod cannot parse the answer for (PodConfig.auto_tool_choice)."""
        if self.config.auto_tool_choice or not tools or choice is None or choice == "none":
            return
        if choice == "auto":
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        fn = choice.get("function") if isinstance(choice, dict) else None
        desc = f'function "{fn.get("name")}"' if isinstance(fn, dict) else f'"{choice}"'
        raise BadRequest(f"tool_choice={desc} requires --tool-call-parser to be set")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        received = self.engine.now()
        body = await self._body(request)
        messages = check_messages(body)
        check_list(body, "tools")
        _request_model(body)
        if not messages:
            raise empty_chat()
        tools = body.get("tools")
        self._tool_choice(tools, body.get("tool_choice", "auto" if tools else None))
        tokens = self._chat_tokens(body)
        return await self._generate(request, body, tokens, chat=True, received=received)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """The Messages API: a chat underneath, its answer in the API's shapes (bench/sim/anthropic.py)."""
        received = self.engine.now()
        try:
            body = await self._body(request)
            try:
                chat = anthropic.chat_request(body)
            except ChatError as e:
                raise BadRequest(str(e), err_type=VALIDATION) from None
            _request_model(chat)  # (what the conversion carried over from the body)
            self._tool_choice(chat.get("tools"), chat.get("tool_choice"))  # (as vLLM's conversion wrote them)
            return await self._generate(request, chat, self._chat_tokens(chat), chat=True, received=received,
                                        api="messages")  # fmt: skip
        except BadRequest as e:
            if e.err_type == VALIDATION:  # vLLM's request validation answers in the OpenAI shape on every path
                return _err(e)
            return _json(anthropic.error(e.message, e.err_type), e.status)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API: a chat underneath, its answer in the API's shapes (bench/sim/responses.py)."""
        received = self.engine.now()
        body = await self._body(request)
        try:
            chat = sim_responses.chat_request(body)
            _request_model(chat)  # (what the conversion carried over from the body)
            tokens = self.chat.tokens(chat, validated=False)  # vLLM builds this chat without its request model
        except ChatError as e:
            raise BadRequest(str(e), "input") from None
        except sim_responses.NotStored as e:
            raise BadRequest(str(e), "response_id", 404, "invalid_request_error") from None  # vLLM's words
        return await self._generate(request, chat, tokens, chat=True, received=received, api="responses",
                                    echo=body)  # fmt: skip

    def _max_tokens(self, body: dict[str, Any], plen: int, chat: bool, exact_length: bool, api: str = "openai") -> int:
        """The tokens to generate, as vLLM 0.32 sets them: the request's (or the default) cut to what the context
        has left after the prompt. ``exact_length``: the prompt came as token ids (text is encoded only up to
        one token past the context, so an over-long text prompt is counted as at least that). The limit is read
        under the name vLLM's refusals give it: an agent API's converted chat holds it so."""
        limit = self.max_model_len
        names = OUTPUT_LIMITS.get(api, OUTPUT_LIMITS["openai"]) if chat else ("max_tokens",)
        key = next((k for k in names if body.get(k) is not None), names[-1])
        asked = lax_int(body, key)
        if asked is not None and asked > limit:
            raise refused(f"{key}={asked} cannot be greater than max_model_len={limit}. Please request fewer output "
                          "tokens.", key, asked)  # fmt: skip
        if plen > limit:
            count = plen if exact_length else limit + 1
            qualifier = "at least " if count == limit + 1 else ""
            raise refused(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                          f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
                          "Please reduce the length of the input prompt.", "input_tokens", count)  # fmt: skip
        mt = min(limit - plen, self.config.default_max_tokens if asked is None else asked)
        if mt < 1:
            raise refused(f"max_tokens must be at least 1, got {mt}.", "max_tokens", mt)
        least = lax_int(body, "min_tokens")
        if least is not None and least < 0:
            raise refused(f"min_tokens must be greater than or equal to 0, got {least}.")
        if least is not None and least > mt:
            raise refused(f"min_tokens must be less than or equal to max_tokens={mt}, got {least}.")
        return mt

    def _remote(self, kvp: dict[str, Any]) -> RemoteKV | None:
        """A do_remote_prefill source, or None (vLLM falls back to a local prefill)."""
        eid, rid = kvp.get("remote_engine_id"), kvp.get("remote_request_id")
        blocks = kvp.get("remote_block_ids")
        if not (isinstance(eid, str) and isinstance(rid, str) and isinstance(blocks, list)):
            return None
        if isinstance(blocks, list) and blocks and isinstance(blocks[0], list):
            blocks = blocks[0]  # per-KV-group form
        peer = self._peers(eid) if self._peers else None
        if peer is None or not all(isinstance(b, int) for b in blocks) or not peer.take_pull(rid, blocks):
            log.info("pod %d: invalid remote prefill params, prefilling locally", self.config.index)
            return None
        return RemoteKV(peer, rid, list(blocks))

    async def _generate(
        self,
        request: web.Request,
        body: dict[str, Any],
        tokens: list[int],
        chat: bool,
        received: float = 0.0,
        api: str = "openai",
        echo: Mapping[str, Any] | None = None,
        exact_length: bool = False,
    ) -> web.StreamResponse:
        """``api``: the answer's shapes ("openai", "messages", "responses"); ``echo``: a Responses request as
        sent (its response repeats some of its fields); ``exact_length``: the prompt came as token ids."""
        self.http_requests += 1
        scale = self.config.time_scale * self.engine.slowdown
        api_s = self.profile.api_seconds(len(tokens)) * scale
        # The prompt is tokenized (host CPU spent) whether or not the request is then refused.
        self.engine.host_work(self.profile.host_stall_seconds(len(tokens)) * scale, api_s)
        max_tokens = self._max_tokens(body, len(tokens), chat, exact_length, api)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise refused("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        stream = bool(lax_bool(body, "stream"))
        opts = body.get("stream_options")
        if opts and not stream:
            raise refused("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(opts and opts.get("include_usage"))
        kvp = body.get("kv_transfer_params")
        prefill_only = bool(kvp and kvp.get("do_remote_decode"))
        remote = self._remote(kvp) if kvp and kvp.get("do_remote_prefill") else None
        if prefill_only:
            max_tokens = 1
        if self.error_rate > 0 and self._rng.random() < self.error_rate:
            self.http_errors += 1
            return self._failed("simulated engine error", api)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        sreq = SimRequest(rid, tokens, max_tokens, salt, prefill_only=prefill_only, remote=remote, stream_tokens=stream)
        sreq.received = received
        if kvp and kvp.get("do_remote_prefill"):
            # Set whether or not the pull goes ahead, as vLLM's output processor does.
            cached = kvp.get("remote_prefill_cached_tokens")
            if isinstance(cached, int):
                sreq.remote_prefill_cached = cached
        if api_s > 0:
            await asyncio.sleep(api_s)
        self.engine.submit(sreq)
        envelope = sim_responses.Response(echo or {}, self.config.model, max_tokens) if api == "responses" else None
        try:
            if stream:
                return await self._stream(request, sreq, chat, include_usage, api, envelope)
            return await self._complete(sreq, chat, api, envelope)
        finally:
            if not sreq.done:
                self.engine.abort(sreq)

    def _usage(self, sreq: SimRequest, chat: bool) -> dict[str, Any]:
        """A chat or completion's usage; vLLM 0.32 counts the tokens written to the cache for a chat only."""
        p, c = len(sreq.prompt), sreq.num_outputs
        return {
            "prompt_tokens": p,
            "total_tokens": p + c,
            "completion_tokens": c,
            "completion_tokens_details": None,
            "prompt_tokens_details": {"cached_tokens": self.reported_cached(sreq), "multimodal_tokens": None,
                                      "created_cache_tokens": self.created_cache(sreq) if chat else None},
        }  # fmt: skip

    @staticmethod
    def reported_cached(sreq: SimRequest) -> int:
        """usage.prompt_tokens_details.cached_tokens as vLLM 0.32 reports it: on a P/D decode leg whose
        params carry the prefill leg's hits, those (pulled KV is not a hit); else local + pulled."""
        if sreq.remote_prefill_cached is not None:
            return sreq.remote_prefill_cached
        return max(sreq.cached_tokens, 0)

    def created_cache(self, sreq: SimRequest) -> int:
        """The prompt tokens this request wrote to the prefix cache, as vLLM 0.32 counts them at its first output
        (``PrefillStats.finalize``): the prompt's full blocks less what it found cached."""
        plen = len(sreq.prompt)
        return max(0, plen // self.block_size * self.block_size - max(sreq.cached_tokens, 0))

    def _kv_params(self, sreq: SimRequest) -> dict[str, Any] | None:
        if not sreq.prefill_only or sreq.kv_transfer_params is None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": sreq.kv_transfer_params["block_ids"],
            "remote_engine_id": self.engine_id,
            "remote_request_id": sreq.request_id,
            "remote_host": self.config.host,
            "remote_port": self.kv_side_port,
            "tp_size": 1,
            "remote_prefill_cached_tokens": max(sreq.cached_tokens, 0),
        }

    def _failed(self, message: str, api: str) -> web.Response:
        if api == "messages":
            return _json(anthropic.error(message, "InternalServerError"), 500)
        return _json(error_body(message, "InternalServerError", 500), 500)

    def _anthropic_usage(self, sreq: SimRequest) -> dict[str, int]:
        return anthropic.usage(len(sreq.prompt), self.reported_cached(sreq), sreq.num_outputs, self.created_cache(sreq))

    def _responses_usage(self, sreq: SimRequest) -> dict[str, Any]:
        return sim_responses.usage(len(sreq.prompt), self.reported_cached(sreq), sreq.num_outputs,
                                   self.created_cache(sreq))  # fmt: skip

    async def _complete(
        self, sreq: SimRequest, chat: bool, api: str = "openai", envelope: sim_responses.Response | None = None
    ) -> web.Response:
        item = await sreq.out.get()  # tokens are not streamed to us: this is the outcome
        if isinstance(item, Failed):
            self.http_errors += 1
            return self._failed(str(item.error), api)
        reason = item.reason if isinstance(item, Finished) else "length"
        text = "".join(self.tokenizer.output_token(i)[1] for i in range(sreq.num_outputs))
        if api == "messages":
            rid = f"chatcmpl-{sreq.request_id}"
            return _json(anthropic.message(rid, self.config.model, text, reason, self._anthropic_usage(sreq)))
        if envelope is not None:
            return _json(envelope.whole(text, reason, self._responses_usage(sreq)))
        created = int(time.time())
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        return _json(
            {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{sreq.request_id}",
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.config.model,
                "choices": [choice],
                "usage": self._usage(sreq, chat),
                "prompt_logprobs": None,
                "kv_transfer_params": self._kv_params(sreq),
            }
        )

    async def _stream(
        self, request: web.Request, sreq: SimRequest, chat: bool, include_usage: bool, api: str = "openai",
        envelope: sim_responses.Response | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        rid_hdr = request.headers.get("X-Request-Id")
        if rid_hdr:
            resp.headers["X-Request-Id"] = rid_hdr
        resp.headers[POD_HEADER] = self.address
        await resp.prepare(request)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{sreq.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model,
        }

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

        messages = (
            anthropic.MessageStream(f"chatcmpl-{sreq.request_id}", self.config.model) if api == "messages" else None
        )
        if envelope is not None:
            await resp.write(envelope.start())
        elif chat and messages is None:
            await send(
                {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        n, texts = 0, []
        while True:
            item = await sreq.out.get()
            if isinstance(item, Failed):
                # A crashed engine cuts the connection mid-stream.
                self.http_errors += 1
                if request.transport is not None:
                    request.transport.close()
                return resp
            if isinstance(item, Finished):
                break
            n += 1
            last = n >= sreq.max_tokens
            reason = "length" if last else None
            if messages is not None:
                await resp.write(messages.token(item.text, self._anthropic_usage(sreq)))
                continue
            if envelope is not None:
                texts.append(item.text)
                await resp.write(envelope.token(item.text))
                continue
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"content": item.text},
                    "logprobs": None,
                    "finish_reason": reason,
                    "stop_reason": None,
                }
            else:
                choice = {"index": 0, "text": item.text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
            await send({**head, "choices": [choice]})
        finish = "length" if n >= sreq.max_tokens else "stop"
        if messages is not None or envelope is not None:
            if messages is not None:
                await resp.write(messages.end(finish, self._anthropic_usage(sreq)))
            elif envelope is not None:
                await resp.write(envelope.end("".join(texts), finish, self._responses_usage(sreq)))
            await resp.write_eof()
            return resp
        if include_usage:
            await send({**head, "choices": [], "usage": self._usage(sreq, chat)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- tokenization endpoints ----------------------------------------------------------------
    def _render_one(
        self, body: dict[str, Any], tokens: list[int], chat: bool, exact_length: bool = False
    ) -> dict[str, Any]:
        mt = self._max_tokens(body, len(tokens), chat, exact_length)
        return {
            "request_id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "token_ids": tokens,
            "sampling_params": {"max_tokens": mt},
            "model": self.config.model,
            "stream": bool(lax_bool(body, "stream")),
            "cache_salt": body.get("cache_salt"),
        }

    async def _render_completion(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens, ids = self._prompt_tokens(body)
        return _json([self._render_one(body, tokens, chat=False, exact_length=ids)])

    async def _render_chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return _json(self._render_one(body, self._chat_tokens(body), chat=True))

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = self._chat_tokens(body) if "messages" in body else self._prompt_tokens(body)[0]
        return _json({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None})

    # -- misc endpoints ------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        m = self.config.model
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": m,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": m,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _info(self, request: web.Request) -> web.Response:
        return _json(self.info())

    async def _stats(self, request: web.Request) -> web.Response:
        return _json(self.stats())

    async def _requests(self, request: web.Request) -> web.Response:
        """Each request's wait before its first step and its TTFT, from the HTTP handler's receipt, in wall
        seconds (``Engine.timings``), by request id (the client's X-Request-Id)."""
        return _json({"time_scale": self.config.time_scale, "requests": self.engine.timings})

    async def _fault(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            raise BadRequest("Invalid JSON body") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be an object")
        known = {"restart", "down_s", "stall_s", "error_rate", "slowdown", "clear", *KV_FAULTS}
        if set(body) - known:
            raise BadRequest(f"unknown fault keys {sorted(set(body) - known)}; known: {sorted(known)}")
        try:
            if body.get("clear"):
                self.fault(error_rate=0.0, slowdown=1.0)
                self.engine.stall_until = 0.0
                self.down_until = 0.0
            er = body.get("error_rate")
            sd = body.get("slowdown")
            self.fault(
                restart=bool(body.get("restart")),
                down_s=float(body.get("down_s", 0.0)),
                stall_s=float(body.get("stall_s", 0.0)),
                error_rate=None if er is None else min(max(float(er), 0.0), 1.0),
                slowdown=None if sd is None else max(float(sd), 1e-3),
            )
            await self._kv_fault(body)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad fault value: {e}") from None
        return _json(self.info())

    async def _kv_fault(self, body: dict[str, Any]) -> None:
        """The KV-event publisher's faults (bench/faults.py): ``kv_lose`` N batches lost for good (a
        sequence gap), ``kv_publisher_restart`` (numbering from 0 again), ``kv_replay_down``."""
        if self.publisher is None:
            if any(body.get(k) for k in KV_FAULTS):
                raise BadRequest("this pod publishes no KV events")
            return
        if body.get("kv_publisher_restart"):
            self.publisher.restart()
        if body.get("kv_lose"):
            self.publisher.lose(int(body["kv_lose"]))
        if body.get("kv_replay_down"):
            await self.publisher.close_replay()
