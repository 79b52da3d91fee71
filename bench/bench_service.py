"""Service path vs in-process engine: same models, prompts, tree and machine.

Runs greedy speculative generation of the same prompts (a) in this process with
:class:`SpeculativeEngine` and (b) through the local stack (request manager + Redis, SSM worker,
LLM verifier as separate processes, gRPC streaming), at each batch size (batch B: B concurrent
requests, run in rounds until every prompt is done). Prints tokens/s, mean per-token latency,
LLM steps and the service's overhead per verify step.

    python bench/bench_service.py --llm /tmp/pycode-a-llm-1b --ssm ../shared/models/pycode-a/ssm \\
        --prompts ../shared/models/pycode-a/prompts.jsonl --count 8 --batch 1,8 --new-tokens 64
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
from compare import load_prompts

from specinfer.client import Client
from specinfer.core import ExpansionConfig
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.launcher import Stack, StackConfig
from specinfer.models.loading import eos_token_id, load_backend


@dataclass
class Run:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0  # LLM verify steps, summed over requests
    iterations: int = 0  # batched verify calls (in-process only)
    per_token: list[float] = field(default_factory=list)  # seconds per generated token, per request


def in_process(args, rounds: list[list[tuple[int, ...]]], batch: int) -> Run:
    torch.set_num_threads(args.threads)
    llm = load_backend(args.llm, "llm", backend=args.backend, kv_cache_bytes=int(args.kv_cache_bytes))
    ssm = load_backend(args.ssm, "ssm", backend=args.backend)
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=batch, eos_token_id=eos_token_id(args.llm)))
    spec = SpeculationConfig(ExpansionConfig.parse(args.expansion))
    run = Run()
    for r, prompts in enumerate(rounds):
        reqs = [GenerationRequest(f"r{r}p{i}", tuple(p), args.new_tokens, speculation=spec, ignore_eos=True) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        results = engine.generate(reqs)
        elapsed = time.perf_counter() - start
        run.seconds += elapsed
        run.tokens += sum(len(x.output_tokens) for x in results)
        run.steps += sum(len(x.steps) for x in results)
        run.iterations += max(len(x.steps) for x in results)
        run.per_token += [elapsed / len(x.output_tokens) for x in results]
    return run


def through_services(args, rounds: list[list[tuple[int, ...]]], batch: int) -> Run:
    cfg = StackConfig(
        llm=Path(args.llm),
        ssms=(Path(args.ssm),),
        port=0,
        state_dir=Path(tempfile.mkdtemp()),
        backend=args.backend,
        expansion=args.expansion,
        threads=args.threads,
        rm_args=("--max-batch", str(batch)),
        model_args=("--kv-cache-bytes", str(int(args.kv_cache_bytes))),
    )
    run = Run()
    with Stack(cfg) as stack, Client(stack.address, timeout=3600) as client:

        def one(prompt: tuple[int, ...]) -> tuple[int, int, float]:
            req = Client.request(prompt, args.new_tokens, expansion=ExpansionConfig.parse(args.expansion).widths, ignore_eos=True)
            t0 = time.perf_counter()
            done = client.generate(req)
            return len(done.token_ids), done.finished.usage.llm_steps, (time.perf_counter() - t0) / max(1, len(done.token_ids))

        for prompts in rounds:
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                out = list(pool.map(one, prompts))
            run.seconds += time.perf_counter() - start
            run.tokens += sum(t for t, _, _ in out)
            run.steps += sum(s for _, s, _ in out)
            run.per_token += [p for _, _, p in out]
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", required=True)
    ap.add_argument("--ssm", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl with a 'text' field per line")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--expansion", default=PAPER_EXPANSION)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-bytes", type=float, default=8e9)
    args = ap.parse_args()
    prompts = load_prompts(Path(args.prompts), Path(args.llm), args.count, 0)
    print(f"LLM {args.llm}, SSM {args.ssm}, {len(prompts)} prompts x {args.new_tokens} tokens, tree <{args.expansion}>, greedy, {args.threads} threads")
    print()
    print("| batch | path | seconds | tokens/s | mean per-token latency ms | LLM steps (sum over requests) | service overhead ms / iteration |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in args.batch.split(",")):
        rounds = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        local = in_process(args, rounds, batch)
        remote = through_services(args, rounds, batch)
        for name, run in (("in-process", local), ("services", remote)):
            overhead = f"{1000 * (remote.seconds - local.seconds) / max(1, local.iterations):.1f}" if run is remote else ""
            share = f" ({100 * (remote.tokens / remote.seconds) / (local.tokens / local.seconds):.0f}% of in-process)" if run is remote else ""
            print(
                f"| {batch} | {name} | {run.seconds:.1f} | {run.tokens / run.seconds:.2f}{share} | {1000 * statistics.mean(run.per_token):.0f} "
                f"| {run.steps} | {overhead} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
