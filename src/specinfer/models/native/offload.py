"""Offloading inference: the decoder layers' weights live in host memory and stream to the device layer by layer.

When an LLM does not fit in device memory, every forward pass copies each layer's weights across
PCIe once. The pass then costs about one transfer of the model whatever its number of tokens, so a
verify step of many tree nodes costs about what one token costs, and every token a tree gets
accepted saves a whole transfer (the paper's offloading use case).

Terms, used in this module and in docs/offloading.md:

- *host layers*: every decoder layer's weights in host memory, pinned (page-locked) when the device
  is CUDA so that copies are DMA transfers that run asynchronously.
- *staging buffers*: two sets of device tensors shaped like one layer's weights (double buffering).
  The k-th layer staged (counted over all passes) goes to buffer ``k % 2``, so the next pass's
  layer 0 follows the last layer without conflict whatever the number of layers.
- *prefetch*: when layer ``l`` starts computing, layer ``l + 1`` (after the last layer: the next
  pass's layer 0) is copied into the other buffer on a dedicated copy stream, as FlexGen does. The
  compute stream waits for a buffer's copy (an event recorded on the copy stream) before a layer
  reads it, and the copy stream waits before overwriting a buffer until the layer that last read it
  is done (an event recorded on the compute stream after that layer). On a CPU there are no streams:
  the same code copies synchronously, so CPU tests exercise the staging logic.
- *resident weights*: what stays on the device for the whole run: the token embeddings, the final
  norm, the LM head, and OPT's learned positions and projections (tied embeddings count once). A
  large vocabulary makes the LM head big (Llama 3 70B: 1 GiB in fp16, about half a layer's 1.6 GiB),
  but it is used once per pass on a few rows and streaming it would add a transfer per pass.
- *quantized layers* (:mod:`.quant`) are staged as they are, packed values and scales: offloading a quantized
  model moves its quantized bytes.
- *device bytes* of offloading: 2 x the largest layer (staging) + the resident weights; the KV cache
  (``kv_cache_bytes``) and the activations come on top. ``offload_reserve_bytes`` bounds the device
  bytes; a load whose device bytes exceed it is refused before anything is copied to the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specinfer.core import InvalidArgument
from specinfer.models.native.quant import QuantizedWeight
from specinfer.models.native.weights import LayerWeights, ModelWeights, map_tensors, named_tensors

RESERVE_FLAG = "offload-reserve-bytes"


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct tensors of ``tensors`` (a tensor listed twice, e.g. tied embeddings, counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def layer_bytes(layer: LayerWeights) -> int:
    return tensor_bytes(named_tensors(layer).values())


def resident_tensors(weights: ModelWeights) -> list[torch.Tensor]:
    """The weights that stay on the device (see the module docstring): everything but the decoder layers."""
    resident = [getattr(weights, f.name) for f in dataclasses.fields(weights) if f.name != "layers"]
    return [t for w in resident if w is not None for t in (w.tensors().values() if type(w) is QuantizedWeight else [w])]


@dataclass(frozen=True)
class OffloadBudget:
    """Device bytes of offloading one model: ``staging`` (2 x its largest layer) and ``resident``."""

    staging: int
    resident: int

    @property
    def device_bytes(self) -> int:
        return self.staging + self.resident


def offload_budget(layer_sizes: Sequence[int], resident: int) -> OffloadBudget:
    """The device bytes of a model whose decoder layers take ``layer_sizes`` bytes each and whose resident weights
    take ``resident``."""
    return OffloadBudget(2 * max(layer_sizes, default=0), resident)


def check_reserve(budget: OffloadBudget, reserve: int) -> None:
    """Raise :class:`InvalidArgument` naming ``--offload-reserve-bytes`` when ``budget`` exceeds ``reserve`` (0: no
    bound)."""
    if reserve < 0:
        raise InvalidArgument(RESERVE_FLAG, f"must be >= 0, got {reserve}")
    if reserve and budget.device_bytes > reserve:
        raise InvalidArgument(
            RESERVE_FLAG,
            f"{reserve} bytes do not hold what offloading keeps on the device: "
            f"{budget.device_bytes} bytes = {budget.staging} (two staging buffers of the largest layer) "
            f"+ {budget.resident} (embeddings, final norm, LM head); "
            f"raise --{RESERVE_FLAG} to at least {budget.device_bytes}, or 0 for no bound",
        )


def model_budget(weights: ModelWeights) -> OffloadBudget:
    return offload_budget([layer_bytes(layer) for layer in weights.layers], tensor_bytes(resident_tensors(weights)))


class ResidentLayers:
    """Every decoder layer already on the device (the default): a layer is its own weights."""

    def __init__(self, layers: list[LayerWeights]) -> None:
        self.layers = layers

    def __len__(self) -> int:
        return len(self.layers)

    def acquire(self, i: int) -> LayerWeights:
        return self.layers[i]

    def release(self) -> None:
        pass


class OffloadedLayers:
    """Decoder layers in host memory, staged into two device buffers as the forward pass reaches
    them (see the module docstring). :meth:`acquire` returns the staged layer ``i`` (and prefetches
    the next one), :meth:`release` marks the layer just acquired as done with its buffer.

    ``copies`` counts layers staged, so tests can check that every pass reads staged copies."""

    def __init__(self, host: list[LayerWeights], device: torch.device) -> None:
        if not host:
            raise ValueError("offloading needs at least one decoder layer")
        shapes = {tuple((name, tuple(t.shape), t.dtype) for name, t in named_tensors(layer).items()) for layer in host}
        if len(shapes) != 1:
            raise ValueError(
                "offloading needs decoder layers of one shape (the staging buffers are shaped like one layer)"
            )
        cuda = device.type == "cuda"
        self.host = [_pinned(layer) for layer in host] if cuda else host
        self.staging = (_empty_like(host[0], device), _empty_like(host[0], device))
        # (host tensor, staging tensor) pairs per layer and buffer, built once so a copy walks no dataclass fields
        self._pairs = [
            [list(zip(named_tensors(h).values(), named_tensors(s).values(), strict=True)) for s in self.staging]
            for h in self.host
        ]
        self.copies = 0
        self._pending: tuple[int, int] | None = None  # (layer, buffer) of the prefetch in flight
        self._current = 0  # buffer of the layer acquired last
        if cuda:
            self._copy_stream = torch.cuda.Stream(device)
            self._ready = (torch.cuda.Event(), torch.cuda.Event())  # per buffer: its copy is done (copy stream)
            self._free = (
                torch.cuda.Event(),
                torch.cuda.Event(),
            )  # per buffer: the layer that read it is done (compute stream)
            self._stage, self._wait_ready, self.release = self._stage_async, self._wait_ready_async, self._release_async
        else:
            self._stage, self._wait_ready, self.release = self._stage_sync, _no_wait, _no_release

    def __len__(self) -> int:
        return len(self.host)

    def acquire(self, i: int) -> LayerWeights:
        """Layer ``i`` staged on the device, once its copy is done; starts copying the next layer into the other
        buffer."""
        if self._pending is not None and self._pending[0] == i:
            buf = self._pending[1]
        else:  # nothing prefetched for it (the first pass, or layers taken out of order): copy it now
            buf = 1 - self._current if self._pending is None else 1 - self._pending[1]
            self._stage(i, buf)
        self._wait_ready(buf)
        self._current = buf
        self._stage((i + 1) % len(self.host), 1 - buf)
        return self.staging[buf]

    def _stage_sync(self, i: int, buf: int) -> None:
        for src, dst in self._pairs[i][buf]:
            dst.copy_(src)
        self._pending = (i, buf)
        self.copies += 1

    def _stage_async(self, i: int, buf: int) -> None:
        stream = self._copy_stream
        stream.wait_event(self._free[buf])  # the layer that last read this buffer is done
        with torch.cuda.stream(stream):
            for src, dst in self._pairs[i][buf]:
                dst.copy_(src, non_blocking=True)
        self._ready[buf].record(stream)
        self._pending = (i, buf)
        self.copies += 1

    def _wait_ready_async(self, buf: int) -> None:
        torch.cuda.current_stream().wait_event(self._ready[buf])

    def _release_async(self) -> None:
        self._free[self._current].record(torch.cuda.current_stream())


def _no_wait(buf: int) -> None:
    pass


def _no_release() -> None:
    pass


def _pinned(layer: LayerWeights) -> LayerWeights:
    return map_tensors(layer, torch.Tensor.pin_memory)


def _empty_like(layer: LayerWeights, device: torch.device) -> LayerWeights:
    return map_tensors(layer, lambda t: torch.empty_like(t, device=device))


def offload_weights(host: ModelWeights, device: torch.device, reserve: int) -> tuple[ModelWeights, OffloadedLayers]:
    """``host`` (every weight in host memory) split for offloading: the resident weights moved to
    ``device`` (ties kept), the decoder layers left in host memory and staged by the returned
    :class:`OffloadedLayers`. Refused (:func:`check_reserve`) before anything reaches the device when
    the device bytes exceed ``reserve``."""
    check_reserve(model_budget(host), reserve)
    # id of a host tensor -> its device copy: tied tensors stay one
    moved: dict[int, torch.Tensor | QuantizedWeight] = {}
    changes = {}
    for f in dataclasses.fields(host):
        t = getattr(host, f.name)
        if f.name != "layers" and t is not None:
            if id(t) not in moved:
                moved[id(t)] = t.map(lambda x: x.to(device)) if isinstance(t, QuantizedWeight) else t.to(device)
            changes[f.name] = moved[id(t)]
    return dataclasses.replace(host, **changes), OffloadedLayers(host.layers, device)
