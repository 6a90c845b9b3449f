"""Decision latency: parse + keys (+ tokenize) + index match + score + record, per request.

    python -m bench.decision [--tokens 8000] [--docs 20] [--requests 400] [--repeat N] [--redis-url URL]

Runs the router in-process (no gRPC, no Envoy: ``bench.overhead`` measures those) for 8k-token
chats over a set of shared documents, once with the approximate index (character blocks) and once
in precise mode (the model's tokenizer and chat template, token blocks, the numpy precise index).
Cold = the first request on a document (its text is tokenized in full); warm = later questions on
a known document (only the new text is tokenized). ``one message``: the document and the question in
one user message (the tokenizer caches long text in chunks: only the last one, with the question,
is encoded again).

The ``ext_proc stream`` row runs a whole request through kvroute's ext_proc servicer in-process: the
headers and body messages parsed from their bytes, the answers serialized, no gRPC or Envoy; its note
gives the do-nothing servicer's time on the same messages (``bench.overhead``'s floor, less gRPC), so
its ``own`` is kvroute's own part of a request, measured without the noise of a loaded machine, in
wall time and in CPU time (``time.process_time`` around each exchange: what other processes run in
between does not count). ``--repeat N`` runs each in-process row N times and keeps the best (the
lowest warm p50): on a shared machine the best of a few runs is the steadiest figure.
``python -m bench.servicer`` times the same exchange in batches (CPU only) for 1k and 8k chats.

``--workload NAME[,NAME]`` instead replays a routing scenario of ``bench.workloads`` (the grid's
shared-prefix, multi-turn, no-reuse, ...) in its order through each index, 4 pods, precise with the
simulated pods' tokenizer and 16-token blocks as the grid runs kvroute-precise: each decision's CPU
time on its own thread (``time.thread_time``: other processes do not count) and wall time, over all its
requests, and ``all CPU``: this process's CPU per decision over the replay, the tokenizers package's
worker threads included (it spreads a batch of pieces over the cores, so a precise decision costs the
machine more than its own thread's time).
``--servicer`` sends each of a grid workload's requests (the Mooncake ones too) through the ext_proc
servicer instead, as kvroute decides behind Envoy: a precise prompt decided on a head or a probe, its
rest encoded and every pick recorded after the answer. Its CPU and wall are the exchange's (what a
request waits on, the process's CPU over it), and ``all CPU`` is the process's CPU per request over
the replay, rests and records included. ``--added-tokens N`` gives precise mode's tokenizer N more added
tokens (named as Llama 3's 256 reserved ones; the simulated pods' tokenizer has 7): what kvroute's split of
a rendered chat at the added tokens costs with a real model's. ``--typographic`` makes the documents'
quotes typographic (’ ”): prompts past ASCII, keyed by characters rather than from one ASCII encoding.
``--image-kb KB`` asks each question about one image, KB kilobytes of base64 in the request (an
``image_url`` part, as OpenAI's API takes an image): what a large body costs the parse and the keys.

With ``--redis-url`` (a redis-server on loopback), each index also runs the two ways replicas could
share state: ``write-behind`` (kvroute's: two replicas read local state; records and loads go to
Redis in the background and peers follow its log) and ``round trip`` (a Redis-held index: before
each decision one pipelined round trip matches the prompt's blocks in Redis with a Lua script and
reads the pods' in-flight counts; the record is written after, untimed). The ``lag`` column is how
long a record took to reach the other replica (write-behind).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import sys
import sysconfig
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench.loadgen import percentile
from bench.noop_extproc import Noop
from bench.servicer import StreamContext, incoming, request_messages
from bench.vllm_model import build as build_model
from extproc.config import build_config
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor
from extproc.state.redis_state import RedisState

ROOT = Path(__file__).resolve().parent.parent
SCALE_PODS = (4, 64, 512)  # --scale: the pool sizes the decision's cost is compared across


def pod_addresses(n: int) -> list[str]:
    """``n`` loopback names; never dialed (the live view, with its KV-event subscribers, never starts)."""
    return [f"127.1.{i // 250}.{i % 250 + 1}:8000" for i in range(n)]


PODS = pod_addresses(8)


def documents(n: int, tokens: int, tok: Any, typographic: bool = False) -> list[str]:
    """Real text (stdlib sources) cut to ≈ ``tokens`` tokens each; ``typographic``: its ASCII quotes made
    typographic ones (’ ”), as text pasted from a word processor: every prompt then has characters past
    ASCII, as most real prompts have somewhere (a curly quote, an accent, an emoji)."""
    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out: list[str] = []
    for p in src:
        text = p.read_text(errors="replace")
        ids = tok.encode(text, add_special_tokens=False).tolist()
        if len(ids) >= tokens:
            doc = tok._tok.decode(ids[:tokens])
            out.append(doc.replace("'", "’").replace('"', "”") if typographic else doc)
        if len(out) == n:
            break
    return out


def _config(precise: bool, model_dir: Path, redis_url: str | None = None, pods: int = len(PODS)) -> dict[str, Any]:
    cfg: dict[str, Any] = {"pools": {"p": {"endpoints": [{"address": a} for a in pod_addresses(pods)]}}}
    if precise:
        cfg["models"] = {"m": {"pool": "p", "tokenizer": str(model_dir), "block_size": 16}}
        cfg["kv_events"] = {"enabled": True}
    if redis_url is not None:
        cfg["redis"] = {"url": redis_url}
    return cfg


# ``--image-kb``: an image (base64 in a data URL, as OpenAI's API takes one) asked about in every question.
_image: dict[str, Any] | None = None


def image_part(kb: int) -> dict[str, Any]:
    """An image_url content part of ``kb`` KB of base64 (deterministic bytes)."""
    data = base64.b64encode(hashlib.shake_256(b"bench.decision image").digest(kb * 768)).decode()
    return {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + data}}


def _body(i: int, docs: list[str], one_message: bool = False) -> bytes:
    """Request ``i``: a question on document ``i % len(docs)``, in a message of its own or after it
    (with ``_image``, a question on that image)."""
    doc, question = docs[i % len(docs)], f"Question {i}: what does this module do?"
    messages: list[dict[str, Any]]
    if one_message:
        messages = [{"role": "user", "content": f"{doc}\n\n{question}"}]
    else:
        asked = question if _image is None else [_image, {"type": "text", "text": question}]
        messages = [{"role": "system", "content": doc}, {"role": "user", "content": asked}]
    return orjson.dumps({"model": "m", "messages": messages})


HEADERS = {":path": "/v1/chat/completions", ":method": "POST"}


def _row(index: str, option: str, cold: list[float], warm: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "index": index,
        "option": option,
        "cold_p50_ms": 1e3 * (percentile(cold, 0.5) or 0),
        "warm_p50_ms": 1e3 * (percentile(warm, 0.5) or 0),
        "warm_p99_ms": 1e3 * (percentile(warm, 0.99) or 0),
        **extra,
    }


class _Timings:
    """Decision times, cold (a document's first request) and warm (its follow-ups)."""

    def __init__(self, docs: list[str], one_message: bool = False) -> None:
        self.docs, self.cold, self.warm, self._seen = docs, list[float](), list[float](), set[int]()
        self.one_message = one_message

    def decide(self, router: Router, i: int) -> None:
        """Request ``i`` through ``router``: parse and route it, timed; its exchange ends at once."""
        d = i % len(self.docs)
        body = _body(i, self.docs, self.one_message)
        t0 = time.perf_counter()
        out = router.route(router.parse("/v1/chat/completions", "POST", HEADERS, body))
        dt = time.perf_counter() - t0
        router.release(out.endpoint)
        (self.warm if d in self._seen else self.cold).append(dt)
        self._seen.add(d)


def run(
    precise: bool, docs: list[str], requests: int, model_dir: Path, one_message: bool = False, pods: int = len(PODS)
) -> dict[str, Any]:
    router = Router(build_config(_config(precise, model_dir, pods=pods)), Metrics())
    t = _Timings(docs, one_message)
    for i in range(requests):
        t.decide(router, i)
    option = "local, one message" if one_message else "local"
    return _row("precise" if precise else "approx", option, t.cold, t.warm, requests=requests, pods=pods)


def scale(docs: list[str], requests: int, model_dir: Path, repeat: int, tokens: int, command: str) -> dict[str, Any]:
    """``--scale``: each index's decision at every pool size of ``SCALE_PODS``, as a ``decision`` headline
    (``python -m bench.results import FILE --as decision-pods``)."""
    rows = []
    for precise in (False, True):
        for n in SCALE_PODS:
            r = best_of(repeat, partial(run, precise, docs, requests, model_dir, pods=n))
            figures = {k: round(r[k], 3) for k in ("cold_p50_ms", "warm_p50_ms", "warm_p99_ms")}
            rows.append({"chats": f"{tokens // 1000}k tokens, {len(docs)} documents", "index": r["index"],
                         "pods": n, **figures})  # fmt: skip
    return {"name": "decision-pods", "kind": "decision", "title": "Decision cost against the pool's size (in-process)",
            "command": command, "rows": rows}  # fmt: skip


def with_added_tokens(model_dir: Path, n: int) -> Path:
    """A copy of tokenizer directory ``model_dir`` (under bench/out/tokenizers) whose tokenizer has ``n`` more
    added special tokens, named as Llama 3's reserved ones (``<|reserved_special_token_0|>``...; Llama 3 has
    256 added tokens, Mistral's Tekken 1000). None occurs in a prompt, so the ids stay the same; kvroute's
    split at the added tokens (extproc/tokenize.py) meets them at every '<' of a rendered chat."""
    from tokenizers import AddedToken, Tokenizer

    out = ROOT / "bench" / "out" / "tokenizers" / f"{model_dir.name}-added{n}"
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "tokenizer.json":
            (out / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(f"<|reserved_special_token_{i}|>", special=True) for i in range(n)])
    tok.save(str(out / "tokenizer.json"))
    return out


