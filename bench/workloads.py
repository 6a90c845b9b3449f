"""Benchmark workloads: deterministic chat requests plus the ideal prefix reuse they allow.

Every workload is a list of ``Item`` (chat messages + output length, optional trace arrival) built
from a seed, so two runs (and every policy in one run) replay byte-identical requests. Text is made
of space-separated pseudo-words, which the simulator's tokenizer (``bench.sim.tokenizer``) turns
into exactly one token each, so token counts can be set precisely.

``ideal_hit_rate`` replays the prompts through one infinite cache with the simulator's own
tokenizer, block hashing and hit rule, including the blocks a pod caches while decoding (a later
chat turn that repeats an answer hits them): the ceiling for any router.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import xxhash

from bench.loadgen import RequestSpec
from bench.sim import anthropic as sim_anthropic
from bench.sim import responses as sim_responses
from bench.sim.cache import block_hashes
from bench.sim.chat import ChatFront
from bench.sim.tokenizer import SimTokenizer
from extproc import anthropic, responses
from extproc.request import CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH

MODEL = "sim-model"
TRACE_BLOCK_TOKENS = 512  # Mooncake hash_ids cover 512-token blocks
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "zo", "pe", "su", "da", "fi", "go", "hu", "je", "xa")


@dataclass(frozen=True, slots=True)
class Item:
    messages: tuple[dict[str, Any], ...]  # the chat (for a Messages request: the chat vLLM runs for it)
    max_tokens: int
    tag: str = ""
    at: float | None = None  # trace arrival (s); None: the harness draws Poisson arrivals
    body: dict[str, Any] | None = None  # the request as sent, where more than messages (tools, system blocks)
    path: str = CHAT_PATH


@dataclass
class Workload:
    name: str
    items: list[Item]
    params: dict[str, Any] = field(default_factory=dict)


def _vocab(size: int = 8192) -> tuple[str, ...]:
    rng = random.Random("bench.workloads/vocab")
    out = {" " + "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(size * 2)}
    return tuple(sorted(out))[:size]


VOCAB = _vocab()  # every word the workloads draw (bench.harness exports it as the pods' tokenizer's)


def words(rng: random.Random, n: int) -> str:
    """``n`` pseudo-words, each with a leading space: exactly ``n`` simulator tokens.

    Drawn from a fixed vocabulary so the tokenizers' memo tables stay warm (pods tokenize faster).
    """
    return "".join(rng.choices(VOCAB, k=n))


def answer_text(max_tokens: int, tok: SimTokenizer | None = None) -> str:
    """What a simulated pod answers with ``max_tokens`` (fixed filler tokens), for later chat turns."""
    tok = tok or SimTokenizer()
    return "".join(tok.output_token(i)[1] for i in range(max_tokens))


def _interleave(rng: random.Random, queues: list[list[Item]]) -> list[Item]:
    """Merge per-user/conversation queues: each round takes the next item of every live queue in a
    shuffled order, so a user's k-th request follows its (k-1)-th by about one round."""
    out: list[Item] = []
    k = 0
    while True:
        batch = [q[k] for q in queues if k < len(q)]
        if not batch:
            return out
        rng.shuffle(batch)
        out += batch
        k += 1


def shared_prefix(
    groups: int = 64,
    users: int = 4,
    questions: int = 4,
    doc_tokens: int = 8000,
    user_tokens: int = 300,
    question_tokens: int = 60,
    max_tokens: int = 32,
    seed: int = 0,
) -> Workload:
    """inference-perf style shared prefix: groups × (long document + per-user context) × questions.

    The defaults' documents (64 × 8k tokens) exceed one h100-llama8b pod's KV cache (448k tokens)
    but fit in four: a router that keeps each document on one pod hits, one that spreads it thrashes.

    One user message ``document + user context + question`` (as inference-perf's shared_prefix
    concatenates system prompt and question), so requests of a group share the document and those
    of one user also share the user context.
    """
    rng = random.Random(seed)
    docs = [words(rng, doc_tokens) for _ in range(groups)]
    queues = []
    for g in range(groups):
        for u in range(users):
            ctx = words(rng, user_tokens)
            q = [
                Item(
                    ({"role": "user", "content": docs[g] + ctx + words(rng, question_tokens)},),
                    max_tokens,
                    tag=f"g{g}u{u}",
                )
                for _ in range(questions)
            ]
            queues.append(q)
    rng.shuffle(queues)
    params = dict(
        groups=groups, users=users, questions=questions, doc_tokens=doc_tokens, user_tokens=user_tokens,
        question_tokens=question_tokens, max_tokens=max_tokens, seed=seed,
    )  # fmt: skip
    return Workload("shared-prefix", _interleave(rng, queues), params)


