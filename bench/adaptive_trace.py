"""Adaptive speculation under changing load: concurrency steps 1 -> 16 -> 1 (issue 21).

Runs the in-process engine with every request on ``speculation: auto``. Phase 1 keeps one
request running, phase 2 keeps ``--peak`` running (a finished request is replaced at once),
phase 3 one again; each phase lasts ``--phase-seconds``. Every iteration records the time, the
requests in the batch, the planner's nodes per request (the mean of its planned tree sizes, 1 =
no speculation), the realised mean tree size, and the iteration's seconds. Writes
``OUT/trace.json`` and ``OUT/planned_budget.png`` (planned budget and concurrency over time) and
prints a per-phase summary: the planned budget follows the load if it drops in phase 2 and comes
back in phase 3; *no stalls* means no iteration takes much longer than the phase's median.

    python bench/adaptive_trace.py --llm /tmp/llm-1b --ssm ../shared/models/pycode-a/ssm \\
        --prompts ../shared/models/pycode-a/prompts.jsonl --dtype float32 --out bench/results/adaptive/trace
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from itertools import cycle
from pathlib import Path

import torch
from common import kv_bytes, load_prompts

from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.engine.calibrate import calibrate_costs
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.loading import load_backend


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument("--ssm", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--peak", type=int, default=16)
    ap.add_argument("--phase-seconds", type=float, default=60.0)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/adaptive/trace"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    prompts = load_prompts(args.prompts, args.llm, 64, args.max_prompt_tokens)
    llm = load_backend(
        args.llm, "llm", dtype, backend="native", kv_cache_bytes=kv_bytes(args.llm, args.peak, DTYPES[dtype])
    )
    ssm = load_backend(args.ssm, "ssm", dtype, backend="native")
    costs = calibrate_costs(
        llm, [ssm], max_verify_tokens=64, progress=lambda m: print(f"calibrating {m}", file=sys.stderr)
    )
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=args.peak), costs)
    source = cycle(prompts)
    serial = 0

    def add() -> None:
        nonlocal serial
        engine.add(
            GenerationRequest(
                f"t{serial}", tuple(next(source)), args.new_tokens, speculation=SpeculationConfig(None), ignore_eos=True
            )
        )
        serial += 1

    trace = []
    t0 = time.perf_counter()
    for phase, concurrency in enumerate((1, args.peak, 1)):
        end = time.perf_counter() + args.phase_seconds
        while time.perf_counter() < end or (phase == 2 and engine.has_work and len(engine.running()) > 1):
            while engine.admitted < concurrency and time.perf_counter() < end:
                add()
            started = time.perf_counter()
            running = engine.admitted
            before = {r.request_id: len(r.steps) for r in engine.running()}
            finished = engine.step()
            seconds = time.perf_counter() - started
            plan = engine.adaptive.previous
            planned = [p.nodes for p in plan.requests.values()] if plan is not None else []
            stepped = [r for r in [*engine.running(), *finished] if len(r.steps) > before.get(r.request_id, 0)]
            trace.append(
                {
                    "t": round(started - t0, 3),
                    "phase": phase,
                    "batch": running,
                    "planned_nodes": round(statistics.mean(planned), 3) if planned else 1.0,
                    "tree_size": round(statistics.mean(r.steps[-1].tree_size for r in stepped), 3) if stepped else 1.0,
                    "committed": sum(r.steps[-1].committed for r in stepped),
                    "seconds": round(seconds, 4),
                }
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace.json").write_text(json.dumps({"dtype": dtype, "peak": args.peak, "trace": trace}, indent=0))
    print(
        "| phase | concurrency | iterations | mean planned nodes/request | mean tree size | tokens/s "
        "| iteration p50 ms | max ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for phase, concurrency in enumerate((1, args.peak, 1)):
        rows = [r for r in trace if r["phase"] == phase]
        secs = sorted(r["seconds"] for r in rows)
        tps = sum(r["committed"] for r in rows) / sum(secs)
        print(
            f"| {phase + 1} | {concurrency} | {len(rows)} | {statistics.mean(r['planned_nodes'] for r in rows):.2f} | "
            f"{statistics.mean(r['tree_size'] for r in rows):.2f} | {tps:.2f} | {1000 * statistics.median(secs):.0f} "
            f"| {1000 * secs[-1]:.0f} |"
        )
    plot(trace, args.out / "planned_budget.png")
    return 0


def plot(trace: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ts = [r["t"] for r in trace]
    ax.step(
        ts, [r["planned_nodes"] for r in trace], where="post", label="planned nodes per request (1 = no speculation)"
    )
    ax.plot(ts, [r["tree_size"] for r in trace], ".", ms=2, alpha=0.5, label="verified tree size (mean over the batch)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tree nodes per request")
    ax2 = ax.twinx()
    ax2.step(ts, [r["batch"] for r in trace], where="post", color="grey", alpha=0.6, label="concurrent requests")
    ax2.set_ylabel("concurrent requests")
    ax.set_title("Adaptive speculation: planned budget as concurrency steps 1 -> 16 -> 1")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
