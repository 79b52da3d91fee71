"""Where a rank sits in a tensor x pipeline parallel group, and what it owns.

Terms: ``tp`` ranks share each pipeline *stage* (tensor parallelism: every weight matrix of the
stage is split across them), ``pp`` stages run one after the other (pipeline parallelism: each
owns a contiguous range of decoder layers). Ranks are numbered stage-major, ``rank = stage * tp +
tp_rank``, so rank 0 (the driver, which serves gRPC) is tensor rank 0 of the first stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specinfer.core import InvalidArgument
from specinfer.models.native.spec import ModelSpec


@dataclass(frozen=True)
class ParallelLayout:
    tp: int  # tensor-parallel ranks per stage
    pp: int  # pipeline stages
    rank: int  # this process, in [0, tp * pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    def stage_ranks(self, stage: int) -> list[int]:
        """The tensor-parallel group of ``stage``."""
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def peer(self, stage: int) -> int:
        """The rank with this rank's tensor index in ``stage`` (hidden states go rank to peer)."""
        return stage * self.tp + self.tp_rank

    def layer_range(self, layers: int, stage: int | None = None) -> range:
        """Layers of ``stage`` (default: this rank's): contiguous, the first ``layers % pp``
        stages one more than the others."""
        s = self.stage if stage is None else stage
        base, extra = divmod(layers, self.pp)
        start = s * base + min(s, extra)
        return range(start, start + base + (1 if s < extra else 0))

    def vocab_range(self, vocab: int) -> range:
        """This rank's rows of the embedding and LM head: ``ceil(vocab / tp)`` each (the last
        shard may be shorter), so the gathered logits are equal-sized blocks."""
        block = -(-vocab // self.tp)
        return range(min(vocab, self.tp_rank * block), min(vocab, (self.tp_rank + 1) * block))


def check_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    """Raise :class:`InvalidArgument` naming the setting when ``spec`` cannot be split so."""
    if tp < 1:
        raise InvalidArgument("tensor-parallel", f"must be >= 1, got {tp}")
    if pp < 1:
        raise InvalidArgument("pipeline-parallel", f"must be >= 1, got {pp}")
    for what, count in (
        ("attention heads", spec.heads),
        ("key/value heads", spec.kv_heads),
        ("MLP width", spec.intermediate_size),
    ):
        if count % tp:
            raise InvalidArgument("tensor-parallel", f"{tp} does not divide the model's {count} {what}")
    if pp > spec.layers:
        raise InvalidArgument("pipeline-parallel", f"{pp} stages but the model has only {spec.layers} layers")


def shard_spec(spec: ModelSpec, layout: ParallelLayout) -> ModelSpec:
    """The spec the rank's blocks run with: its heads, MLP columns and layers (with their windows)."""
    layers = layout.layer_range(spec.layers)
    return dataclasses.replace(
        spec,
        heads=spec.heads // layout.tp,
        kv_heads=spec.kv_heads // layout.tp,
        intermediate_size=spec.intermediate_size // layout.tp,
        layers=len(layers),
        layer_windows=spec.layer_windows[layers.start : layers.stop],
    )
