"""What the per-request options that touch verification cost: tokens/s of the in-process engine with ``logprobs``
(0, 5, 20), with penalties (presence, frequency, repetition), with a logit bias, against the same requests without
them, with a static speculation tree and without speculation, in one run (greedy, the same prompts; rows
interleaved per repeat, medians reported).

A step whose requests ask for logprobs runs one more device pass (log-softmax, gather, top-k over the rows of the
accepted paths) and one more device-to-host copy; penalties and biases adjust every tree node's row on the device
(each node's counts include its own path). Logprobs must not change the outputs, which the script checks;
penalties and biases do change them, so their rows also report tokens per step.

    python bench/sampling_cost.py --llm ../shared/models/pycode-a/llm --ssm ../shared/models/pycode-a/ssm \
        --prompts ../shared/models/pycode-a/prompts.jsonl --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import load_prompts

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.dtypes import DTYPE_CHOICES, resolve_dtype
from specinfer.models.loading import load_backend

PENALTIES = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
# label -> (sampling, logprobs); the bias row's tokens are picked from the plain outputs at run time
ROWS = {
    "plain": (SamplingParams(), None),
    "logprobs 0": (SamplingParams(), 0),
    "logprobs 5": (SamplingParams(), 5),
    "logprobs 20": (SamplingParams(), 20),
    "penalties": (PENALTIES, None),
    "logit_bias (16 tokens)": (None, None),
}


def run(engine: SpeculativeEngine, prompts, spec, sampling, logprobs: int | None, new_tokens: int, tag: str):
    requests = [
        GenerationRequest(f"{tag}-{i}", p, new_tokens, sampling, spec, ignore_eos=True, logprobs=logprobs)
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
    plain = run(engine, prompts, None, SamplingParams(), None, args.new_tokens, "bias-source")[2]
    common: dict[int, int] = {}
    for out in plain:
        for t in out:
            common[t] = common.get(t, 0) + 1
    bias = tuple((t, -5.0) for t in sorted(common, key=common.get, reverse=True)[:16])
    rows = {label: (sampling or SamplingParams(logit_bias=bias), lp) for label, (sampling, lp) in ROWS.items()}
    table = {}
    for name, spec in specs.items():
        for label, (sampling, lp) in rows.items():  # untimed: the first use of each shape and path
            run(engine, prompts, spec, sampling, lp, 8, f"warm-{name}-{label}")
        timings: dict[str, list[float]] = {label: [] for label in rows}
        outputs = {}
        for repeat in range(args.repeats):
            for label, (sampling, lp) in rows.items():
                tag = f"{name}-{label}-{repeat}"
                tps, per_step, out = run(engine, prompts, spec, sampling, lp, args.new_tokens, tag)
                timings[label].append(tps)
                outputs.setdefault(label, out)
                table[name, label] = per_step
        if any(outputs[label] != outputs["plain"] for label in rows if label.startswith("logprobs")):
            raise SystemExit(f"{name}: the outputs changed with logprobs")
        for label in rows:
            table[name, label] = (statistics.median(timings[label]), table[name, label])
    shape = f"{len(prompts)} prompts x {args.new_tokens} tokens, batch {args.batch}"
    print(f"dtype {dtype}, threads {args.threads}, {shape}, vocabulary {llm.vocab_size}")
    print("| speculation | request option | tokens/s | x plain | tokens/step |")
    print("| --- | --- | --- | --- | --- |")
    for name in specs:
        base = table[name, "plain"][0]
        for label in rows:
            tps, per_step = table[name, label]
            print(f"| {name} | {label} | {tps:.1f} | {tps / base:.3f} | {per_step:.2f} |")


if __name__ == "__main__":
    main()
