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

Only what changes the launches is a dimension of the shape: packed tokens, logit rows, segments and the launch
grid's rows per segment. The rest is fixed for the runner's life where a fixed size is cheap: the block table is as
wide as a request's longest (a few hundred int32 per segment), the ancestor words cover the largest tree, and the
split-KV heuristic plans for the longest prefix (the kernel cuts each segment's *own* prefix into that many chunks at
run time, so a short prefix only gets smaller chunks). Without that, a context growing past each power of two was a
new shape, captured in the serving path (0.3-1 s on an H200: BENCHMARKS.md, "CUDA graphs on an H200").

A shape's graph is captured on its first step (after one eager warm-up that compiles the Triton variants), up to
``max_graphs`` shapes; steps of more than ``max_tokens`` tokens (prefill) or of a shape past that bound run eagerly,
as do steps that want features (draft heads). :func:`warmup_steps` lists the shapes a server meets (batches of
requests with trees of power-of-two sizes), which :func:`specinfer.models.native.warmup.warm_graphs` captures at
start-up, so that a warmed server captures nothing while it serves (:class:`GraphStats` counts what it captured
when). A capture that fails (logged once, :attr:`GraphRunner.capture_error`) turns graphs off for the runner's life:
the steps run eagerly, the requests are served. Without CUDA the same padded path runs eagerly (``capture=False``):
that is how the padding is tested on a CPU (``tests/test_graphs.py``).
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass, replace

import numpy as np
import torch

from specinfer.kernels.metadata import (
    BITS_PER_WORD,
    MetadataShape,
    TreeAttentionMetadata,
    next_power_of_two,
    pad_metadata,
    padded_buffer_words,
)
from specinfer.models.native.model import NativeModel
from specinfer.models.native.paged_pool import AnyKVPool, PagedKVPool
from specinfer.models.native.step import LocalRunner, PackedStep

log = logging.getLogger(__name__)


PENDING_ROWS_PER_TOKEN = 16  # ancestor rows a shape holds per packed token (StepShape.covering)


@dataclass(frozen=True)
class GraphLimits:
    """The sizes a runner fixes for its life (module docstring): ``request_rows``, KV rows of a request at its longest
    (its prefix and tree nodes); ``tree_rows``, nodes of a request's largest tree (pending ones included; in a graphed
    step a tree is at most its nodes, or a new request's uncached context and its nodes)."""

    request_rows: int
    tree_rows: int


