"""Attention on a CPU: the SDPA path as it runs (GQA groups folded into one head's rows, keys and values read in
place) beside the form it replaced (head-major copies of queries, keys and values, SDPA's ``enable_gqa``).

Part 1, per operation: one request's attention for a model's head shape (``--heads``, ``--kv-heads``, 64-wide
heads), one query (an incremental step) or a tree of ``--tree`` nodes (a chain, every node a query), behind
``--contexts`` cached tokens, in each ``--dtypes``; microseconds per call, best of ``--rounds`` rounds.

Part 2, with ``--llm``: greedy incremental decoding of that checkpoint (``--quantize``, ``--dtype``, the same paged KV
pool), ms per token,
the two forms swapped in the running process round after round (``--rounds``), after a ``--context``-token prompt.

    python bench/attention_cpu.py --heads 9 --kv-heads 3 --contexts 64,512,2048 \\
        --llm ~/.cache/specinfer/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --dtype bfloat16 --quantize int4
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specinfer.kernels import build_paged_tree_metadata, tree_attention
from specinfer.kernels.tree_attention_ref import _cached_additive_mask, _request_views

PATH = sys.modules["specinfer.kernels.tree_attention"]  # the module whose tree_attention_sdpa part 2 swaps
HEAD_DIM = 64
BLOCK = 16  # KV block size of the paged pool, the services' default


def copied_sdpa(q, k_cache, v_cache, meta, sm_scale=None, softcap=None, window=None):
    """The form replaced: per request, head-major contiguous copies and SDPA's ``enable_gqa``, with the path's own
    gather and its masks cached per step (no soft cap or window: the models this bench runs have neither)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[-2]
    for b in range(meta.batch_size):
        qb, kb, vb = _request_views(q, k_cache, v_cache, meta, b)  # [nq, H, D], [L, kv_heads, D] x 2
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (qb, kb, vb))  # [1, heads, len, D]
        causal = meta.is_chain[b] and meta.prefix_lens[b] == 0 and meta.num_queries[b] == len(meta.parents[b])
        one = meta.is_chain[b] and meta.num_queries[b] == 1
        mask = None if causal or one else _cached_additive_mask(meta, b, q.device, q.dtype, None)  # [nq, L]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal, enable_gqa=group > 1)
        out[meta.q_starts[b] : meta.q_starts[b + 1]] = ob[0].transpose(0, 1)
    return out


def best_us(fn: Callable[[], object], rounds: int, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def op_rows(args) -> list[str]:
    rows = [
        "| dtype | queries | context | copies + enable_gqa (us) | folded, in place (us) | x |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            for n in (1, args.tree):
                length = context + n
                blocks = -(-length // BLOCK)
                k = torch.randn(blocks, BLOCK, args.kv_heads, HEAD_DIM, generator=gen).to(dtype)
                v = torch.randn(blocks, BLOCK, args.kv_heads, HEAD_DIM, generator=gen).to(dtype)
                q = torch.randn(n, args.heads, HEAD_DIM, generator=gen).to(dtype)
                table = torch.randperm(blocks, generator=gen).tolist()
                meta = build_paged_tree_metadata([tuple(range(-1, n - 1))], [context], [table], BLOCK, "cpu")
                inputs = (q, k, v, meta)
                old = best_us(lambda inputs=inputs: copied_sdpa(*inputs), args.rounds)
                new = best_us(lambda inputs=inputs: tree_attention(*inputs, impl="torch"), args.rounds)
                rows.append(f"| {str(dtype)[6:]} | {n} | {context} | {old:.1f} | {new:.1f} | {old / new:.2f} |")
    return rows


def decode_rows(args) -> list[str]:
    from specinfer.engine import EngineConfig, GenerationRequest, SpeculativeEngine
    from specinfer.models.loading import load_backend

    llm = load_backend(args.llm, "llm", args.dtype, backend="native", kv_block_size=BLOCK, quantize=args.quantize)
    engine = SpeculativeEngine(llm, [], EngineConfig(max_batch=1, eos_token_id=None))
    prompt = tuple((i * 7919) % 4000 + 5 for i in range(args.context))  # ids every vocabulary here has
    forms = {"copies + enable_gqa": copied_sdpa, "folded, in place": PATH.tree_attention_sdpa}
    times: dict[str, list[float]] = {name: [] for name in forms}
    texts: dict[str, set[tuple[int, ...]]] = {name: set() for name in forms}
    engine.generate([GenerationRequest("warm", prompt, 8, ignore_eos=True)])
    try:
        for r in range(args.rounds):
            for name, form in forms.items():
                PATH.tree_attention_sdpa = form
                start = time.perf_counter()
                (done,) = engine.generate([GenerationRequest(f"{name}-{r}", prompt, args.new_tokens, ignore_eos=True)])
                times[name].append((time.perf_counter() - start) / args.new_tokens * 1e3)
                texts[name].add(tuple(done.output_tokens))
    finally:
        PATH.tree_attention_sdpa = forms["folded, in place"]
    first = texts["copies + enable_gqa"]
    rows = ["| form | ms per token, best | median | outputs over the rounds | = copies' |", "|---|---:|---:|---:|---|"]
    for name, ts in times.items():
        median = sorted(ts)[len(ts) // 2]
        rows.append(f"| {name} | {min(ts):.2f} | {median:.2f} | {len(texts[name])} | {texts[name] == first} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--contexts", default="64,512,2048")
    ap.add_argument("--tree", type=int, default=8, help="nodes of the tree rows")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llm", help="part 2: a checkpoint folder")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--context", type=int, default=512, help="part 2: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{args.heads} heads, {args.kv_heads} KV heads of {HEAD_DIM}, {args.threads} threads; "
        f"paged KV, blocks of {BLOCK}"
    )
    print("\n".join(op_rows(args)))
    if args.llm:
        print(
            f"\n{args.llm}, {args.dtype}, quantize {args.quantize}, {args.context}-token prompt, "
            f"{args.new_tokens} new tokens, greedy"
        )
        print("\n".join(decode_rows(args)))


if __name__ == "__main__":
    main()
