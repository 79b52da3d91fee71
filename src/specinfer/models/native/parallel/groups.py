"""The torch.distributed process groups of a tensor x pipeline parallel LLM.

- *world* (the default group; NCCL on GPUs, gloo on CPUs): pipeline send/recv of hidden states
  and of the logits back to rank 0. Its timeout bounds every collective, so a dead or stuck
  peer raises instead of hanging.
- *tensor* (one per stage, same backend): the all-reduces and all-gathers of tensor parallelism.
- *control* (gloo, all ranks, no practical timeout): rank 0 broadcasts each operation to the
  other ranks, which wait on it while the service is idle (hours, possibly). It is on the CPU
  even with NCCL so an idle rank blocks in a socket read, not in a GPU kernel.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from specinfer.models.native.parallel.layout import ParallelLayout

IDLE_TIMEOUT = datetime.timedelta(days=365)  # an idle rank waits for the next operation this long


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torchrun's MASTER_ADDR / MASTER_PORT) and how long a collective
    may wait for a peer."""

    master_addr: str
    master_port: int
    timeout_seconds: float


@dataclass(frozen=True)
class ParallelGroups:
    layout: ParallelLayout
    world: dist.ProcessGroup
    tensor: dist.ProcessGroup | None  # None when tp == 1
    control: dist.ProcessGroup


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_groups(layout: ParallelLayout, rendezvous: Rendezvous, device: torch.device) -> ParallelGroups:
    """Join the job (blocks until every rank has joined or the timeout passes)."""
    timeout = datetime.timedelta(seconds=rendezvous.timeout_seconds)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    tensor = None
    # every rank creates every group, in the same order (torch.distributed requires it)
    for stage in range(layout.pp):
        group = dist.new_group(layout.stage_ranks(stage), timeout=timeout)
        if stage == layout.stage:
            tensor = group
    control = dist.new_group(list(range(layout.world_size)), backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroups(layout, dist.group.WORLD, tensor if layout.tp > 1 else None, control)


def close_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process once its groups are closed, without Python's interpreter finalization.

    Why: gloo's worker threads may still hold finished work objects, and freeing their tensors while
    the interpreter shuts down aborts the process ("terminate called without an active exception",
    SIGABRT) after all its work is done. It happened in about one full test run in four, to a rank
    that had passed the shutdown barrier and destroyed its groups (a known PyTorch teardown issue)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
