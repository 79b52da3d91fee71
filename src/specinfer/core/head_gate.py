"""Whether a step asks the verifier's draft head for the next trees: measured, not modelled.

A head tree costs the verifier a head pass per depth over its frontier, after the verification, for
every request that drafts with it; what it returns is more tokens accepted in the next step, and SSM
passes the next step may skip (:meth:`~specinfer.core.adaptive.AdaptiveSpeculation.outdrafts_ssms`).
Both sides change with the batch: at batch 1 on a CPU the head's tree is worth far more than its
passes; at batch 16 the verify step is already long, the cut keeps few head nodes, and the passes for
sixteen requests are not free. Rather than a cost model of the head (its passes, its attention over
each request's pairs, what the cut keeps, which SSM passes it saves), :class:`HeadGate` measures the
one number that decides: the batch's committed tokens per second, in steps that ask the head and in
steps that do not, per batch-size bucket (1, 2, 3-4, 5-8, 9-16, ...).

Terms.
- An *arm*: asking the head (on) or not (off).
- A *block*: :attr:`HeadGateConfig.block` consecutive steps of one bucket on one arm. A step's tokens come
  from the trees drafted in the step before it, so the first step of a block is not scored: it still
  carries the other arm's trees.
- A bucket measures the likelier arm for two blocks, then the other for one, then keeps the better, and every
  :attr:`HeadGateConfig.explore_every` blocks runs the other one for a block again (the text, the load and
  the batch's mix change). The likelier arm is the one the nearest smaller bucket prefers, or where none
  has measured both, the head up to :attr:`HeadGateConfig.first_on_max_batch` requests and no head above,
  so a short run at a large batch does not spend its first blocks on a head that does not pay there.
  Each arm's rate is a ratio of decayed sums (tokens / seconds), so a long step weighs as long as it took
  and the last few dozen steps decide.

Pure state, no I/O: the engine core calls :meth:`HeadGate.decide` before a step's verification and
:meth:`HeadGate.observe` after its commits, with the seconds it measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HeadGateConfig:
    """``block``: steps an arm runs before the gate decides again (at least 2: the first is not scored);
    ``explore_every``: every this many decided blocks of a bucket, the losing arm runs one block;
    ``memory``: per scored step of an arm, the weight its earlier steps keep (0.95: about the last 20);
    ``measure``: False asks the head every step (no measuring: tests that need its trees every step);
    ``first_on_max_batch``: where no smaller batch size has measured both arms yet, batches of up to this
    many requests measure the head first (two blocks), larger ones measure without it first. Only the
    order: both arms are measured before the gate decides. On the 2-core AMX CPU with a 1B-shaped LLM the
    head paid at batch 1-4 and cost more than it returned at 16 (BENCHMARKS.md, draft heads);
    ``first_on_margin``: how much faster the on arm must have measured at the nearest smaller bucket for a larger
    bucket to measure it first (0.1: 10 %). What an arm returns shrinks as the batch grows, and measuring first
    the arm that loses costs its two blocks at the gap: where on won narrowly at a smaller batch, a larger one
    is likelier to lose with it, and off steps, the shorter ones, are the cheap arm to measure first."""

    block: int = 8
    explore_every: int = 16
    memory: float = 0.95
    measure: bool = True
    first_on_max_batch: int = 4
    first_on_margin: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.block < 2
            or self.explore_every < 2
            or not 0.0 < self.memory <= 1.0
            or self.first_on_max_batch < 0
            or self.first_on_margin < 0.0
        ):
            raise ValueError(f"invalid head gate config {self}")

    @property
    def scored_steps(self) -> int:
        """One block's scored steps (its first step is not scored)."""
        return self.block - 1


def bucket(batch_size: int) -> int:
    """The batch-size bucket: ceil(log2(batch_size)) (1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...)."""
    return max(0, batch_size - 1).bit_length()


@dataclass
class _Arm:
    tokens: float = 0.0  # decayed sum of committed tokens
    seconds: float = 0.0  # decayed sum of step seconds
    samples: int = 0  # scored steps

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0.0 else 0.0


@dataclass
class _Bucket:
    on: _Arm = field(default_factory=_Arm)
    off: _Arm = field(default_factory=_Arm)
    decided: int = 0  # blocks decided on measurements (not first measurements)
    first: bool | None = None  # the arm measured first (None: not chosen yet)


@dataclass
class _Block:
    bucket: int
    on: bool
    steps: int = 0


class HeadGate:
    """See the module docstring."""

    def __init__(self, config: HeadGateConfig = HeadGateConfig()) -> None:
        self.config = config
        self._buckets: dict[int, _Bucket] = {}
        self._block: _Block | None = None

    def decide(self, batch_size: int) -> bool:
        """Whether this step (``batch_size`` requests) asks the head for next trees. Call once per step
        in which some request may draft with the head, then :meth:`observe` it."""
        if not self.config.measure:
            return True
        b = bucket(batch_size)
        block = self._block
        if block is None or block.bucket != b or block.steps >= self.config.block:
            block = self._block = _Block(b, self._choose(b))
        block.steps += 1
        return block.on

    def observe(self, batch_size: int, on: bool, tokens: int, seconds: float) -> None:
        """A step :meth:`decide` answered ``on`` for committed ``tokens`` in ``seconds`` (the caller chooses which steps
        count: the speculation gate scores every step whole, the draft head's leaves out prompts' steps)."""
        block = self._block
        if block is None or block.steps <= 1 or block.on != on or block.bucket != bucket(batch_size):
            return  # the block's first step carries the other arm's trees
        if seconds <= 0.0:
            return
        arm = self._arm(block.bucket, on)
        m = self.config.memory
        arm.tokens = m * arm.tokens + tokens
        arm.seconds = m * arm.seconds + seconds
        arm.samples += 1

    def rates(self, batch_size: int) -> tuple[float, float]:
        """Committed tokens per second measured with and without the head at this batch size (0: none)."""
        state = self._buckets.get(bucket(batch_size), _Bucket())
        return state.on.rate, state.off.rate

    def _arm(self, b: int, on: bool) -> _Arm:
        state = self._buckets.setdefault(b, _Bucket())
        return state.on if on else state.off

    def _choose(self, b: int) -> bool:
        state = self._buckets.setdefault(b, _Bucket())
        enough = self.config.scored_steps
        if state.first is None:
            state.first = self._first_arm(b)
        first, other = (state.on, state.off) if state.first else (state.off, state.on)
        if first.samples < 2 * enough:  # two blocks of the likelier arm before the other is tried
            return state.first
        if other.samples < enough:
            return not state.first
        state.decided += 1
        best = state.on.rate >= state.off.rate
        return not best if state.decided % self.config.explore_every == 0 else best

    def _first_arm(self, b: int) -> bool:
        """The arm a bucket measures first: the one the nearest smaller bucket that measured both prefers, on
        only by :attr:`HeadGateConfig.first_on_margin` (what the head returns shrinks as the batch grows, so a
        head that does not pay at batch 4 is unlikely to at 8: a short run at 8 should not spend its first
        blocks on it), else asking the head up to :attr:`HeadGateConfig.first_on_max_batch` requests and not
        asking it above."""
        enough = self.config.scored_steps
        for smaller in range(b - 1, -1, -1):
            state = self._buckets.get(smaller)
            if state is not None and state.on.samples >= enough and state.off.samples >= enough:
                return state.on.rate >= state.off.rate * (1.0 + self.config.first_on_margin)
        return b <= bucket(self.config.first_on_max_batch)
