"""The OpenAI-compatible HTTP API under load, against the same load through gRPC (issue 15).

One local stack (LLM verifier, SSM workers, request manager with its HTTP API); ``--streams``
client threads generate greedy requests back to back for ``--seconds`` per path, through gRPC
(``Generate`` streams, as bench/soak.py does) and through HTTP (``/v1/completions`` with
``stream: true``, server-sent events read with the standard library), after an uncounted warm-up,
in the order gRPC, HTTP, HTTP, gRPC (half of ``--seconds`` each). Both paths use the same
prompts, lengths and speculation. Reports, per path: finished requests, errors, tokens/s, time to
first token and inter-token latency (p50/p99), and HTTP's tokens/s relative to gRPC's.

    python bench/http_load.py --streams 32 --seconds 60 --json bench/results/http-load.json

Exit code 1 on any error.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

from common import DEFAULT_PAIR, Totals, pct, stream_loop

from specinfer.launcher import Stack, StackConfig
from specinfer.request_manager.state.redis_server import free_tcp_port


def http_stream_loop(port: int, prompts: list[list[int]], index: int, args, stop_at: float, totals: Totals) -> None:
    """Like common.stream_loop, over HTTP: one keep-alive connection, SSE chunks parsed as they come."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.request_timeout)
    k = index
    while time.monotonic() < stop_at:
        prompt = prompts[k % len(prompts)]
        k += args.streams
        body = {"prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        started = last = time.monotonic()
        lat, first, count, tokens = [], None, 0, 0
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                with totals.lock:
                    totals.errors[f"HTTP {resp.status}"] += 1
                continue
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    resp.read()
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    continue
                now = time.monotonic()
                if chunk["choices"][0]["text"]:
                    # a chunk carries one verify step's tokens; their count comes with the usage chunk, so
                    # latency is taken per chunk here and spread over tokens below
                    if first is None:
                        first = now - started
                    lat.append(now - last)
                    last = now
                    count += 1
        except (OSError, http.client.HTTPException, RuntimeError) as exc:
            with totals.lock:
                totals.errors[type(exc).__name__] += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.request_timeout)
            continue
        per_token = [d / (tokens / count) for d in lat] if count and tokens else []
        with totals.lock:
            totals.requests += 1
            totals.tokens += tokens
            totals.per_token += per_token[1:]
            if first is not None:
                totals.first_token.append(first)
    conn.close()


def run_phase(target, address, prompts, args, totals: Totals, seconds: float) -> float:
    """``args.streams`` clients of ``target`` for ``seconds`` (requests in flight then finish), counted
    into ``totals``; returns the phase's wall time."""
    start = time.monotonic()
    stop_at = start + seconds
    threads = [
        threading.Thread(target=target, args=(address, prompts, i, args, stop_at, totals), daemon=True)
        for i in range(args.streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


def summary(totals: Totals, elapsed: float) -> dict:
    return {
        "requests": totals.requests,
        "errors": dict(totals.errors),
        "tokens": totals.tokens,
        "tokens_per_s": round(totals.tokens / elapsed, 1),
        "ttft_ms": {
            "p50": round(1000 * pct(totals.first_token, 50), 1),
            "p99": round(1000 * pct(totals.first_token, 99), 1),
        },
        "itl_ms": {
            "p50": round(1000 * pct(totals.per_token, 50), 1),
            "p99": round(1000 * pct(totals.per_token, 99), 1),
        },
        "seconds": round(elapsed, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", type=Path, default=DEFAULT_PAIR / "llm")
    p.add_argument("--ssm", type=Path, default=DEFAULT_PAIR / "ssm")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PAIR / "prompts.jsonl", help="JSON lines with 'text'")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0, help="per path, in two halves (gRPC, HTTP, HTTP, gRPC)")
    p.add_argument(
        "--warmup-seconds", type=float, default=10.0, help="gRPC load before the measured phases (not counted)"
    )
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--expansion", default="auto")
    p.add_argument("--retry-pause", type=float, default=0.2, help="after RESOURCE_EXHAUSTED (counted as an error here)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.llm / "tokenizer.json"))
    prompts = [tok.encode(json.loads(line)["text"]).ids[:256] for line in args.prompts.read_text().splitlines()[:200]]
    cfg = StackConfig(
        llm=args.llm,
        ssms=(args.ssm,),
        workers=args.workers,
        port=0,
        state_dir=Path(tempfile.mkdtemp(prefix="specinfer-http-load-")),
        expansion=args.expansion,
        http_port=free_tcp_port(),
        rm_args=("--max-batch", str(args.max_batch), "--max-queue", str(4 * args.streams)),
    )
    totals = {"grpc": Totals(), "http": Totals()}
    seconds = {"grpc": 0.0, "http": 0.0}
    with Stack(cfg) as stack:
        targets = {"grpc": (stream_loop, stack.address), "http": (http_stream_loop, cfg.http_port)}
        if args.warmup_seconds > 0:  # not counted: first allocations, and the cost model's first refinements
            run_phase(stream_loop, stack.address, prompts, args, Totals(), args.warmup_seconds)
        # ABBA: each path runs twice for half of --seconds, so a drift over the run (warm-up, the online
        # cost model, other load on the machine) weighs on both paths alike
        for path in ("grpc", "http", "http", "grpc"):
            print(f"{path}: {args.seconds / 2:.0f} s with {args.streams} streams", flush=True)
            seconds[path] += run_phase(*targets[path], prompts, args, totals[path], args.seconds / 2)
    out = {
        "streams": args.streams,
        "new_tokens": args.new_tokens,
        **{path: summary(totals[path], seconds[path]) for path in ("grpc", "http")},
    }
    out["http_vs_grpc_tokens_per_s"] = round(out["http"]["tokens_per_s"] / max(1e-9, out["grpc"]["tokens_per_s"]), 3)
    print("| path | requests | errors | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("| --- " * 8 + "|")
    for path in ("grpc", "http"):
        s = out[path]
        print(
            f"| {path} | {s['requests']} | {sum(s['errors'].values())} | {s['tokens_per_s']} | {s['ttft_ms']['p50']} "
            f"| {s['ttft_ms']['p99']} | {s['itl_ms']['p50']} | {s['itl_ms']['p99']} |"
        )
    print(f"HTTP tokens/s = {out['http_vs_grpc_tokens_per_s']}x gRPC's")
    print(json.dumps(out))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 1 if out["grpc"]["errors"] or out["http"]["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
