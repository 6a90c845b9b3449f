"""``kvroute explain`` and ``kvroute endpoints``: call a running kvroute's admin service and print
readable tables (``--json`` for scripts)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message

if TYPE_CHECKING:  # the stubs are generated at install time: loaded only when a command runs
    from extproc.admin.proto import admin_pb2 as pb

DEFAULT_ADMIN = "127.0.0.1:9004"
EXIT_UNREACHABLE = 3


def add_arguments(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--admin", default=DEFAULT_ADMIN, metavar="HOST:PORT",
                        help=f"kvroute's admin port (server.admin_port; default {DEFAULT_ADMIN})")  # fmt: skip
    common.add_argument("--json", action="store_true", help="print the answer as JSON")
    common.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for kvroute (default 5)")
    e = sub.add_parser(
        "explain",
        parents=[common],
        help="the decision kvroute would make now for a request (changes nothing)",
        description="Ask a running kvroute where it would send this request, and why: every endpoint's filter "
        "verdicts, scores, matched blocks and predicted cached tokens, and the P/D decision. Nothing is "
        "recorded: no index entry, pin, in-flight slot or queue estimate.",
    )
    e.add_argument("--body", required=True, metavar="FILE", help="the OpenAI request body (JSON); - for stdin")
    e.add_argument("--header", "-H", action="append", default=[], metavar="K:V",
                   help="a request header, e.g. x-tenant-id:acme (repeatable)")  # fmt: skip
    e.add_argument("--path", default="/v1/chat/completions", help="the request path (default /v1/chat/completions)")
    n = sub.add_parser("endpoints", parents=[common], help="the pods kvroute knows, their state and load")
    n.add_argument("--pool", default="", help="only this pool")


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToJson

    from extproc.admin.proto import admin_pb2 as pb
    from extproc.admin.proto import admin_pb2_grpc as pb_grpc

    try:
        with grpc.insecure_channel(args.admin) as channel:
            stub = pb_grpc.AdminStub(channel)
            if args.command == "explain":
                answer: Message = stub.Explain(_explain_request(args, pb), timeout=args.timeout)
            else:
                answer = stub.ListEndpoints(pb.ListEndpointsRequest(pool=args.pool), timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"kvroute {args.command}: {args.admin}: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (OSError, ValueError) as e:
        print(f"kvroute {args.command}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(MessageToJson(answer, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    elif isinstance(answer, pb.ExplainResponse):
        print(render_explain(answer))
    else:
        assert isinstance(answer, pb.ListEndpointsResponse)
        print(render_endpoints(answer))
    return 0


def _explain_request(args: argparse.Namespace, pb: Any) -> pb.ExplainRequest:
    body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    headers = {}
    for h in args.header:
        k, sep, v = h.partition(":")
        if not sep or not k.strip():
            raise ValueError(f"--header {h!r}: not K:V")
        headers[k.strip().lower()] = v.strip()
    return pb.ExplainRequest(path=args.path, method="POST", body=body, headers=headers)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _opt(msg: Message, field: str, fmt: str = "{:.3g}") -> str:
    return fmt.format(getattr(msg, field)) if msg.HasField(field) else "-"


def render_explain(x: pb.ExplainResponse) -> str:
    if x.http_status != 200:
        return f"refused: HTTP {x.http_status}: {x.error}"
    keys = "token-exact keys (precise index)" if x.precise else "character-block keys (approximate index)"
    lines = [
        f"pool {x.pool}  model {x.model or '-'}  reason {x.reason}  {x.total_blocks} blocks, "
        f"~{x.prompt_tokens} prompt tokens, {keys}",
        "",
    ]
    rows = []
    for e in x.endpoints:
        failed = next((f.filter for f in e.filters if not f.passed), "")
        rows.append([
            "pick" if e.rank == 0 else f"#{e.rank}" if e.rank > 0 else "out",
            e.address, e.role, e.state, f"failed {failed}" if failed else "ok",
            f"{e.total_score:.3f}", e.matched_blocks, e.predicted_cached_tokens, e.inflight,
            _opt(e, "queue"), _opt(e, "kv_usage", "{:.0%}"), _opt(e, "estimated_ttft_s", "{:.4f}"),
        ])  # fmt: skip
    lines.append(table(["rank", "endpoint", "role", "state", "filters", "score", "matched", "cached_tok",
                        "inflight", "queue", "kv_use", "est_ttft_s"], rows))  # fmt: skip
    if x.hold_s:
        lines += ["", f"held {x.hold_s:.3f}s before the answer: long prefills queued ahead on the pick (routing.hold)"]
        if 0 < x.hold_pace < 1:
            lines.append(f"  at the pods' measured pace: {x.hold_pace:.2f} of routing.cost's seconds "
                         f"(kvroute_cost_model_fit {1 / x.hold_pace:.2f})")  # fmt: skip
    if x.HasField("pd"):
        p = x.pd
        split = f"split -> prefill on {p.prefill}" if p.split else "no split (local prefill)"
        lines += ["", f"P/D: {split}; reason {p.reason}; handoff {p.handoff}; {p.uncached_tokens} uncached tokens; "
                  f"local {_opt(p, 'local_s', '{:.3f}s')}, split adds {_opt(p, 'delay_s', '{:.3f}s')}, "
                  f"allowed {_opt(p, 'allowance_s', '{:.3f}s')}, target {_opt(p, 'target_s', '{:.3f}s')}"]  # fmt: skip
    return "\n".join(lines)


def render_endpoints(x: pb.ListEndpointsResponse) -> str:
    rows = [
        [e.pool, e.address, e.role, e.state, e.model or "-", e.cache_bucket or "-", e.inflight, _opt(e, "queue"),
         _opt(e, "running"), _opt(e, "kv_usage", "{:.0%}"), _opt(e, "scrape_age_s", "{:.2f}s"), e.index_blocks,
         e.kv_events.get("batches_applied", "-") if e.kv_events else "-"]
        for e in x.endpoints
    ]  # fmt: skip
    if not rows:
        return "no endpoints"
    out = table(["pool", "endpoint", "role", "state", "model", "bucket", "inflight", "queue", "running", "kv_use",
                 "scraped", "index_blocks", "kv_batches"], rows)  # fmt: skip
    from extproc.capacity import FIT_WARN  # the range outside which kvroute warns

    for f in x.cost_fits:
        off = not FIT_WARN[0] <= f.fit <= FIT_WARN[1]
        out += (f"\nrouting.cost, pool {f.pool} ({f.role} pods): the pods prefill at {f.fit:.2f}x the rate it assumes "
                f"({f.measured_prefills:.0f} first tokens measured)"
                + (f"; scale per_token_s and per_token_context_s by {1 / f.fit:.2f}" if off else ""))  # fmt: skip
    return out
