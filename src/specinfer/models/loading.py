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
from specinfer.models.native.backend import DEFAULT_GRAPH_TOKENS, DEFAULT_GRAPH_WARMUP_SECONDS
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
    cuda_graph_warmup_seconds: float = DEFAULT_GRAPH_WARMUP_SECONDS,
    quantize: str = "none",
) -> CausalLM:
    """A model backend for the checkpoint at ``path``: ``native`` (our runtime; the Llama family,
    Qwen3, Phi-3, Gemma 2 / 3 and OPT: docs/models.md), ``reference`` (any causal LM through transformers) or
    ``auto`` (native where the architecture is supported). ``dtype``: a name of :data:`DTYPE_CHOICES` (``auto``: see
    :mod:`specinfer.models.dtypes`). The other settings are the native backend's, as
    :class:`~specinfer.models.native.backend.NativeOptions` defines them (paged KV, offloading: docs/offloading.md,
    CUDA graphs and their start-up warm-up, quantization: docs/quantization.md); offloading and quantization are
    refused for the reference backend."""
    # every setting is checked before anything is logged or loaded: a bad one is the one line on stderr
    requested, dtype = dtype, resolve_dtype(dtype, device)
    if backend not in BACKENDS:
        raise InvalidArgument("backend", f"must be one of {BACKENDS}, got {backend!r}")
    _check_not_negative(
        {
            "kv-block-size": kv_block_size,
            "max-seq-len": max_seq_len,
            "offload-reserve-bytes": offload_reserve_bytes,
            "cuda-graph-tokens": cuda_graph_tokens,
            "cuda-graph-warmup-seconds": cuda_graph_warmup_seconds,
        }
    )
    if offload_reserve_bytes and not offload:
        raise InvalidArgument("offload-reserve-bytes", "bounds offloading's device memory: it needs --offload")
    if offload and backend == "reference":
        raise InvalidArgument("offload", "offloading needs the native backend")
    _check_quantize_setting(quantize, backend)
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
                cuda_graph_warmup_seconds=cuda_graph_warmup_seconds,
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


def _check_quantize_setting(quantize: str, backend: str) -> None:
    """InvalidArgument naming ``quantize`` for a scheme we lack or the reference backend (which has none)."""
    if quantize not in QUANTIZE_CHOICES:
        raise InvalidArgument("quantize", f"must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if quantize != "none" and backend == "reference":
        raise InvalidArgument("quantize", "quantized weights need the native backend")


def _check_not_negative(settings: dict[str, float]) -> None:
    """InvalidArgument naming the first setting (its flag) that is negative or NaN."""
    for flag, value in settings.items():
        if not value >= 0:  # NaN too
            raise InvalidArgument(flag, f"must be >= 0, got {value}")


def _quantized(quantize: str) -> str:
    """What a load's log line says of its quantization."""
    return "" if quantize == "none" else f", projections {quantize}"
