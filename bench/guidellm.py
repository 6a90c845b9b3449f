"""``python -m bench.guidellm``: a routing comparison driven by guidellm, a load generator no one here wrote.

Per policy (default kvroute-approx and sglang-router): a fresh simulated fleet with the router in
front of it, started as ``python -m bench run`` starts them (bench/harness.py), then ``guidellm run``
against the router's URL with the same data, Poisson rate, request count and seed. guidellm's JSON
report gives TTFT p50/p90/p99, inter-token and request latency and output throughput; the pods' own
counters give the prefix-cache hit rate and the balance, as in ``bench run``. It prints the rows side
by side and writes ``<out>/results.json`` + ``run.json`` in ``bench run``'s format, so
``python -m bench.results import <out> --as routing-guidellm`` makes them a headline; each policy's
guidellm report stays as ``<out>/<policy>.guidellm.json``. ``--repeat N`` runs every policy N times,
the rounds interleaved, and reports each figure as the median of the N with its min-max (reports
``<policy>.<round>.guidellm.json``).

guidellm (torch and transformers come with it) lives in its own venv, ``make guidellm``. Its
tokenizer is the sim's (bench.sim.tokenizer.export_tokenizer) taught the words guidellm writes
(Faker's lorem list), so the prompt lengths guidellm asks for are the pods' token counts (checked:
a 2000-token cut of its text is 2000 tokens at the pods); with the bench's own tokenizer every such
word would count one token per byte on guidellm's side. kvroute's ``routing.chars_per_token`` is
measured on the same text (``--chars-per-token auto``, ~5.8), as ``bench run``'s auto does.
guidellm's request count is its own (it once left one of 30 requests out of its report); the
pods' counts are in ``results.md``'s per-pod table.

The default data mirrors ``bench run --scenario shared-prefix``'s headline (64 documents of 8000
tokens, 360 tokens of the request's own, 32 out; 300 requests at 13.4 req/s, load 0.7 there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness, report, results, workloads
from bench.sim.tokenizer import SimTokenizer, export_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
TOKENIZER_DIR = ROOT / "bench" / "out" / ".cache" / "guidellm-tokenizer"
DATA: dict[str, str] = {
    "shared-prefix": "kind=synthetic_text,prefix_tokens=8000,prefix_count=64,prompt_tokens=360,output_tokens=32",
}
POLICIES = ("kvroute-approx", "sglang-router")
# guidellm prefixes each prompt with "<iteration> <sample> m<turn> " (a number is one piece at the
# pods): pieces up to this are known to the tokenizer.
_NUMBERS = 1_000
# guidellm cuts prompts by decoding token ids, so an id must name one piece: the sim's hashed ids (32k,
# as the pods use) collide; among 2^26 the ~7k pieces seldom do (exporting costs ~1 s per 2^26).
_VOCAB_SIZE = 1 << 26


class GuidellmError(RuntimeError):
    """guidellm is missing, failed, or wrote a report without the figures needed; says which."""


@dataclass
class FakerText:
    """What guidellm's synthetic text is made of (Faker's en_US lorem words) and a sample of it."""

    words: list[str]
    sample: str

    @property
    def chars_per_token(self) -> float:
        """Characters per pod token of guidellm's text (kvroute's routing.chars_per_token for it)."""
        return len(self.sample) / max(1, len(SimTokenizer().encode(self.sample)))


def faker_text(guidellm: Path) -> FakerText:
    """Faker's word list and 20k characters of its text, from guidellm's own venv."""
    python = guidellm.parent / "python"
    code = (
        "import json; from faker import Faker; from faker.providers.lorem.en_US import Provider; "
        "f = Faker(); f.seed_instance(0); "
        "print(json.dumps({'words': Provider.word_list, 'sample': f.text(max_nb_chars=20000)}))"
    )
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, timeout=60)
        got = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise GuidellmError(f"{python}: cannot read Faker's words ({e}); run `make guidellm`") from e
    return FakerText([str(w) for w in got["words"]], str(got["sample"]))


def tokenizer_pieces(words: Sequence[str]) -> list[str]:
    """Every piece guidellm's text splits into at the pods: each word (and number) bare or after a
    space, capitalised too (a sentence's first word; a newline is a piece of its own)."""
    forms = [
        *words,
        *(w.capitalize() for w in words),
        *(str(n) for n in range(_NUMBERS)),
        *(f"m{t}" for t in range(64)),
    ]
    return [*forms, *(" " + f for f in forms)]


def build_tokenizer(words: Sequence[str], out: Path) -> Path:
    """The sim's tokenizer as a Hugging Face directory that knows ``words`` (built once): the pods'
    pieces, so the same counts, under ids that do not collide (``_VOCAB_SIZE``)."""
    export_tokenizer(out, tokenizer_pieces(words), vocab_size=_VOCAB_SIZE)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    if len(set(vocab.values())) < len(vocab):  # guidellm's prompts may then be a token off here and there
        print(f"bench.guidellm: {len(vocab) - len(set(vocab.values()))} token ids name two pieces", file=sys.stderr)
    return out


def guidellm_args(
    guidellm: Path, url: str, tokenizer: Path, data: str, rate: float, requests: int, seed: int, report_path: Path
) -> list[str]:
    """``guidellm run`` at a Poisson ``rate`` for ``requests`` requests, its JSON report to ``report_path``."""
    return [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={url},model={workloads.MODEL}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", data,
        "--profile", f"kind=poisson,rate={rate:g}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--seed", f"kind=static,value={seed}",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]  # fmt: skip


def _stat(metrics: dict[str, Any], name: str) -> dict[str, Any]:
    try:
        s = metrics[name]["successful"]
    except KeyError as e:
        raise GuidellmError(f"guidellm report: no metrics.{name}.successful") from e
    assert isinstance(s, dict)
    return s


def parse_report(path: Path) -> dict[str, Any]:
    """A guidellm JSON report's one benchmark as ``bench run`` row figures (seconds, tokens/s)."""
    doc = json.loads(path.read_text())
    benchmarks = doc.get("benchmarks") or []
    if len(benchmarks) != 1:
        raise GuidellmError(f"{path}: expected one benchmark, found {len(benchmarks)}")
    b = benchmarks[0]
    m = b["metrics"]
    totals = m["request_totals"]
    ttft, itl, e2e = (_stat(m, k) for k in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency"))
    if not ttft.get("count"):
        raise GuidellmError(f"{path}: no successful request ({totals})")
    duration = float(b["duration"])
    out_tokens = float(_stat(m, "output_token_count")["total_sum"])
    return {
        "requests": int(totals["total"]),
        "errors": int(totals["errored"]) + int(totals["incomplete"]),
        "ttft_p50_s": ttft["percentiles"]["p50"] / 1e3,
        "ttft_p90_s": ttft["percentiles"]["p90"] / 1e3,
        "ttft_p99_s": ttft["percentiles"]["p99"] / 1e3,
        "itl_p50_s": itl["percentiles"]["p50"] / 1e3,
        "itl_p99_s": itl["percentiles"]["p99"] / 1e3,
        "e2e_p50_s": e2e["percentiles"]["p50"],
        "output_tok_s": out_tokens / duration if duration > 0 else 0.0,
        "throughput_rps": int(totals["successful"]) / duration if duration > 0 else 0.0,
        "prompt_tokens_p50": _stat(m, "prompt_token_count")["percentiles"]["p50"],
        "wall_s": duration,
        "off_schedule": off_schedule(b),
    }


def off_schedule(benchmark: dict[str, Any]) -> int:
    """Requests guidellm aimed before its own start. Its Poisson schedule sometimes never takes the start
    time (arrival times count from -1 s), so every arrival is overdue and all the requests go out in a
    burst: not the load asked for. guidellm 0.8.1's AsyncPoissonStrategy.init_processes_start wakes the
    workers (the start time's event) before it writes the schedule's offset, and a worker that reads the
    offset first counts from its initial -1 s: on this 2-core host about one run in four."""
    n = 0
    for recs in (benchmark.get("requests") or {}).values():
        for r in recs or ():
            info = r.get("info") or {}
            target, start = (info.get("timings") or {}).get("targeted_start"), info.get("scheduler_start_time")
            n += target is not None and start is not None and target < start - 1.0
    return n


def hit_and_balance(pods: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The pods' prefix-cache hit rate (tokens) and busy-time imbalance over the run, as ``bench run``'s rows."""
    queried = sum(p["prefix_queries_tokens"] for p in pods)
    busy = [p["busy_s"] for p in pods]
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    return {
        "hit_rate": sum(p["prefix_hits_tokens"] for p in pods) / queried if queried else 0.0,
        "load_imbalance": max(busy) / mean_busy if mean_busy > 0 else None,
        "pods": [dict(p) for p in pods],
    }


@dataclass
class Setup:
    guidellm: Path
    tokenizer: Path
    data: str
    rate: float
    requests: int
    seed: int
    timeout: float
    out: Path


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# Runs of one policy until guidellm keeps its schedule (``off_schedule``: ~1 in 4 does not here): six in a row
# off it (~1 in 4,000) stop the command rather than report a load that was not asked for.
OFF_SCHEDULE_TRIES = 6


def run_policy(
    policy: str, cfg: harness.RunConfig, s: Setup, tries: int = OFF_SCHEDULE_TRIES, tag: str = ""
) -> report.PolicyRun:
    """``run_once``, again on a fresh fleet while guidellm sent its requests off schedule."""
    for attempt in range(1, tries + 1):
        run = run_once(policy, cfg, s, tag)
        late = run.row.get("off_schedule") or 0
        if not late:
            return run
        print(f"  {policy}: guidellm sent {late} requests off its schedule (a burst); run {attempt} of {tries}",
              file=sys.stderr)  # fmt: skip
    raise GuidellmError(f"{policy}: guidellm kept sending requests off its Poisson schedule ({tries} runs)")


def run_once(policy: str, cfg: harness.RunConfig, s: Setup, tag: str = "") -> report.PolicyRun:
    """One policy on a fresh fleet under guidellm; a router that fails to start becomes a ``failed`` row.
    guidellm's report and log are ``<out>/<policy><tag>.guidellm.json`` / ``.log``."""
    report_path = s.out / f"{policy}{tag}.guidellm.json"
    log_path = s.out / f"{policy}{tag}.guidellm.log"
    try:
        with contextlib.ExitStack() as stack:
            fleet = stack.enter_context(harness.SimFleet(cfg))
            router = harness.open_router(policy, fleet, stack, cfg)
            pids = {**fleet.pids(), **router.pids}
            before, cpu0, child0 = fleet.stats(), harness._cpu(pids), _children_cpu()
            t0 = time.perf_counter()
            args = guidellm_args(s.guidellm, router.url, s.tokenizer, s.data, s.rate, s.requests, s.seed, report_path)
            with log_path.open("w") as log:
                rc = subprocess.run(
                    args, stdout=log, stderr=subprocess.STDOUT, timeout=s.timeout, check=False
                ).returncode
            wall = time.perf_counter() - t0
            cpu1, after, child1 = harness._cpu(pids), fleet.stats(), _children_cpu()
    except harness.RouterStartError as e:
        print(f"\n*** {e}\n", file=sys.stderr)
        return report.PolicyRun({"policy": policy, "scenario": "guidellm", "failed": str(e).splitlines()[0]})
    if rc != 0 or not report_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise GuidellmError(f"{policy}: guidellm exited {rc} (log {log_path}):\n{tail}")
    cores = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0 if k in cpu1}
    cores["guidellm"] = (child1 - child0) / wall
    other = cores["machine"] - sum(v for k, v in cores.items() if k not in ("machine", "client"))
    row: dict[str, Any] = {
        "policy": policy,
        "scenario": "guidellm",
        **parse_report(report_path),
        **hit_and_balance(report.pod_deltas(before, after)),
        "ideal_hit_rate": None,  # guidellm's prompts are its own: no ideal computed
        "cpu_cores": cores,
        "other_cores": other,
        "contended": other > cfg.quiet_cores,
    }
    return report.PolicyRun(row)


def side_by_side(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table, plus guidellm's own request rate and median prompt length."""
    lines = [report.markdown_table(rows), "", "| policy | completed req/s | prompt tokens p50 |", "|---|---|---|"]
    lines += [
        f"| {r['policy']} | {report.cell(r, 'throughput_rps', '{:.2f}')} | "
        f"{report.cell(r, 'prompt_tokens_p50', '{:.0f}')} |"
        for r in rows
        if not r.get("failed")
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.guidellm",
        description=(__doc__ or "").split("\n\n")[0].split(": ", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list of bench run's policies")
    ap.add_argument("--data", default="shared-prefix",
                    help=f"a preset ({', '.join(DATA)}) or guidellm's own --data value")  # fmt: skip
    ap.add_argument("--rate", type=float, default=13.4, help="Poisson arrivals, req/s")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--profile", default="h100-llama8b")
    ap.add_argument("--seed", type=int, default=0, help="guidellm's data and arrival seed (the same for every policy)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="s one guidellm run may take")
    ap.add_argument("--chars-per-token", type=harness.chars_per_token_arg, default="auto",
                    help="kvroute's routing.chars_per_token: a number, or auto, measured on guidellm's text "
                    "(Faker's words: ~5.8 characters a pod token; kvroute's own default is English's 4)")  # fmt: skip
    ap.add_argument("--quiet-wait", type=float, default=0.0, help="wait up to this many s for a quieter host")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="rounds of every policy, interleaved (the same arrivals, fresh fleets): each figure the "
                    "median of the N runs, its min-max beside it")  # fmt: skip
    ap.add_argument("--guidellm", type=Path, default=GUIDELLM, help="the guidellm executable (make guidellm)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/guidellm"))
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat must be 1 or more")
    harness.stop_on_sigterm()
    if not a.guidellm.exists():
        print(f"bench.guidellm: {a.guidellm} is missing; run `make guidellm`", file=sys.stderr)
        return 2
    policies = [p for p in a.policies.split(",") if p]
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        text = faker_text(a.guidellm)
    except GuidellmError as e:
        print(f"bench.guidellm: {e}", file=sys.stderr)
        return 2
    cpt = round(text.chars_per_token, 2) if a.chars_per_token == "auto" else a.chars_per_token
    # kvroute-precise's tokenizer knows guidellm's words as the pods' does (else no block key would match).
    cfg = harness.RunConfig(policies, pods=a.pods, profile=a.profile, out=a.out, quiet=True, chars_per_token=cpt,
                            extra_pieces=tuple(tokenizer_pieces(text.words)))  # fmt: skip
    data = DATA.get(a.data, a.data)
    tokenizer = build_tokenizer(text.words, TOKENIZER_DIR)
    s = Setup(a.guidellm, tokenizer, data, a.rate, a.requests, a.seed, a.timeout, a.out)
    t_start = time.monotonic()
    per_round: list[list[report.PolicyRun]] = []
    for k in range(a.repeat):
        runs = []
        for policy in policies:
            if a.quiet_wait > 0:
                harness.wait_quiet(a.quiet_wait, cfg.quiet_cores)
            round_note = f" (round {k + 1} of {a.repeat})" if a.repeat > 1 else ""
            print(f"{policy}: guidellm, {a.requests} requests at {a.rate:g} req/s{round_note} ...", file=sys.stderr,
                  flush=True)  # fmt: skip
            try:
                runs.append(run_policy(policy, cfg, s, tag=f".{k + 1}" if a.repeat > 1 else ""))
            except (GuidellmError, subprocess.TimeoutExpired) as e:
                print(f"bench.guidellm: {e}", file=sys.stderr)
                return 1
        per_round.append(runs)
    runs = per_round[0] if a.repeat == 1 else report.median_runs(per_round)
    meta = {
        "scenario": "guidellm",
        "command": "python -m bench.guidellm " + " ".join(argv if argv is not None else sys.argv[1:]),
        "workload": {"client": "guidellm", "data": data, "requests": a.requests, "rate_rps": a.rate, "seed": a.seed},
        "pods": a.pods,
        "profile": a.profile,
        "machine": f"{os.cpu_count()} CPU cores, no GPU (simulated pods)",
        "code": results.code_version(),
        "rate_rps": a.rate,
        "requests": a.requests,
        "repeat": a.repeat,
        "kvroute_chars_per_token": cpt,
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    report.write(a.out, runs, meta, plots=False)
    print(side_by_side([r.row for r in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
