"""Where this request manager's requests run on the LLM verifier replicas, and what it knows of each
replica's KV blocks: :class:`PlacementMap`, the one owner of both.

Terms:

- *Placement* of a request: the address of the verifier replica that holds its LLM cache. A request is
  *placed* by the iteration's plan (:class:`~specinfer.request_manager.scheduling.placement.Placement`,
  over :func:`~specinfer.core.kv_budget.schedule`) or, when no plan placed it (a calibration call, or a
  request whose replica left after the plan), by its verify call (:meth:`PlacementMap.home`). It is
  *unplaced* when its caches are released, when another request manager takes it over, and when its
  replica is taken out or leaves; the next plan or call places it anew, and the new replica rebuilds
  its cache from the committed tokens (context protocol).
- A replica's *KV budget*: the blocks it reported when it joined (none: it does not admit by blocks).
- Its *free blocks*: what it last said no request holds (its verify answers and GetInfo carry them).
- Our *held blocks* on a replica: what our requests there hold once a step has run (their committed
  tokens' blocks), as the last plan left them. A replica's used blocks less ours are other request
  managers' (:meth:`PlacementMap.budgets`).
- Our *step use* of a replica: what the last plan's requests there take during their step, in
  :func:`~specinfer.core.kv_budget.replica_takes`'s unit (blocks, or rows without a budget).

One rule places every request: :func:`~specinfer.core.kv_budget.replica_for` (the replica with the
most room once the request is in; a placed request stays home), inside ``schedule`` for the planned
ones and here for the others.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from specinfer.core.kv_budget import KVBudget, Replicas, Schedule, StepRows, replica_for, replica_takes


class PlacementMap:
    """The placement of this request manager's requests over the verifier replicas and the replicas'
    KV block counts (see the module docstring). Replicas are named by address; ``replicas`` arguments
    are the live ones, in :meth:`~.replica_pool.ReplicaPool.live` order (a plan's replica indices index
    them). Only its own methods change what it holds."""

    def __init__(self) -> None:
        self._where: dict[str, str] = {}  # request ID -> the replica holding its LLM cache
        self._budgets: dict[str, KVBudget | None] = {}  # joined replica -> its KV budget (None: it reports none)
        self._free: dict[str, int] = {}  # replica with a budget -> its free blocks, as last heard
        self._free_at: dict[str, float] = {}  # replica -> time.monotonic() when they were heard
        # replica -> our held blocks and our step use there, as the last plan left them (replaced whole by
        # each plan: a replica that left and came back since holds what the next plan gives it)
        self._held: dict[str, int] = {}
        self._used: dict[str, int] = {}

    # -- replicas ------------------------------------------------------------------------------

    def join(self, address: str, budget: KVBudget | None, free: int) -> None:
        """``address`` joined with ``budget``, ``free`` of its blocks free (ignored without a budget)."""
        self._budgets[address] = budget
        if budget is not None:
            self.heard_free(address, free)

    def leave(self, address: str) -> int:
        """``address`` is no longer found: forget its counts and unplace its requests; how many there were."""
        self._budgets.pop(address, None)
        self._free.pop(address, None)
        self._free_at.pop(address, None)
        return self.unplace_from(address)

    def unplace_from(self, address: str) -> int:
        """Unplace the requests on ``address`` (taken out, or gone); how many there were."""
        gone = [rid for rid, a in self._where.items() if a == address]
        for rid in gone:
            del self._where[rid]
        return len(gone)

    def heard_free(self, address: str, free: int) -> None:
        """``address`` says ``free`` of its blocks are free, now."""
        self._free[address] = free
        self._free_at[address] = time.monotonic()

    def counts_free(self, address: str) -> bool:
        """Whether ``address`` reports free blocks (it has a KV budget)."""
        return address in self._free

    def stale(self, replicas: Sequence[str], max_age: float) -> list[str]:
        """Those of ``replicas`` whose free-block count is older than ``max_age`` seconds."""
        now = time.monotonic()
        return [a for a in replicas if a in self._free and now - self._free_at.get(a, 0.0) > max_age]

    # -- requests ------------------------------------------------------------------------------

    def where(self, request_id: str) -> str | None:
        """The replica ``request_id`` is placed on (None: not placed)."""
        return self._where.get(request_id)

    def indices(self, replicas: Sequence[str]) -> dict[str, int]:
        """Request ID -> the index in ``replicas`` of its replica, for the requests placed on one of them."""
        return {rid: replicas.index(a) for rid, a in self._where.items() if a in replicas}

    def place(self, placement: Mapping[str, str]) -> None:
        """Record where requests run (request ID -> live replica address), as a plan decided."""
        self._where.update(placement)

    def unplace(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._where.pop(rid, None)

    # -- KV blocks -----------------------------------------------------------------------------

    def budgets(self, replicas: Sequence[str]) -> list[KVBudget | None]:
        """What each of ``replicas``' KV budget leaves to us (None: it reports none). Other request
        managers may share a replica: the blocks it last said were used, less our held blocks there
        (counted when that report came), are theirs, and are not ours to admit into. With one request
        manager that is about nothing; with several, two may still admit into the same free blocks at
        once: the replica then refuses the call (RESOURCE_EXHAUSTED, see
        :attr:`~specinfer.core.engine_core.VerifyRound.refused`) and its free count is asked again."""
        out: list[KVBudget | None] = []
        for a in replicas:
            total = self._budgets.get(a)
            if total is not None and a in self._free:
                others = max(0, total.blocks - self._free[a] - self._held.get(a, 0))
                total = KVBudget(total.block_size, total.blocks - others)
            out.append(total)
        return out

    def hold(
        self, plan: Schedule, replicas: Sequence[str], budgets: Sequence[KVBudget | None], committed: Mapping[str, int]
    ) -> None:
        """Take ``plan`` (over ``replicas`` with ``budgets``, from :meth:`budgets`) as what our requests hold:
        each one's ``committed`` tokens, once its step has run, as the replica's next free count will say."""
        held = dict.fromkeys(replicas, 0)
        for rid, r in plan.placement.items():
            b = budgets[r]
            held[replicas[r]] += b.blocks_for(committed[rid]) if b is not None else 0
        self._held = held
        self._used = dict(zip(replicas, plan.replica_blocks_used, strict=True))

    def home(self, request_id: str, rows: StepRows, replicas: Sequence[str]) -> str | None:
        """The replica of ``request_id`` among the live ``replicas`` (None: none is live). One that no plan
        placed there (a calibration call; its replica left after the plan) is placed now by the plan's rule,
        as if the last plan had admitted it after its own requests, with ``rows`` (its context and tree).
        Unlike a plan, it goes to the replica with the most room even when none has room for it: it is
        verified now or its call fails, and a replica out of blocks refuses it, which is retried."""
        address = self._where.get(request_id)
        if address is not None and address in replicas:
            return address
        if not replicas:
            return None
        budgets = self.budgets(replicas)
        used = [self._used.get(a, 0) for a in replicas]
        r = replica_for(Replicas(tuple(budgets)), used, request_id, rows, must_fit=False)
        assert r is not None  # without must_fit some replica is chosen
        address = replicas[r]
        self._used[address] = used[r] + replica_takes(budgets[r], rows)  # the next one sees it there
        self._where[request_id] = address
        return address
