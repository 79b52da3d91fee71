"""Verify-step latency: native backend vs reference backend on the CPU (or a GPU).

One *verify step* is one ``forward_tree`` call of the LLM over a token tree per request, on top
of a cached prefix; each timed step commits the previous root, as a real decode loop does, so
the cache bookkeeping (adoption, compaction) is timed too.

    python bench/bench_step.py --llm ../shared/models/pycode-a/llm --batch 1,8 --prefix 128,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specinfer.core import ExpansionConfig, TokenTree
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.models.interface import TreeForward
from specinfer.models.loading import load_backend


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


def time_steps(model, batch: int, prefix: int, cfg: ExpansionConfig, steps: int, warmup: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.vocab_size
    contexts = [torch.randint(3, vocab, (prefix,), generator=gen).tolist() for _ in range(batch)]
    model.forward_tree([TreeForward(f"b{i}", c[:-1], [c[-1]], [-1]) for i, c in enumerate(contexts)])  # prefill
    times = []
    for step in range(warmup + steps):
        items = []
        for i, c in enumerate(contexts):
            c.append(int(torch.randint(3, vocab, (1,), generator=gen)))
            tree = expansion_tree(cfg, c[-1], vocab, gen)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llm", required=True)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prefix", default="128,512")
    ap.add_argument("--expansion", default=PAPER_EXPANSION)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-bytes", type=float, default=4e9, help="native KV pool budget")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ExpansionConfig.parse(args.expansion)
    backends = {
        name: load_backend(args.llm, "llm", args.dtype, args.device, backend=name, kv_cache_bytes=int(args.kv_cache_bytes)) for name in ("reference", "native")
    }
    print(
        f"LLM {args.llm}, tree <{args.expansion}> ({cfg.max_nodes} nodes), {args.dtype} on {args.device}, {args.threads} threads, median of {args.steps} steps"
    )
    print()
    print("| batch | prefix | reference ms | native ms | native speedup |")
    print("| --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in args.batch.split(",")):
        for prefix in (int(p) for p in args.prefix.split(",")):
            ms = {
                name: 1000 * statistics.median(time_steps(m, batch, prefix, cfg, args.steps, args.warmup, seed=batch * 1000 + prefix))
                for name, m in backends.items()
            }
            print(f"| {batch} | {prefix} | {ms['reference']:.1f} | {ms['native']:.1f} | {ms['reference'] / ms['native']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
