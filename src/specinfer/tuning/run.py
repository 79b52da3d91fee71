"""``specinfer tune``: measure, search, write the result (see :mod:`specinfer.tuning`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.tuning import TUNING_FILE
from specinfer.tuning.model import Candidate, evaluate, search


@dataclass(frozen=True)
class TuneConfig:
    """``llm``: the LLM that will serve (costs are measured on it); ``acceptance_llm``: a model
    with the same logits to produce greedy continuations (default: ``llm``); ``batch``: the
    batch size to tune for; the search covers ``max_depth``/``max_width``/``max_nodes``."""

    llm: Path
    ssm: Path
    prompts: Path
    acceptance_llm: Path | None = None
    count: int = 30
    offset: int = 100
    new_tokens: int = 64
    batch: int = 1
    max_depth: int = 8
    max_width: int = 4
    max_nodes: int = 64
    reps: int = 7
    threads: int = 0
    out: Path = Path("specinfer-tuning.json")
    install: bool = False

    def validate(self) -> None:
        for name in ("count", "new_tokens", "batch", "max_depth", "max_width", "reps"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(name.replace("_", "-"), "must be > 0")
        if self.max_nodes < 2:
            raise InvalidArgument("max-nodes", "must be at least 2 (a root and one child)")


def _prompts(cfg: TuneConfig) -> list[tuple[int, ...]]:
    from specinfer.checkpoint import load_tokenizer

    tok = load_tokenizer(cfg.llm)
    if tok is None:
        raise InvalidArgument("llm", f"{str(cfg.llm)!r} has no tokenizer.json, so the prompts cannot be encoded")
    try:
        lines = cfg.prompts.read_text().splitlines()
        chosen = lines[cfg.offset : cfg.offset + cfg.count] or lines[: cfg.count]
        texts = [json.loads(line)["text"] for line in chosen if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument("prompts", f"cannot read {str(cfg.prompts)!r}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidArgument(
            "prompts", f"{str(cfg.prompts)!r} is not JSON lines with a 'text' field: {exc!r}"
        ) from None
    if not texts:
        raise InvalidArgument("prompts", f"{str(cfg.prompts)!r} holds no prompt")
    return [tuple(tok.encode(t).ids) for t in texts]


def run_tune(cfg: TuneConfig, log=None) -> dict:
    log = log or sys.stderr  # resolved per call: a default of sys.stderr would pin the stream at import
    import torch

    from specinfer.models.cross_vocab import draft_vocabulary, in_llm_ids
    from specinfer.models.loading import load_backend
    from specinfer.tuning.measure import cost_model, greedy_continuations, ssm_ranks

    cfg.validate()
    from specinfer.checkpoint import check_checkpoint

    for path, flag in ((cfg.llm, "llm"), (cfg.ssm, "ssm"), (cfg.acceptance_llm, "acceptance-llm")):
        if path is not None:
            check_checkpoint(path, flag)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    prompts = _prompts(cfg)
    started = time.perf_counter()
    ssm = in_llm_ids(load_backend(cfg.ssm, "ssm", backend="native"), draft_vocabulary(cfg.llm, cfg.ssm, "ssm"))
    acceptance_llm = load_backend(cfg.acceptance_llm or cfg.llm, "acceptance-llm", backend="native")
    print(f"acceptance: greedy continuations of {len(prompts)} prompts x {cfg.new_tokens} tokens", file=log, flush=True)
    continuations = greedy_continuations(acceptance_llm, ssm, prompts, cfg.new_tokens)
    ranks = [ssm_ranks(ssm, p, c) for p, c in zip(prompts, continuations, strict=True)]
    del acceptance_llm
    print(f"costs: verify and draft passes at batch {cfg.batch} on {cfg.llm}", file=log, flush=True)
    llm = load_backend(cfg.llm, "llm", backend="native")
    contexts = [prompts[i % len(prompts)] for i in range(cfg.batch)]
    cost = cost_model(llm, ssm, contexts, cfg.max_nodes, cfg.reps)
    ranked = search(ranks, cost, cfg.max_depth, cfg.max_width, cfg.max_nodes)
    pick = ranked[0]
    paper = evaluate(ranks, cost, ExpansionConfig.parse(PAPER_EXPANSION).widths)
    sequence = evaluate(ranks, cost, (1,) * len(pick.widths))
    incremental = Candidate((), 1.0, cost.step_seconds(()))
    all_ranks = [int(r) for rs in ranks for r in rs]
    result = {
        "pick": pick.as_dict(),
        "paper": paper.as_dict(),
        "sequence_same_depth": sequence.as_dict(),
        "incremental": {**incremental.as_dict(), "expansion": "none"},
        "top": [c.as_dict() for c in ranked[:10]],
        "acceptance": {
            "positions": len(all_ranks),
            "top_k_agreement": {
                str(k): round(sum(r < k for r in all_ranks) / len(all_ranks), 4) for k in range(1, cfg.max_width + 1)
            },
        },
        "cost": {
            "verify_seconds": {str(k): round(v, 6) for k, v in cost.verify.items()},
            "draft_seconds": {str(k): round(v, 6) for k, v in cost.draft.items()},
            "overhead_seconds": round(cost.overhead, 6),
        },
        "meta": {
            "llm": str(cfg.llm),
            "acceptance_llm": str(cfg.acceptance_llm or cfg.llm),
            "ssm": str(cfg.ssm),
            "prompts": f"{cfg.prompts} [{cfg.offset}:{cfg.offset + len(prompts)}]",
            "new_tokens": cfg.new_tokens,
            "batch": cfg.batch,
            "search": {"max_depth": cfg.max_depth, "max_width": cfg.max_width, "max_nodes": cfg.max_nodes},
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.perf_counter() - started, 1),
        },
    }
    text = json.dumps(result, indent=1)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(text + "\n")
    if cfg.install:
        (cfg.ssm / TUNING_FILE).write_text(text + "\n")
    return result


def add_tune_parser(sub) -> None:
    p = sub.add_parser(
        "tune", help="pick the expansion tree with the highest expected tokens/s for an LLM/SSM pair on this machine"
    )
    p.add_argument("--llm", required=True, help="the LLM that will serve (costs are measured on it)")
    p.add_argument("--ssm", required=True, help="the SSM")
    p.add_argument("--prompts", required=True, help="calibration prompts: JSON lines with a 'text' field")
    p.add_argument(
        "--acceptance-llm",
        default=None,
        help="a model with the LLM's logits that is cheaper to run (e.g. before inflation)",
    )
    p.add_argument("--count", type=int, default=30, help="calibration prompts")
    p.add_argument(
        "--offset", type=int, default=100, help="first calibration prompt (keep them apart from benchmark prompts)"
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=64,
        help="the LLM's greedy tokens per calibration prompt (where the SSM's ranks are measured)",
    )
    p.add_argument("--batch", type=int, default=1, help="batch size to tune for")
    p.add_argument("--max-depth", type=int, default=8, help="deepest tree searched")
    p.add_argument("--max-width", type=int, default=4, help="most children per node searched")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree searched (nodes, the root included)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per measured size")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core, torch's own choice)")
    p.add_argument(
        "--out",
        default="specinfer-tuning.json",
        help="where the result (JSON: the picked tree, acceptance, step costs) is written",
    )
    p.add_argument(
        "--install",
        action="store_true",
        help=f"also write {TUNING_FILE} into the SSM folder (--expansion tuned: its pick; auto: its acceptance)",
    )


def tune_main(args: argparse.Namespace) -> int:
    from specinfer.checkpoint import model_folder

    cfg = TuneConfig(
        llm=model_folder(args.llm, "llm"),
        ssm=model_folder(args.ssm, "ssm"),
        prompts=Path(args.prompts),
        acceptance_llm=model_folder(args.acceptance_llm, "acceptance-llm") if args.acceptance_llm else None,
        count=args.count,
        offset=args.offset,
        new_tokens=args.new_tokens,
        batch=args.batch,
        max_depth=args.max_depth,
        max_width=args.max_width,
        max_nodes=args.max_nodes,
        reps=args.reps,
        threads=args.threads,
        out=Path(args.out),
        install=args.install,
    )
    result = run_tune(cfg)
    print("| config | nodes | tokens / step | step ms | tokens/s (expected) |")
    print("| --- | --- | --- | --- | --- |")
    rows = [
        ("pick", result["pick"]),
        ("paper", result["paper"]),
        ("sequence", result["sequence_same_depth"]),
        ("incremental", result["incremental"]),
    ]
    for name, c in rows:
        print(
            f"| {name} <{c['expansion']}> | {c['nodes']} | {c['tokens_per_step']:.2f} | {1000 * c['step_seconds']:.1f} "
            f"| {c['tokens_per_second']:.2f} |"
        )
    print(f"wrote {cfg.out}" + (f" and {cfg.ssm / TUNING_FILE}" if cfg.install else ""))
    return 0