def _workload_router(precise: bool, pods: int, added_tokens: int = 0) -> Router:
    """A fresh router over ``pods`` loopback pods, as the grid runs kvroute (precise: the simulated pods'
    tokenizer and 16-token blocks; ``added_tokens``: with that many more added tokens, ``with_added_tokens``)."""
    from bench import workloads
    from bench.harness import precise_settings

    cfg: dict[str, Any] = {"pools": {"default": {"endpoints": [{"address": a} for a in pod_addresses(pods)]}},
                           "default_pool": "default", **(precise_settings(16) if precise else {})}  # fmt: skip
    if precise and added_tokens:
        model = cfg["models"][workloads.MODEL]
        model["tokenizer"] = str(with_added_tokens(Path(model["tokenizer"]), added_tokens))
    return Router(build_config(cfg), Metrics())


def _chat_body(item: Any) -> bytes:
    """A workload item's chat request body."""
    from bench import workloads

    return orjson.dumps({"model": workloads.MODEL, "messages": list(item.messages), "max_tokens": item.max_tokens})


def _workload_row(name: str, precise: bool, cpu: list[float], wall: list[float], **extra: float) -> dict[str, Any]:
    ms = lambda xs, q: 1e3 * (percentile(xs, q) or 0)  # noqa: E731
    return {"workload": name, "index": "precise" if precise else "approx", "requests": len(cpu),
            "cpu_p50_ms": ms(cpu, 0.5), "cpu_p99_ms": ms(cpu, 0.99), "cpu_mean_ms": 1e3 * sum(cpu) / len(cpu),
            "wall_p50_ms": ms(wall, 0.5), **extra}  # fmt: skip