def multi_turn(
    conversations: int = 48,
    turns: int = 6,
    system_prompts: int = 4,
    system_tokens: int = 1000,
    user_tokens: int = 500,
    max_tokens: int = 64,
    seed: int = 0,
) -> Workload:
    """Chats whose every turn resends the whole history (system prompt, earlier questions and the
    answers the pods gave) plus a new question; a few system prompts are shared across chats."""
    rng = random.Random(seed)
    systems = [words(rng, system_tokens) for _ in range(system_prompts)]
    answer = answer_text(max_tokens)
    queues = []
    for c in range(conversations):
        history: list[dict[str, str]] = [{"role": "system", "content": systems[c % system_prompts]}]
        q = []
        for _ in range(turns):
            history.append({"role": "user", "content": words(rng, user_tokens)})
            q.append(Item(tuple(history), max_tokens, tag=f"c{c}"))
            history = [*history, {"role": "assistant", "content": answer}]
        queues.append(q)
    params = dict(
        conversations=conversations, turns=turns, system_prompts=system_prompts, system_tokens=system_tokens,
        user_tokens=user_tokens, max_tokens=max_tokens, seed=seed,
    )  # fmt: skip
    return Workload("multi-turn", _interleave(rng, queues), params)


# Claude Code's tools, as many as it sends (its own and an MCP server's), and the arguments each takes.
AGENT_TOOLS = ("bash", "read_file", "write_file", "edit_file", "glob", "grep", "list_dir", "web_fetch",
               "web_search", "todo_write", "task", "notebook_edit", "mcp_query", "mcp_schema", "mcp_tables",
               "exit_plan")  # fmt: skip
AGENT_ARGS = ("command", "path", "pattern", "content", "url", "query")
# JSON text (tools, tool calls) takes these pieces besides the workloads' words: the exported tokenizer gives
# them the built-in tokenizer's ids (bench.harness.precise_tokenizer).
JSON_WORDS = ("type", "function", "name", "description", "parameters", "object", "properties", "string",
              "required", "arguments", "id", "null", "true", "false", "strict", *AGENT_TOOLS, *AGENT_ARGS)  # fmt: skip


def tokenizer_pieces() -> list[str]:
    """Every piece the workloads' text is made of (bench.harness.precise_tokenizer exports them)."""
    punct = [chr(c) for c in range(33, 127) if not chr(c).isalnum() and chr(c) != "_"]
    return [*VOCAB, *(w.strip() for w in VOCAB), *JSON_WORDS, *(" " + w for w in JSON_WORDS), *punct,
            *(" " + p for p in punct)]  # fmt: skip


# The agentic sessions' APIs: each one's workload name and path.
AGENT_APIS = {"messages": ("agentic", MESSAGES_PATH), "chat": ("agentic-chat", CHAT_PATH),
              "responses": ("agentic-responses", RESPONSES_PATH)}  # fmt: skip


