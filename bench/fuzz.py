"""Fuzz kvroute's inputs: ``make fuzz`` (≥ 1 M cases; not in CI).

Four targets, each a property that must hold for any input:
- ``request``: an OpenAI request (JSON, UTF-8, types, nesting depth, huge numbers, huge arrays)
  through the ext_proc stream, BUFFERED: routed, passed on, or answered with an OpenAI-style error
  of an expected status (400/404/413/429/503); never an internal error; no in-flight slot leaked;
- ``template``: chat requests rendered with a real chat template and tokenizer (precise mode): a
  template or tokenizer failure falls back to approximate keys, never fails the request;
- ``kv_events``: msgpack garbage and mutated vLLM batches: decoded, or ``KVEventDecodeError``;
  what decodes applies to the precise index without an exception;
- ``stream``: ext_proc message sequences Envoy would not send (out of order, duplicate headers,
  body after end_of_stream, trailers only, response before request): the same answers' rules.

The same checks run as Hypothesis properties in CI (tests/unit/test_properties.py, bounded and
derandomized). Here a seeded, structure-aware random generator drives them: valid requests and
batches, then mutated (fields dropped, retyped, nested, inflated; bytes flipped, cut, made invalid
UTF-8). Why not atheris (it installs): its byte-level, coverage-guided search stops at the first
crash (we count them), needs its own native build wired into the install, and most of these
inputs are structures that random bytes seldom reach; a generator that builds them directly runs
~1 M cases in minutes on 2 cores. A failing case is written to ``--out`` for replay
(``--replay FILE``).

Reports cases per target, crashes (property violations or exceptions), peak RSS, and RSS after
the first tenth of the run and at the end. Bounded memory: kvroute's tables and the tokenizer's
piece cache are made small here, so they are full within the first tenth; RSS growing more than
``--max-rss-growth`` after it fails the run (it found the capacity window that grew by a sample
per request while unscraped, and a tokenizer cache bounded in characters, not bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pickle
import random
import re
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import tokenize
from extproc.config import HeadersConfig, build_config
from extproc.index.precise import PreciseIndex
from extproc.kvevents.decode import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventDecodeError,
    decode_message,
    decode_payload,
)
from extproc.kvevents.encode import encode_batch
from extproc.observability import Metrics
from extproc.router import Router
from extproc.server import ExternalProcessor

ROOT = Path(__file__).resolve().parent.parent
PODS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
MAX_BODY = 64 * 1024  # small, so 413s are reached
EXPECTED_STATUS = {400, 404, 413, 429, 503}
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/models", "/v1/embeddings",
         "/", "/v1/chat/completions?x=1"]  # fmt: skip
MODES = [None, pm.ProcessingMode.STREAMED, pm.ProcessingMode.FULL_DUPLEX_STREAMED]
TARGETS = ("request", "template", "kv_events", "stream")
DEEP = "<deep {}>"  # a placeholder for arrays nested that deep, written into the JSON text
_DEEP = re.compile(rb'"<deep (\d+)>"')

_H = HeadersConfig()
# Every header kvroute reads or strips (its defaults), plus the length Envoy forwards.
FUZZ_HEADERS = (_H.tenant, *_H.route_id, _H.priority, _H.objective, _H.ttft_slo, *_H.routing_headers(),
                "content-length")  # fmt: skip


class PropertyFailed(AssertionError):
    """An input broke one of the properties above."""


# -- the system under test ------------------------------------------------------------------------


def _router(model_dir: Path | None, secret_file: Path | None) -> Router:
    cfg: dict[str, Any] = {
        "pools": {"p": {"endpoints": [{"address": a} for a in PODS]}},
        "models": {"m": {"pool": "p"}},
        "server": {"max_body_bytes": MAX_BODY},
        # Small tables, so they are full early in the run and memory must stay flat from then on.
        "routing": {"index_capacity_blocks": 4096, "route_table_size": 4096},
    }
    if secret_file is not None:  # tenancy on: every accepted inference body is rewritten with a salt
        cfg["tenancy"] = {"cache_salt": "inject", "secret_file": str(secret_file)}
    if model_dir is not None:
        cfg["models"]["m"] |= {"tokenizer": str(model_dir), "block_size": 16}
        cfg["kv_events"] = {
            "enabled": True,
            "capacity_blocks": 4096,
        }  # the precise index (nothing subscribes: start() is never called)
    return Router(build_config(cfg), Metrics())


@dataclass
class System:
    """Routers (approximate with tenancy, precise with a chat template) and their ext_proc servers."""

    model_dir: Path | None
    _tmp: Any = field(default_factory=lambda: tempfile.TemporaryDirectory(prefix="kvroute-fuzz-"))

    def __post_init__(self) -> None:
        secret = Path(self._tmp.name) / "salt-secret"
        secret.write_text("fuzzing-secret-0123456789")
        self.approx = _router(None, secret)
        self.precise = _router(self.model_dir, None) if self.model_dir is not None else None
        self.index = PreciseIndex(capacity_blocks=4096)

    def close(self) -> None:
        self._tmp.cleanup()


def _internal_errors(router: Router) -> float:
    """kvroute_errors_total{kind="internal"}: what the stream handler counts when it had to fail open
    (read off the one metric: collecting the whole registry per case would dominate the run)."""
    return sum(
        s.value
        for m in router.metrics.errors.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("kind") == "internal"
    )


def _inflight(router: Router) -> int:
    return sum(e.inflight for e in router.registry.by_address.values())


def _check_answer(resp: pb.ProcessingResponse) -> None:
    if resp.WhichOneof("response") != "immediate_response":
        return
    imm = resp.immediate_response
    status = imm.status.code
    try:
        err = orjson.loads(imm.body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise PropertyFailed(f"error body is not OpenAI-shaped: {imm.body[:200]!r}") from e
    if status not in EXPECTED_STATUS and not (status == 500 and err.get("type") == "server_error"):
        raise PropertyFailed(f"unexpected status {status}: {err}")
    if err.get("code") != status or not err.get("message") or not isinstance(err.get("type"), str):
        raise PropertyFailed(f"error body incomplete: {err}")


async def check_stream(router: Router, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Any message sequence: every answer well-formed, no internal error, nothing left in flight."""
    before = _internal_errors(router)
    proc = ExternalProcessor(router)

    async def it() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    out = [r async for r in proc.Process(it(), None)]
    for r in out:
        _check_answer(r)
    if _internal_errors(router) != before:
        raise PropertyFailed("kvroute counted an internal error (see the log)")
    if _inflight(router):
        raise PropertyFailed(f"{_inflight(router)} in-flight slot(s) left after the stream ended")
    decided = [r for r in out if r.WhichOneof("response") == "immediate_response"]
    if len(decided) > 1:
        raise PropertyFailed("more than one immediate response on one stream")
    return out


