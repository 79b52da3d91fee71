"""The start-up capture of CUDA graphs: the step shapes a server meets (:func:`.graphs.warmup_steps`) replayed once
with synthetic requests when a model loads, so that no step in the serving path pays a capture (BENCHMARKS.md,
"CUDA graphs captured at start-up")."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from specinfer.core.tree import binary_tree_parents
from specinfer.models.interface import TreeForward
from specinfer.models.native.graphs import GraphRunner, GraphStats, warmup_steps
from specinfer.models.on_device import wait_for

if TYPE_CHECKING:
    from specinfer.models.native.backend import NativeBackend

log = logging.getLogger(__name__)

WARMUP_BATCH = 32  # the warm-up's largest batch (graphs.warmup_steps); larger ones are captured when met


@torch.inference_mode()
def warm_graphs(backend: NativeBackend, max_batch: int, max_nodes: int, seconds: float) -> GraphStats:
    """Capture the CUDA graphs of the shapes a server meets (:func:`.graphs.warmup_steps`: batches up to
    ``max_batch`` requests, the pool permitting, trees up to ``max_nodes`` nodes: a prefill's chain is a tree of
    the step too) with synthetic requests of a one-token context, for at most ``seconds`` (the commonest shapes
    first), so that serving captures nothing."""
    runner = backend.runner
    if not isinstance(runner, GraphRunner):
        raise ValueError("warm_graphs needs a GraphRunner (CUDA graphs on)")
    batch = max(1, min(max_batch, backend.max_requests))
    steps = warmup_steps(batch, min(max_nodes, backend.rows_per_request - 1), runner.max_tokens)
    ids = [f"__graph-warmup-{k}" for k in range(batch)]
    started = time.monotonic()
    runner.start_warmup()
    done = 0
    try:
        wait_for(backend.forward_tree([TreeForward(rid, [], [0], [-1]) for rid in ids]))  # their one-token contexts
        for sizes in steps:
            if time.monotonic() - started > seconds:
                break
            items = [
                TreeForward(rid, [0], [0] * n, binary_tree_parents(n))
                for rid, n in zip(ids[: len(sizes)], sizes, strict=True)
            ]
            wait_for(backend.forward_tree(items))
            done += 1
    finally:
        for rid in ids:
            backend.release(rid)
        stats = runner.end_warmup(time.monotonic() - started)
    log.info(
        "CUDA graphs warmed up: %d shapes in %.1f s (%d of %d warm-up steps%s)",
        stats.warmup,
        stats.warmup_seconds,
        done,
        len(steps),
        "" if done == len(steps) else f", cut at --cuda-graph-warmup-seconds {seconds:g}",
    )
    return stats
