"""What one SSM draft costs: ``draft_trees`` (the SSM worker's ``Speculate`` and the in-process engine's drafting) on
one SSM, one request, a dynamic tree of ``--nodes`` nodes and ``--depth`` depths, greedy.

Each call drafts from the request's context, which then grows by one committed token (as after a step that accepted
nothing but the bonus), so the SSM's cache stays warm and its attention context grows as in serving. Prints, per round
of ``--calls`` calls: milliseconds a call, passes a call (one SSM forward per depth), milliseconds a pass and the
tree's nodes; then the same split by part (the SSM's forward, the pass's tables of top tokens, the tree builders'
Python) over all rounds.

    python bench/draft_passes.py --ssm models/demo/ssm --prompts models/demo/prompts.jsonl --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
from common import Timed, load_prompts

from specinfer.core.dynamic_trees import BestFirstTreeBuilder, TreeBudget
from specinfer.core.iteration import DraftSpec
from specinfer.core.sampling import SamplingParams
from specinfer.models import drafting
from specinfer.models.loading import load_backend

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ssm", type=Path, default=REPO / "models/demo/ssm")
    ap.add_argument("--prompts", type=Path, default=REPO / "models/demo/prompts.jsonl")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the SSM worker's default: 1)")
    ap.add_argument("--nodes", type=int, default=24, help="the tree budget's nodes, the root included")
    ap.add_argument("--depth", type=int, default=8, help="the tree budget's depths (most passes a call)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=150, help="calls a round")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ssm = load_backend(str(args.ssm), "ssm", args.dtype, backend="native")
    context = list(load_prompts(args.prompts, args.ssm, 1, args.prompt_tokens)[0])
    budget = TreeBudget(args.nodes, args.depth)

    def job(step: int) -> DraftSpec:
        return DraftSpec("r", context[:-1], context[-1], None, SamplingParams(), 8, 0, step, 0, budget=budget)

    drafting.draft_trees(ssm, [job(0)])  # warm-up: the prompt's prefill
    parts: Counter = Counter()
    Timed(parts, "SSM forward (forward_tree)", ssm, "forward_tree")
    Timed(parts, "row tables (pass_tables)", drafting, "pass_tables")
    Timed(parts, "builder (expand)", BestFirstTreeBuilder, "expand")
    print("| round | ms a call | passes a call | ms a pass | nodes |\n|---:|---:|---:|---:|---:|")
    calls = passes = 0
    total = 0.0
    for r in range(args.rounds):
        seconds, counted, nodes = 0.0, [], 0
        for i in range(args.calls):
            start = time.perf_counter()
            (tree,) = drafting.draft_trees(ssm, [job(i)], lambda tokens, secs, out=counted: out.append(secs))
            seconds += time.perf_counter() - start
            nodes += len(tree.tree)
            context.append(context[(i * 7) % args.prompt_tokens])  # one committed token a call
        calls, passes, total = calls + args.calls, passes + len(counted), total + seconds
        print(
            f"| {r + 1} | {seconds / args.calls * 1e3:.2f} | {len(counted) / args.calls:.1f} "
            f"| {seconds / len(counted) * 1e3:.3f} | {nodes / args.calls:.1f} |"
        )
    print("\n| part | ms a pass |\n|---|---:|")
    for key, secs in parts.items():
        print(f"| {key} | {secs / passes * 1e3:.3f} |")
    rest = total - sum(parts.values())
    print(f"| the rest of draft_trees (items, propose, the loop) | {rest / passes * 1e3:.3f} |")


if __name__ == "__main__":
    main()
