"""Step cost model: seconds of a verify call and of an SSM draft pass, measured and refined online.

Terms.
- *Verify tokens*: the tree nodes of one batched verify call, roots included (a batch of b
  requests decoding incrementally verifies b tokens).
- *Context work*: the sum over the batch of (tree nodes x committed context length): what tree
  attention reads beyond the matrix products, which scale with the tokens alone.
- *Frontier tokens*: the nodes one SSM pass expands, over the whole batch.

A verify call is modelled as ``table(tokens) + per_context * context_work``, a draft pass as
``table_ssm(frontier tokens)``. Each table holds seconds at token buckets (:data:`BUCKETS`: powers
of two and the midpoints between them, because on a CPU the cost changes regime between 4 and 8
rows), interpolated linearly between buckets and extrapolated beyond the last by its slope. A call
over more tokens never costs less, so reads go through a monotone fit (pool adjacent violators),
weighted by how many observations each bucket has folded in: a bucket that real steps keep
measuring outweighs a stale neighbour from the start-up calibration instead of being averaged with
it. Start-up calibration (:mod:`specinfer.engine.calibrate`) fills the tables; every real step
then moves the buckets next to its size toward what it took: while few real calls measured a bucket,
to their running mean (the seed counts as one call, and the first real call replaces it), then by an
exponential moving average. A seed is a guess about served calls: calibration times synthetic requests
(a few, at a short context) on a machine whose speed may have been elsewhere (other processes loading,
a VM's neighbours), and beyond its largest size the table only extrapolates (on a 2-core CPU with a
1B-shaped LLM, 128 rows cost 3.6x 32 where the slope of 48-64 said 1.7x). A sample is clipped to
between a tenth and twice the prediction, so one stall moves a bucket at most to twice what it said,
and the calls after it average it out. Every verify call samples the model, a request's first step
too: its prompt's tokens are rows like a tree's (:func:`~specinfer.core.call_shapes.call_shape`).
Sizes that no real step measures are tried now and then on the model's optimistic copy
(:meth:`StepCosts.optimistic`), so a seed that rules them out is measured and corrected instead of
steering the whole run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.acceptance import nondecreasing

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
ONLINE_RATE = 0.15  # weight of one observation in the moving average of its buckets


def _interp(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``ys`` at ``x`` (a number or an array): linear between the points ``xs``, and past the last
    one along the last segment's slope (never falling).  # like x"""
    if len(xs) < 2:
        return np.interp(x, xs, ys)
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    if np.ndim(x) == 0:
        return ys[-1] + slope * (x - xs[-1]) if x > xs[-1] else np.interp(x, xs, ys)
    return np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), np.interp(x, xs, ys))