def agentic(
    sessions: int = 32,
    turns: int = 8,
    system_tokens: int = 2500,
    tool_tokens: int = 120,
    env_tokens: int = 100,
    task_tokens: int = 150,
    result_tokens: int = 400,
    max_tokens: int = 48,
    api: str = "messages",
    seed: int = 0,
) -> Workload:
    """Coding-agent sessions shaped as Claude Code sends them over the Anthropic Messages API (``api``
    "messages", ``POST /v1/messages``), the same conversations as chat requests ("chat"), or shaped as Codex
    sends them over the OpenAI Responses API ("responses", ``POST /v1/responses``: ``agentic_responses``).

    Every request carries the agent's tools (``tool_tokens`` of description each, the same for every
    session) and system prompt (``system_tokens``, shared), then the session's environment block
    (``env_tokens``); the first turn a task, each later one the assistant's last answer (the pods' text)
    with a tool call and the user's tool result (``result_tokens``: a file, a command's output). Over the
    Messages API the system's first block is Claude Code's attribution line, new every request
    (``x-anthropic-billing-header: ...; cch=<hash>``): vLLM cuts it before rendering, as kvroute does;
    a router keying the request's raw text sees a different prefix every time.
    """
    if api not in AGENT_APIS:
        raise ValueError(f"api must be one of {', '.join(AGENT_APIS)}, not {api!r}")
    name, path = AGENT_APIS[api]
    rng = random.Random(seed)
    system = words(rng, system_tokens).strip()
    tools: list[dict[str, Any]] = [{"name": name, "description": words(rng, tool_tokens).strip(),
              "input_schema": {"type": "object", "required": [arg],
                               "properties": {arg: {"type": "string", "description": words(rng, 12).strip()}}}}
             for name, arg in zip(AGENT_TOOLS, itertools.cycle(AGENT_ARGS))]  # fmt: skip
    answer = answer_text(max_tokens)  # what the pods answered, resent as it came
    queues = []
    for c in range(sessions):
        env = words(rng, env_tokens)  # vLLM joins the system blocks as they are: its first space parts it
        history: list[dict[str, Any]] = [{"role": "user", "content": words(rng, task_tokens).strip()}]
        q = []
        for _ in range(turns):
            billing = f"x-anthropic-billing-header: cc_version=2.1.3; cch={rng.getrandbits(40):010x};"
            blocks = [{"type": "text", "text": text} for text in (billing, system, env)]
            body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "tools": tools, "system": blocks,
                                    "messages": list(history)}  # fmt: skip
            if api == "responses":
                body = _codex_request(body, f"s{c}-{seed}")
                chat = responses.to_chat(body)
            else:
                chat = anthropic.to_chat(body)
            if api == "chat":
                body = {"model": MODEL, "max_tokens": max_tokens, **chat}
            q.append(Item(tuple(chat["messages"]), max_tokens, f"s{c}", body=body, path=path))
            tool, arg = rng.randrange(len(tools)), rng.choice(VOCAB).strip()
            call = {"type": "tool_use", "id": rng.choice(VOCAB).strip(), "name": tools[tool]["name"],
                    "input": {next(iter(tools[tool]["input_schema"]["properties"])): arg}}  # fmt: skip
            result = {"type": "tool_result", "tool_use_id": call["id"], "content": words(rng, result_tokens).strip()}
            history += [{"role": "assistant", "content": [{"type": "text", "text": answer}, call]},
                        {"role": "user", "content": [result]}]  # fmt: skip
        queues.append(q)
    params = dict(
        sessions=sessions, turns=turns, system_tokens=system_tokens, tool_tokens=tool_tokens, env_tokens=env_tokens,
        task_tokens=task_tokens, result_tokens=result_tokens, max_tokens=max_tokens, api=api, seed=seed,
    )  # fmt: skip
    return Workload(name, _interleave(rng, queues), params)


def agentic_chat(**kw: Any) -> Workload:
    """``agentic``'s sessions as chat requests (what the peer routers serve)."""
    return agentic(api="chat", **kw)


def agentic_responses(**kw: Any) -> Workload:
    """``agentic``'s sessions over the OpenAI Responses API, as Codex sends them (``_codex_request``)."""
    return agentic(api="responses", **kw)


def _codex_request(messages_body: dict[str, Any], conversation: str) -> dict[str, Any]:
    """A Messages request's conversation as Codex sends it over the Responses API: the system prompt as
    ``instructions`` (no attribution line: Codex sends none), the environment block as the first user item,
    each assistant turn as an output message then a ``function_call`` item (its arguments a JSON string), each
    tool result a ``function_call_output`` item; flat function tools; the conversation's id as
    ``prompt_cache_key``, ``store`` false, the output cap as ``max_output_tokens``."""
    _billing, system, env = (b["text"] for b in messages_body["system"])

    def said(role: str, kind: str, text: str) -> dict[str, Any]:
        return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}

    items = [said("user", "input_text", env.strip())]
    for m in messages_body["messages"]:
        content = m["content"]
        if isinstance(content, str):
            items.append(said(m["role"], "input_text", content))
            continue
        for block in content:
            if block["type"] == "text":
                items.append(said("assistant", "output_text", block["text"]))
            elif block["type"] == "tool_use":
                items.append({"type": "function_call", "name": block["name"], "call_id": block["id"],
                              "arguments": json.dumps(block["input"])})  # fmt: skip
            elif block["type"] == "tool_result":
                items.append({"type": "function_call_output", "call_id": block["tool_use_id"],
                              "output": block["content"]})  # fmt: skip
    tools = [{"type": "function", "name": t["name"], "description": t["description"], "strict": False,
              "parameters": t["input_schema"]} for t in messages_body["tools"]]  # fmt: skip
    return {"model": MODEL, "instructions": system, "input": items, "tools": tools, "tool_choice": "auto",
            "parallel_tool_calls": False, "store": False, "prompt_cache_key": conversation,
            "max_output_tokens": messages_body["max_tokens"]}  # fmt: skip