def run_workload(name: str, precise: bool, pods: int = 4, added_tokens: int = 0) -> dict[str, Any]:
    """``--workload``: scenario ``name``'s requests, in order, each decided (parse, tokenize, route) and
    released at once on a fresh router; CPU and wall time per decision."""
    from bench import workloads

    router = _workload_router(precise, pods, added_tokens)
    cpu: list[float] = []
    wall: list[float] = []
    bodies = [_chat_body(item) for item in workloads.build(name, None, None).items]
    p0 = time.process_time()
    for body in bodies:
        w0, c0 = time.perf_counter(), time.thread_time()
        out = router.route(router.parse("/v1/chat/completions", "POST", HEADERS, body))
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        router.release(out.endpoint)
    return _workload_row(name, precise, cpu, wall, all_cpu_ms=1e3 * (time.process_time() - p0) / len(cpu))


async def run_workload_servicer(name: str, precise: bool, pods: int = 4, added_tokens: int = 0) -> dict[str, Any]:
    """``--workload --servicer``: grid workload ``name``'s requests in order, each through kvroute's ext_proc
    servicer in-process (headers and body messages, as Envoy sends them), as kvroute decides behind
    Envoy: precise decisions on a head or probe, their rests encoded and every pick recorded after the
    answer (settled before the next request). Per request: the exchange's wall and CPU time (the critical
    path, the rests and records apart), and this process's CPU per request over the whole replay, rests
    and records included."""
    from bench.grid import Grid, build_workload

    proc = ExternalProcessor(_workload_router(precise, pods, added_tokens))
    grid = Grid(out=ROOT / "bench" / "out" / "grid", workloads=[name], pods=[pods], loads=[0.7], policies=None)
    wall: list[float] = []
    cpu: list[float] = []
    c0 = time.process_time()
    try:
        for item in build_workload(grid, name).items:
            w, c = await _exchange(proc, request_messages(_chat_body(item)))
            wall.append(w)
            cpu.append(c)
            await asyncio.sleep(0)  # the pick's record, made once answered, as the loop turns between arrivals
            while proc._deferred:  # the rests, as between arrivals
                await asyncio.gather(*proc._deferred)
        total = time.process_time() - c0
    finally:
        proc.close()
    return _workload_row(name, precise, cpu, wall, all_cpu_ms=1e3 * total / len(cpu))


