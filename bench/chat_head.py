"""A chat model's draft head on held-out chat prompts, in process, batch 1 (issue 51's "at least 2 tokens per LLM
step on chat answers"): each prompt of ``--split`` is one user message through the model's chat template, answered
greedily by these rows, of one run, taking turns prompt by prompt:

- ``incremental``: speculation off (one LLM step per token);
- ``default, no head``: the default adaptive speculation with what it has without a draft model (the suffix
  tree of the request's own text);
- ``default + head``: the same with a draft head (``--head``; repeated: two rows per head, named by its folder);
- ``head, gates off``: the same, both measured gates (the head's and the speculation's) asking the head every step:
  what the head drafts and what its steps cost, where the gates would otherwise keep a head that does not pay off.

Reported per row: tokens per LLM step (counts: the same on any machine), tokens/s (timing: only meaningful on
an otherwise idle machine) and how many outputs equal incremental decoding's. Writes ``OUT/chat_head.json``.

    python bench/chat_head.py --llm SmolLM2-135M-Instruct.Q4_1.gguf --head models/smollm2/head \\
        --prompts models/smollm2/prompts.jsonl --new-tokens 96 --dtype float32 --out bench/results/chat-head
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from specinfer.checkpoint import load_tokenizer, model_folder
from specinfer.core.head_gate import HeadGateConfig
from specinfer.core.planner import PlannerConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.head_drafter import with_head
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.request_manager.api.chat_template import ChatTemplate
from specinfer.training.chat_corpus import conversation, read_prompts

HEAD = SpeculationConfig(None, ssms=(), suffix=True, head=True)
ALWAYS = PlannerConfig(head_gate=HeadGateConfig(measure=False), speculation_gate=HeadGateConfig(measure=False))
PLAIN_ROWS = {  # name: (speculation, planner: None for the default's)
    "incremental": (None, None),
    "default, no head": (SpeculationConfig(None, ssms=(), suffix=True, head=False), None),
}
HEAD_ROWS = {"default + head": (HEAD, None), "head, gates off": (HEAD, ALWAYS)}  # per --head


def run_rows(runs: list[tuple], config: EngineConfig, prompts: list[tuple[int, ...]], new_tokens: int) -> dict:
    """Each prompt alone (batch 1) through each row's engine (one per row, calibrated before the clock), the rows
    taking turns prompt by prompt, so that a machine whose speed drifts (a shared 2-core CPU moved one row's
    tokens/s by 1.5x between runs) slows them alike: per row tokens, LLM steps, seconds, outputs."""
    engines = {}
    for name, llm, spec, planner in runs:
        engines[name] = SpeculativeEngine(llm, [], replace(config, planner=planner or config.planner))
        if spec is not None:
            engines[name].adaptive  # the cost model's start-up calibration, before the clock starts  # noqa: B018
    rows = {name: {"tokens": 0, "llm_steps": 0, "seconds": 0.0, "outputs": []} for name in engines}
    for i, prompt in enumerate(prompts):
        for r, (name, _llm, spec, _planner) in enumerate(runs):
            start = time.perf_counter()
            (res,) = engines[name].generate([GenerationRequest(f"r{r}-p{i}", prompt, new_tokens, speculation=spec)])
            row = rows[name]
            row["seconds"] += time.perf_counter() - start
            row["tokens"], row["llm_steps"] = row["tokens"] + len(res.output_tokens), row["llm_steps"] + res.llm_steps
            row["outputs"].append(list(res.output_tokens))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", required=True, help="the chat model's folder or GGUF file")
    ap.add_argument("--head", type=Path, action="append", required=True, help="a head folder; repeat to compare")
    ap.add_argument("--prompts", type=Path, required=True, help='JSON lines {"prompt": ..., "split": ...}')
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--count", type=int, default=0, help="prompts to run (0: all of the split)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", default="none", choices=["none", "int8", "int4"], help="the LLM's layers kept so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/chat-head"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = model_folder(args.llm, "llm")
    template, tok = ChatTemplate.load(folder), load_tokenizer(folder)
    questions = read_prompts(args.prompts, args.split)[: args.count or None]
    prompts = [tuple(tok.encode(conversation(template, q)).ids) for q in questions]
    backend = load_backend(folder, "llm", args.dtype, backend="native", quantize=args.quantize)
    config = EngineConfig(eos_token_id=eos_token_id(folder))
    runs = [(name, backend, spec, planner) for name, (spec, planner) in PLAIN_ROWS.items()]
    for head in args.head:  # each head drafts for the same backend, row after row
        named = f" ({head.name})" if len(args.head) > 1 else ""
        runs += [(name + named, with_head(backend, head, folder), *row) for name, row in HEAD_ROWS.items()]
    rows = run_rows(runs, config, prompts, args.new_tokens)
    base = rows["incremental"]
    weights = "" if args.quantize == "none" else f", layers {args.quantize}"
    print(f"{len(prompts)} {args.split} prompts x {args.new_tokens} new tokens, batch 1, greedy, {args.dtype}{weights}")
    print("| row | tokens / LLM step | tokens/s | x incremental tokens/s | outputs equal to incremental |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        r["tokens_per_step"] = round(r["tokens"] / r["llm_steps"], 3)
        r["seconds"] = round(r["seconds"], 2)
        r["tokens_per_second"] = round(r["tokens"] / r["seconds"], 2)
        r["equal"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"], strict=True))
        speedup = r["tokens_per_second"] / (base["tokens"] / base["seconds"])
        equal = f"{r['equal']}/{len(prompts)}"
        print(f"| {name} | {r['tokens_per_step']} | {r['tokens_per_second']} | {speedup:.2f} | {equal} |")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    (args.out / "chat_head.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
