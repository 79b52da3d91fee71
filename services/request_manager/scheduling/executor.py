"""The engine core's executor over gRPC (:class:`RemoteExecutor`): SSM workers draft, verifier replicas verify.

It is where the request manager's calls meet :class:`~specinfer.core.engine_core.EngineCore`: an SSM
whose call fails costs speed, not answers (its requests verify smaller trees); a verification round
that reaches no replica waits a doubling backoff and raises :class:`~.cluster.remote.VerifierUnavailable`
(nothing was committed; the step is retried), and the request manager's health follows the verifier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from specinfer.core.engine_core import DraftRound, VerifyRound
from specinfer.core.iteration import DraftSpec, VerifySpec
from specinfer.request_manager.cluster.failover import settled_all
from specinfer.request_manager.cluster.remote import Verifiers, VerifierUnavailable
from specinfer.request_manager.cluster.ssm_workers import SsmWorkers
from specinfer.request_manager.scheduling.placement import Placement
from specinfer.serving.scheduler_metrics import SchedulerMetrics

log = logging.getLogger("specinfer.request_manager")


@dataclass(frozen=True)
class Backoff:
    """The wait after a failed verification round: ``first_seconds``, doubling per failure in a row, at most
    ``max_seconds``."""

    first_seconds: float = 0.5
    max_seconds: float = 8.0

    def after(self, failures: int) -> float:
        return min(self.max_seconds, self.first_seconds * 2 ** (failures - 1))


class RemoteExecutor:
    """Drafts on the SSM workers (every SSM's call concurrently; SSM i is ``ssm_names[i]``) and
    verifies on the verifier replicas the requests are placed on (:class:`~.placement.Placement`)."""

    def __init__(
        self,
        ssm_names: Sequence[str],
        workers: SsmWorkers | None,
        verifier: Verifiers,
        placement: Placement,
        metrics: SchedulerMetrics,
        backoff: Backoff,
    ) -> None:
        self.ssm_names = tuple(ssm_names)
        self.workers = workers
        self.verifier = verifier
        self.placement = placement
        self.metrics = metrics
        self.backoff = backoff
        self.failures = 0  # failed verification rounds in a row
        # called with False when a round fails after one that answered, with True when one answers again
        self.on_verifier_change: Callable[[bool], object] | None = None

    async def draft(self, jobs: Mapping[int, Sequence[DraftSpec]]) -> DraftRound:
        if self.workers is None:
            return DraftRound({})
        indices = list(jobs)
        results = await settled_all([self.workers.speculate(self.ssm_names[i], jobs[i]) for i in indices])
        trees, passes = {}, []
        for index, result in zip(indices, results, strict=True):
            name = self.ssm_names[index]
            if isinstance(result, BaseException):
                # a failed SSM costs speed, not answers: its requests verify smaller trees
                log.warning("speculation failed", extra={"ssm": name, "error": repr(result)})
                self.metrics.ssm_failures.labels(name).inc()
                continue
            trees[index] = result.trees
            passes += [(index, tokens, seconds) for tokens, seconds in result.passes]
        return DraftRound(trees, tuple(passes))

    async def verify(self, jobs: Sequence[VerifySpec]) -> VerifyRound:
        m = self.metrics
        try:
            round_ = await self.verifier.verify(jobs)
        except VerifierUnavailable as exc:
            # no replica answers (down or restarting): requests wait (nothing was committed), caches are
            # rebuilt from the committed tokens when one is back (the contexts go out whole)
            self.failures += 1
            wait = self.backoff.after(self.failures)
            log.warning("verifier call failed; retrying", extra={"error": str(exc), "retry_in_s": wait})
            m.verifier_failures.inc()
            if self.failures == 1 and self.on_verifier_change is not None:
                self.on_verifier_change(False)
            await asyncio.sleep(wait)
            raise
        if round_.refused:
            self.placement.refused()
        if round_.failed:  # a replica failed: the others' requests go on, its own retry on another replica
            m.verifier_failures.inc()
        if self.failures:
            log.info("verifier answers again", extra={"failed_calls": self.failures})
            self.failures = 0
            if self.on_verifier_change is not None:
                self.on_verifier_change(True)
        for address, calls, _ in round_.timings:
            m.verifier_requests.labels(address).inc(len(calls))
        return round_
