"""Speculation methods through the services (and in process): same models, prompts and machine.

Runs greedy generation of the same prompts with each method, (a) through the local stack (request
manager + Redis, SSM worker, LLM verifier as separate processes, gRPC streaming) and, unless
``--skip-in-process``, (b) in this process with :class:`SpeculativeEngine`, at each batch size
(batch B: B concurrent requests, run in rounds until every prompt is done). Methods, chosen per
request through the public API: ``none`` (incremental decoding), ``auto`` (adaptive speculation),
``auto-no-head`` (adaptive, without the draft head ``--head`` gives the verifier) and static expansions
(``1,1,1,1,1,1,1,1``). One stack per batch size serves every method, so the
rows of a batch size share the services' start-up calibration. Prints tokens/s, mean per-token
latency, LLM steps, and each method's speed relative to ``none`` on the same path.

    python bench/bench_service.py --llm /tmp/llm-1b --ssm ../shared/models/pycode-a/ssm \\
        --prompts ../shared/models/pycode-a/prompts.jsonl --count 8 --batch 1,8 --new-tokens 32 \\
        --methods "none;auto;1,1,1,1,1,1,1,1;1,1,3,1,1,1,1,1"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import load_prompts

from specinfer.client import Client
from specinfer.core import ExpansionConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.launcher import Stack, StackConfig
from specinfer.models.head_drafter import with_head
from specinfer.models.loading import eos_token_id, load_backend


@dataclass
class Run:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0  # LLM verify steps, summed over requests
    per_token: list[float] = field(default_factory=list)  # seconds per generated token, per request
    outputs: list[tuple[int, ...]] = field(default_factory=list)


def in_process(args, rounds: list[list[tuple[int, ...]]], batch: int, methods: list[str]) -> dict[str, Run]:
    torch.set_num_threads(args.threads)
    llm = load_backend(args.llm, "llm", args.dtype, backend=args.backend, kv_cache_bytes=int(args.kv_cache_bytes))
    ssm = load_backend(args.ssm, "ssm", args.dtype, backend=args.backend)
    if args.head:
        llm = with_head(llm, args.head, args.llm)
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=batch, eos_token_id=eos_token_id(args.llm)))
    if any(m.startswith("auto") for m in methods):
        engine.adaptive  # noqa: B018 - calibrates the cost model now, outside the timed rows
    runs = {}
    for method in methods:
        if method == "none":
            spec = None
        elif method.startswith("auto"):
            spec = SpeculationConfig(None, head=method == "auto")
        else:
            spec = SpeculationConfig(ExpansionConfig.parse(method))
        run = runs[method] = Run()
        for r, prompts in enumerate(rounds):
            reqs = [
                GenerationRequest(f"{method}-r{r}p{i}", tuple(p), args.new_tokens, speculation=spec, ignore_eos=True)
                for i, p in enumerate(prompts)
            ]
            start = time.perf_counter()
            results = engine.generate(reqs)
            elapsed = time.perf_counter() - start
            run.seconds += elapsed
            run.tokens += sum(len(x.output_tokens) for x in results)
            run.steps += sum(len(x.steps) for x in results)
            run.per_token += [elapsed / len(x.output_tokens) for x in results]
            run.outputs += [tuple(x.output_tokens) for x in results]
    return runs


def through_services(args, rounds: list[list[tuple[int, ...]]], batch: int, methods: list[str]) -> dict[str, Run]:
    cfg = StackConfig(
        llm=Path(args.llm),
        ssms=(Path(args.ssm),),
        port=0,
        state_dir=Path(tempfile.mkdtemp()),
        backend=args.backend,
        expansion="auto",
        threads=args.threads,
        extra_env=(("SPECINFER_DTYPE", args.dtype),),
        rm_args=("--max-batch", str(batch)),
        model_args=("--kv-cache-bytes", str(int(args.kv_cache_bytes))),
        head=Path(args.head) if args.head else None,
    )
    runs = {}
    started = time.perf_counter()
    with Stack(cfg) as stack, Client(stack.address, timeout=3600) as client:
        print(
            f"stack for batch {batch} up (start-up calibration included) in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        for method in methods:

            def one(prompt: tuple[int, ...], method: str = method) -> tuple[tuple[int, ...], int, float]:
                adaptive = method.startswith("auto")
                widths = () if method == "none" or adaptive else ExpansionConfig.parse(method).widths
                req = Client.request(
                    prompt,
                    args.new_tokens,
                    expansion=widths,
                    speculation=method != "none",
                    adaptive=adaptive,
                    head=None if not adaptive else method == "auto",
                    ignore_eos=True,
                )
                t0 = time.perf_counter()
                done = client.generate(req)
                return (
                    tuple(done.token_ids),
                    done.finished.usage.llm_steps,
                    (time.perf_counter() - t0) / max(1, len(done.token_ids)),
                )

            run = runs[method] = Run()
            for prompts in rounds:
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                    out = list(pool.map(one, prompts))
                run.seconds += time.perf_counter() - start
                run.tokens += sum(len(t) for t, _, _ in out)
                run.steps += sum(s for _, s, _ in out)
                run.per_token += [p for _, _, p in out]
                run.outputs += [t for t, _, _ in out]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", required=True)
    ap.add_argument("--ssm", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl with a 'text' field per line")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=64, help="keep each prompt's last N tokens")
    ap.add_argument("--methods", default="none;auto;1,1,1,1,1,1,1,1", help="';'-separated: none, auto, or an expansion")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-bytes", type=float, default=4e9)
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--head", default=None, help="a draft head of the LLM: the verifier (and the engine) draft with it")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    prompts = load_prompts(Path(args.prompts), Path(args.llm), args.count, args.max_prompt_tokens)
    print(
        f"LLM {args.llm}, SSM {args.ssm}, {len(prompts)} prompts x {args.new_tokens} tokens, greedy, {args.dtype}, "
        f"{args.threads} threads"
    )
    table = [
        "| batch | path | method | seconds | tokens/s | vs none | mean per-token latency ms | LLM steps "
        "| greedy = none |",
        "| --- " * 9 + "|",
    ]
    for batch in (int(b) for b in args.batch.split(",")):
        rounds = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        paths = {"services": through_services(args, rounds, batch, methods)}
        if not args.skip_in_process:
            paths["in-process"] = in_process(args, rounds, batch, methods)
        for path, runs in paths.items():
            base = runs.get("none")
            for method, run in runs.items():
                rate = run.tokens / run.seconds
                versus = f"{rate / (base.tokens / base.seconds):.2f}" if base is not None else ""
                same = (
                    f"{sum(a == b for a, b in zip(run.outputs, base.outputs, strict=True))}/{len(run.outputs)}"
                    if base is not None
                    else ""
                )
                latency = 1000 * statistics.mean(run.per_token)
                row = (
                    f"| {batch} | {path} | {method} | {run.seconds:.3f} | {rate:.2f} | {versus} | {latency:.1f} "
                    f"| {run.steps} | {same} |"
                )
                table.append(row)
                print(row, flush=True)
    print()
    print("\n".join(table))


if __name__ == "__main__":
    main()