def no_reuse(requests: int = 400, prompt_tokens: int = 2000, max_tokens: int = 32, seed: int = 0) -> Workload:
    """Unique random prompts: no router can find a hit; shows what cache-aware routing costs."""
    rng = random.Random(seed)
    # Each request is its own session (tag): a session-hashing router spreads them.
    items = [
        Item(({"role": "user", "content": words(rng, prompt_tokens)},), max_tokens, f"r{i}") for i in range(requests)
    ]
    return Workload("no-reuse", items, dict(requests=requests, prompt_tokens=prompt_tokens, max_tokens=max_tokens))


def mixed_pd(
    requests: int = 200,
    doc_fraction: float = 0.4,
    documents: int = 24,
    doc_tokens: tuple[int, int] = (6000, 12000),
    chat_tokens: tuple[int, int] = (150, 500),
    question_tokens: tuple[int, int] = (40, 120),
    max_tokens: tuple[int, int] = (200, 500),
    seed: int = 0,
    name: str = "mixed-pd",
) -> Workload:
    """Prefill/decode interference: short chats mixed with long-document questions, long outputs.

    A fraction ``doc_fraction`` of the requests asks a question about one of ``documents`` long
    documents (6k-12k tokens; a document is drawn uniformly, so each is reused a few times, with a
    new question after it); the rest are short chats (a few hundred tokens). Every request streams
    200-500 output tokens, so many decodes are in flight when a long prefill lands on their pod:
    the case prefill/decode disaggregation is for. Tags: ``d<k>`` (document k) and ``c<i>``.
    """
    rng = random.Random(seed)
    docs = [words(rng, rng.randint(*doc_tokens)) for _ in range(documents)]
    items = []
    for i in range(requests):
        out = rng.randint(*max_tokens)
        if rng.random() < doc_fraction:
            d = rng.randrange(documents)
            content, tag = docs[d] + words(rng, rng.randint(*question_tokens)), f"d{d}"
        else:
            content, tag = words(rng, rng.randint(*chat_tokens)), f"c{i}"
        items.append(Item(({"role": "user", "content": content},), out, tag=tag))
    params = dict(
        requests=requests, doc_fraction=doc_fraction, documents=documents, doc_tokens=list(doc_tokens),
        chat_tokens=list(chat_tokens), question_tokens=list(question_tokens), max_tokens=list(max_tokens), seed=seed,
    )  # fmt: skip
    return Workload(name, items, params)


def mixed_pd_fresh(seed: int = 0) -> Workload:
    """``mixed-pd`` where long prompts are mostly new (400 documents: summarising or reviewing fresh
    documents rather than asking about a few shared ones), so prefix caching cannot remove the long
    prefills: the regime prefill/decode disaggregation is built for."""
    return mixed_pd(documents=400, seed=seed, name="mixed-pd-fresh")


class TraceText:
    """Deterministic text per Mooncake hash id: equal ids give identical ~512-token runs."""

    def __init__(self, block_tokens: int = TRACE_BLOCK_TOKENS, seed: int = 0) -> None:
        self.block_tokens = block_tokens
        self.seed = seed
        self._cache: dict[int, str] = {}

    def block(self, hash_id: int) -> str:
        text = self._cache.get(hash_id)
        if text is None:
            text = self._cache[hash_id] = words(random.Random(f"{self.seed}/{hash_id}"), self.block_tokens)
        return text

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> str:
        """Blocks in order, the last one cut so the prompt has ``input_length`` tokens."""
        parts = []
        left = input_length
        for h in hash_ids:
            if left <= 0:
                break
            b = self.block(h)
            if left < self.block_tokens:
                # Every token is one " word" piece: cut at the left-th word boundary.
                b = " ".join(b.split(" ")[: left + 1])
            parts.append(b)
            left -= self.block_tokens
        return "".join(parts)


