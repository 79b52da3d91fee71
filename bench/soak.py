"""Soak: many concurrent streams against the local stack for a fixed time.

Starts ``specinfer up``'s stack (LLM verifier, SSM workers, request manager with embedded Redis)
and runs ``--streams`` client threads, each generating greedy requests back to back for
``--seconds``. A request refused with RESOURCE_EXHAUSTED (the deliberate load protection: queue
bound) is counted and retried after a short pause; every other error is counted by status. While
it runs, the RSS of every process (Redis included) is sampled. Reports errors by status,
per-token latency (time between stream messages divided by the tokens they carry; p50/p99) and
time to first token, throughput, and RSS at the start, the peak and the end per process.

    python bench/soak.py --streams 64 --seconds 60 --json soak.json

Exit code 1 when an error other than RESOURCE_EXHAUSTED happened.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from common import DEFAULT_PAIR, Totals, pct, stream_loop

from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.launcher import Stack, StackConfig


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (psutil when installed, else /proc); None once it is gone."""
    try:
        import psutil

        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None
    except ImportError:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the request manager's embedded redis-server)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", type=Path, default=DEFAULT_PAIR / "llm")
    p.add_argument("--ssm", type=Path, default=DEFAULT_PAIR / "ssm")
    p.add_argument(
        "--prompts",
        type=Path,
        default=DEFAULT_PAIR / "prompts.jsonl",
        help="JSON lines with 'text' (tokenized with the LLM's tokenizer)",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument(
        "--max-queue", type=int, default=16, help="below streams - max_batch, so some requests meet RESOURCE_EXHAUSTED"
    )
    p.add_argument("--expansion", default=PAPER_EXPANSION)
    p.add_argument("--retry-pause", type=float, default=0.2)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--sample-seconds", type=float, default=2.0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here too")
    return p.parse_args()


def main() -> int:
    args = parse_args()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.llm / "tokenizer.json"))
    prompts = [tok.encode(json.loads(line)["text"]).ids[:256] for line in args.prompts.read_text().splitlines()[:200]]
    state = Path(tempfile.mkdtemp(prefix="specinfer-soak-"))
    cfg = StackConfig(
        llm=args.llm,
        ssms=(args.ssm,),
        workers=args.workers,
        port=0,
        state_dir=state,
        expansion=args.expansion,
        rm_args=("--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)),
    )
    with Stack(cfg) as stack:
        samples, totals, elapsed = soak(stack, prompts, args)
        alive = {p.name: p.popen.poll() is None for p in stack.processes}
    summary = summarise(args, samples, totals, elapsed, alive)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if summary["unexpected_errors"] or not all(alive.values()) else 0


def soak(
    stack: Stack, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, list[tuple[float, int]]], Totals, float]:
    """Run the streams until ``--seconds`` have passed, sampling every process's RSS meanwhile; the samples
    by process, the streams' totals and the seconds it took."""
    pids = {p.name: p.popen.pid for p in stack.processes}
    for child in child_pids(pids["request-manager"]):
        pids["redis-server"] = child
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
    totals = Totals()
    start = time.monotonic()
    stop_at = start + args.seconds
    threads = [
        threading.Thread(target=stream_loop, args=(stack.address, prompts, i, args, stop_at, totals), daemon=True)
        for i in range(args.streams)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        now = time.monotonic() - start
        for name, pid in pids.items():
            rss = rss_bytes(pid)
            if rss is not None:
                samples[name].append((now, rss))
        time.sleep(args.sample_seconds)
    return samples, totals, time.monotonic() - start


def summarise(
    args: argparse.Namespace,
    samples: dict[str, list[tuple[float, int]]],
    totals: Totals,
    elapsed: float,
    alive: dict[str, bool],
) -> dict:
    """The summary: throughput, errors by status, latencies and each process's memory."""
    mib = 1 << 20
    memory = {
        name: {
            "start_mib": round(s[0][1] / mib, 1),
            "mid_mib": round(s[len(s) // 2][1] / mib, 1),
            "peak_mib": round(max(r for _, r in s) / mib, 1),
            "end_mib": round(s[-1][1] / mib, 1),
            "samples": len(s),
        }
        for name, s in samples.items()
        if s
    }
    unexpected = {k: v for k, v in totals.errors.items() if k != "RESOURCE_EXHAUSTED"}
    return {
        "streams": args.streams,
        "seconds": round(elapsed, 1),
        "requests_finished": totals.requests,
        "tokens": totals.tokens,
        "tokens_per_s": round(totals.tokens / elapsed, 1),
        "errors": dict(totals.errors),
        "unexpected_errors": sum(unexpected.values()),
        "per_token_ms": {
            "p50": round(1000 * pct(totals.per_token, 50), 1),
            "p99": round(1000 * pct(totals.per_token, 99), 1),
            "mean": round(1000 * statistics.fmean(totals.per_token), 1) if totals.per_token else None,
        },
        "first_token_ms": {
            "p50": round(1000 * pct(totals.first_token, 50), 1),
            "p99": round(1000 * pct(totals.first_token, 99), 1),
        },
        "memory": memory,
        "processes_alive_at_end": alive,
        "cpu_count": os.cpu_count(),
    }


if __name__ == "__main__":
    raise SystemExit(main())
