"""Verify-step latency by tree size and batch: our native runtime beside transformers (the reference backend).

One *verify step* is one ``forward_tree`` call of the LLM over a token tree per request, on top of a cached
prefix; each timed step commits the previous root, as a real decode loop does, so the cache bookkeeping
(adoption, compaction) is timed too. Trees of ``--nodes`` sizes are complete binary trees (node i's parent is
(i - 1) // 2: depth log2(n), like the wide trees speculation verifies); ``--expansion`` times one expansion
tree instead. Runtimes (``--runtimes``):

- ``native``: our runtime, each matrix product in the form measured fastest at load (``gemm auto``);
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

RUNTIMES = ("native", "native-linear", "reference")


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
    """A complete binary tree of ``nodes`` nodes (node i's parent is (i - 1) // 2) with random tokens."""
    tokens = [root, *torch.randint(3, vocab, (nodes - 1,), generator=gen).tolist()]
    return TokenTree(tuple(tokens), binary_tree_parents(nodes))


def time_steps(model: CausalLM, batch: int, prefix: int, make_tree, steps: int, warmup: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.vocab_size
    contexts = [torch.randint(3, vocab, (prefix,), generator=gen).tolist() for _ in range(batch)]
    model.forward_tree([TreeForward(f"b{i}", c[:-1], [c[-1]], [-1]) for i, c in enumerate(contexts)])  # prefill
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
    for i in range(batch):
        model.release(f"b{i}")
    return times


def load(runtime: str, args: argparse.Namespace) -> CausalLM:
    if runtime == "native-linear":
        dtype = DTYPES[resolve_dtype(args.dtype, args.device)]
        return NativeBackend.load(args.llm, NativeOptions(dtype, args.device, int(args.kv_cache_bytes), gemm="linear"))
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
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--kv-cache-bytes", type=float, default=4e9, help="native KV pool budget")
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


if __name__ == "__main__":
    main()
