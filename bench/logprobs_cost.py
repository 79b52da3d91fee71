"""What asking for logprobs costs: tokens/s of the in-process engine with ``logprobs`` unset, 0, 5 and 20, with a
static speculation tree and without speculation, in one run (greedy, the same prompts; rows interleaved per repeat,
medians reported). A step whose requests ask for logprobs runs one more device pass (log-softmax, gather, top-k
over the rows of the accepted paths) and one more device-to-host copy. The outputs must not change with logprobs,
which the script checks.

    python bench/logprobs_cost.py --llm ../shared/models/pycode-a/llm --ssm ../shared/models/pycode-a/ssm \
        --prompts ../shared/models/pycode-a/prompts.jsonl --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import load_prompts

from specinfer.core import ExpansionConfig
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.dtypes import DTYPE_CHOICES, resolve_dtype
from specinfer.models.loading import load_backend

COUNTS = (None, 0, 5, 20)


def run(engine: SpeculativeEngine, prompts, spec, logprobs: int | None, new_tokens: int, tag: str):
    requests = [
        GenerationRequest(f"{tag}-{i}", p, new_tokens, speculation=spec, ignore_eos=True, logprobs=logprobs)
        for i, p in enumerate(prompts)
    ]
    started = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_tokens) for r in results)
    steps = sum(r.llm_steps for r in results)
    return tokens / seconds, tokens / steps, [r.output_tokens for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument("--ssm", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help="JSON lines with a 'text' field")
    ap.add_argument("--count", type=int, default=8, help="prompts, run as one batch")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--expansion", default=PAPER_EXPANSION)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    llm = load_backend(args.llm, "llm", dtype, "cpu", backend="native")
    ssm = load_backend(args.ssm, "ssm", dtype, "cpu", backend="native")
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=args.batch))
    prompts = load_prompts(args.prompts, args.llm, args.count, 256)
    specs = {"tree " + args.expansion: SpeculationConfig(ExpansionConfig.parse(args.expansion)), "none": None}
    rows = {}
    for name, spec in specs.items():
        for count in COUNTS:  # untimed: the first use of each shape and path
            run(engine, prompts, spec, count, 8, f"warm-{name}-{count}")
        timings = {c: [] for c in COUNTS}
        outputs = {}
        for repeat in range(args.repeats):
            for count in COUNTS:
                tps, per_step, out = run(engine, prompts, spec, count, args.new_tokens, f"{name}-{count}-{repeat}")
                timings[count].append(tps)
                outputs.setdefault(count, out)
                rows[name, count] = per_step
        base = outputs[None]
        if any(out != base for out in outputs.values()):
            raise SystemExit(f"{name}: the outputs changed with logprobs")
        for count in COUNTS:
            rows[name, count] = (statistics.median(timings[count]), rows[name, count])
    shape = f"{len(prompts)} prompts x {args.new_tokens} tokens, batch {args.batch}"
    print(f"dtype {dtype}, threads {args.threads}, {shape}")
    print("| speculation | logprobs | tokens/s | x unset | tokens/step |")
    print("| --- | --- | --- | --- | --- |")
    for name in specs:
        base = rows[name, None][0]
        for count in COUNTS:
            tps, per_step = rows[name, count]
            label = "unset" if count is None else str(count)
            print(f"| {name} | {label} | {tps:.1f} | {tps / base:.3f} | {per_step:.2f} |")


if __name__ == "__main__":
    main()
