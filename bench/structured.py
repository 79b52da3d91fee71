"""Structured outputs under speculation: tokens per LLM step and tokens/s of JSON-schema requests, with and
without the grammar's help, against unconstrained decoding of the same prompts.

Each tree (the paper's static tree, adaptive trees) runs the same prompts greedily in the in-process engine (native
backend) five ways: unconstrained; under the schema with unmasked drafts and the tree kept whole (forbidden nodes
verified for nothing: ``GrammarSpeculation(prune=False, certain_tokens=0, mask_drafts=False)``); pruned (the nodes
the grammar forbids dropped before verification); pruned with the grammar's certain tokens appended inside the tree;
the drafts masked inside the drafters, with certain tokens (the default, :mod:`specinfer.core.grammar_states`).
Every constrained row's outputs must equal the others' (the grammar's help changes the steps, never the tokens). It
prints a markdown table: tokens per LLM step, tokens/s, the grammar's time per step (the tree walks: masks and
certain tokens, on the CPU) and the drafters' (the masks of each pass's frontier rows, per LLM step). Tokens per step
are counts; tokens/s and milliseconds mean something only on an
otherwise idle machine.

    python bench/structured.py --pair models/demo --count 8 --new-tokens 96
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path

from common import load_prompts

from specinfer.checkpoint import load_tokenizer
from specinfer.core import ExpansionConfig
from specinfer.core.constraints import Constraint, grammars_for
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.core.grammar_states import GrammarSpeculation
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.engine.calibrate import calibrate_costs
from specinfer.models.loading import eos_token_id, load_backend

# A record of fixed keys: most of its characters are the grammar's certain tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
WAYS = {  # row name -> the grammar's help (None: unconstrained requests)
    "unconstrained": None,
    "schema, whole tree": GrammarSpeculation(prune=False, certain_tokens=0, mask_drafts=False),
    "schema, pruned": GrammarSpeculation(certain_tokens=0, mask_drafts=False),
    "schema, pruned + certain tokens": GrammarSpeculation(mask_drafts=False),
    "schema, masked drafts + certain tokens": GrammarSpeculation(),
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, required=True, help="folder with llm/, ssm/, prompts.jsonl")
    ap.add_argument("--schema", type=Path, help="a JSON schema file (default: a record of five fixed keys)")
    ap.add_argument("--count", type=int, default=8, help="prompts (requests per row, run as one batch)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--trees", default="paper,adaptive", help="which of paper,adaptive to run")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    schema = args.schema.read_text() if args.schema is not None else json.dumps(SCHEMA)
    constraint = Constraint("json_schema", schema)
    llm = load_backend(args.pair / "llm", "llm", args.dtype, args.device, backend="native", kv_cache_bytes=1 << 30)
    ssm = load_backend(args.pair / "ssm", "ssm", args.dtype, args.device, backend="native", kv_cache_bytes=1 << 30)
    eos = eos_token_id(args.pair / "llm")
    grammars = grammars_for(load_tokenizer(args.pair / "llm"), llm.vocab_size, eos)
    costs = calibrate_costs(llm, [ssm], max_verify_tokens=64)  # once; each row refines its own copy
    prompts = load_prompts(args.pair / "prompts.jsonl", args.pair / "llm", args.count, args.max_prompt_tokens)
    trees = {
        "paper": SpeculationConfig(ExpansionConfig.parse(PAPER_EXPANSION)),
        "adaptive": SpeculationConfig(None),
    }
    warm = SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos), copy.deepcopy(costs), grammars=grammars)
    warm.generate([GenerationRequest(f"warm-{i}", p, 8, constraint=constraint) for i, p in enumerate(prompts)])
    print("| tree | requests | tokens per LLM step | tokens/s | grammar ms per step | draft masks ms per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tree in args.trees.split(","):
        outputs = None
        for way, help_ in WAYS.items():
            config = EngineConfig(eos_token_id=eos, grammar=help_ or GrammarSpeculation())
            # a fresh engine per row: the adaptive planner's acceptance model starts from its prior each time
            engine = SpeculativeEngine(llm, [ssm], config, copy.deepcopy(costs), grammars=grammars)
            requests = [
                GenerationRequest(
                    f"{tree}-{way}-{i}", p, args.new_tokens, speculation=trees[tree], constraint=help_ and constraint
                )
                for i, p in enumerate(prompts)
            ]
            started = time.perf_counter()
            results = engine.generate(requests)
            seconds = time.perf_counter() - started
            tokens = sum(len(r.output_tokens) for r in results)
            steps = sum(r.llm_steps for r in results)
            grammar_steps, grammar_seconds = engine.grammar_time
            per_step = f"{1e3 * grammar_seconds / grammar_steps:.2f}" if grammar_steps else "-"
            masked = grammar_steps and engine.draft_mask_seconds
            masks = f"{1e3 * engine.draft_mask_seconds / grammar_steps:.2f}" if masked else "-"
            row = f"| {tree} | {way} | {tokens / steps:.2f} | {tokens / seconds:.1f} | {per_step} | {masks} |"
            print(row, flush=True)
            if help_ is not None:
                got = [r.output_tokens for r in results]
                if outputs is not None and got != outputs:
                    raise SystemExit(f"{tree}, {way}: outputs differ from the other constrained rows")
                outputs = got
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
