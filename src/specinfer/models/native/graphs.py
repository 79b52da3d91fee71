"""CUDA graphs of the native forward pass: a step's ~1000 kernel launches replayed as one.

On a GPU a verify step of a 7B model launches about a thousand kernels, and the host, not the device, sets its
pace (BENCHMARKS.md, "First run on a GPU": 15.9 ms a 1-node step against a ~4.6 ms weight-streaming floor). A CUDA
graph records those launches once and replays them with one call, from fixed device addresses and shapes. On an
H200 that step went from 39.2 ms to 6.3 ms (BENCHMARKS.md, "CUDA graphs on an H200"), bound by the device now.

Steps vary (how many requests, tokens, tree nodes, KV blocks), so each one is *padded* to a :class:`StepShape`:
every size rounded up to a power of two. The step's inputs are copied into that shape's static buffers (two
host-to-device copies), the shape's graph replays, and the first ``N`` logit rows are the step's. Padding adds

- tokens that belong to no attention segment: token 0 at position 0, whose K/V go to the pool's scratch row
  (:class:`~specinfer.models.native.kv_pool.PoolTensors`) and whose rows nobody reads (every other operation of
  the forward pass works row by row);
- segments without queries and logit rows that repeat row 0 (:func:`specinfer.kernels.metadata.pad_metadata`).

So a padded step computes, for its real rows, what the unpadded step computes: the same kernels on the same
values, only with more rows in the matrix products (cuBLAS may pick another algorithm for another row count, so
in bf16 the last bits can differ from an eager step of the exact size, as they do between any two batch sizes).

A shape's graph is captured on its first step (after one eager warm-up that compiles the Triton variants), up to
``max_graphs`` shapes; steps of more than ``max_tokens`` tokens (prefill) or of a shape past that bound run eagerly,
as do steps that want features (draft heads). A capture that fails (logged once, :attr:`GraphRunner.capture_error`)
turns graphs off for the runner's life: the steps run eagerly, the requests are served. Without CUDA the same
padded path runs eagerly (``capture=False``): that is how the padding is tested on a CPU (``tests/test_graphs.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from specinfer.kernels.metadata import (
    MetadataShape,
    TreeAttentionMetadata,
    next_power_of_two,
    pad_metadata,
    padded_buffer_words,
)
from specinfer.models.native.model import NativeModel
from specinfer.models.native.paged_pool import AnyKVPool
from specinfer.models.native.step import LocalRunner, PackedStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShape:
    """What a padded step's graph is specific to: its token rows, logit rows and metadata shape."""

    tokens: int  # T, packed token rows
    logits: int  # N, logit rows
    meta: MetadataShape

    @staticmethod
    def covering(step: PackedStep, meta: TreeAttentionMetadata) -> StepShape:
        tokens = next_power_of_two(len(step.tokens))
        return StepShape(tokens, next_power_of_two(len(step.logit_rows)), MetadataShape.covering(meta, tokens))


