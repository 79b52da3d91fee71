"""Tensor and pipeline parallelism of the native LLM over torch.distributed (NCCL on GPUs, gloo
on CPUs); docs/parallelism.md describes the layout, the protocol and the costs."""

from specinfer.models.native.parallel.driver import DriverRunner, RankFailure
from specinfer.models.native.parallel.groups import Rendezvous, close_groups, exit_rank
from specinfer.models.native.parallel.layout import ParallelLayout, check_layout
from specinfer.models.native.parallel.load import load_driver, run_rank

__all__ = [
    "DriverRunner",
    "ParallelLayout",
    "RankFailure",
    "Rendezvous",
    "check_layout",
    "close_groups",
    "exit_rank",
    "load_driver",
    "run_rank",
]