def headers_msg(
    path: str, method: str = "POST", extra: dict[str, str] | None = None, eos: bool = False, mode: Any = None
) -> pb.ProcessingRequest:
    hs = [(":path", path), (":method", method), *(extra or {}).items()]
    m = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8", "surrogatepass")) for k, v in hs]
            ),
            end_of_stream=eos,
        )
    )
    if mode is not None:
        m.protocol_config.request_body_mode = mode
        m.protocol_config.send_body_without_waiting_for_header_response = mode == pm.ProcessingMode.STREAMED
    return m


def body_msg(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=eos))


async def check_request(router: Router, path: str, headers: dict[str, str], raw: bytes) -> None:
    """One request as Envoy sends it in BUFFERED mode."""
    out = await check_stream(router, [headers_msg(path, extra=headers), body_msg(raw, True)])
    if out[-1].WhichOneof("response") not in ("request_body", "immediate_response"):
        raise PropertyFailed(f"no answer to the body: {[r.WhichOneof('response') for r in out]}")


def check_kv_payload(index: PreciseIndex, payload: bytes, frames: bool = False) -> None:
    """Decoded or KVEventDecodeError; a decoded batch applies to the index without an exception."""
    try:
        batch = decode_message([b"kv", (0).to_bytes(8, "big"), payload]).batch if frames else decode_payload(payload)
    except KVEventDecodeError:
        return
    index.apply_batch("10.0.0.1:8000", batch)
    index.match([1, 2, 3], ["10.0.0.1:8000"])