class _PaddedStep:
    """One shape's static inputs (fixed device addresses, refilled per step), its graph and its output."""

    def __init__(self, shape: StepShape, device: torch.device) -> None:
        self.shape = shape
        t, n = shape.tokens, shape.logits
        self.ids = torch.zeros(3 * t + n, dtype=torch.long, device=device)  # tokens, positions, cache rows, logit rows
        self.tokens, self.positions, self.cache_rows, self.logit_rows = self.ids.split((t, t, t, n))
        # the padded metadata's int32 buffer: pad_metadata's tensors are views of it
        self.meta_words = torch.zeros(padded_buffer_words(shape.meta), dtype=torch.int32, device=device)
        self.meta: TreeAttentionMetadata | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [N_pad, vocab] float32, the graph's output

    def fill(self, step: PackedStep, meta: TreeAttentionMetadata, pool: AnyKVPool) -> None:
        """Copy ``step`` (with ``meta``, its metadata on the host) into the static buffers, padded to the shape."""
        t, n = len(step.tokens), len(step.logit_rows)
        ids = np.zeros(3 * self.shape.tokens + self.shape.logits, dtype=np.int64)
        tokens, positions, rows, logit_rows = np.split(ids, np.cumsum([self.shape.tokens] * 3))
        tokens[:t], positions[:t], rows[:t], logit_rows[:n] = (
            step.tokens,
            step.positions,
            step.cache_rows,
            step.logit_rows,
        )
        rows[t:] = pool.scratch_row
        self.ids.copy_(torch.from_numpy(ids))
        cache_len = pool.k.shape[1]  # rows (contiguous) or KV blocks (paged) the launch may address
        self.meta = pad_metadata(meta, self.shape.meta, cache_len, self.meta_words.device, self.meta_words)

    def forward(self, model: NativeModel, pool: AnyKVPool) -> torch.Tensor:  # [N_pad, vocab] float32
        assert self.meta is not None
        return model.forward(self.tokens, self.positions, self.cache_rows, self.meta, pool, self.logit_rows)


class GraphRunner(LocalRunner):
    """A :class:`LocalRunner` whose steps replay CUDA graphs, one per :class:`StepShape` (module docstring).

    ``max_tokens``: steps of more packed tokens run eagerly (prefill: compute-bound, and a graph per prompt length
    would hold memory for nothing); ``max_graphs``: shapes captured at most, later new shapes run eagerly;
    ``capture``: False runs the padded path eagerly (no CUDA, or to compare)."""

    def __init__(
        self,
        model: NativeModel,
        pool: AnyKVPool,
        device: torch.device,
        max_tokens: int,
        max_graphs: int = 64,
        capture: bool = True,
    ) -> None:
        super().__init__(model, pool, device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self._steps: dict[StepShape, _PaddedStep] = {}
        self._memory = torch.cuda.graph_pool_handle() if capture else None  # one pool: graphs replay one at a time
        self.eager_steps = 0  # steps that ran eagerly (too large, or past max_graphs)
        self.capture_error: str | None = None  # why a capture failed (every later step then runs eagerly)

    @property
    def graphs(self) -> int:
        """Shapes captured (or, without capture, padded shapes seen)."""
        return len(self._steps)

    def run(self, step: PackedStep) -> torch.Tensor:
        if len(step.tokens) > self.max_tokens:
            self.eager_steps += 1
            return super().run(step)
        meta = step.metadata(torch.device("cpu"))
        shape = StepShape.covering(step, meta)
        padded = self._steps.get(shape)
        if padded is None:
            if len(self._steps) >= self.max_graphs:
                self.eager_steps += 1
                return super().run(step)
            padded = self._steps[shape] = _PaddedStep(shape, self.device)
            padded.fill(step, meta, self._pool)
            if self.capture:
                try:
                    self._capture(padded)
                except Exception as exc:  # a serving process keeps serving, eagerly, rather than fail its requests
                    log.warning("CUDA graph capture failed, steps run eagerly from now on: %s", exc, exc_info=True)
                    self.capture_error = repr(exc)
                    self.max_graphs = 0
                    del self._steps[shape]
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # what the failed capture queued, done first
                    self.eager_steps += 1
                    return super().run(step)
        else:
            padded.fill(step, meta, self._pool)
        if padded.graph is None:
            logits = padded.forward(self.model, self._pool)
        else:
            padded.graph.replay()
            logits = padded.logits
        # a copy: the next replay of any shape may overwrite the graph's output (they share one memory pool)
        return logits[: len(step.logit_rows)].clone()  # [N, vocab]

    def _capture(self, padded: _PaddedStep) -> None:
        """One eager run on a side stream (it compiles the Triton variants and sets cuBLAS up, which a capture may not
        do; it writes the same K/V as the replay will), then the capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            padded.forward(self.model, self._pool)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            padded.logits = padded.forward(self.model, self._pool)
        padded.graph = graph
