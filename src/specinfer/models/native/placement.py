"""A native model's weights on its device: built in the run dtype, quantized (:mod:`.quant`) and offloaded
(:mod:`.offload`) as the options say."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specinfer.models.native.offload import OffloadedLayers, offload_weights
from specinfer.models.native.quant import check_quantize, quantize_head, quantize_weights, slow_on_cpu
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import ModelWeights, build_weights, map_tensors, read_state_dict

if TYPE_CHECKING:
    from specinfer.models.native.backend import NativeOptions

log = logging.getLogger(__name__)


def device_weights(
    spec: ModelSpec, path: Path, options: NativeOptions, device: torch.device
) -> tuple[ModelWeights, OffloadedLayers | None]:
    """The model's weights for ``device`` and, offloaded, the decoder layers kept in host memory (else None)."""
    check_quantize(options.quantize, options.quantize_group_size, options.dtype, device)
    if slow_on_cpu(options.quantize, options.quantize_group_size, options.dtype, device):
        log.warning(
            "%s products in %s on a CPU take PyTorch's slow path: --dtype bfloat16 is fast",
            options.quantize,
            options.dtype,
        )
    layers: OffloadedLayers | None = None
    if options.offload or options.quantize != "none":
        # built in host memory, quantized layer by layer for the device's kernels; offloaded, only the resident
        # weights move to the device, else all of them (the device never holds the plain projections)
        host = build_weights(spec, read_state_dict(path), options.dtype, torch.device("cpu"))
        host = quantize_weights(host, options.quantize, options.quantize_group_size, device)
        host = quantize_head(host, options.quantize, device)
        if options.offload:
            weights, layers = offload_weights(host, device, options.offload_reserve_bytes)
        else:
            weights = map_tensors(host, lambda t: t.to(device))
    else:
        weights = build_weights(spec, read_state_dict(path), options.dtype, device)
    return weights, layers
