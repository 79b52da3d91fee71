"""Accepted tokens per verify step of coupled verification against multi-step speculative sampling.

Both verifications are exact (docs/speculation.md): MSS accepts a draft token x with probability
min(1, p(x) / q(x)), coupled verification accepts it when it is the LLM's own Gumbel-max draw, fixed by
the request's seed and the token's position. This runs the in-process engine (native backend, fp32:
counts, not timings, so the machine's load does not matter) on each pair, at each temperature, with
the paper's static tree and adaptive trees, every request seeded, once verified each way, and prints
a markdown table: tree tokens accepted per verify step, tokens committed per step, and the share of
the seeded outputs that equal decoding without speculation with the same seed (coupled: all).

    python bench/coupled_vs_mss.py --pair models/demo --pair ../shared/models/pycode-a
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from pathlib import Path

from common import load_prompts

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.engine.calibrate import calibrate_costs
from specinfer.models.loading import eos_token_id, load_backend


def run(
    engine: SpeculativeEngine,
    prompts: Sequence[tuple[int, ...]],
    params: SamplingParams,
    spec: SpeculationConfig | None,
    new_tokens: int,
    tag: str,
):
    requests = [
        GenerationRequest(
            f"{tag}-{i}",
            p,
            new_tokens,
            SamplingParams(params.temperature, params.top_k, params.top_p, 1000 + i, params.verification),
            spec,
        )
        for i, p in enumerate(prompts)
    ]
    return engine.generate(requests)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pair", type=Path, action="append", required=True, help="folder with llm/, ssm/, prompts.jsonl (repeat)"
    )
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--count", type=int, default=24, help="prompts per row")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="bfloat16: near-ties may flip between batch shapes",
    )
    ap.add_argument("--trees", default="paper,adaptive", help="which of paper,adaptive to run")
    args = ap.parse_args(argv)
    print(
        "| pair | temperature | tree | verification | accepted per step | tokens per step | equal to no speculation |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for pair in args.pair:
        llm = load_backend(pair / "llm", "llm", args.dtype, backend="native", kv_cache_bytes=1 << 30)
        ssm = load_backend(pair / "ssm", "ssm", args.dtype, backend="native", kv_cache_bytes=1 << 30)
        config = EngineConfig(eos_token_id=eos_token_id(pair / "llm"))
        costs = calibrate_costs(llm, [ssm], max_verify_tokens=64)  # once per pair; each row refines its own copy
        plain_engine = SpeculativeEngine(llm, [ssm], config)
        prompts = load_prompts(pair / "prompts.jsonl", pair / "llm", args.count, args.max_prompt_tokens)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            trees = {
                "paper": ("paper " + PAPER_EXPANSION, SpeculationConfig(ExpansionConfig.parse(PAPER_EXPANSION))),
                "adaptive": ("adaptive", SpeculationConfig(None)),
            }
            for tree, spec in (trees[name] for name in args.trees.split(",")):
                for verification in ("mss", "coupled"):
                    params = SamplingParams(temperature=temperature, verification=verification)
                    plain = run(plain_engine, prompts, params, None, args.new_tokens, f"plain-{verification}")
                    # a fresh engine per row: the adaptive planner's acceptance model starts from its prior each time
                    engine = SpeculativeEngine(llm, [ssm], config, copy.deepcopy(costs))
                    results = run(engine, prompts, params, spec, args.new_tokens, f"{verification}-{tree}")
                    steps = sum(r.llm_steps for r in results)
                    accepted = sum(r.mean_accepted * r.llm_steps for r in results)
                    tokens = sum(len(r.output_tokens) for r in results)
                    same = sum(r.output_tokens == p.output_tokens for r, p in zip(results, plain, strict=True))
                    print(
                        f"| {pair.name} | {temperature} | {tree} | {verification} | {accepted / steps:.2f} "
                        f"| {tokens / steps:.2f} | {same}/{len(results)} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
