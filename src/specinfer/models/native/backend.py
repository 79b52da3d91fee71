"""Native backend: our own blocks, a preallocated KV pool and the fused tree-attention kernel.

Implements :class:`specinfer.models.interface.CausalLM`. One forward pass packs, for every request, up to two
*segments* for the attention kernel: the context tokens the cache lacks (a chain: prefill, or a rebuild after a lost
cache) and the new tree nodes, which attend to the whole context, to their pending ancestors and to themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specinfer.core.errors import InvalidArgument
from specinfer.core.kv_budget import KVBudget, PrefixCacheStats, blocks_for
from specinfer.kernels.tree_attention import resolve_impl
from specinfer.models.interface import TreeForward
from specinfer.models.kv_store import RequestCache
from specinfer.models.native.fused import dense_candidate
from specinfer.models.native.gemm import GEMM_CHOICES, GemmPlan, plan_for
from specinfer.models.native.graphs import GraphLimits, GraphRunner, GraphStats
from specinfer.models.native.kv_pool import KVPool, SlotStorage
from specinfer.models.native.model import NativeModel, RopeTables
from specinfer.models.native.paged_pool import AnyKVPool, BlockStorage, PagedKVPool
from specinfer.models.native.placement import device_weights
from specinfer.models.native.quant import DEFAULT_GROUP_SIZE, QUANTIZE_CHOICES
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.step import LocalRunner, PackedStep, StepRequest, StepRunner
from specinfer.models.native.warmup import WARMUP_BATCH, warm_graphs
from specinfer.models.native.weights import ModelWeights

DEFAULT_GRAPH_TOKENS = 512  # a decode batch of 64 requests with trees of 8 nodes
DEFAULT_GRAPH_WARMUP_SECONDS = 60.0


@dataclass(frozen=True)
class NativeOptions:
    """``kv_cache_bytes``: memory for the KV pool; ``max_seq_len``: tokens per request slot
    (0: the model's limit); ``attention``: ``auto`` (Triton on CUDA, PyTorch on CPU),
    ``triton`` or ``torch``; ``max_tree_nodes``: extra rows per slot for tree nodes beyond the
    sequence (a tree's nodes share positions, so they need rows but no positions); ``gemm``:
    ``auto`` (measure at load which form of each matrix product is faster, :mod:`.gemm`), ``plain`` (the same,
    weights never packed), ``linear`` (always ``F.linear``), ``transposed`` (``w @ x.T`` up to 128 rows) or
    ``packed`` (oneDNN's packed layer weights);
    ``kv_block_size``: 0 for one contiguous slot per request (:mod:`.kv_pool`), else a paged pool
    of KV blocks of that many tokens, taken as requests grow (:mod:`.paged_pool`); ``offload``: keep
    the decoder layers in host memory and stream them to the device layer by layer (:mod:`.offload`);
    ``offload_reserve_bytes``: most device bytes offloading may use for staging and resident
    weights (0: no bound); ``prefix_caching``: with a paged pool, full blocks of committed context
    are cached and a request whose context starts with cached blocks takes them instead of
    computing them (:mod:`.paged_pool`; no effect on contiguous slots, which requests do not share);
    ``cuda_graph_tokens``: on a CUDA device, with the Triton attention and without offloading, steps of at most this
    many packed tokens replay CUDA graphs (:mod:`.graphs`; 0: never); ``cuda_graph_warmup_seconds``: at load, the
    graphs of the shapes a server meets are captured for at most this long (:func:`.warmup.warm_graphs`; 0: none,
    each shape is captured on its first step); ``quantize``: the decoder layers' projections kept as ``int8`` or
    ``int4`` (groups of ``quantize_group_size`` inputs) instead of ``none`` (:mod:`.quant`); ``fused_layers``: decode
    and verify steps through the fused CPU decoder layers where they can run the model (:mod:`.fused`)."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    kv_cache_bytes: int = 1 << 30
    max_seq_len: int = 0
    attention: str = "auto"
    max_tree_nodes: int = 256
    gemm: str = "auto"
    kv_block_size: int = 0
    offload: bool = False
    offload_reserve_bytes: int = 0
    prefix_caching: bool = True
    cuda_graph_tokens: int = DEFAULT_GRAPH_TOKENS
    cuda_graph_warmup_seconds: float = DEFAULT_GRAPH_WARMUP_SECONDS
    quantize: str = "none"
    quantize_group_size: int = DEFAULT_GROUP_SIZE
    fused_layers: bool = True

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {self.quantize!r}")
        if self.cuda_graph_warmup_seconds < 0:
            raise ValueError(f"cuda_graph_warmup_seconds must be >= 0, got {self.cuda_graph_warmup_seconds}")
        if self.cuda_graph_tokens < 0:
            raise ValueError(f"cuda_graph_tokens must be >= 0, got {self.cuda_graph_tokens}")
        if self.offload_reserve_bytes < 0:
            raise ValueError(f"offload_reserve_bytes must be >= 0, got {self.offload_reserve_bytes}")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"gemm must be one of {GEMM_CHOICES}, got {self.gemm!r}")
        if self.kv_block_size < 0:
            raise ValueError(f"kv_block_size must be >= 0, got {self.kv_block_size}")


def slot_len(spec: ModelSpec, options: NativeOptions) -> int:
    """Positions a request may use: the model's limit, or ``max_seq_len`` when lower."""
    limit = spec.positions_limit
    return min(limit, options.max_seq_len) if options.max_seq_len else limit


def pool_slots(spec: ModelSpec, options: NativeOptions) -> tuple[int, int]:
    """``(rows per slot, slots)`` of a KV pool for ``spec`` within ``options.kv_cache_bytes``:
    each slot holds a whole sequence plus ``max_tree_nodes`` tree rows."""
    rows = request_rows(spec, options)
    return rows, options.kv_cache_bytes // (KVPool.bytes_per_token(spec, options.dtype) * rows)


def request_rows(spec: ModelSpec, options: NativeOptions) -> int:
    """KV rows one request may need: a whole sequence plus ``max_tree_nodes`` tree rows."""
    return slot_len(spec, options) + options.max_tree_nodes


def check_kv_budget(spec: ModelSpec, options: NativeOptions) -> None:
    """:class:`InvalidArgument` naming ``kv-cache-bytes`` when ``options.kv_cache_bytes`` cannot hold the KV
    rows of one request at its longest (:func:`request_rows`), saying the smallest budget that does and the
    largest ``--max-seq-len`` that fits this one."""
    per_row = KVPool.bytes_per_token(spec, options.dtype)
    rows = request_rows(spec, options)
    unit = options.kv_block_size or rows  # paged: whole KV blocks; contiguous: one slot of a request's rows
    need = per_row * blocks_for(rows, unit) * unit
    if options.kv_cache_bytes >= need:
        return
    fitting_rows = options.kv_cache_bytes // (per_row * unit) * unit if options.kv_block_size else None
    fitting_rows = options.kv_cache_bytes // per_row if fitting_rows is None else fitting_rows
    longest = fitting_rows - options.max_tree_nodes  # the rows a request's tree nodes need besides its positions
    shorter = f", or --max-seq-len {longest} or less" if longest > 0 else ""
    raise InvalidArgument(
        "kv-cache-bytes",
        f"{options.kv_cache_bytes} bytes hold no request of {slot_len(spec, options)} positions ({rows} KV rows with "
        f"{options.max_tree_nodes} for tree nodes, {per_row} bytes each): "
        f"give --kv-cache-bytes {need} or more{shorter}",
    )


def pool_geometry(spec: ModelSpec, options: NativeOptions) -> tuple[int, int]:
    """``(rows per unit, units)`` of the KV pool for ``spec`` within ``options.kv_cache_bytes``:
    slots (:func:`pool_slots`), or KV blocks of ``kv_block_size`` rows for a paged pool; raises
    :class:`InvalidArgument` when it holds no request (:func:`check_kv_budget`)."""
    check_kv_budget(spec, options)
    if not options.kv_block_size:
        return pool_slots(spec, options)
    return options.kv_block_size, options.kv_cache_bytes // (
        KVPool.bytes_per_token(spec, options.dtype) * options.kv_block_size
    )


def new_pool(
    spec: ModelSpec,
    options: NativeOptions,
    device: torch.device,
    geometry: tuple[int, int],
    contiguous: type[KVPool] = KVPool,
    paged: type[PagedKVPool] = PagedKVPool,
) -> AnyKVPool:
    """A pool of ``spec``'s shape with ``geometry`` (:func:`pool_geometry`) in the layout ``options``
    asks for, of class ``contiguous`` or ``paged`` (a parallel driver passes its recording ones)."""
    return (paged if options.kv_block_size else contiguous)(spec, options.dtype, device, *geometry)


def gemm_plan(weights: ModelWeights, options: NativeOptions, plain: bool = False) -> GemmPlan:
    """The matrix-product forms of a model's weights under ``options`` (:func:`.gemm.plan_for`), its layers' projections
    packed where the plan packs them (none when ``plain``: offloaded, or read by the fused CPU layers)."""
    plan = plan_for(options.gemm, weights, torch.device(options.device), packing=not plain)
    plan.pack(weights)
    return plan


def rope_tables(spec: ModelSpec, path: Path, device: torch.device) -> RopeTables | None:
    """RoPE tables on ``device`` of the checkpoint at ``path``; None for a family without RoPE (OPT: learned
    positions)."""
    if not spec.family.rope:
        return None
    local = (
        None if spec.local_rope_theta is None else default_inv_freq(spec.local_rope_theta, spec.rotary_dim).to(device)
    )
    if spec.rope_type != "default":
        # scaled RoPE: transformers' own tables (imported here only: it takes seconds, and every rank
        # of a parallel verifier pays it at start-up)
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = AutoConfig.from_pretrained(str(path)).get_text_config()  # gemma3: its text_config
        layer_type = None if local is None else "full_attention"  # Gemma 3 keeps RoPE parameters per layer type
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = (params[layer_type] if layer_type else params).get("rope_type", "default")
        if rope_type != "default":
            inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
            return RopeTables(inv.float().to(device), float(scale), local)
    return RopeTables(default_inv_freq(spec.rope_theta, spec.rotary_dim).to(device), 1.0, local)


def uses_cuda_graphs(options: NativeOptions, device: torch.device) -> bool:
    """Whether steps replay CUDA graphs (:mod:`.graphs`): a CUDA device, the Triton attention (the PyTorch path builds
    masks on the host inside the step, which a capture cannot hold), no offloading (it streams layers with events
    the host waits on) and ``cuda_graph_tokens`` > 0."""
    triton = resolve_impl(options.attention, device.type == "cuda") == "triton"
    return device.type == "cuda" and triton and not options.offload and options.cuda_graph_tokens > 0


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Unscaled RoPE inverse frequencies of ``dim`` rotary dimensions with base ``theta``.  # [dim / 2] float32"""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class NativeBackend:
    """Per-request bookkeeping (which tokens each request's KV slot or KV blocks hold, what a step
    must compute) on top of a :class:`StepRunner` that executes the packed steps: the whole model
    in this process, or a group of ranks (:mod:`specinfer.models.native.parallel`)."""

    def __init__(self, spec: ModelSpec, runner: StepRunner, options: NativeOptions) -> None:
        self.spec = spec
        self.runner = runner
        self.options = options
        self.device = torch.device(options.device)
        self.pool: AnyKVPool = runner.pool
        self.block_size = options.kv_block_size  # 0: contiguous slots
        if isinstance(self.pool, PagedKVPool) != bool(self.block_size):
            raise ValueError(f"kv_block_size {self.block_size} does not match the runner's {type(self.pool).__name__}")
        self.vocab_size = spec.vocab_size
        self.max_positions = slot_len(spec, options)
        self.rows_per_request = request_rows(
            spec, options
        )  # KV rows a request may use (its slot, paged: its most blocks' rows)
        # Concurrent requests the KV pool holds, each at its longest (a slot is one block of a whole
        # request's rows). Paged, a request takes its blocks as it grows, so more fit at once: the
        # drivers admit by kv_budget (core.kv_budget.schedule).
        budget = self.kv_budget
        self.max_requests = budget.blocks // budget.blocks_for(self.rows_per_request)
        if self.max_requests == 0:
            raise ValueError(
                "the KV budget does not hold the KV blocks of one request; raise the budget or lower max_seq_len"
            )
        self._caches: dict[str, RequestCache] = {}
        self.prefix_caching = bool(self.block_size) and options.prefix_caching
        self._prefix_queried = 0  # PrefixCacheStats' totals
        self._prefix_hits = 0

    @property
    def kv_budget(self) -> KVBudget:
        """Paged: the pool's KV blocks; contiguous: its slots, each one block of a whole request's rows."""
        if self.block_size:
            return KVBudget(self.block_size, self.pool.num_blocks)
        return KVBudget(self.pool.slot_len, self.pool.num_slots)

    @property
    def kv_blocks_free(self) -> int:
        """KV blocks no request holds (contiguous layout: free slots)."""
        return self.pool.free_blocks if self.block_size else self.pool.free_slots

    @classmethod
    def load(cls, path: str | Path, options: NativeOptions = NativeOptions()) -> NativeBackend:
        path = Path(path)
        spec = ModelSpec.from_dir(path)
        geometry = pool_geometry(spec, options)  # a budget that holds no request fails before the weights load
        device = torch.device(options.device)
        weights, layers = device_weights(spec, path, options, device)
        # plans key shapes (so hold for staging buffers); plain weights where offloaded or read by the fused CPU layers
        fused = options.fused_layers
        gemm = gemm_plan(weights, options, layers is not None or (fused and dense_candidate(spec, device, options)))
        model = NativeModel(spec, weights, rope_tables(spec, path, device), options.attention, gemm, layers, fused)
        pool = new_pool(spec, options, device, geometry)
        if uses_cuda_graphs(options, device):
            limits = GraphLimits(request_rows(spec, options), max(options.max_tree_nodes, options.cuda_graph_tokens))
            backend = cls(spec, GraphRunner(model, pool, device, limits, options.cuda_graph_tokens), options)
            if options.cuda_graph_warmup_seconds > 0:
                warm_graphs(backend, WARMUP_BATCH, options.cuda_graph_tokens, options.cuda_graph_warmup_seconds)
            return backend
        return cls(spec, LocalRunner(model, pool, device), options)

    @property
    def graph_stats(self) -> GraphStats | None:
        """What the CUDA graphs' runner captured at warm-up and since (None: steps run without graphs)."""
        return self.runner.stats if isinstance(self.runner, GraphRunner) else None

    def cached_requests(self) -> list[str]:
        return list(self._caches)

    def release(self, request_id: str) -> None:
        cache = self._caches.pop(request_id, None)
        if cache is not None:
            cache.storage.release()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return PrefixCacheStats(self._prefix_queried, self._prefix_hits) if self.prefix_caching else None

    def prefix_hits(self, request_id: str) -> int:
        cache = self._caches.get(request_id)
        return cache.reused if cache is not None else 0

    def _cache(self, request_id: str) -> RequestCache:
        cache = self._caches.get(request_id)
        if cache is None:
            storage = (
                BlockStorage(self.pool, self.prefix_caching)
                if self.block_size
                else SlotStorage(self.pool, self.pool.allocate())
            )
            cache = RequestCache(storage)
            self._caches[request_id] = cache
        return cache

    @torch.inference_mode()
    def forward_tree(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        requests, plans = self._plan(batch)
        step = PackedStep.from_trees(requests, self.block_size)
        if not step.tokens:  # every cache already holds its context and no nodes came (a prefill that is up to date)
            return [torch.empty(0, self.vocab_size, device=self.device) for _ in batch]
        logits = self.runner.run(step)  # [sum n, vocab]
        return self._record(plans, logits)

    @torch.inference_mode()
    def forward_tree_features(self, batch: Sequence[TreeForward]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`forward_tree`'s logits, and per request the features (:meth:`NativeModel.forward_features`) of
        every token this call computed: the context tokens its cache lacked (a chain ending at the context's
        end), then its new nodes. # each [n_new, V], each [m_chain + n_new, lm_head_dim]

        Only a model in this process has them (a tensor- or pipeline-parallel group returns logits alone)."""
        runner = self._local_runner()
        requests, plans = self._plan(batch)
        step = PackedStep.from_trees(requests, self.block_size)
        if not step.tokens:
            empty = torch.empty(0, self.feature_dim, device=self.device)
            return [torch.empty(0, self.vocab_size, device=self.device) for _ in batch], [empty for _ in batch]
        logits, features = runner.run_features(step)  # [sum n, vocab], [T, lm_head_dim]
        out, at = [], 0
        for r in requests:  # rows are packed request by request: chain, then nodes
            rows = len(r.chain) + len(r.tokens)
            out.append(features[at : at + rows])
            at += rows
        return self._record(plans, logits), out

    @property
    def feature_dim(self) -> int:
        """Width of a feature (:meth:`forward_tree_features`): the LM head's input."""
        return int(self._local_model().w.lm_head.shape[1])

    def lm_logits(self, features: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        """The LLM's logits of features  # [N, feature_dim] (its LM head, as in a forward pass)."""
        return self._local_model().logits(features)

    def lm_logits_after(self, proj: torch.Tensor, rows: torch.Tensor | None = None, threads: int = 0) -> Callable:
        """The LLM's LM head (``rows``: those K tokens' alone) after a linear map into features ``proj``: a function
        of ``x``  # [N, k] -> [N, vocab or K] float32 (:meth:`NativeModel.logits_after`, ``threads``)."""
        return self._local_model().logits_after(proj, rows, threads)

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:  # [N, feature_dim]
        """Rows of the LLM's token embedding table  # tokens [N] int64 on the model's device."""
        return self._local_model().embed_rows(tokens)

    def _local_model(self) -> NativeModel:
        return self._local_runner().model

    def _local_runner(self) -> LocalRunner:
        """The runner of a model in this process; a parallel group's model is spread over its ranks."""
        if not isinstance(self.runner, LocalRunner):
            raise InvalidArgument("head", "draft heads need the LLM in one process (tensor and pipeline parallel 1)")
        return self.runner

    def _plan(
        self, batch: Sequence[TreeForward]
    ) -> tuple[list[StepRequest], list[tuple[TreeForward, RequestCache, list[int]]]]:
        """Sync each request's cache with its context and reserve its rows: the step's requests, and per
        request what :meth:`_record` needs once the step ran."""
        requests, plans = [], []
        for item in batch:
            cache = self._cache(item.request_id)
            chain = cache.sync(item.context_tokens, new_round=bool(item.parents) and item.parents[0] < 0)
            if (
                chain or cache.reused
            ):  # the cache lacked context tokens: a prefix cache lookup (a hit, for cache.reused of them)
                self._prefix_queried += len(chain) + cache.reused
                self._prefix_hits += cache.reused
            lc, lp, m, n = cache.context_len, cache.pending_len, len(chain), len(item.tokens)
            if lc + m > self.max_positions or lp + n > self.rows_per_request - lc - m:
                raise ValueError(
                    f"request {item.request_id!r} needs {lc + m + lp + n} KV rows, "
                    f"a request holds {self.rows_per_request}"
                )
            storage = cache.storage
            storage.reserve(lc + m, lc + m + lp + n)
            requests.append(
                StepRequest(
                    storage.start, lc, chain, item.tokens, cache.node_parents(item.parents), tuple(storage.block_table)
                )
            )
            plans.append((item, cache, chain))
        return requests, plans

    @staticmethod
    def _record(
        plans: Sequence[tuple[TreeForward, RequestCache, list[int]]], logits: torch.Tensor
    ) -> list[torch.Tensor]:
        """The caches now hold what the step computed; each request's logit rows.  # each [n_new, V]"""
        out, offset = [], 0
        for item, cache, chain in plans:
            cache.record_context(chain)
            cache.record_pending(item.tokens, item.parents)
            n = len(item.tokens)
            out.append(logits[offset : offset + n])
            offset += n
        return out