def best_of(repeat: int, measure: Callable[[], dict[str, Any]], figure: str = "warm_p50_ms") -> dict[str, Any]:
    """The run with the lowest ``figure`` of ``repeat`` (each on a fresh router)."""
    return min((measure() for _ in range(max(1, repeat))), key=lambda r: r[figure])


async def _exchange(servicer: Any, messages: tuple[bytes, bytes]) -> tuple[float, float]:
    """One request through ``servicer.Process``: seconds from its first message parsed to its last
    answer serialized, in wall time and in this process's CPU time (the pick's record, made once the
    loop turns after the answer, is the caller's to let run outside)."""
    t0, c0 = time.perf_counter(), time.process_time()
    async for resp in servicer.Process(incoming(messages), StreamContext()):
        resp.SerializeToString()
    return time.perf_counter() - t0, time.process_time() - c0


async def run_stream(docs: list[str], requests: int, model_dir: Path) -> dict[str, Any]:
    """Each request through kvroute's ext_proc servicer, then through the do-nothing one (the floor)."""
    router = Router(build_config(_config(False, model_dir)), Metrics())
    kvroute, floor = ExternalProcessor(router), Noop(PODS[0])
    cold: list[float] = []
    warm: list[float] = []
    warm_cpu: list[float] = []
    noop: list[float] = []
    noop_cpu: list[float] = []
    seen: set[int] = set()
    for i in range(requests):
        messages = request_messages(_body(i, docs))
        wall, cpu = await _exchange(kvroute, messages)
        await asyncio.sleep(0)  # the loop turns between arrivals: the pick's record, made once answered
        if i % len(docs) in seen:
            warm.append(wall)
            warm_cpu.append(cpu)
        else:
            cold.append(wall)
        seen.add(i % len(docs))
        wall, cpu = await _exchange(floor, messages)
        noop.append(wall)
        noop_cpu.append(cpu)
    ms = [1e3 * (percentile(x, 0.5) or 0) for x in (noop, warm_cpu, noop_cpu)]
    return _row("approx", "ext_proc stream", cold, warm, requests=requests, noop_p50_ms=ms[0],
                warm_cpu_p50_ms=ms[1], noop_cpu_p50_ms=ms[2])  # fmt: skip


async def run_paced(precise: bool, docs: list[str], requests: int, model_dir: Path, url: str | None) -> dict[str, Any]:
    """Requests 1 ms apart in an event loop. With ``url``: two replicas sharing through Redis, decisions
    alternating between them (so each also applies the other's records between its own decisions,
    as a real replica does); without: one replica alone, the baseline at the same pace."""
    tag = f"bench-decision-{time.time_ns()}:"  # this run's keys only
    cfg = _config(precise, model_dir, url)
    if url is not None:
        cfg["redis"]["key_prefix"] = tag
    replicas = [Router(build_config(cfg), Metrics()) for _ in range(2 if url else 1)]
    for r in replicas:
        await r.state.start()  # the shared state's tasks only
    states = [r.state for r in replicas if isinstance(r.state, RedisState)]
    while not all(st.up for st in states):
        await asyncio.sleep(0.01)
    t = _Timings(docs)
    for i in range(requests):
        t.decide(replicas[i % len(replicas)], i)
        await asyncio.sleep(0.001)  # requests arrive 1 ms apart: the writer and reader run in between
    lags = [lag for st in states for lag in st.lags]
    for r in replicas:
        await r.state.aclose()
    if url is None:
        return _row("precise" if precise else "approx", "local, paced", t.cold, t.warm, requests=requests)
    return _row("precise" if precise else "approx", "write-behind", t.cold, t.warm, requests=requests,
                lag_p50_ms=1e3 * (percentile(lags, 0.5) or 0))  # fmt: skip


