"""Building one rank of a tensor x pipeline parallel LLM from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from specinfer.models.native.backend import (
    NativeBackend,
    NativeOptions,
    gemm_plan,
    new_pool,
    pool_geometry,
    rope_tables,
)
from specinfer.models.native.offload import offload_weights
from specinfer.models.native.parallel.driver import DriverRunner, RecordingPagedPool, RecordingPool, serve_rank
from specinfer.models.native.parallel.groups import ParallelGroups, Rendezvous, init_groups
from specinfer.models.native.parallel.layout import ParallelLayout, check_layout, shard_spec
from specinfer.models.native.parallel.shard import shard_weights
from specinfer.models.native.parallel.stage import StageModel
from specinfer.models.native.quant import quantize_weights
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import build_weights, map_tensors, read_state_dict


def _stage(path: Path, spec: ModelSpec, options: NativeOptions, groups: ParallelGroups) -> tuple[StageModel, int, int]:
    """This rank's model on its device, and the pool geometry (:func:`pool_geometry`: rows per
    slot and slots, or rows per KV block and blocks), which every rank computes alike: for the
    largest stage (the first), so ``kv_cache_bytes`` bounds each rank's pool."""
    layout = groups.layout
    device = torch.device(options.device)
    # build and shard on the CPU, so the device only ever holds this rank's shard
    full = build_weights(spec, read_state_dict(path), options.dtype, torch.device("cpu"))
    shard = quantize_weights(shard_weights(spec, full, layout), options.quantize, options.quantize_group_size, device)
    del full
    layers = None
    if options.offload:  # each rank streams its own shard's layers; the reserve bounds each rank's device
        weights, layers = offload_weights(shard, device, options.offload_reserve_bytes)
    else:
        weights = map_tensors(shard, lambda t: t.to(device))
    gemm = gemm_plan(weights, options, layers is not None)
    model = StageModel(
        shard_spec(spec, layout),
        weights,
        rope_tables(spec, path, device),
        options.attention,
        spec.vocab_size,
        groups,
        gemm,
        layers,
    )
    rows, units = pool_geometry(shard_spec(spec, ParallelLayout(layout.tp, layout.pp, 0)), options)
    return model, rows, units


def _join_and_load(
    path: str | Path, options: NativeOptions, layout: ParallelLayout, rendezvous: Rendezvous
) -> tuple[ModelSpec, torch.device, tuple[StageModel, int, int]]:
    """What every rank does first: check the layout, join the process groups, load its stage's
    shard. Returns (the model's spec, the device, (stage model, KV rows per slot or block, slots or blocks))."""
    path = Path(path)
    spec = ModelSpec.from_dir(path)
    check_layout(spec, layout.tp, layout.pp)
    device = torch.device(options.device)
    groups = init_groups(layout, rendezvous, device)
    return spec, device, _stage(path, spec, options, groups)


def load_driver(
    path: str | Path, options: NativeOptions, layout: ParallelLayout, rendezvous: Rendezvous
) -> tuple[NativeBackend, DriverRunner]:
    """Rank 0: joins the group, loads its shard; returns the backend to serve and its runner
    (``runner.shutdown()`` stops the other ranks; ``runner.failure`` says whether the group broke)."""
    spec, device, (model, rows, units) = _join_and_load(path, options, layout, rendezvous)
    runner = DriverRunner(
        model, new_pool(model.spec, options, device, (rows, units), RecordingPool, RecordingPagedPool), device
    )
    return NativeBackend(spec, runner, options), runner


def run_rank(path: str | Path, options: NativeOptions, layout: ParallelLayout, rendezvous: Rendezvous) -> None:
    """Every rank but 0: join the group, load the shard, replay rank 0's operations until shutdown."""
    _, device, (model, rows, units) = _join_and_load(path, options, layout, rendezvous)
    serve_rank(model, new_pool(model.spec, options, device, (rows, units)), device)