class CostTable:
    """Seconds by token count (see the module docstring)."""

    def __init__(self, seconds: Mapping[int, float]) -> None:
        if not seconds:
            raise ValueError("a cost table needs at least one measurement")
        xs = np.array(sorted(seconds), dtype=np.float64)
        ys = nondecreasing([float(seconds[int(x)]) for x in xs])
        # the buckets up to the first one at or past the largest measured size; beyond, extrapolate
        covered = [b for b in BUCKETS if b < xs[-1]]
        covered.append(next((b for b in BUCKETS if b >= xs[-1]), BUCKETS[-1]))
        self.buckets = np.array(covered, dtype=np.float64)
        self.seconds = _interp(xs, ys, self.buckets)
        self.samples = np.ones(
            len(self.buckets)
        )  # the fit's weight per bucket: 1 for the seed, + observations folded in
        self._fit: np.ndarray | None = None

    def fitted(self) -> np.ndarray:
        """The monotone fit of the buckets' seconds, weighted by their samples (recomputed only after an
        observation).  # [buckets]"""
        if self._fit is None:
            # a seed no real call measured, above what real calls measured at a larger size, is wrong (fewer
            # tokens never cost more): capped there before pooling, or it would hold the measured bucket up
            seconds = self.seconds.copy()
            measured = self.measured()
            ceiling = np.inf
            for k in range(len(seconds) - 1, -1, -1):
                if measured[k]:
                    ceiling = min(ceiling, seconds[k])
                else:
                    seconds[k] = min(seconds[k], ceiling)
            self._fit = nondecreasing(seconds, self.samples)
        return self._fit

    def __call__(self, tokens: float) -> float:
        # the planner calls this once per candidate node: a scalar, not a one-element array, keeps it cheap
        return float(_interp(self.buckets, self.fitted(), float(tokens))) if tokens > 0 else 0.0

    def many(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds for each entry of ``tokens`` (0 for none).  # [n]"""
        x = np.asarray(tokens, dtype=np.float64)
        return np.where(x <= 0, 0.0, _interp(self.buckets, self.fitted(), x))

    def observe(self, tokens: float, seconds: float) -> None:
        """Fold one measured call of ``tokens`` tokens into the two buckets around it."""
        if tokens <= 0 or not np.isfinite(seconds) or seconds < 0:
            return
        predicted = self(tokens)
        sample = float(np.clip(seconds, 0.1 * predicted, 2.0 * predicted)) if predicted > 0 else float(seconds)
        x = float(tokens)
        while x > self.buckets[-1] and self.buckets[-1] < BUCKETS[-1]:
            # a call larger than any measured: add the next bucket, at its extrapolated cost
            nxt = float(next(b for b in BUCKETS if b > self.buckets[-1]))
            self.seconds = np.append(self.seconds, self(nxt))
            self.buckets = np.append(self.buckets, nxt)
            self.samples = np.append(self.samples, 1.0)
            self._fit = None
        if x >= self.buckets[-1]:
            i = j = len(self.buckets) - 1
            wi, wj = 1.0, 0.0
        else:
            j = int(np.searchsorted(self.buckets, x, side="right"))
            i = max(0, j - 1)
            span = self.buckets[j] - self.buckets[i]
            wj = (x - self.buckets[i]) / span if span > 0 else 1.0
            wi = 1.0 - wj
        # shift both neighbours by the same error, each in proportion to how close the sample is; the
        # error is against the raw buckets, not the fit, so they settle on what steps take (against
        # the fit, which pools a bucket with its neighbours, they would overshoot)
        error = sample - float(_interp(self.buckets, self.seconds, x))
        for k, w in ((i, wi), (j, wj)):
            if w > 0:
                # a bucket few real calls measured follows their running mean (the seed was a guess, in either
                # direction: see the module docstring); one many measured, a moving average of the recent ones
                rate = max(ONLINE_RATE, 1.0 / self.samples[k])
                self.seconds[k] += rate * w * error
                self.samples[k] += w
        self.seconds = np.maximum(self.seconds, 0.0)
        self._fit = None

    def measured(self) -> np.ndarray:
        """Whether real calls measured each bucket (half a call's weight at least: a call between two buckets
        counts for both in proportion), not only the seed it started from.  # [buckets] bool"""
        return self.samples - 1.0 >= 0.5

    def optimistic(self) -> CostTable:
        """A copy in which each bucket no real call measured, up to twice the largest measured one, costs no
        more than the fit at the measured bucket below it: the least it could cost (a call over more tokens
        never costs less). Beyond twice, the copy keeps the seed: exploration grows one doubling at a time.
        Plans made on it try sizes a pessimistic seed would rule out for good (:mod:`specinfer.core.adaptive`)."""
        copy = CostTable.restore(self.buckets.astype(np.int64).tolist(), self.seconds.tolist(), self.samples.tolist())
        measured = self.measured()
        if not measured.any():
            return copy
        fit = self.fitted()
        largest = float(self.buckets[measured][-1])
        floor = None
        for k in range(len(self.buckets)):
            if measured[k]:
                floor = fit[k]
            elif floor is not None and self.buckets[k] <= 2.0 * largest:
                copy.seconds[k] = min(copy.seconds[k], floor)
        return copy

    def as_dict(self) -> dict[int, float]:
        return {int(b): float(s) for b, s in zip(self.buckets, self.fitted(), strict=True)}

    @classmethod
    def restore(cls, buckets: Sequence[int], seconds: Sequence[float], samples: Sequence[float]) -> CostTable:
        """A table in exactly the state given (its raw buckets, seconds and samples, as a saved table
        held them: :mod:`specinfer.engine.calibration_cache`), not refitted as the constructor would;
        raises ValueError for a state no table can be in."""
        xs = np.asarray(buckets, dtype=np.float64)
        ys = np.asarray(seconds, dtype=np.float64)
        ws = np.asarray(samples, dtype=np.float64)
        if not (xs.ndim == 1 and len(xs) >= 1 and xs.shape == ys.shape == ws.shape):
            raise ValueError("a cost table needs as many buckets, seconds and samples, at least one")
        if not set(xs.tolist()) <= set(BUCKETS) or np.any(np.diff(xs) <= 0):
            raise ValueError(f"cost table buckets must be increasing values of {BUCKETS}")
        if not (np.all(np.isfinite(ys)) and np.all(ys >= 0) and np.all(np.isfinite(ws)) and np.all(ws > 0)):
            raise ValueError("cost table seconds must be finite and >= 0, samples finite and > 0")
        table = cls({1: 0.0})
        table.buckets, table.seconds, table.samples = xs, ys, ws
        return table


@dataclass(frozen=True)
class VerifyShape:
    """What a verify call's cost depends on: its ``tokens`` and ``context_work`` (module docstring)."""

    tokens: int
    context_work: int


NO_TOKENS = VerifyShape(0, 0)


class StepCosts:
    """The verify model and one draft-pass table per SSM (by the SSM's index in the driver's order)."""

    def __init__(
        self,
        verify: CostTable,
        per_context: float,
        drafts: Mapping[int, CostTable],
        overhead: float = 0.0,
        frozen: bool = False,
    ) -> None:
        """``frozen``: ignore observations (a fixed model, e.g. to make plans reproducible)."""
        self.verify_table = verify
        self.per_context = max(0.0, per_context)
        self.drafts = dict(drafts)
        self.overhead = overhead  # seconds per iteration outside the models
        self.frozen = frozen

    def verify_seconds(self, shape: VerifyShape) -> float:
        return self.verify_table(shape.tokens) + self.per_context * shape.context_work

    def verify_many(self, tokens: np.ndarray, context_work: np.ndarray) -> np.ndarray:
        """:meth:`verify_seconds` of many shapes at once.  # [n]"""
        return self.verify_table.many(tokens) + self.per_context * np.asarray(context_work, dtype=np.float64)

    def draft_seconds(self, ssm: int, frontier_tokens: int) -> float:
        table = self.drafts.get(ssm)
        return table(frontier_tokens) if table is not None and frontier_tokens > 0 else 0.0

    def observe_verify(self, shape: VerifyShape, seconds: float) -> None:
        if not self.frozen:
            self.verify_table.observe(shape.tokens, seconds - self.per_context * shape.context_work)

    def observe_overhead(self, seconds: float) -> None:
        """Seconds of one iteration outside the model calls, into the overhead's moving average."""
        if not self.frozen and seconds >= 0.0:
            self.overhead += ONLINE_RATE * (seconds - self.overhead)

    def observe_draft(self, ssm: int, frontier_tokens: int, seconds: float) -> None:
        if self.frozen:
            return
        table = self.drafts.get(ssm)
        if table is None:
            self.drafts[ssm] = CostTable({max(1, frontier_tokens): seconds})
        else:
            table.observe(frontier_tokens, seconds)

    def optimistic(self) -> StepCosts:
        """A frozen copy whose tables are :meth:`CostTable.optimistic` (observations go to this model, not it)."""
        return StepCosts(
            self.verify_table.optimistic(),
            self.per_context,
            {s: t.optimistic() for s, t in self.drafts.items()},
            self.overhead,
            frozen=True,
        )

    def describe(self) -> dict:
        """The current tables, for GetInfo, metrics and logs."""
        return {
            "verify_seconds": self.verify_table.as_dict(),
            "verify_seconds_per_context_token": self.per_context,
            "draft_seconds": {ssm: t.as_dict() for ssm, t in sorted(self.drafts.items())},
            "overhead_seconds": self.overhead,
        }
