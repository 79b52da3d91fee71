"""Tokens per LLM step for several tree configurations, greedy and sampling.

Prints a markdown table: mean accepted tokens per LLM verify step (tree tokens the LLM kept),
tokens per step (accepted + bonus), mean tree size. Runs the in-process engine on the given
pair and prompt set, all prompts as one batch.

    python bench/acceptance.py --pair ../shared/models/pycode-a --prompts 50 --new-tokens 128
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import load_prompts

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import eos_token_id
from specinfer.models.reference import ReferenceBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--pair", type=Path, default=Path("../shared/models/pycode-a"), help="folder with llm/, ssm/, prompts.jsonl"
    )
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--configs", default=f"1,1,1,1,1,1,1,1;{PAPER_EXPANSION};4,2,2,1,1,1,1,1")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.pair / "prompts.jsonl", args.pair / "llm", args.prompts, 0)
    engine = SpeculativeEngine(
        ReferenceBackend.load(args.pair / "llm"),
        [ReferenceBackend.load(args.pair / "ssm")],
        EngineConfig(eos_token_id=eos_token_id(args.pair / "llm")),
    )
    print(
        f"pair {args.pair}, {len(prompts)} prompts, {args.new_tokens} new tokens each (EOS ignored), "
        f"batch {len(prompts)}"
    )
    print()
    print(
        "| expansion | nodes | temperature | accepted / step | tokens / step | mean tree size | LLM steps | seconds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cfg_text in args.configs.split(";"):
        cfg = ExpansionConfig.parse(cfg_text)
        for temp in (float(t) for t in args.temperatures.split(",")):
            spec = SpeculationConfig(cfg)
            reqs = [
                GenerationRequest(
                    f"{cfg_text}-{temp}-{i}",
                    p,
                    args.new_tokens,
                    SamplingParams(temperature=temp, seed=args.seed + i),
                    spec,
                    ignore_eos=True,
                )
                for i, p in enumerate(prompts)
            ]
            start = time.perf_counter()
            results = engine.generate(reqs)
            secs = time.perf_counter() - start
            steps = [s for r in results for s in r.steps]
            accepted = sum(s.accepted for s in steps) / len(steps)
            tokens = sum(len(r.output_tokens) for r in results) / len(steps)
            size = sum(s.tree_size for s in steps) / len(steps)
            print(
                f"| <{cfg_text}> | {cfg.max_nodes} | {temp:g} | {accepted:.2f} | {tokens:.2f} | {size:.1f} "
                f"| {len(steps)} | {secs:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