# A Redis-held index: block key → set of pods. Walks the prompt's keys in order and returns each pod's
# leading matched blocks (the same answer as PrefixIndex.match), in one call.
MATCH_LUA = """
local counts, alive = {}, nil
for i = 2, #ARGV do
  local members = redis.call('SMEMBERS', ARGV[1] .. ARGV[i])
  if #members == 0 then break end
  local nxt, any = {}, false
  for _, m in ipairs(members) do
    if alive == nil or alive[m] then nxt[m] = true; counts[m] = i - 1; any = true end
  end
  if not any then break end
  alive = nxt
end
local out = {}
for m, c in pairs(counts) do table.insert(out, m); table.insert(out, c) end
return out
"""


def run_round_trip(precise: bool, docs: list[str], requests: int, model_dir: Path, url: str) -> dict[str, Any]:
    """Before each decision, one pipelined round trip: the prompt's blocks matched in Redis (Lua) and
    the pods' in-flight counts read; the decision itself runs as usual, the record is written after."""
    import redis

    router = Router(build_config(_config(precise, model_dir)), Metrics())
    client = redis.Redis.from_url(url)
    prefix = "bench-decision:rt:"
    match = client.register_script(MATCH_LUA)
    cold: list[float] = []
    warm: list[float] = []
    trips: list[float] = []
    seen: set[int] = set()
    for i in range(requests):
        d = i % len(docs)
        body = _body(i, docs)
        t0 = time.perf_counter()
        req = router.parse("/v1/chat/completions", "POST", HEADERS, body)
        k = router.keys(req, router.registry.pools["p"].endpoints)
        t1 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        match(args=[prefix, *k.keys], client=pipe)
        pipe.hgetall(prefix + "inflight")
        pipe.execute()
        trips.append(time.perf_counter() - t1)
        out = router.route(req)
        dt = time.perf_counter() - t0
        router.release(out.endpoint)
        (warm if d in seen else cold).append(dt)
        seen.add(d)
        rec = client.pipeline(transaction=False)  # write-behind in a real design: untimed here
        for key in k.keys:
            rec.sadd(prefix + str(key), out.endpoint)
            rec.expire(prefix + str(key), 600)
        rec.execute()
    for key in client.scan_iter(prefix + "*", count=1000):
        client.delete(key)
    client.close()
    return _row("precise" if precise else "approx", "round trip", cold, warm, requests=requests,
                trip_p50_ms=1e3 * (percentile(trips, 0.5) or 0))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decision", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=8000, help="document length in tokens")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each in-process row; the best is shown")
    ap.add_argument("--redis-url", help="also run the shared-state options against this Redis (loopback)")
    ap.add_argument("--scale", type=Path, metavar="JSON",
                    help=f"only the local decision at {', '.join(map(str, SCALE_PODS))} pods, each index; the "
                    "rows as a bench.results headline in JSON")  # fmt: skip
    ap.add_argument("--workload", metavar="NAME[,NAME]",
                    help="replay these bench.workloads scenarios (e.g. multi-turn) instead: CPU per decision, "
                    "each index, as the grid runs them; --repeat keeps each row's lowest CPU p50")  # fmt: skip
    ap.add_argument("--servicer", action="store_true",
                    help="with --workload (any grid workload, the Mooncake ones too): each request through "
                    "the ext_proc servicer, as behind Envoy (heads, probes, rests after the answer); adds "
                    "the CPU per request with the rests")  # fmt: skip
    ap.add_argument("--image-kb", type=int, default=0, metavar="KB",
                    help="every question asked about one image of KB kilobytes, base64 in the request")  # fmt: skip
    ap.add_argument("--typographic", action="store_true",
                    help="the documents' quotes typographic (’ ”): prompts past ASCII, as most real ones")  # fmt: skip
    ap.add_argument("--added-tokens", type=int, default=0, metavar="N",
                    help="with --workload: precise mode's tokenizer with N more added tokens, as a real model's "
                    "(Llama 3: 256; the simulated pods' has 7)")  # fmt: skip
    a = ap.parse_args()
    if a.workload:
        print("| workload | index | decisions | CPU p50 ms | CPU p99 ms | CPU mean ms | wall p50 ms | all CPU ms |\n"
              "|---|---|---|---|---|---|---|---|")  # fmt: skip
        cols = ("cpu_p50_ms", "cpu_p99_ms", "cpu_mean_ms", "wall_p50_ms", "all_cpu_ms")
        for name in a.workload.split(","):
            for precise in (False, True):
                if a.servicer:
                    measure = partial(lambda n, p: asyncio.run(run_workload_servicer(n, p, 4, a.added_tokens)),
                                      name, precise)  # fmt: skip
                else:
                    measure = partial(run_workload, name, precise, 4, a.added_tokens)
                r = best_of(a.repeat, measure, "cpu_p50_ms")
                print(f"| {name} | {r['index']} | {r['requests']} | {' | '.join(f'{r[k]:.2f}' for k in cols)} |")
        return
    global _image
    _image = image_part(a.image_kb) if a.image_kb else None
    model_dir = build_model(ROOT / ".cache" / "tiny-llama")
    from extproc.tokenize import ModelTokenizer

    docs = documents(a.docs, a.tokens, ModelTokenizer.from_dir(model_dir), a.typographic)
    if a.scale is not None:
        h = scale(docs, a.requests, model_dir, a.repeat, a.tokens, "python -m bench.decision " + " ".join(sys.argv[1:]))
        print("| index | pods | cold p50 ms | warm p50 ms | warm p99 ms |\n|---|---|---|---|---|")
        for r in h["rows"]:
            ms = " | ".join(f"{r[k]:.2f}" for k in ("cold_p50_ms", "warm_p50_ms", "warm_p99_ms"))
            print(f"| {r['index']} | {r['pods']} | {ms} |")
        a.scale.parent.mkdir(parents=True, exist_ok=True)
        a.scale.write_text(json.dumps(h, indent=1) + "\n")
        print(f"wrote {a.scale}")
        return
    rows = []
    for precise in (False, True):
        rows.append(best_of(a.repeat, partial(run, precise, docs, a.requests, model_dir)))
        if precise:
            rows.append(best_of(a.repeat, partial(run, True, docs, a.requests, model_dir, one_message=True)))
        else:
            rows.append(best_of(a.repeat, lambda: asyncio.run(run_stream(docs, a.requests, model_dir))))
        if a.redis_url:
            rows.append(asyncio.run(run_paced(precise, docs, a.requests, model_dir, None)))
            rows.append(asyncio.run(run_paced(precise, docs, a.requests, model_dir, a.redis_url)))
            rows.append(run_round_trip(precise, docs, a.requests, model_dir, a.redis_url))
    print(f"{a.tokens}-token chats over {len(docs)} documents, {a.requests} decisions each, 8 pods\n")
    print("| index | state | cold p50 ms | warm p50 ms | warm p99 ms | added warm p50 ms | note |")
    print("|---|---|---|---|---|---|---|")
    # Write-behind is compared with one replica at the same pace; the round trip with the tight loop.
    base = {(r["index"], r["option"] == "local, paced"): r["warm_p50_ms"] for r in rows
            if r["option"] in ("local", "local, paced")}  # fmt: skip
    for r in rows:
        note = ""
        if "lag_p50_ms" in r:
            note = f"record reaches the peer in {r['lag_p50_ms']:.2f} ms (p50)"
        if "trip_p50_ms" in r:
            note = f"round trip alone {r['trip_p50_ms']:.2f} ms (p50)"
        if "noop_p50_ms" in r:
            own_cpu = r["warm_cpu_p50_ms"] - r["noop_cpu_p50_ms"]
            note = (f"do-nothing servicer {r['noop_p50_ms']:.3f} ms (p50); kvroute's own "
                    f"{r['warm_p50_ms'] - r['noop_p50_ms']:.3f} ms warm; CPU {r['warm_cpu_p50_ms']:.3f} vs "
                    f"{r['noop_cpu_p50_ms']:.3f} ms, own {own_cpu:.3f} ms")  # fmt: skip
        added = r["warm_p50_ms"] - base[(r["index"], r["option"] in ("local, paced", "write-behind"))]
        print(f"| {r['index']} | {r['option']} | {r['cold_p50_ms']:.2f} | {r['warm_p50_ms']:.2f} | "
              f"{r['warm_p99_ms']:.2f} | {added:+.2f} | {note} |")  # fmt: skip


if __name__ == "__main__":
    main()
