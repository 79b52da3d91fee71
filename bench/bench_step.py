"""Verify-step latency by tree size and batch: our native runtime beside transformers (the reference backend).

One *verify step* is one ``forward_tree`` call of the LLM over a token tree per request, on top of a cached
prefix; each timed step commits the previous root, as a real decode loop does, so the cache bookkeeping
(adoption, compaction) is timed too. Trees of ``--nodes`` sizes are complete binary trees (node i's parent is
(i - 1) // 2: depth log2(n), like the wide trees speculation verifies); ``--expansion`` times one expansion
tree instead. Runtimes (``--runtimes``):

- ``native``: our runtime, each matrix product in the form measured fastest at load (``gemm auto``); on a CUDA
  device its steps replay CUDA graphs (``--cuda-graph-tokens``' default);
- ``native-eager``: the same without CUDA graphs (on a CPU it is ``native``);
- ``native-plain``: our runtime measured as ``native`` but with no weight packed (``gemm plain``: the plan before
  oneDNN's packed form was a candidate);
- ``native-linear``: our runtime with every product through ``F.linear`` (the form before the measurement);
- ``reference``: transformers' own forward with a tree attention mask (one token = its incremental step).

    python bench/bench_step.py --llm /tmp/llm-1b --dtype float32 --batch 1 --prefix 128 --nodes 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from specinfer.core import ExpansionConfig, TokenTree
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.core.tree import binary_tree_parents
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.loading import load_backend
from specinfer.models.native import NativeBackend, NativeOptions

RUNTIMES = ("native", "native-eager", "native-plain", "native-linear", "reference")


def expansion_tree(cfg: ExpansionConfig, root: int, vocab: int, gen: torch.Generator) -> TokenTree:
    tokens, parents, frontier = [root], [-1], [0]
    for width in cfg.widths:
        nxt = []
        for parent in frontier:
            for t in torch.randperm(vocab, generator=gen)[:width].tolist():
                nxt.append(len(tokens))
                tokens.append(t)
                parents.append(parent)
        frontier = nxt
    return TokenTree(tuple(tokens), tuple(parents))


def binary_tree(nodes: int, root: int, vocab: int, gen: torch.Generator) -> TokenTree:
    """A complete binary tree of ``nodes`` nodes (node i's parent is (i - 1) // 2) with random distinct tokens
    (siblings must differ: drawn with repeats, two of them eventually matched and the tree was refused)."""
    tokens = [root, *(torch.randperm(vocab - 3, generator=gen)[: nodes - 1] + 3).tolist()]
    return TokenTree(tuple(tokens), binary_tree_parents(nodes))


def time_steps(
    model: CausalLM, batch: int, prefix: int, make_tree, steps: int, warmup: int, seed: int, step_done=None
) -> list[float]:
    """Seconds of each of ``steps`` verify steps (after a prefill and ``warmup`` steps); ``step_done()``, when given,
    is called after the prefill and after every step (a profiler's ``step``)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.vocab_size
    contexts = [torch.randint(3, vocab, (prefix,), generator=gen).tolist() for _ in range(batch)]
    model.forward_tree([TreeForward(f"b{i}", c[:-1], [c[-1]], [-1]) for i, c in enumerate(contexts)])  # prefill
    step_done = step_done or (lambda: None)
    step_done()
    times = []
    for step in range(warmup + steps):
        items = []
        for i, c in enumerate(contexts):
            c.append(int(torch.randint(3, vocab, (1,), generator=gen)))
            tree = make_tree(c[-1], vocab, gen)
            items.append(TreeForward(f"b{i}", c[:-1], tree.tokens, tree.parents))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.forward_tree(items)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        step_done()
    for i in range(batch):
        model.release(f"b{i}")
    return times


def profile_steps(model: CausalLM, batch: int, prefix: int, make_tree, steps: int, warmup: int, seed: int) -> dict:
    """Where a step's time goes, from ``torch.profiler`` over ``steps`` steps (after the prefill and ``warmup``):
    the host's operator calls per step, the device's kernel time per step (0 on a CPU), and the five operators
    with the most host time (self, per step). A step whose wall time is far above its device time is bound by
    the host launching work (what CUDA graphs remove), not by the device."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, schedule=schedule(wait=1 + warmup, warmup=0, active=steps)) as prof:
        time_steps(model, batch, prefix, make_tree, steps, warmup, seed, step_done=prof.step)
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    return {
        "ops_per_step": sum(e.count for e in events) / steps,
        "host_ms": sum(e.self_cpu_time_total for e in events) / steps / 1e3,
        "device_ms": sum(device_us(e) for e in events) / steps / 1e3,
        "top": [(e.key, e.count / steps, e.self_cpu_time_total / steps / 1e3) for e in top],
    }


def load(runtime: str, args: argparse.Namespace) -> CausalLM:
    dtype = DTYPES[resolve_dtype(args.dtype, args.device)]
    if runtime in ("native-linear", "native-plain"):
        gemm = runtime.removeprefix("native-")
        return NativeBackend.load(args.llm, NativeOptions(dtype, args.device, int(args.kv_cache_bytes), gemm=gemm))
    if runtime == "native-eager":
        return NativeBackend.load(
            args.llm, NativeOptions(dtype, args.device, int(args.kv_cache_bytes), cuda_graph_tokens=0)
        )
    backend = "native" if runtime == "native" else "reference"
    return load_backend(
        args.llm, "llm", args.dtype, args.device, backend=backend, kv_cache_bytes=int(args.kv_cache_bytes)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", required=True)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--prefix", default="128")
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64", help="tree sizes (complete binary trees)")
    ap.add_argument(
        "--expansion", default="", help=f"time this expansion tree instead of --nodes, e.g. {PAPER_EXPANSION}"
    )
    ap.add_argument("--runtimes", default="native,native-linear,reference", help=f"some of {', '.join(RUNTIMES)}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--kv-cache-bytes", type=float, default=4e9, help="native KV pool budget")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile the smallest and largest tree of each configuration (torch.profiler): host operator "
        "calls and time per step against the device's kernel time, and the costliest operators",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runtimes = [r for r in args.runtimes.split(",") if r]
    if set(runtimes) - set(RUNTIMES):
        sys.exit(f"--runtimes: unknown {sorted(set(runtimes) - set(RUNTIMES))}; choose from {RUNTIMES}")
    if args.expansion:
        cfg = ExpansionConfig.parse(args.expansion)
        shapes = [
            (f"<{args.expansion}>", cfg.max_nodes, lambda root, vocab, gen: expansion_tree(cfg, root, vocab, gen))
        ]
    else:
        shapes = [
            (str(n), n, lambda root, vocab, gen, n=n: binary_tree(n, root, vocab, gen))
            for n in (int(x) for x in args.nodes.split(","))
        ]
    dtype = resolve_dtype(args.dtype, args.device)
    configs = [(int(b), int(p)) for b in args.batch.split(",") for p in args.prefix.split(",")]
    ms: dict[tuple[str, int, int, str], float] = {}
    profiles: dict[tuple[str, int, int, str], dict] = {}
    for (
        r
    ) in runtimes:  # one model in memory at a time: several 1B copies crowd this machine's memory and slow each other
        model = load(r, args)
        for batch, prefix in configs:
            for label, nodes, make_tree in shapes:
                times = time_steps(
                    model, batch, prefix, make_tree, args.steps, args.warmup, seed=batch * 1000 + prefix + nodes
                )
                ms[(r, batch, prefix, label)] = 1000 * statistics.median(times)
                print(
                    f"{r} batch {batch} prefix {prefix} tree {label}: {ms[(r, batch, prefix, label)]:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
                if args.profile and label in (shapes[0][0], shapes[-1][0]):
                    seed = batch * 1000 + prefix + nodes
                    profiles[(r, batch, prefix, label)] = profile_steps(
                        model, batch, prefix, make_tree, args.steps, args.warmup, seed
                    )
        del model
        gc.collect()
    print(
        f"LLM {args.llm}, {dtype} on {args.device}, {args.threads} threads, median of {args.steps} steps "
        f"({time.strftime('%Y-%m-%d')})"
    )
    print()
    print("| batch | prefix | tree | " + " | ".join(f"{r} ms | {r} vs first" for r in runtimes) + " |")
    print("|" + " --- |" * (3 + 2 * len(runtimes)))
    for batch, prefix in configs:
        for label, _, _ in shapes:
            cells = [
                f"{ms[(r, batch, prefix, label)]:.1f} | "
                f"{ms[(r, batch, prefix, label)] / ms[(r, batch, prefix, shapes[0][0])]:.2f}x"
                for r in runtimes
            ]
            print(f"| {batch} | {prefix} | {label} | " + " | ".join(cells) + " |")
    if profiles:
        print_profiles(profiles, ms)


def print_profiles(profiles: dict[tuple[str, int, int, str], dict], ms: dict[tuple[str, int, int, str], float]) -> None:
    """:func:`profile_steps`' figures as a table, beside each step's unprofiled time."""
    print()
    print("Profiled (torch.profiler; per step; host ms: operators' own host time, under the profiler's overhead)")
    print()
    print(
        "| runtime | batch | prefix | tree | step ms | operator calls (nested too) | host ms | device ms "
        "| costliest on the host |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (r, batch, prefix, label), f in profiles.items():
        top = ", ".join(f"{name} {calls:.0f}x {t:.2f} ms" for name, calls, t in f["top"])
        print(
            f"| {r} | {batch} | {prefix} | {label} | {ms[(r, batch, prefix, label)]:.1f} | {f['ops_per_step']:.0f} "
            f"| {f['host_ms']:.1f} | {f['device_ms']:.1f} | {top} |"
        )


if __name__ == "__main__":
    main()
