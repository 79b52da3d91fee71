"""How many requests the same KV memory holds at once: contiguous slots against KV blocks (issue 16).

For each layout the in-process engine runs ``--requests`` greedy requests of ``--context`` tokens
(a prompt of ``--context - --new-tokens`` tokens, then ``--new-tokens`` generated) with the LLM's KV
pool sized ``--kv-cache-bytes``:

- ``slots``: one contiguous slot per request, sized for the model's longest sequence plus its tree
  rows (``--kv-block-size 0``, the default of the services);
- ``blocks N``: a paged pool of N-token KV blocks (``--kv-block-size N``); requests are admitted and
  preempted by KV blocks (``specinfer.core.kv_budget``).

Reported per layout: the pool's size (slots or blocks), the most requests running in one iteration
(measured), preemptions, iterations, and tokens/s. The SSM (for ``--speculation auto`` or a static
tree) gets a pool with room for every request, so the LLM's pool is the limit.

    python bench/kv_capacity.py --llm /tmp/llm-1b --ssm ../shared/models/pycode-a/ssm --requests 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import prompt_windows

from specinfer.core import ExpansionConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.kv_pool import KVPool
from specinfer.models.native.spec import ModelSpec


def run(args: argparse.Namespace, block_size: int, prompts: list[tuple[int, ...]]) -> dict:
    dtype = DTYPES[resolve_dtype(args.dtype, "cpu")]
    llm = NativeBackend.load(args.llm, NativeOptions(dtype, "cpu", args.kv_cache_bytes, kv_block_size=block_size))
    ssms = []
    if args.speculation != "none":
        ssm_spec = ModelSpec.from_dir(args.ssm)
        room = KVPool.bytes_per_token(ssm_spec, dtype) * (ssm_spec.positions_limit + 256) * (len(prompts) + 1)
        ssms = [NativeBackend.load(args.ssm, NativeOptions(dtype, "cpu", room, kv_block_size=16))]
    engine = SpeculativeEngine(
        llm, ssms, EngineConfig(max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens)
    )
    spec = (
        None
        if args.speculation == "none"
        else SpeculationConfig(None if args.speculation == "auto" else ExpansionConfig.parse(args.speculation))
    )
    requests = [
        GenerationRequest(f"r{i}", p, args.new_tokens, speculation=spec, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    if spec is not None and spec.expansion is None:
        engine.adaptive  # noqa: B018 (calibrate the cost model before the clock starts)
    for r in requests:
        engine.add(r)
    most, iterations, tokens = 0, 0, 0
    started = time.perf_counter()
    while engine.has_work:
        finished = engine.step()
        most = max(most, len(engine.running()) + len(finished))  # requests of the iteration just run
        iterations += 1
        tokens += sum(len(r.output_tokens) for r in finished)
    seconds = time.perf_counter() - started
    budget = llm.kv_budget
    return {
        "layout": f"blocks {block_size}" if block_size else "slots",
        "pool": f"{budget.blocks} x {budget.block_size} tokens",
        "most_running": most,
        "preemptions": engine.preemptions,
        "iterations": iterations,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument("--ssm", type=Path, default=Path("../shared/models/pycode-a/ssm"))
    ap.add_argument("--prompts", type=Path, default=Path("../shared/models/pycode-a/prompts.jsonl"))
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--context", type=int, default=256, help="tokens of a request at its end (prompt + new tokens)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument(
        "--kv-cache-bytes", type=int, default=1 << 30, help="the LLM's KV pool (the services' default: 1 GiB)"
    )
    ap.add_argument("--block-sizes", default="16", help="comma-separated KV block sizes to run beside slots")
    ap.add_argument("--speculation", default="auto", help="none, auto or a static tree such as 1,1,3,1")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=EngineConfig.max_prefill_tokens,
        help="admission's prefill cap per iteration (0: none)",
    )
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = prompt_windows(args.llm, args.prompts, args.requests, args.context - args.new_tokens)
    rows = [run(args, bs, prompts) for bs in (0, *(int(b) for b in args.block_sizes.split(",")))]
    dtype = resolve_dtype(args.dtype, "cpu")
    cap = args.max_prefill_tokens or "none"
    pool = f"LLM KV pool {args.kv_cache_bytes / 2**20:.0f} MiB"
    print(
        f"{args.requests} requests of {args.context} tokens, speculation {args.speculation}, {pool}, {dtype}, "
        f"prefill cap {cap}"
    )
    print("| layout | pool | most requests running at once | vs slots | preemptions | iterations | tokens/s |")
    print("| --- " * 7 + "|")
    for r in rows:
        versus = r["most_running"] / rows[0]["most_running"]
        print(
            f"| {r['layout']} | {r['pool']} | {r['most_running']} | {versus:.1f}x | {r['preemptions']} "
            f"| {r['iterations']} | {r['tokens_per_s']} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