# -- the generator -----------------------------------------------------------------------------------


def _fit_msgpack(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**64:
        return v % 2**64
    if isinstance(v, list):
        return [_fit_msgpack(x) for x in v]
    if isinstance(v, dict):
        return {k: _fit_msgpack(x) for k, x in v.items()}
    return v


class Gen:
    """Structure-aware random inputs: valid ones, mutated."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def text(self, n: int | None = None) -> str:
        r = self.r
        n = r.choice([0, 1, 5, 40, 300, 2000]) if n is None else n
        alphabet = r.choice(["abc def ", "ü€数字 ", "<|user|>{{}}{%%}\n", "\x00\x1f\ud7ff\ue000\U0010ffff"])
        return "".join(r.choices(alphabet, k=n))

    def scalar(self) -> Any:
        r = self.r
        return r.choice(
            [
                None,
                True,
                False,
                0,
                -1,
                1,
                2**31,
                2**32,
                2**63 - 1,
                -(2**63),
                2**64 - 1,
                1.5,
                -0.0,
                1e308,
                "",
                "m",
                self.text(r.choice([1, 10])),
                r.randrange(-(2**64), 2**64),
            ]
        )

    def value(self, depth: int = 0) -> Any:
        r = self.r
        k = r.random()
        if depth > 3 or k < 0.5:
            return self.scalar()
        if k < 0.75:
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        return {self.text(r.choice([1, 4])): self.value(depth + 1) for _ in range(r.randrange(4))}

    def message(self) -> dict[str, Any]:
        r = self.r
        content: Any = self.text()
        if r.random() < 0.3:
            content = [
                {"type": "text", "text": self.text()},
                r.choice([{"type": "image_url", "image_url": {"url": "data:x"}}, "part", {"text": self.text(3)}]),
            ]
        m: dict[str, Any] = {"role": r.choice(["user", "system", "assistant", "tool"]), "content": content}
        if r.random() < 0.1:
            m["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        return m

    def valid_body(self, path: str) -> dict[str, Any]:
        r = self.r
        body: dict[str, Any] = {"model": r.choice(["m", "m", "m", "other"])}
        if "chat" in path or r.random() < 0.2:
            body["messages"] = [self.message() for _ in range(r.randrange(1, 5))]
        else:
            body["prompt"] = r.choice(
                [self.text(), [self.text(), self.text()], [r.randrange(50_000) for _ in range(r.choice([1, 64, 300]))]]
            )
        for name, make in (
            ("stream", lambda: True),
            ("max_tokens", lambda: r.randrange(1, 100)),
            ("user", lambda: "u"),
            ("cache_salt", lambda: "s"),
            ("tools", lambda: [{"type": "function"}]),
        ):
            if r.random() < 0.2:
                body[name] = make()
        return body

    def mutate_obj(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.r
        for _ in range(r.randrange(1, 4)):
            k = r.random()
            keys = list(body)
            if k < 0.3 and keys:
                body[r.choice(keys)] = self.value()
            elif k < 0.45 and keys:
                del body[r.choice(keys)]
            elif k < 0.6:
                body[
                    r.choice(
                        [
                            "model",
                            "messages",
                            "prompt",
                            "max_tokens",
                            "stream",
                            "cache_salt",
                            "tools",
                            "kv_transfer_params",
                            "max_completion_tokens",
                            "user",
                        ]
                    )
                ] = self.value()
            elif k < 0.7 and isinstance(body.get("messages"), list) and body["messages"]:
                m = r.choice(body["messages"])
                if isinstance(m, dict):
                    m[r.choice(["role", "content", "tool_calls", "name"])] = self.value()
            elif k < 0.8:  # deep nesting somewhere hashed
                depth = r.choice([10, 253, 254, 255, 300, 1000, 1030])
                body[r.choice(["tools", "messages", "prompt", "x"])] = [{"type": "x", "v": DEEP.format(depth)}]
            elif k < 0.9:  # huge arrays and numbers
                body[r.choice(["prompt", "messages", "tools"])] = [r.choice([0, 2**32, -1, "x"])] * r.choice(
                    [1000, 20_000]
                )
            else:
                body["prompt"] = [[r.randrange(-5, 2**33) for _ in range(r.randrange(1, 70))]]
        return body

    def mutate_bytes(self, raw: bytes) -> bytes:
        r = self.r
        b = bytearray(raw)
        k = r.random()
        if k < 0.25 and b:
            for _ in range(r.randrange(1, 8)):
                b[r.randrange(len(b))] = r.randrange(256)
        elif k < 0.4:
            b = b[: r.randrange(len(b) + 1)]
        elif k < 0.55:
            b += bytes([r.choice([0x80, 0xC0, 0xED, 0xFF])]) + b'"'
            b = bytearray(b'{"model":"m","prompt":"' + b[-10:])
        elif k < 0.65:
            b = bytearray(r.choice([b"[", b'{"a":']) * r.choice([100, 1023, 1025, 5000]))
        elif k < 0.75:
            b = bytearray(b'{"model":"m","prompt":"x","max_tokens":' + b"9" * r.choice([20, 400, 5000]) + b"}")
        elif k < 0.85:
            b = bytearray(b" " * r.choice([0, MAX_BODY - 10, MAX_BODY + 1])) + b
        else:
            b = bytearray(r.randbytes(r.randrange(64)))
        return bytes(b)

    def request(self) -> tuple[str, dict[str, str], bytes]:
        r = self.r
        path = r.choice(PATHS)
        body = self.valid_body(path)
        if r.random() < 0.6:
            body = self.mutate_obj(body)
        raw = json.dumps(body).encode("utf-8", "surrogatepass")  # orjson's writer refuses ints past 64 bits
        raw = _DEEP.sub(lambda m: b"[" * int(m[1]) + b"]" * int(m[1]), raw)
        if r.random() < 0.3:
            raw = self.mutate_bytes(raw)
        return path, self.headers(), raw

    def headers(self) -> dict[str, str]:
        r = self.r
        h: dict[str, str] = {}
        for name in FUZZ_HEADERS:
            if r.random() < 0.2:
                h[name] = r.choice(
                    [
                        "",
                        "a",
                        "-1",
                        "1e400",
                        "nan",
                        "sheddable",
                        "99999999999999999999",
                        "0x10",
                        "10.0.0.1:8000",
                        "\x00\xff",
                        self.text(3),
                        "150",
                    ]
                )
        return h

    def chat_body(self) -> dict[str, Any]:
        body = self.valid_body("/v1/chat/completions")
        body["model"] = "m"
        r = self.r
        if r.random() < 0.5:
            body = self.mutate_obj(body)
            body["model"] = "m"
        if r.random() < 0.2:
            body["chat_template_kwargs"] = self.value()
        if r.random() < 0.1:
            body["add_generation_prompt"] = self.value()
        return body

    def mp_value(self) -> Any:
        """A value msgpack can write (integers in -2^63..2^64-1)."""
        return _fit_msgpack(self.value())

    def kv_payload(self) -> bytes:
        r = self.r
        bs = r.choice([1, 4, 16])
        n = r.randrange(1, 4)
        parent = r.choice([None, r.randrange(2**64)])
        extra = r.choice([None, (("salt",), *[None] * (n - 1)), ((("mm", 0),),) * n])  # root salt; multimodal
        events: list[KVEvent] = [
            BlockStored(
                tuple(r.randrange(2**64) for _ in range(n)),
                parent,
                tuple(r.randrange(4096) for _ in range(n * bs)),
                bs,
                extra_keys=extra,
            ),
            BlockRemoved(tuple(r.randrange(2**64) for _ in range(r.randrange(3)))),
        ]
        payload = encode_batch(events, ts=time.time(), form=r.choice(["map", "array"]))
        k = r.random()
        if k < 0.3:
            obj = msgpack.unpackb(payload, strict_map_key=False)
            evs = obj["events"] if isinstance(obj, dict) else obj[1]
            ev = r.choice(evs)
            if isinstance(ev, dict):
                ev[r.choice(list(ev))] = self.mp_value()
            else:
                ev[r.randrange(len(ev))] = self.mp_value()
            return bytes(msgpack.packb(obj))
        if k < 0.5:
            return bytes(
                msgpack.packb(
                    r.choice(
                        [
                            self.mp_value(),
                            [self.mp_value(), [self.mp_value()]],
                            {"ts": 1, "events": [self.mp_value() for _ in range(3)]},
                        ]
                    )
                )
            )
        if k < 0.7:
            return self.mutate_bytes(payload)
        if k < 0.75:
            return b"\x91" * r.choice([10, 1000, 5000])  # nested arrays
        return payload

    def stream(self) -> list[pb.ProcessingRequest]:
        r = self.r
        path, headers, raw = self.request()
        if r.random() < 0.5:
            raw = orjson.dumps(self.valid_body(path))
        mode = r.choice(MODES)
        msgs: list[pb.ProcessingRequest] = []
        for _ in range(r.randrange(1, 9)):
            k = r.random()
            if k < 0.2:
                msgs.append(headers_msg(path, r.choice(["POST", "GET"]), headers, eos=r.random() < 0.2, mode=mode))
            elif k < 0.55:
                cut = r.randrange(len(raw) + 1)
                msgs.append(body_msg(raw[:cut], False))
                msgs.append(body_msg(raw[cut:], r.random() < 0.8))
            elif k < 0.65:
                msgs.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
            elif k < 0.75:
                hs = pb.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[base_pb2.HeaderValue(key="x-kvroute-upstream", raw_value=r.choice(PODS).encode())]
                    ),
                    end_of_stream=r.random() < 0.3,
                )
                msgs.append(pb.ProcessingRequest(response_headers=hs))
            elif k < 0.9:
                usage = b'{"usage":{"prompt_tokens":' + str(r.randrange(10**6)).encode() + b',"cached_tokens":9}}'
                msgs.append(
                    pb.ProcessingRequest(
                        response_body=pb.HttpBody(
                            body=r.choice([usage, r.randbytes(20)]), end_of_stream=r.random() < 0.5
                        )
                    )
                )
            elif k < 0.95:
                msgs.append(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
            else:
                msgs.append(pb.ProcessingRequest())  # no request at all
        return msgs


# -- the run --------------------------------------------------------------------------------------------


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class Report:
    cases: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    crashes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    rss_early_kib: int = 0
    rss_end_kib: int = 0
    seconds: float = 0.0

    @property
    def peak_rss_mib(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def render(self) -> str:
        lines = [f"{'target':<10} {'cases':>10} {'crashes':>8}"]
        lines += [f"{t:<10} {self.cases[t]:>10,} {self.crashes[t]:>8}" for t in TARGETS]
        total, crashes = sum(self.cases.values()), sum(self.crashes.values())
        lines.append(f"{'total':<10} {total:>10,} {crashes:>8}")
        lines.append(
            f"{total / self.seconds:,.0f} cases/s over {self.seconds:.0f} s; peak RSS {self.peak_rss_mib:.0f} MiB; "
            f"RSS after the first tenth {self.rss_early_kib / 1024:.0f} MiB, at the end "
            f"{self.rss_end_kib / 1024:.0f} MiB"
        )
        return "\n".join(lines)


async def run_case(sysm: System, target: str, case: Any) -> None:
    if target == "request":
        await check_request(sysm.approx, *case)
    elif target == "template":
        assert sysm.precise is not None
        await check_request(sysm.precise, "/v1/chat/completions", {}, json.dumps(case).encode("utf-8", "surrogatepass"))
    elif target == "kv_events":
        check_kv_payload(sysm.index, case[0], frames=case[1])
    else:
        await check_stream(sysm.approx, case)


def make_case(gen: Gen, target: str) -> Any:
    if target == "request":
        return gen.request()
    if target == "template":
        return gen.chat_body()
    if target == "kv_events":
        return gen.kv_payload(), gen.r.random() < 0.5
    return gen.stream()


async def fuzz(args: argparse.Namespace, sysm: System) -> Report:
    from tqdm import tqdm

    targets = [t for t in args.targets if t != "template" or sysm.precise is not None]
    rep = Report()
    gen = Gen(random.Random(args.seed))
    out = Path(args.out)
    t0 = time.monotonic()
    early = max(1, args.cases // 10)
    with tqdm(total=args.cases, unit="case", smoothing=0.05, mininterval=1.0, disable=args.quiet) as bar:
        for i in range(args.cases):
            target = targets[i % len(targets)]
            case = make_case(gen, target)
            try:
                await run_case(sysm, target, case)
            except Exception as e:  # a crash: counted, kept for replay, the run goes on
                rep.crashes[target] += 1
                out.mkdir(parents=True, exist_ok=True)
                with open(out / f"crash-{target}-{i}.pickle", "wb") as f:
                    pickle.dump((target, case if target != "stream" else [m.SerializeToString() for m in case]), f)
                if rep.crashes[target] <= 3:
                    tqdm.write(f"crash #{i} ({target}): {type(e).__name__}: {str(e)[:300]}")
            rep.cases[target] += 1
            if i + 1 == early:
                rep.rss_early_kib = rss_kib()
            if i % 1000 == 0:
                bar.update(1000 if i else 1)
                bar.set_postfix(crashes=sum(rep.crashes.values()), rss_mib=rss_kib() // 1024)
        bar.update(args.cases - bar.n)
    rep.rss_end_kib = rss_kib()
    rep.seconds = time.monotonic() - t0
    return rep


async def replay(path: Path, sysm: System) -> None:
    with open(path, "rb") as f:
        target, case = pickle.load(f)
    if target == "stream":
        case = [pb.ProcessingRequest.FromString(m) for m in case]
    await run_case(sysm, target, case)
    print("no crash")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=1_000_000, help="cases in all, spread evenly over the targets")
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    p.add_argument(
        "--model",
        default=str(ROOT / ".cache" / "tiny-llama"),
        help="model dir with tokenizer.json and a chat template (built by bench.vllm_model)",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "fuzz"), help="where failing cases are written")
    p.add_argument("--replay", type=Path, help="run one saved failing case")
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.10,
        help="fail if RSS grows more than this fraction after the first tenth of the run",
    )
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    # Rejections are logged at info, template failures at warning: millions of lines otherwise. The
    # properties read kvroute's error counters instead.
    tokenize.CACHE_BYTES = 4 << 20  # likewise the tokenizer's piece cache
    logging.getLogger("kvroute").setLevel(logging.CRITICAL if args.replay is None else logging.INFO)
    model = Path(args.model)
    if "template" in args.targets and not (model / "tokenizer.json").is_file():
        from bench.vllm_model import build

        build(model)
    sysm = System(model if (model / "tokenizer.json").is_file() else None)
    try:
        if args.replay:
            asyncio.run(replay(args.replay, sysm))
            return 0
        rep = asyncio.run(fuzz(args, sysm))
    finally:
        sysm.close()
    print(rep.render())
    growth = rep.rss_end_kib / max(rep.rss_early_kib, 1) - 1
    if sum(rep.crashes.values()):
        print(f"FAIL: {sum(rep.crashes.values())} crash(es); cases in {args.out}", file=sys.stderr)
        return 1
    if growth > args.max_rss_growth:
        print(f"FAIL: RSS grew {growth:.0%} after the first tenth (limit {args.max_rss_growth:.0%})", file=sys.stderr)
        return 1
    print(f"OK: 0 crashes, RSS growth after the first tenth {growth:+.1%}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
