"""Rank 0 drives, the other ranks replay: the protocol of a tensor x pipeline parallel LLM.

Rank 0 runs the ordinary :class:`NativeBackend` (request caches, slot allocation, packed steps)
on a :class:`DriverRunner`. Everything that changes device state goes to every rank as one
:class:`Operation` broadcast on the control group: a forward step, preceded by the KV row moves
made since the last step (adopting an accepted path compacts the pool: :class:`MoveRecorder`
records those moves on rank 0, every other rank applies them to its own shard before the step,
so all pools stay in the same order). Slot and KV block allocation and release touch no tensor
and stay on rank 0; a paged step carries its block tables. The other ranks loop in
:func:`serve_rank` until a shutdown operation.

A failed collective (a dead peer closes its sockets; a stuck one runs into the group timeout)
raises :class:`RankFailure` on rank 0 and marks the runner failed: the service turns
NOT_SERVING and exits (``specinfer.llm_verifier.ranks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from specinfer.core.errors import Unavailable
from specinfer.models.native.kv_pool import KVPool, PoolTensors
from specinfer.models.native.paged_pool import AnyKVPool, PagedKVPool
from specinfer.models.native.parallel.stage import StageModel, run_stage
from specinfer.models.native.step import PackedStep

Moves = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (source rows, destination rows) per move


class RankFailure(Unavailable, RuntimeError):
    """A rank of the parallel group failed; the group cannot compute any more."""


@dataclass(frozen=True)
class Operation:
    """What rank 0 asks of every rank: ``step`` (after applying ``moves``) or ``shutdown``."""

    kind: str  # "step" or "shutdown"
    moves: Moves = ()
    step: PackedStep | None = None


class MoveRecorder(PoolTensors):
    """Rank 0's pools: apply moves like any pool and keep them for the other ranks. A mixin for
    both layouts (the moves are rows of the flattened pool in either)."""

    _moves: Moves = ()  # since the last take_moves; a tuple, so no constructor of its own is needed

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        super().move(src, dst)
        self._moves = (*self._moves, (tuple(src.tolist()), tuple(dst.tolist())))

    def take_moves(self) -> Moves:
        moves, self._moves = self._moves, ()
        return moves


class RecordingPool(MoveRecorder, KVPool):
    """Rank 0's contiguous pool."""


class RecordingPagedPool(MoveRecorder, PagedKVPool):
    """Rank 0's paged pool. Its KV blocks are handed out on rank 0 only (that touches no tensor);
    block tables reach the other ranks inside each :class:`PackedStep`."""


def broadcast(op: Operation | None, control: dist.ProcessGroup) -> Operation:
    """Rank 0 sends ``op``; every other rank passes None and gets it."""
    box = [op]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


class DriverRunner:
    """:class:`specinfer.models.native.step.StepRunner` of rank 0: the step runs on every rank."""

    def __init__(self, model: StageModel, pool: RecordingPool | RecordingPagedPool, device: torch.device) -> None:
        self.model = model
        self._pool = pool
        self.device = device
        self.groups = model.groups
        self.failure: str | None = None  # why the group broke, once it has

    @property
    def pool(self) -> AnyKVPool:
        return self._pool

    def run(self, step: PackedStep) -> torch.Tensor:
        if self.failure is not None:
            raise RankFailure(self.failure)
        layout = self.groups.layout
        # built (and so checked) before anything is sent: a step that cannot run fails this call
        # alone and leaves the ranks in step
        meta = step.metadata(self.device)
        try:
            broadcast(Operation("step", self._pool.take_moves(), step), self.groups.control)
            logits = run_stage(self.model, self._pool, step, meta, self.device)
            if layout.pp > 1:  # rank 0 is on the first stage; the logits come from the last
                logits = torch.empty(len(step.logit_rows), self.model.vocab_size, device=self.device)
                if step.logit_rows:
                    dist.recv(logits, src=(layout.pp - 1) * layout.tp, group=self.groups.world)
            return logits
        except Exception as exc:  # any error inside a collective leaves the ranks out of step
            self.failure = f"a rank of the parallel group failed: {type(exc).__name__}: {exc}"
            raise RankFailure(self.failure) from exc

    def shutdown(self) -> None:
        """Tell the other ranks to exit (nothing to tell when the group already broke)."""
        if self.failure is None:
            broadcast(Operation("shutdown"), self.groups.control)
            # every rank leaves together: a rank that tears its gloo pairs down while a peer still
            # reads from them may abort in gloo's threads ("terminate called without an active exception")
            dist.barrier(group=self.groups.control)


@torch.inference_mode()
def serve_rank(model: StageModel, pool: AnyKVPool, device: torch.device) -> None:
    """The loop of every rank but 0: replay operations until shutdown (returns) or a failed
    collective (raises)."""
    groups = model.groups
    layout = groups.layout
    sends_logits = layout.pp > 1 and layout.is_last_stage and layout.tp_rank == 0
    while True:
        op = broadcast(None, groups.control)
        if op.kind == "shutdown":
            dist.barrier(group=groups.control)  # see DriverRunner.shutdown
            return
        for src, dst in op.moves:
            pool.move(
                torch.tensor(src, dtype=torch.long, device=device), torch.tensor(dst, dtype=torch.long, device=device)
            )
        logits = run_stage(model, pool, op.step, op.step.metadata(device), device)
        if sends_logits and op.step.logit_rows:
            dist.send(logits, dst=0, group=groups.world)
