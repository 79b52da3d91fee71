"""Start-up calibration of the step cost model: time a model's forward passes by size.

Runs the model on synthetic requests (random tokens, their caches released afterwards): a verify
call of n tree nodes for n in powers of two up to ``max_tokens`` (several requests of at most
``nodes_per_request`` nodes each when n is larger, as a batch would be), the same 16-node call
over a short and a long context (the per-context-token cost of tree attention), and an SSM pass
over a frontier of n nodes. Each size is timed ``repeats`` times after a warm-up and the median
kept. The tables seed :class:`~specinfer.core.costs.StepCosts`, which real steps then refine.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from specinfer.core.costs import BUCKETS, CostTable, StepCosts
from specinfer.core.tree import binary_tree_parents
from specinfer.models.interface import CausalLM, TreeForward

log = logging.getLogger("specinfer.calibrate")

SHORT_CONTEXT = 32
LONG_CONTEXT = 512


def log_progress(msg: str) -> None:
    """The default progress report: one log line per measured size."""
    log.info("calibrating", extra={"step": msg})


def _items(tokens: int, per_request: int, context: Sequence[int], rng: np.random.Generator, vocab: int, tag: str) -> list[TreeForward]:
    items, left, k = [], tokens, 0
    while left > 0:
        n = min(per_request, left)
        nodes = rng.integers(0, vocab, size=n).tolist()
        items.append(TreeForward(f"__calibrate-{tag}-{k}", context, nodes, binary_tree_parents(n)))
        left -= n
        k += 1
    return items


def time_forward(model: CausalLM, tokens: int, per_request: int, context_len: int, repeats: int, seed: int = 0, tag: str = "v") -> float:
    """Median seconds of one ``forward_tree`` over ``tokens`` new nodes (after a warm-up call that also fills the caches)."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, model.vocab_size, size=max(1, context_len)).tolist()
    if model.max_requests is not None:  # as many requests as the caches hold, larger trees if need be
        per_request = max(per_request, -(-tokens // model.max_requests))
    items = _items(tokens, per_request, context, rng, model.vocab_size, tag)
    try:
        model.forward_tree(items)  # warm-up: prefills the contexts
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model.forward_tree(items)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        for it in items:
            model.release(it.request_id)


def calibrate_table(model: CausalLM, max_tokens: int, per_request: int, repeats: int, progress: Callable[[str], None], what: str) -> CostTable:
    sizes = [b for b in BUCKETS if b <= max_tokens]
    seconds = {}
    for n in sizes:
        seconds[n] = time_forward(model, n, per_request, SHORT_CONTEXT, repeats, tag=what)
        progress(f"{what}: {n} tokens {seconds[n] * 1e3:.1f} ms")
    return CostTable(seconds)


def calibrate_costs(
    llm: CausalLM,
    ssms: Sequence[CausalLM],
    max_verify_tokens: int = 64,
    max_frontier_tokens: int = 32,
    nodes_per_request: int = 32,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> StepCosts:
    """The cost model of ``llm`` verifying and each SSM drafting (by its index in ``ssms``)."""
    say = progress or log_progress
    per_request = max(1, nodes_per_request)
    verify = calibrate_table(llm, max_verify_tokens, per_request, repeats, say, "verify")
    per_context = 0.0
    long_ctx = min(LONG_CONTEXT, llm.max_positions - max_verify_tokens - 1)
    if long_ctx > 2 * SHORT_CONTEXT:
        n = min(16, max_verify_tokens)
        short = time_forward(llm, n, per_request, SHORT_CONTEXT, repeats, seed=1, tag="ctx")
        long = time_forward(llm, n, per_request, long_ctx, repeats, seed=1, tag="ctx")
        per_context = max(0.0, (long - short) / (n * (long_ctx - SHORT_CONTEXT)))
        say(f"verify: {per_context * 1e9:.2f} ns per tree node and context token")
    drafts = {i: calibrate_table(ssm, max_frontier_tokens, max_frontier_tokens, repeats, say, f"ssm{i}") for i, ssm in enumerate(ssms)}
    return StepCosts(verify, per_context, drafts)
