"""Merged token trees of boost-tuned SSMs vs one SSM with the same node budget vs merged copies.

Measures tokens per LLM step (the paper's measure of how much a tree gets accepted; it does not
depend on the machine) on held-out prompts, greedy and at temperature 1, with our engine:

- ``single``: one SSM with a tree (e.g. the paper's <1,1,3,1,1,1,1,1>, 21 nodes);
- ``single, best at N nodes``: one SSM with the static tree of at most N nodes (root included)
  that gives it the most tokens per step under greedy decoding; chosen on *other* prompts
  (``--select-offset``) by walking the SSM's ranks of the LLM's greedy tokens (the tuner's
  model), so the test prompts do not pick it;
- ``merged``: several SSMs, each with a tree, merged (the same SSM twice = merged copies).

    python bench/merge_trees.py --llm models/demo/llm --ssm ssm=models/demo/ssm --ssm ssm-1=models/demo/ssm-1 \\
        --ssm ssm-2=models/demo/ssm-2 --prompts models/demo/prompts.jsonl --out bench/results/boost \\
        --case "ssm@1,1,3,1,1,1,1,1" --case "ssm+ssm-1@1,1,3,1,1,1,1,1" --best-single ssm:41
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from common import load_prompts
from tqdm import tqdm

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import load_backend
from specinfer.tuning.measure import greedy_continuations, ssm_ranks
from specinfer.tuning.model import CostModel, num_nodes, search


@dataclass(frozen=True)
class Case:
    label: str
    ssms: tuple[str, ...]  # names; a name may repeat (merged copies)
    widths: tuple[int, ...]

    @property
    def budget(self) -> int:
        """Nodes of all the input trees together, one shared root."""
        return 1 + len(self.ssms) * (num_nodes(self.widths) - 1)


def parse_case(text: str) -> Case:
    names, _, widths = text.partition("@")
    ssms = tuple(n.strip() for n in names.split("+"))
    w = ExpansionConfig.parse(widths).widths
    kind = "single" if len(ssms) == 1 else ("merged copies" if len(set(ssms)) == 1 else "merged")
    return Case(f"{kind}: {' + '.join(ssms)} <{','.join(map(str, w))}>", ssms, tuple(w))


# every step costs the same, so the tuner's search ranks trees by tokens per step alone
EQUAL_STEP_COST = CostModel(verify={1: 1.0}, draft={1: 0.0})


def greedy_ranks(llm, ssm, prompts, new_tokens: int) -> list:
    """The SSM's rank of each of the LLM's greedy tokens, per prompt (the tuner's measurement)."""
    conts = greedy_continuations(llm, ssm, prompts, new_tokens)
    return [ssm_ranks(ssm, p, c) for p, c in zip(prompts, conts, strict=True)]


def best_single(ranks: list, max_nodes: int, max_depth: int = 8, max_width: int = 4) -> tuple[tuple[int, ...], float]:
    """The tree of at most ``max_nodes`` nodes with the most greedy tokens per step for these ranks."""
    best = search(ranks, EQUAL_STEP_COST, max_depth, max_width, max_nodes)[0]
    return best.widths, best.tokens_per_step


def run_case(
    engine: SpeculativeEngine,
    index: dict[str, int],
    case: Case,
    prompts,
    new_tokens: int,
    temperature: float,
    seed: int,
    batch: int,
) -> dict:
    copies: dict[str, int] = {}
    ids = []
    for name in case.ssms:  # the k-th use of a name takes its k-th loaded copy
        copies[name] = copies.get(name, 0) + 1
        ids.append(index[f"{name}#{copies[name]}"])
    spec = SpeculationConfig(ExpansionConfig(case.widths), tuple(ids))
    tokens = steps = nodes = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        reqs = [
            GenerationRequest(
                f"{case.label}-{temperature}-{first + i}",
                tuple(p),
                new_tokens,
                SamplingParams(temperature=temperature, seed=seed + first + i),
                spec,
                ignore_eos=True,
            )
            for i, p in enumerate(prompts[first : first + batch])
        ]
        for r in engine.generate(reqs):
            tokens += len(r.output_tokens)
            steps += len(r.steps)
            nodes += sum(s.tree_size for s in r.steps)
    return {
        "case": case.label,
        "ssms": list(case.ssms),
        "widths": list(case.widths),
        "node_budget": case.budget,
        "temperature": temperature,
        "tokens_per_step": round(tokens / steps, 3),
        "mean_tree_size": round(nodes / steps, 1),
        "tokens": tokens,
        "llm_steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
    }


def markdown(rows: Sequence[dict]) -> str:
    temps = sorted({r["temperature"] for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    head = "| case | node budget | " + " | ".join(f"tokens/step T={t:g} (mean tree size)" for t in temps) + " |"
    lines = [head, "|" + " --- |" * (2 + len(temps))]
    for c in cases:
        by_t = {r["temperature"]: r for r in rows if r["case"] == c}
        first = next(iter(by_t.values()))
        cells = [
            f"{by_t[t]['tokens_per_step']:.2f} ({by_t[t]['mean_tree_size']:.0f})" if t in by_t else "" for t in temps
        ]
        lines.append(f"| {c} | {first['node_budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument("--ssm", action="append", required=True, help="NAME=DIR; repeat")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--offset", type=int, default=0, help="first test prompt")
    ap.add_argument(
        "--select-offset", type=int, default=100, help="first prompt of the set that picks the best single trees"
    )
    ap.add_argument("--select-count", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=64)
    ap.add_argument("--case", action="append", default=[], help="NAME[+NAME...]@WIDTHS; repeat")
    ap.add_argument(
        "--best-single",
        action="append",
        default=[],
        help="NAME:MAX_NODES: add that SSM's best tree of at most MAX_NODES nodes",
    )
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def load_drafters(args: argparse.Namespace, cases: Sequence[Case]) -> tuple[list, dict[str, int]]:
    """Each SSM as many times as one case merges it (``NAME#k``), and each one's index among them."""
    paths = dict(s.split("=", 1) for s in args.ssm)
    need: dict[str, int] = {}
    for c in cases:
        for n in set(c.ssms):
            need[n] = max(need.get(n, 0), c.ssms.count(n))
    for spec in args.best_single:
        need.setdefault(spec.split(":")[0], 1)
    backends, index = [], {}
    for name, count in need.items():
        for k in range(1, count + 1):
            index[f"{name}#{k}"] = len(backends)
            backends.append(load_backend(paths[name], f"{name}#{k}"))
    return backends, index


def pick_best_singles(
    args: argparse.Namespace, llm, backends: list, index: dict[str, int], select: list
) -> tuple[list[Case], list[dict]]:
    """The cases of ``--best-single`` (each SSM's best tree within a node budget, picked on the selection
    prompts), and what was picked."""
    cases, picked, ranks = [], [], {}
    for spec in args.best_single:
        name, nodes = spec.split(":")
        if name not in ranks:  # one measurement per SSM serves every budget
            ranks[name] = greedy_ranks(llm, backends[index[f"{name}#1"]], select, args.new_tokens)
        widths, est = best_single(ranks[name], int(nodes))
        case = Case(f"single, best at <= {nodes} nodes: {name} <{','.join(map(str, widths))}>", (name,), widths)
        picked.append(
            {
                "ssm": name,
                "max_nodes": int(nodes),
                "widths": list(widths),
                "nodes": num_nodes(widths),
                "selection_tokens_per_step": round(est, 3),
            }
        )
        print(
            f"best single tree for {name} within {nodes} nodes (on prompts {args.select_offset}..): {widths}, "
            f"{num_nodes(widths)} nodes",
            file=sys.stderr,
        )
        cases.append(case)
    return cases, picked


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [parse_case(c) for c in args.case]
    all_prompts = load_prompts(args.prompts, args.llm, args.select_offset + args.select_count, args.max_prompt_tokens)
    prompts = all_prompts[args.offset : args.offset + args.count]
    select = all_prompts[args.select_offset : args.select_offset + args.select_count]
    llm = load_backend(args.llm, "llm")
    backends, index = load_drafters(args, cases)
    singles, picked = pick_best_singles(args, llm, backends, index, select)
    cases += singles
    engine = SpeculativeEngine(llm, backends, EngineConfig(eos_token_id=None, max_batch=args.batch))
    temps = [float(t) for t in args.temperatures.split(",")]
    rows = []
    with tqdm(total=len(cases) * len(temps), desc="cases", file=sys.stderr) as bar:
        for t in temps:
            for c in cases:
                rows.append(run_case(engine, index, c, prompts, args.new_tokens, t, args.seed, args.batch))
                bar.update(1)
    table = markdown(rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": "bench/merge_trees.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d"),
            "picked": picked,
        }
        (args.out / "merge.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        (args.out / "merge.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
