"""Benchmark tree attention: the fused Triton kernel vs PyTorch SDPA with an explicit mask vs the fp32 reference.

Every request of a configuration has the same tree size and prefix length; its KV region (prefix + tree) sits in one
shared ``[capacity, num_kv_heads, head_dim]`` cache as in the verify step. Prints a markdown table.

GPU timing uses CUDA events (median of ``--iters`` runs after ``--warmup``); the bandwidth column is
``(K and V bytes of prefix + tree) + Q bytes`` over that time, and "of copy" that bandwidth over the device's own
device-to-device copy bandwidth, measured first (the roofline of a kernel that streams the KV cache once). On CPU the
timing is ``time.perf_counter`` and the Triton kernel is skipped unless asked for with ``--impl triton`` (it then runs
under the Triton interpreter, whose timings say nothing about the kernel).

Examples::

    python bench/bench_tree_attention.py                    # GPU defaults: trees 16..256, prefixes 512..8k, batch 1..16
    python bench/bench_tree_attention.py --trees 64 --prefixes 2048 --batches 1 4 --dtype fp16 --check
    python bench/bench_tree_attention.py --impl triton --trees 16 --prefixes 512 --batches 1   # CPU, interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("triton", "sdpa", "ref")


def parse_args() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--trees",
        type=int,
        nargs="+",
        default=[16, 64, 256] if gpu else [16, 64],
        help="tree sizes (nodes per request)",
    )
    p.add_argument(
        "--prefixes", type=int, nargs="+", default=[512, 2048, 8192] if gpu else [512, 2048], help="prefix lengths"
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16] if gpu else [1, 4], help="batch sizes")
    p.add_argument("--tree-shape", choices=["random", "chain", "star", "branches"], default="random")
    p.add_argument("--heads", type=int, default=32 if gpu else 8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8 if gpu else 2, help="KV heads (GQA group = heads / kv-heads)")
    p.add_argument("--head-dim", type=int, default=128 if gpu else 64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument(
        "--impl",
        dest="impls",
        action="append",
        choices=IMPLS,
        help="implementation(s) to time (repeatable); default: all that apply",
    )
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument(
        "--check", action="store_true", help="also report each implementation's relative error against the reference"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.device = torch.device("cuda" if gpu else "cpu")
    forced = args.impls is not None
    args.impls = args.impls or list(IMPLS)
    if not gpu and "triton" in args.impls and not forced:
        args.impls.remove("triton")  # interpreter timings are meaningless
    return args


def make_parents(shape: str, n: int, rng: np.random.Generator) -> list[int]:
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    if shape == "branches":  # 4 chains from the root, like merged SSM drafts
        return [-1] + [0 if i <= 4 else i - 4 for i in range(1, n)]
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


@dataclass
class Case:
    q: torch.Tensor  # [total_nodes, heads, head_dim]
    k_cache: torch.Tensor  # [capacity, kv_heads, head_dim]
    v_cache: torch.Tensor  # [capacity, kv_heads, head_dim]
    meta: object  # TreeAttentionMetadata
    bytes_moved: int


def make_case(args: argparse.Namespace, batch: int, tree: int, prefix: int) -> Case:
    from specinfer.kernels import build_tree_metadata

    rng = np.random.default_rng(args.seed)
    parents = [make_parents(args.tree_shape, tree, rng) for _ in range(batch)]
    region = prefix + tree
    meta = build_tree_metadata(parents, [prefix] * batch, [b * region for b in range(batch)], args.device)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=args.device).manual_seed(args.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=args.device, dtype=torch.float32).to(dtype)

    q = randn(batch * tree, args.heads, args.head_dim)
    k_cache = randn(batch * region, args.kv_heads, args.head_dim)
    v_cache = randn(batch * region, args.kv_heads, args.head_dim)
    elt = q.element_size()
    bytes_moved = 2 * batch * region * args.kv_heads * args.head_dim * elt + q.numel() * elt
    return Case(q, k_cache, v_cache, meta, bytes_moved)


def impl_fn(name: str) -> Callable[[Case], torch.Tensor]:
    from specinfer.kernels import tree_attention_ref, tree_attention_sdpa

    if name == "triton":
        from specinfer.kernels.tree_attention_triton import tree_attention_triton

        return lambda c: tree_attention_triton(c.q, c.k_cache, c.v_cache, c.meta)
    if name == "sdpa":
        return lambda c: tree_attention_sdpa(c.q, c.k_cache, c.v_cache, c.meta)
    return lambda c: tree_attention_ref(c.q, c.k_cache, c.v_cache, c.meta)


def time_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(warmup: int, iters: int) -> float:
    """Device-to-device copy bandwidth (GB/s: bytes read + bytes written per second) of a 1 GiB buffer: what
    a kernel that streams the KV cache can hope for."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, iters, cuda=True)
    torch.cuda.empty_cache()  # the buffers go when the function returns
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def main() -> None:
    args = parse_args()
    cuda = args.device.type == "cuda"
    if not cuda and "triton" in args.impls:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module (and triton) is imported
    fns = {name: impl_fn(name) for name in args.impls}
    copy_gbs = copy_bandwidth_gbs(args.warmup, args.iters) if cuda else 0.0
    print(
        f"device={torch.cuda.get_device_name() if cuda else 'cpu'} dtype={args.dtype} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} tree_shape={args.tree_shape}"
        + (f" copy_bandwidth={copy_gbs:.0f} GB/s" if cuda else "")
        + "\n"
    )
    cols = (
        ["batch", "tree", "prefix", "impl", "time (ms)", "vs sdpa"]
        + (["GB/s", "of copy"] if cuda else [])
        + (["rel err"] if args.check else [])
    )
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---:" for _ in cols) + "|")
    for batch in args.batches:
        for tree in args.trees:
            for prefix in args.prefixes:
                case = make_case(args, batch, tree, prefix)
                ref = impl_fn("ref")(case) if args.check else None
                times = {
                    name: time_ms(lambda fn=fn, case=case: fn(case), args.warmup, args.iters, cuda)
                    for name, fn in fns.items()
                }
                for name, ms in times.items():
                    row = [str(batch), str(tree), str(prefix), name, f"{ms:.3f}"]
                    row.append(f"{times['sdpa'] / ms:.2f}x" if "sdpa" in times else "-")
                    if cuda:
                        gbs = case.bytes_moved / (ms * 1e-3) / 1e9
                        row += [f"{gbs:.0f}", f"{gbs / copy_gbs:.0%}"]
                    if ref is not None:
                        out = fns[name](case).float()
                        row.append(f"{((out - ref.float()).abs().max() / ref.float().abs().max()).item():.2e}")
                    print("| " + " | ".join(row) + " |", flush=True)
                del case
                if cuda:
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
