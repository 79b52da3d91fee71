"""The fused CPU decoder layers against the per-operation layers (``NativeOptions.fused_layers``), in one process.

Loads the LLM twice, the C layers on and off, and times greedy incremental decoding of the same prompts on each,
the two alternated over ``--rounds`` rounds (so that the machine's drift hits both). Prints milliseconds a token
(the prompt's prefill taken out: a run of 2 new tokens is subtracted from a run of ``--new-tokens + 2``), the best
round of each, the ratio, and whether the two produced the same tokens (they need not: the C layers round apart from
PyTorch's operations, and a quantized model's activations, rounded to int8, flip near ties; each path's speculation
equals its own incremental decoding, which tests/kernels/test_cpu_layers.py checks).

    python bench/fused_layers.py --llm models/demo/llm --dtype float32
    python bench/fused_layers.py --llm <SmolLM2 folder> --quantize int4 --prompts models/smollm2/prompts.jsonl
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import load_prompts

from specinfer.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from specinfer.models.native import NativeBackend, NativeOptions

REPO = Path(__file__).resolve().parents[1]


def decode_ms(engine: SpeculativeEngine, prompts: list[tuple[int, ...]], new_tokens: int, tag: str) -> float:
    """Milliseconds a token of greedy decoding over ``prompts``, prefill taken out."""

    def run(n: int, suffix: str) -> float:
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.generate([GenerationRequest(f"{tag}-{suffix}-{i}", p, n, ignore_eos=True)])
        return time.perf_counter() - start

    return (run(new_tokens + 2, "long") - run(2, "short")) / (new_tokens * len(prompts)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llm", type=Path, default=REPO / "models/demo/llm")
    ap.add_argument("--prompts", type=Path, default=REPO / "models/demo/prompts.jsonl")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--count", type=int, default=3, help="prompts")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.llm, args.count, args.prompt_tokens)
    engines = {}
    for fused in (True, False):
        options = NativeOptions(
            dtype=getattr(torch, args.dtype), kv_block_size=16, quantize=args.quantize, fused_layers=fused
        )
        backend = NativeBackend.load(args.llm, options)
        if fused and backend.runner.model.fused is None:
            raise SystemExit("the fused CPU layers do not run this model here (see the log)")
        engines["fused" if fused else "per operation"] = SpeculativeEngine(backend, [], EngineConfig(max_batch=1))
    outputs = {}
    for name, engine in engines.items():  # warm-up, and the tokens each gives
        outputs[name] = [
            engine.generate([GenerationRequest(f"warm-{i}", p, args.new_tokens, ignore_eos=True)])[0].output_tokens
            for i, p in enumerate(prompts)
        ]
    best = {name: float("inf") for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            best[name] = min(best[name], decode_ms(engine, prompts, args.new_tokens, f"r{r}"))
    print(f"{args.llm.name}, {args.dtype}, quantize {args.quantize}, {args.threads} threads, best of {args.rounds}")
    print("| layers | ms a token | tokens/s | x per operation |")
    print("|---|---:|---:|---:|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.2f} | {1e3 / ms:.1f} | {best['per operation'] / ms:.2f} |")
    same = outputs["fused"] == outputs["per operation"]
    print(f"greedy tokens equal: {'yes' if same else 'no'} ({len(prompts)} prompts x {args.new_tokens})")


if __name__ == "__main__":
    main()