def read_trace(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Mooncake JSONL rows (timestamp ms, input_length, output_length, hash_ids), validated."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                row = {
                    "timestamp": float(r["timestamp"]),
                    "input_length": int(r["input_length"]),
                    "output_length": int(r["output_length"]),
                    "hash_ids": [int(h) for h in r["hash_ids"]],
                }
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row ({e})") from None
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def session_key(hash_ids: Sequence[int], common: set[int]) -> int:
    """A trace row's session: its first block id that is not a fleet-wide prefix (system prompt)."""
    for h in hash_ids:
        if h not in common:
            return h
    return hash_ids[0] if hash_ids else 0


def common_ids(rows: list[dict[str, Any]]) -> set[int]:
    """Ids found at the start of more than 5% of rows: shared system prompts, not sessions."""
    counts = Counter(h for r in rows for h in r["hash_ids"][:2])
    return {h for h, c in counts.items() if c > 0.05 * len(rows)}


def sample_sessions(rows: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """Keep one session in ``every`` (whole sessions, so reuse within a session survives thinning)."""
    if every <= 1:
        return rows
    common = common_ids(rows)
    return [r for r in rows if xxhash.xxh64_intdigest(str(session_key(r["hash_ids"], common)).encode()) % every == 0]


def trace(
    path: str | Path,
    max_requests: int | None = None,
    max_output_tokens: int = 64,
    max_input_tokens: int = 30_000,
    sample: int = 1,
    seed: int = 0,
    spread: bool = False,
) -> Workload:
    """Mooncake trace replay; ``at`` keeps the trace's own times (the harness rescales them).

    ``sample`` keeps one session in N over the whole trace instead of only its first minutes (the
    head of a trace has little reuse yet). Inputs longer than ``max_input_tokens`` (the profile's
    context window) keep their leading blocks only, which preserves the prefix structure.
    ``spread``: Mooncake's traces tick every 3 s (every request of a tick has one timestamp), so a
    replay as written sends each tick's requests at one instant; spread, the requests of a tick
    arrive evenly over it in the trace's order (``tick_spread``).
    """
    all_rows = read_trace(path)
    rows = sample_sessions(all_rows, sample)[:max_requests]
    common = common_ids(all_rows)
    text = TraceText(seed=seed)
    t0 = rows[0]["timestamp"] if rows else 0.0
    items = []
    for r in rows:
        n = min(r["input_length"], max_input_tokens)
        body = text.prompt(r["hash_ids"], n)
        out = max(1, min(r["output_length"], max_output_tokens))
        tag = f"s{session_key(r['hash_ids'], common)}"  # the session: what a client would send as its id
        items.append(Item(({"role": "user", "content": body},), out, tag=tag, at=(r["timestamp"] - t0) / 1000))
    tick_s = None
    if spread:
        tick_s = trace_tick([r["timestamp"] for r in all_rows]) / 1000
        at = tick_spread([it.at or 0.0 for it in items], tick_s)
        items = [replace(it, at=t) for it, t in zip(items, at, strict=True)]
    name = Path(path).stem.removesuffix("_trace")
    params = dict(
        trace=str(path), sample=sample, max_output_tokens=max_output_tokens, max_input_tokens=max_input_tokens,
        span_s=items[-1].at if items else 0.0,
    )  # fmt: skip
    if tick_s is not None:
        params["spread_over_tick_s"] = tick_s
    return Workload(name, items, params)


def trace_tick(timestamps: Sequence[float]) -> float:
    """A trace's clock step: the most common gap between its distinct timestamps (Mooncake: 3000 ms)."""
    distinct = sorted(set(timestamps))
    gaps = Counter(round(b - a) for a, b in itertools.pairwise(distinct))
    if not gaps:
        raise ValueError("a trace needs two distinct timestamps to spread over its step")
    return float(gaps.most_common(1)[0][0])


def tick_spread(times: Sequence[float], tick: float) -> list[float]:
    """``times`` (ascending) with the requests sharing one time spread evenly over the ``tick`` after
    it, in order (the k-th of n at +k/n of the tick)."""
    out: list[float] = []
    for t, same in itertools.groupby(times):
        n = len(list(same))
        out.extend(t + tick * k / n for k in range(n))
    return out


def max_input_tokens(max_model_len: int, max_output_tokens: int) -> int:
    """A trace prompt's cap: the context window less the output and room for the chat template."""
    return max_model_len - max_output_tokens - 16


SCENARIOS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "no-reuse": no_reuse,
    "agentic": agentic,
    "agentic-chat": agentic_chat,
    "agentic-responses": agentic_responses,
    "mixed-pd": mixed_pd,
    "mixed-pd-fresh": mixed_pd_fresh,
}


