"""One rank of a parallel run of a fixed sequence of verifier steps (run as a script per rank).

``python scenario.py CHECKPOINT TP PP RANK PORT OUT [KV_BLOCK_SIZE]``: every rank joins the group
on 127.0.0.1:PORT (gloo); rank 0 drives :func:`steps` and saves the logits of every step to OUT
(``torch.save``), the others replay. ``KV_BLOCK_SIZE`` > 0: a paged KV pool (default 0: slots). The test runs
:func:`steps` on a single-process backend too.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.native import NativeOptions
from specinfer.models.native.parallel import ParallelLayout, Rendezvous, close_groups, exit_rank, load_driver, run_rank

OPTIONS = NativeOptions(kv_cache_bytes=1 << 22, max_seq_len=128, attention="torch", max_tree_nodes=32)
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def steps(llm: CausalLM, vocab: int) -> list[list[torch.Tensor]]:
    """Prefill three prompts (two as chains with logits, one without), then three tree-verify
    steps, each on the context that adopts an accepted path of the step before (KV moves), with a
    request released and a new one joining in between (slot reuse) whose prompt starts with another
    request's first 12 tokens (on a paged pool, it takes their cached KV blocks)."""
    gen = torch.Generator().manual_seed(3)
    prompts = {f"r{i}": torch.randint(0, vocab, (n,), generator=gen).tolist() for i, n in enumerate((5, 17, 11))}
    out = [
        llm.forward_tree([TreeForward(rid, [], p, list(range(-1, len(p) - 1))) for rid, p in list(prompts.items())[:2]])
    ]
    out.append(llm.forward_tree([TreeForward("r2", prompts["r2"], [], [])]))  # prefill without logits
    for step in range(3):
        if step == 2:
            llm.release("r0")
            del prompts["r0"]
            prompts["r3"] = prompts["r1"][:12] + torch.randint(0, vocab, (9,), generator=gen).tolist()
        items = []
        for i, (rid, p) in enumerate(prompts.items()):
            tree = [p[-1]] + [(7 * k + 5 * i + 3 * step) % vocab for k in range(1, len(TREE_PARENTS))]
            items.append(TreeForward(rid, p[:-1], tree, TREE_PARENTS))
        out.append(llm.forward_tree(items))
        # accept root -> node 1 -> node 4 -> node 6, plus a bonus token
        prompts = {
            it.request_id: list(it.context_tokens) + [it.tokens[0], it.tokens[1], it.tokens[4], it.tokens[6], step + 1]
            for it in items
        }
    return out


def main(argv: list[str]) -> None:
    checkpoint, tp, pp, rank, port, out, *extra = argv  # extra: [KV block size [, offload (0 or 1)]]
    options = dataclasses.replace(
        OPTIONS, kv_block_size=int(extra[0]) if extra else 0, offload=len(extra) > 1 and extra[1] == "1"
    )
    torch.set_num_threads(1)
    layout = ParallelLayout(int(tp), int(pp), int(rank))
    rendezvous = Rendezvous("127.0.0.1", int(port), 60.0)
    try:
        if layout.rank == 0:
            backend, runner = load_driver(checkpoint, options, layout, rendezvous)
            logits = steps(backend, backend.vocab_size)
            runner.shutdown()
            if options.kv_block_size:  # the ranks computed on blocks r3 shares with r1 (block tables from rank 0)
                assert backend.prefix_cache_stats.hit_tokens >= 12 // options.kv_block_size * options.kv_block_size
            torch.save(logits, Path(out))
        else:
            run_rank(checkpoint, options, layout, rendezvous)
    finally:
        close_groups()
    exit_rank(0)  # as the verifier's ranks do (see exit_rank); an exception above exits 1 as usual


if __name__ == "__main__":
    main(sys.argv[1:])
