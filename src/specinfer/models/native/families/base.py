"""The seam between the native runtime and a model family.

A *family* is what the native runtime knows of the checkpoints of one Hugging Face ``model_type``:
its config mapping (config.json to :class:`ModelSpec`), its weight names (a state dict to
:class:`ModelWeights`) and its layer quirks (the :class:`Blocks` of its forward pass). Families
whose blocks are alike share a module, each family one frozen instance whose fields say how it
differs from the others there; :mod:`.registry` maps each ``model_type`` to its family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specinfer.kernels import TreeAttentionMetadata
from specinfer.models.native.kv_pool import PoolTensors
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import LayerWeights, ModelWeights, Placement

if TYPE_CHECKING:
    from specinfer.models.native.model import NativeModel

Rope = tuple[torch.Tensor, torch.Tensor] | None  # a layer's (cos, signed_sin) [T, 1, rotary_dim] each; None: no RoPE
# (model, layer index, its weights, h [T, hidden], rope, cache_rows [T], metadata, pool) -> h after the layer
Layer = Callable[
    ["NativeModel", int, LayerWeights, torch.Tensor, Rope, torch.Tensor, TreeAttentionMetadata, PoolTensors],
    torch.Tensor,
]


@dataclass(frozen=True)
class Blocks:
    """A family's forward-pass pieces, picked once per model so that the per-layer path runs no
    family branch. Each takes the :class:`NativeModel` first, for what every family shares (its
    ``linear``, ``attention`` and ``reduce``, weights, spec): a tensor-parallel shard overrides
    those, never the blocks."""

    # (model, token embeddings [T, word_embed_dim], positions [T]) -> [T, hidden]
    embed: Callable[[NativeModel, torch.Tensor, torch.Tensor], torch.Tensor]
    layer: Layer
    # (model, h [T, hidden]) -> features [T, lm_head_dim]: the final norm (OPT: and project_out)
    final: Callable[[NativeModel, torch.Tensor], torch.Tensor]
    # (model, layer, q [T, heads, head_dim], k [T, kv_heads, head_dim]) -> normed (q, k); None: no query/key norms
    qk_norm: Callable[[NativeModel, LayerWeights, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None


class Family(Protocol):
    """What the native runtime asks a family. ``rope``: whether its layers rotate queries and keys
    (False: learned position embeddings, no RoPE tables); ``gated_mlp``: whether a layer's ``up_w``
    is the gate rows then the up rows (SwiGLU, GeGLU), which tensor parallelism splits half by half
    (False: one input projection, split by rows)."""

    @property
    def model_type(self) -> str: ...

    @property
    def rope(self) -> bool: ...

    @property
    def gated_mlp(self) -> bool: ...

    def spec(self, cfg: dict) -> ModelSpec:
        """The spec of a config.json of this model_type; :class:`UnsupportedModel` for one the blocks cannot run."""
        ...

    def weights(self, spec: ModelSpec, state: dict[str, torch.Tensor], place: Placement) -> ModelWeights:
        """The weights of a checkpoint's state dict, named as this family names them, placed by ``place``."""
        ...

    def blocks(self, spec: ModelSpec, dtype: torch.dtype) -> Blocks:
        """The forward pass's blocks for ``spec`` (``dtype``: the weights')."""
        ...