def build(scenario: str | None, trace_path: str | None, max_requests: int | None, seed: int = 0, **kw: Any) -> Workload:
    """A named scenario (cut to ``max_requests``) or a trace file."""
    if trace_path:
        return trace(trace_path, max_requests=max_requests, seed=seed, **kw)
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {sorted(SCENARIOS)} or --trace FILE")
    w = SCENARIOS[scenario](seed=seed, **kw)
    if max_requests is not None:
        w.items = w.items[:max_requests]
    return w


def request_body(item: Item, stream: bool = True) -> bytes:
    body: dict[str, Any] = item.body or {"model": MODEL, "messages": list(item.messages), "max_tokens": item.max_tokens}
    if stream:
        body = {**body, "stream": True}
        if item.path == CHAT_PATH:  # the Messages and Responses APIs have none: their streams end with usage
            body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def naive_hash_pod(item: Item, pods: int) -> int:
    """The textbook gateway: hash of the first 256 characters of the last message, modulo N."""
    return xxhash.xxh64_intdigest(str(item.messages[-1]["content"])[:256].encode()) % pods


def specs(
    items: Iterable[Item],
    arrivals: Sequence[float],
    stream: bool = True,
    headers: Sequence[tuple[tuple[str, str], ...]] | None = None,
) -> list[RequestSpec]:
    return [
        RequestSpec(
            body=request_body(it, stream),
            at=t,
            tag=it.tag,
            path=it.path,
            headers=headers[i] if headers else (),
            request_id=f"bench-{i}",
        )
        for i, (it, t) in enumerate(zip(items, arrivals, strict=True))
    ]


def prompt_ids(front: ChatFront, item: Item) -> list[int]:
    """``item``'s prompt as a simulated pod builds it (``front``: the pod's chat front)."""
    if item.body is None:
        return front.tokenizer.render_chat([dict(m) for m in item.messages], None)
    if item.path == RESPONSES_PATH:
        return front.tokens(sim_responses.chat_request(item.body), validated=False)
    return front.tokens(sim_anthropic.chat_request(item.body) if item.path == MESSAGES_PATH else item.body)


def ideal_hit_rate(items: Iterable[Item], block_size: int, capacity_blocks: int | None = None) -> dict[str, float]:
    """Tokens one simulated pod would serve from cache, over prompt tokens, requests one at a time in
    item order: an infinite cache, or with ``capacity_blocks`` one LRU cache of that many blocks.

    The bounded cache is the whole fleet's KV memory as one pod (``pods × capacity_blocks``): under
    memory pressure no router reaches the infinite ideal, so this is the fair bar. Eviction follows
    bench.sim (vLLM): least recently freed first, and a request's blocks are freed tail first, so its
    last blocks go before its first ones. Requests run alone, so nothing is pinned by a neighbour.
    """
    tok = SimTokenizer()
    front = ChatFront(tok)
    outputs: dict[int, list[int]] = {}
    lru: OrderedDict[int, None] = OrderedDict()  # oldest first; infinite: never trimmed
    queried = hits = chars = 0
    for it in items:
        prompt = prompt_ids(front, it)
        chars += sum(len(str(m.get("content") or "")) for m in it.messages)
        hashes = block_hashes(prompt, block_size)
        limit = (len(prompt) - 1) // block_size  # vLLM recomputes at least the last prompt token
        n = 0
        while n < min(limit, len(hashes)) and hashes[n] in lru:
            n += 1
        queried += len(prompt)
        hits += n * block_size
        # A pod computes the prompt and every output token but the last; their full blocks stay cached.
        out = outputs.get(it.max_tokens)
        if out is None:
            out = outputs[it.max_tokens] = [tok.output_token(i)[0] for i in range(it.max_tokens - 1)]
        blocks = block_hashes(prompt + out, block_size)
        for h in reversed(blocks):  # freed tail first: the first block ends most recently used
            lru[h] = None
            lru.move_to_end(h)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return {
        "prompt_tokens": queried,
        "hit_tokens": hits,
        "hit_rate": hits / queried if queried else 0.0,
        "chars_per_token": chars / queried if queried else 0.0,  # message text per prompt token
    }
