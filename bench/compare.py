"""Side by side on one LLM/SSM pair, one prompt set and one machine, in one run:

(a) ``hf-incremental``: transformers ``generate`` (one LLM forward per token), batch 1 and, for
    the comparison at each batch size, batched ``generate`` (prompts left-padded);
(b) ``hf-assisted``: transformers assisted generation (``assistant_model``: sequence speculation
    with transformers' default schedule), batch 1;
(c) ``sequence``: ours, a chain of the same depth as the trees (``<1,1,...,1>``);
(d) ``tree``: ours, expansion trees (the paper's ``<1,1,3,1,1,1,1,1>`` and others, e.g. the
    tuner's pick);
(e) ``merged``: ours, the trees of two or more SSMs merged;
(f) ``auto``: ours, adaptive speculation (the planner sizes each request's dynamic tree every
    step, or turns speculation off, from the measured step costs and the learned acceptance;
    the cost model is calibrated once before the first timed row; each adaptive row starts from that
    calibration with fresh adaptive state, as a fresh server would, so no row inherits what an earlier
    one learned and the order of the rows does not matter);
plus ``incremental``: ours with speculation off (the baseline of each batch size). Greedy and
temperature 1; batch 1 and larger batches. Every row runs in one dtype (``--dtype``, transformers'
rows included).

Reported per run: tokens per LLM step, tokens/s, speedup over (a) (and over our incremental at
the same batch size, and over transformers' batched generate), per-token latency p50/p99,
whether greedy outputs equal (a)'s, and how many equal our own incremental decoding at the same
batch size, with the mean length of the matching prefix (in bf16, rounding can flip near-ties, so
neither is expected to be all). Writes
``OUT/compare.json``, ``OUT/compare.md`` and PNG plots (tokens/step vs tree size; speedup vs
batch size).

*Decode* numbers leave out each request's first step (prefill, identical work for every method):
decode tokens/s = tokens after the first step / time after the first step.
*Per-token latency*: when a request receives k tokens at once, t seconds after its previous
tokens (or after it started, for the first ones), each of the k tokens counts t / k.

    python bench/compare.py --llm /tmp/pycode-a-llm-1b --ssm ../shared/models/pycode-a/ssm \\
        --ssm /tmp/pycode-a-ssm2 --prompts ../shared/models/pycode-a/prompts.jsonl --count 50 \\
        --new-tokens 32 --out bench/results/inflated
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from common import kv_bytes, load_prompts, timed_load
from compare_runs import ADAPTIVE_DRAFTERS, Case, Run, run_hf, run_ours
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from specinfer.core import ExpansionConfig
from specinfer.core.acceptance import slot_prior_from_agreement
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, SpeculativeEngine
from specinfer.engine.calibrate import calibrate_costs
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.head_drafter import with_head
from specinfer.models.interface import CausalLM
from specinfer.models.loading import load_backend


def build_cases(args: argparse.Namespace, num_ssms: int) -> list[Case]:
    temperatures = [float(t) for t in args.temperatures.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    trees = [t for t in args.trees.split(";") if t]
    depth = len(ExpansionConfig.parse(trees[0] if trees else PAPER_EXPANSION).widths)
    chain = ",".join(["1"] * depth)
    cases = []
    for temp in temperatures:
        if not args.skip_hf and 1 in batches:
            cases += [
                Case("hf-incremental", 1, temp),
                Case("hf-assisted", 1, temp),
            ]  # transformers' assisted generation takes batch 1 only
        for batch in batches:
            if not args.skip_hf and batch > 1:
                cases.append(Case("hf-incremental", batch, temp))  # batched generate
            if not args.no_incremental:
                cases.append(Case("incremental", batch, temp))
            if not args.no_sequence:
                cases.append(Case("sequence", batch, temp, chain))
            cases += [Case("tree", batch, temp, t) for t in trees]
            if num_ssms >= 2:
                cases.append(Case("merged", batch, temp, args.merged_tree or trees[0], tuple(range(num_ssms))))
            if not args.no_auto:
                cases.append(Case("auto", batch, temp, "", tuple(range(num_ssms))))
            if args.drafter_rows:
                cases += [
                    Case("auto-ssm-only", batch, temp, "", tuple(range(num_ssms))),
                    Case("suffix-only", batch, temp, "", ()),
                ]
                if args.head:
                    cases += [
                        Case("head-only", batch, temp, "", ()),
                        Case("auto-no-head", batch, temp, "", tuple(range(num_ssms))),
                    ]
    return cases


def markdown(rows: list[dict]) -> str:
    cols = [
        ("label", "method"),
        ("batch", "batch"),
        ("temperature", "temp"),
        ("mean_tree_size", "mean tree size"),
        ("tokens_per_step", "tokens / LLM step"),
        ("tokens_per_second", "tokens/s"),
        ("speedup_vs_hf_incremental", "speedup vs (a)"),
        ("decode_tokens_per_second", "decode tokens/s"),
        ("decode_speedup_vs_hf_incremental", "decode speedup vs (a)"),
        ("speedup_vs_incremental_same_batch", "speedup vs ours incremental, same batch"),
        ("speedup_vs_hf_same_batch", "speedup vs transformers, same batch"),
        ("latency_p50_ms", "per-token p50 ms"),
        ("latency_p99_ms", "per-token p99 ms"),
        ("greedy_equals_hf", "greedy output = (a)"),
        ("greedy_equals_incremental", "greedy output = ours incremental"),
        ("matching_prefix", "mean matching prefix"),
    ]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cells.append("" if v is None else f"{v:g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for temp in sorted({r["temperature"] for r in rows}):
        ours = [
            r
            for r in rows
            if r["temperature"] == temp and r["batch"] == 1 and r["method"] not in ("hf-assisted", "hf-incremental")
        ]
        pts = sorted((r["mean_tree_size"], r["tokens_per_step"], r["label"]) for r in ours)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"temperature {temp:g}")
        for x, y, label in pts:
            ax.annotate(label.replace("tree ", ""), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("mean token-tree size (nodes per verify step)")
    ax.set_ylabel("tokens per LLM step")
    ax.set_title("Tokens per LLM step vs tree size (batch 1)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "tokens_per_step_vs_tree_size.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label in dict.fromkeys(
        r["label"] for r in rows if r["method"] not in ("hf-incremental", "hf-assisted", "incremental")
    ):
        for temp in sorted({r["temperature"] for r in rows}):
            pts = sorted(
                (r["batch"], r["speedup_vs_incremental_same_batch"])
                for r in rows
                if r["label"] == label
                and r["temperature"] == temp
                and r["speedup_vs_incremental_same_batch"] is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{label}, T={temp:g}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("tokens/s over our incremental decoding")
    ax.set_title("Speedup vs batch size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(out / "speedup_vs_batch_size.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument(
        "--ssm", type=Path, action="append", required=True, help="an SSM checkpoint; repeat for merged trees"
    )
    ap.add_argument("--prompts", type=Path, required=True, help="JSON lines with a 'text' field")
    ap.add_argument("--count", type=int, default=50, help="prompts to run")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument(
        "--trees",
        default=PAPER_EXPANSION,
        help="our expansion trees, ';'-separated (the first also sets the sequence depth)",
    )
    ap.add_argument(
        "--tuned", type=Path, default=None, help="a tuner result (bench/tune.py --out): its pick is added to --trees"
    )
    ap.add_argument(
        "--merged-tree", default="", help="expansion of each SSM in the merged runs (default: the first tree)"
    )
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument(
        "--batch", default="1,8", help="batch sizes (transformers: generate at each, assisted generation at 1)"
    )
    ap.add_argument("--skip-hf", action="store_true", help="only our runs")
    ap.add_argument(
        "--no-incremental", action="store_true", help="skip our incremental decoding (the batch-size baseline)"
    )
    ap.add_argument("--no-sequence", action="store_true", help="skip our sequence speculation")
    ap.add_argument("--no-auto", action="store_true", help="skip our adaptive speculation")
    ap.add_argument(
        "--drafter-rows",
        action="store_true",
        help="add adaptive rows with one kind of drafter: SSMs alone, suffix alone (with --head: head alone, and "
        "all but the head)",
    )
    ap.add_argument("--head", type=Path, default=None, help="a draft head of the LLM: adaptive rows also draft with it")
    ap.add_argument(
        "--max-prompt-tokens", type=int, default=0, help="keep only each prompt's last N tokens (0: whole prompts)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="of every row: transformers' models and ours (e.g. cuda)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="of every row, transformers' included")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/compare"))
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tuned is not None:
        pick = json.loads(args.tuned.read_text())["pick"]["expansion"]
        if pick not in args.trees.split(";"):
            args.trees = f"{args.trees};{pick}"
    prompts = load_prompts(args.prompts, args.llm, args.count, args.max_prompt_tokens)
    cases = build_cases(args, len(args.ssm))
    batches = max((c.batch for c in cases), default=1)
    print(
        f"LLM {args.llm}, SSMs {[str(s) for s in args.ssm]}, {len(prompts)} prompts x {args.new_tokens} new tokens "
        f"(EOS ignored), {len(cases)} runs"
    )

    dtype = resolve_dtype(args.dtype, args.device)
    print(f"every row in {dtype} on {args.device}")
    hf_llm = hf_ssm = None
    if any(c.method.startswith("hf-") for c in cases):
        hf_llm = AutoModelForCausalLM.from_pretrained(str(args.llm), dtype=DTYPES[dtype]).eval().to(args.device)
        hf_ssm = AutoModelForCausalLM.from_pretrained(str(args.ssm[0]), dtype=DTYPES[dtype]).eval().to(args.device)
    budget = kv_bytes(args.llm, batches, DTYPES[dtype])
    llm: CausalLM = timed_load(lambda: load_backend(args.llm, "llm", dtype, args.device, "native", budget))
    if args.head is not None:
        llm = with_head(llm, args.head, args.llm)
    ssms = [load_backend(p, f"ssm[{i}]", dtype, args.device, backend="native") for i, p in enumerate(args.ssm)]
    costs = calibrate(llm, ssms, cases)
    priors = tuned_priors(args)
    batches_ours = {c.batch for c in cases if not c.method.startswith("hf-")}
    engines = {  # the warm-up's and the static rows' (their adaptive state is never used)
        b: SpeculativeEngine(llm, ssms, EngineConfig(max_batch=b, slot_priors=priors), copy.deepcopy(costs))
        for b in batches_ours
    }

    warm_up(cases, prompts, hf_llm, hf_ssm, engines, args.seed)
    runs: list[Run] = []
    with tqdm(total=len(cases) * len(prompts), unit="request", file=sys.stderr) as progress:
        for case in cases:
            progress.set_description(f"{case.label} b={case.batch} T={case.temperature:g}")
            if case.method.startswith("hf-"):
                runs.append(run_hf(case, prompts, args.new_tokens, hf_llm, hf_ssm, args.seed, progress))
            else:
                engine = engines[case.batch]
                if case.method in ADAPTIVE_DRAFTERS:  # fresh adaptive state from the calibration (module docstring)
                    config = EngineConfig(max_batch=case.batch, slot_priors=priors)
                    engine = SpeculativeEngine(llm, ssms, config, copy.deepcopy(costs))
                runs.append(run_ours(case, prompts, args.new_tokens, engine, args.seed, progress))
    print(f"CUDA graphs after the runs (serving: captured while they ran): {[m.graph_stats for m in (llm, *ssms)]}")
    write_results(args, summarise(runs), prompts, dtype)
    return 0


def calibrate(llm: CausalLM, ssms: Sequence[CausalLM], cases: Sequence[Case]):
    """The step cost model, when an adaptive row needs one (else None)."""
    if not any(c.method in ADAPTIVE_DRAFTERS for c in cases):
        return None
    started = time.perf_counter()
    costs = calibrate_costs(
        llm, ssms, max_verify_tokens=64, progress=lambda msg: print(f"calibrating {msg}", file=sys.stderr)
    )
    print(f"cost model calibrated in {time.perf_counter() - started:.1f} s: {json.dumps(costs.describe())}")
    return costs


def tuned_priors(args: argparse.Namespace) -> tuple[tuple[float, ...], ...]:
    """The tuner's measured agreement (if given) as SSM 0's prior slot acceptance, as a tuning file installed in
    its folder would be."""
    if not args.tuned:
        return ()
    top_k = json.loads(args.tuned.read_text())["acceptance"]["top_k_agreement"]
    return (slot_prior_from_agreement({int(k): v for k, v in top_k.items()}),)


def warm_up(cases: Sequence[Case], prompts, hf_llm, hf_ssm, engines: dict, seed: int) -> None:
    """Lazy initialisation, allocator, thread pools: a few short runs, not timed."""
    with tqdm(total=0, disable=True) as quiet:
        warm = [Case(c.method, 1, c.temperature, c.expansion, c.ssms) for c in cases if c.batch == 1][:8]
        for case in warm:
            if case.method.startswith("hf-"):
                run_hf(case, prompts[:1], 4, hf_llm, hf_ssm, seed, quiet)
            elif 1 in engines:
                run_ours(case, prompts[:1], 4, engines[1], seed, quiet)


def write_results(args: argparse.Namespace, rows: list[dict], prompts, dtype: str) -> None:
    """compare.json (rows and the run's facts), compare.md (the table, also printed) and the plots."""
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "llm": str(args.llm),
        "ssms": [str(s) for s in args.ssm],
        "prompts": str(args.prompts),
        "count": len(prompts),
        "new_tokens": args.new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "threads": args.threads,
        "dtype": dtype,
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    (args.out / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows)
    (args.out / "compare.md").write_text(table + "\n")
    print(table)
    for path in plot(rows, args.out):
        print(f"wrote {path}")


def summarise(runs: list[Run]) -> list[dict]:
    """Table rows; speedups against (a) at the same temperature and our incremental decoding at the same batch."""
    rows = []
    for run in runs:
        c = run.case
        base = next(
            (
                r
                for r in runs
                if r.case.method == "hf-incremental" and r.case.temperature == c.temperature and r.case.batch == 1
            ),
            None,
        )
        batch_base = next(
            (
                r
                for r in runs
                if r.case.method == "incremental" and r.case.temperature == c.temperature and r.case.batch == c.batch
            ),
            None,
        )
        hf_batch = next(
            (
                r
                for r in runs
                if r.case.method == "hf-incremental" and r.case.temperature == c.temperature and r.case.batch == c.batch
            ),
            None,
        )
        row = run.row(base, batch_base, hf_batch)
        if c.temperature == 0 and base is not None:
            row["greedy_equals_hf"] = (
                f"{sum(a == b for a, b in zip(run.outputs, base.outputs, strict=True))}/{len(run.outputs)}"
            )
        if c.temperature == 0 and batch_base is not None and not c.method.startswith("hf-"):
            same, prefix = agreement(run.outputs, batch_base.outputs)
            row["greedy_equals_incremental"] = f"{same}/{len(run.outputs)}"
            row["matching_prefix"] = round(prefix, 1)
        rows.append(row)
    return rows


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> tuple[int, float]:
    """How many outputs equal the reference's, and the mean length of the prefix each shares with it."""
    same = sum(list(a) == list(b) for a, b in zip(outputs, reference, strict=True))
    prefixes = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(outputs, reference, strict=True)
    ]
    return same, sum(prefixes) / max(1, len(prefixes))


if __name__ == "__main__":
    sys.exit(main())