@dataclass(frozen=True)
class StepShape:
    """What a padded step's graph is specific to: its token rows, logit rows and metadata shape."""

    tokens: int  # T, packed token rows
    logits: int  # N, logit rows
    meta: MetadataShape

    @staticmethod
    def covering(step: PackedStep, meta: TreeAttentionMetadata, limits: GraphLimits, block_size: int) -> StepShape:
        """The shape of ``step``: its varying sizes rounded up to powers of two, the rest at ``limits`` (or above, for
        a step past them); ``block_size``: the paged pool's (0: contiguous slots, no block table)."""
        tokens = next_power_of_two(len(step.tokens))
        least = MetadataShape.covering(meta, tokens)
        # the fixed sizes need not be powers of two: compare them with the step's own
        width = meta.block_table.shape[1] if meta.block_table is not None else 0
        least = replace(least, table_width=width, max_prefix_len=meta.max_prefix_len)
        fixed = MetadataShape(
            batch=least.batch,
            queries=tokens,
            max_queries=least.max_queries,
            words=next_power_of_two(-(-limits.tree_rows // BITS_PER_WORD)),
            # a row per node of a non-chain tree, pending nodes included: an SSM's frontier calls send a few nodes
            # on top of a round's earlier ones, so rows outnumber tokens (a step past this gets the least above)
            bit_rows=tokens * PENDING_ROWS_PER_TOKEN,
            table_width=-(-limits.request_rows // block_size) if block_size else 0,
            max_prefix_len=limits.request_rows,
        )
        # logit rows: as many as tokens, although a step computing a context's chain wants fewer (a new request's
        # prompt), so that those steps share the trees' steps' shapes (the rows' LM head is cheap beside a capture)
        return StepShape(tokens, tokens, _at_least(fixed, least))


def _at_least(shape: MetadataShape, least: MetadataShape) -> MetadataShape:
    """Each size of ``shape`` raised to ``least``'s where that is larger."""
    return MetadataShape(*(max(a, b) for a, b in zip(astuple(shape), astuple(least), strict=True)))


@dataclass(frozen=True)
class GraphStats:
    """What a :class:`GraphRunner` did since load: shapes captured while warming up (``warmup``) and after
    (``serving``: each one a capture in the serving path, 0.3-1 s on a GPU), steps run eagerly (prefill past
    ``max_tokens``, shapes past ``max_graphs``, after a failed capture), and the warm-up's seconds."""

    warmup: int = 0
    serving: int = 0
    eager_steps: int = 0
    warmup_seconds: float = 0.0


def warmup_steps(max_batch: int, max_nodes: int, max_tokens: int) -> list[list[int]]:
    """Steps whose shapes cover a server's: for each power-of-two batch ``b <= max_batch`` and largest tree
    ``q <= max_nodes`` (both rounded up: ``b / 2 + 1`` to ``b`` requests, the first tree of ``q / 2 + 1`` to ``q``
    nodes), one step per power of two of packed tokens such a batch can fill (trees of at least 1 and at most the
    first's nodes), at most ``max_tokens`` of them. A step is its trees' node counts. Batch 1 first (every tree size
    of a lone request), then incremental batches, then the rest by size: a warm-up cut short by its time bound keeps
    the commonest."""
    steps: list[tuple[tuple[int, int, int], list[int]]] = []
    b = 1
    while b <= max_batch:
        q = 1
        while q <= max_nodes:
            low = q // 2 + 1 if q > 1 else 1  # the first tree's fewest nodes for this q
            fewest = b // 2 + 1 if b > 1 else 1  # the fewest requests padded to b
            least, most = low + fewest - 1, min(b * q, max_tokens)  # packed tokens such a batch can hold
            t = next_power_of_two(least)
            while t <= next_power_of_two(most) and least <= most:
                total = min(max(least, t // 2 + 1), most)  # a count within (t / 2, t]: that shape's tokens
                requests = min(b, total - low + 1)
                first = max(low, min(q, total - (requests - 1)))
                rest = [1] * (requests - 1)
                extra = total - first - (requests - 1)
                for k in range(requests - 1):  # the extra nodes spread over the other trees, none above the first
                    add = min(first - 1, extra)
                    rest[k] += add
                    extra -= add
                key = (0 if b == 1 else 1 if q == 1 else 2, t, b)
                steps.append((key, [first, *rest]))
                t *= 2
            q *= 2
        b *= 2
    return [sizes for _, sizes in sorted(steps, key=lambda s: s[0])]


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

    ``limits``: the sizes fixed for the runner's life (:class:`GraphLimits`); ``max_tokens``: steps of more packed
    tokens run eagerly (prefill: compute-bound, and a graph per prompt length would hold memory for nothing);
    ``max_graphs``: shapes captured at most after the warm-up, later new shapes run eagerly; ``capture``: False runs
    the padded path eagerly (no CUDA, or to compare)."""

    def __init__(
        self,
        model: NativeModel,
        pool: AnyKVPool,
        device: torch.device,
        limits: GraphLimits,
        max_tokens: int,
        max_graphs: int = 64,
        capture: bool = True,
    ) -> None:
        super().__init__(model, pool, device)
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.limits = limits
        self._block_size = pool.block_size if isinstance(pool, PagedKVPool) else 0  # 0: contiguous slots
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.capture = capture
        self._steps: dict[StepShape, _PaddedStep] = {}
        self._memory = torch.cuda.graph_pool_handle() if capture else None  # one pool: graphs replay one at a time
        self.eager_steps = 0  # steps that ran eagerly (too large, or past max_graphs)
        self.capture_error: str | None = None  # why a capture failed (every later step then runs eagerly)
        self._logits: torch.Tensor | None = None  # [T_max, vocab] float32, every graph's output (_capture)
        self._warming = False  # between start_warmup and end_warmup
        self._warm_shapes = 0  # shapes the warm-up captured
        self._warm_seconds = 0.0

    @property
    def graphs(self) -> int:
        """Shapes captured (or, without capture, padded shapes seen)."""
        return len(self._steps)

    @property
    def stats(self) -> GraphStats:
        if self._warming:
            return GraphStats(warmup=self.graphs, eager_steps=self.eager_steps)
        serving = self.graphs - self._warm_shapes
        return GraphStats(self._warm_shapes, serving, self.eager_steps, self._warm_seconds)

    def start_warmup(self) -> None:
        """Steps from now on are the warm-up's, until :meth:`end_warmup`: their shapes do not count against
        ``max_graphs``."""
        self._warming = True

    def end_warmup(self, seconds: float) -> GraphStats:
        """The warm-up, which took ``seconds``, is over: shapes captured from now on are the serving path's
        (:attr:`stats`)."""
        self._warming = False
        self._warm_shapes = self.graphs
        self._warm_seconds = seconds
        return self.stats

    def run(self, step: PackedStep) -> torch.Tensor:
        if len(step.tokens) > self.max_tokens:
            self.eager_steps += 1
            return super().run(step)
        meta = step.metadata(torch.device("cpu"))
        shape = StepShape.covering(step, meta, self.limits, self._block_size)
        padded = self._steps.get(shape)
        if padded is None:
            late = len(self._steps) - self._warm_shapes  # shapes captured past the warm-up
            if self.capture_error is not None or (not self._warming and late >= self.max_graphs):
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
        # a copy: the next replay of any shape overwrites the graphs' one output buffer
        return logits[: len(step.logit_rows)].clone()  # [N, vocab]

    def _capture(self, padded: _PaddedStep) -> None:
        """One eager run on a side stream (it compiles the Triton variants and sets cuBLAS up, which a capture may not
        do; it writes the same K/V as the replay will), then the capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            vocab = padded.forward(self.model, self._pool).shape[1]
        torch.cuda.current_stream(self.device).wait_stream(side)
        rows = padded.shape.logits
        if self._logits is None:
            # one output buffer for every graph, outside their memory pool: a graph's own output stays allocated
            # while the graph lives, which over ~100 shapes of up to 512 rows is gigabytes at a 128k vocabulary
            self._logits = torch.empty(
                next_power_of_two(self.max_tokens), vocab, dtype=torch.float32, device=self.device
            )  # [T_max, vocab]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            self._logits[:rows].copy_(padded.forward(self.model, self._pool))
        padded.logits = self._logits[:rows]
        padded.graph = graph
