"""Loading local Hugging Face checkpoints (nothing is downloaded).

``eos_token_id`` and ``load_tokenizer`` (from :mod:`specinfer.checkpoint`) are re-exported here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specinfer.checkpoint import check_checkpoint, eos_token_id, load_tokenizer
from specinfer.core import InvalidArgument
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.interface import CausalLM
from specinfer.models.native.backend import DEFAULT_GRAPH_TOKENS
from specinfer.models.native.quant import QUANTIZE_CHOICES

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "DTYPES", "DTYPE_CHOICES", "check_checkpoint", "eos_token_id", "load_backend", "load_tokenizer"]

BACKENDS = ("auto", "native", "reference")


def load_backend(
    path: str | Path,
    field: str,
    dtype: str = "auto",
    device: str = "cpu",
    backend: str = "auto",
    kv_cache_bytes: int = 1 << 30,
    attention: str = "auto",
    kv_block_size: int = 0,
    max_seq_len: int = 0,
    offload: bool = False,
    offload_reserve_bytes: int = 0,
    prefix_caching: bool = True,
    cuda_graph_tokens: int = DEFAULT_GRAPH_TOKENS,
    quantize: str = "none",
) -> CausalLM:
    """A model backend for the checkpoint at ``path``: ``native`` (our runtime; the Llama family,
    Qwen3, Phi-3, Gemma 2 / 3 and OPT: docs/models.md), ``reference`` (any causal LM through transformers) or
    ``auto`` (native where the architecture is supported). ``dtype``: a name of :data:`DTYPE_CHOICES` (``auto``: see
    :mod:`specinfer.models.dtypes`); ``kv_block_size``: 0 for contiguous KV slots, else a paged KV
    pool with KV blocks of that many tokens (native backend only); ``max_seq_len``: most positions
    of a request, prompt and output (native backend; 0: the model's limit); ``offload``: decoder layers
    in host memory, streamed to the device layer by layer, within ``offload_reserve_bytes`` of device
    memory (0: no bound; native backend only, docs/offloading.md); ``prefix_caching``: with
    a paged pool, requests share the KV blocks of common context prefixes (native backend); ``cuda_graph_tokens``:
    on CUDA, steps of at most this many tokens replay CUDA graphs (native backend; 0: never); ``quantize``: ``int8``
    or ``int4`` keeps the decoder layers' projections quantized (native backend, docs/quantization.md; ``none``:
    plain)."""
    # every setting is checked before anything is logged or loaded: a bad one is the one line on stderr
    requested, dtype = dtype, resolve_dtype(dtype, device)
    if backend not in BACKENDS:
        raise InvalidArgument("backend", f"must be one of {BACKENDS}, got {backend!r}")
    if kv_block_size < 0:
        raise InvalidArgument("kv-block-size", f"must be >= 0, got {kv_block_size}")
    if max_seq_len < 0:
        raise InvalidArgument("max-seq-len", f"must be >= 0, got {max_seq_len}")
    if offload_reserve_bytes < 0:
        raise InvalidArgument("offload-reserve-bytes", f"must be >= 0, got {offload_reserve_bytes}")
    if cuda_graph_tokens < 0:
        raise InvalidArgument("cuda-graph-tokens", f"must be >= 0, got {cuda_graph_tokens}")
    if offload_reserve_bytes and not offload:
        raise InvalidArgument("offload-reserve-bytes", "bounds offloading's device memory: it needs --offload")
    if offload and backend == "reference":
        raise InvalidArgument("offload", "offloading needs the native backend")
    if quantize not in QUANTIZE_CHOICES:
        raise InvalidArgument("quantize", f"must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if quantize != "none" and backend == "reference":
        raise InvalidArgument("quantize", "quantized weights need the native backend")
    path = check_checkpoint(path, field)
    if backend != "reference":
        from specinfer.models.native import ModelSpec, NativeBackend, NativeOptions, UnsupportedModel
        from specinfer.models.native.backend import check_kv_budget
        from specinfer.models.native.quant import check_quantize

        try:
            spec = ModelSpec.from_dir(path)
        except UnsupportedModel as exc:
            if backend == "native" or offload or quantize != "none":
                field = "offload" if offload else "quantize" if quantize != "none" else "backend"
                raise InvalidArgument(field, f"native backend cannot run {path}: {exc}") from exc
        else:
            options = NativeOptions(
                DTYPES[dtype],
                device,
                kv_cache_bytes,
                max_seq_len,
                attention,
                kv_block_size=kv_block_size,
                offload=offload,
                offload_reserve_bytes=offload_reserve_bytes,
                prefix_caching=prefix_caching,
                cuda_graph_tokens=cuda_graph_tokens,
                quantize=quantize,
            )
            check_kv_budget(spec, options)
            check_quantize(quantize, options.quantize_group_size, options.dtype, torch.device(device))
            log.info("loading %s in %s (dtype %s%s) on %s", path, dtype, requested, _quantized(quantize), device)
            return NativeBackend.load(path, options)
    log.info("loading %s in %s (dtype %s) on %s", path, dtype, requested, device)
    # imported here only: transformers' modeling code takes seconds to import, which every service
    # start and test run on the native backend would pay for nothing
    from specinfer.models.reference import ReferenceBackend

    return ReferenceBackend.load(path, dtype=DTYPES[dtype], device=device)


def _quantized(quantize: str) -> str:
    """What a load's log line says of its quantization."""
    return "" if quantize == "none" else f", projections {quantize}"
