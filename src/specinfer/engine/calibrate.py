"""Start-up calibration of the step cost model: time a model's forward passes by size.

Runs the model on synthetic requests (random tokens, their caches released afterwards): a verify
call of n tree nodes for every bucket n of :data:`~specinfer.core.costs.BUCKETS` up to
``max_tokens``, the same 16-node call over a short and a long context (the per-context-token cost
of tree attention), and an SSM pass over a frontier of n nodes.

Why it is built this way (measured on a 1B model in fp32 on 2 CPU cores, where one call's time
varies by up to 30% from call to call):
- *Rounds, not one size after another.* Every size is timed once per round, ``repeats`` rounds
  after a warm-up round, and each size keeps its median. A slow spell of the machine then slows
  every size a little instead of one size a lot, which would bend the table (a 4-node call
  measured slower than an 8-node one makes the extra nodes look free).
- *One set of requests, prefilled once.* A call of n nodes spreads them over up to
  :data:`CALIBRATION_REQUESTS` requests (one node each, like a batch decoding incrementally, then
  small binary trees), so a round costs only the timed calls. What a call costs depends on its
  token count, not on how the tokens split between requests: 16 requests x 1 node, 4 x 4 and
  1 x 16 took the same time within noise.
- *Every bucket, not only powers of two.* On a CPU the matrix products change regime between 4
  and 8 rows (4 rows cost little more than 1; 6 rows cost 60% more than 4), and a straight line
  from 4 to 8 would hide the steep part.
The tables seed :class:`~specinfer.core.costs.StepCosts`, which real steps then refine.

That full calibration takes tens of seconds for a 1B model on 2 CPU cores: the services spend it
once at start-up. ``specinfer generate`` cannot, as a 40-token run takes about as long, so where
no cached table exists (:mod:`specinfer.engine.calibration_cache`) it *probes* instead
(:func:`probe_costs`): a few calls of one request within about a second, enough for a sane first
plan, which the real steps then refine (the refined table is what the cache keeps).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.costs import BUCKETS, CostTable, StepCosts
from specinfer.core.tree import binary_tree_parents
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.on_device import wait_for

log = logging.getLogger("specinfer.calibrate")

SHORT_CONTEXT = 32
LONG_CONTEXT = 512
CALIBRATION_REQUESTS = 8  # requests a calibration call spreads its nodes over (at most)
CONTEXT_PROBE_TOKENS = 16  # nodes of the calls that measure the per-context-token cost
REPEATS = 5  # timed rounds after the warm-up


def log_progress(msg: str) -> None:
    """The default progress report: one log line per step of the calibration."""
    log.info("calibrating", extra={"step": msg})


class _Requests:
    """Synthetic requests with random contexts of ``context_len`` tokens, prefilled by the first call."""

    def __init__(self, model: CausalLM, count: int, context_len: int, rng: np.random.Generator, tag: str) -> None:
        self.model = model
        self.contexts = [rng.integers(0, model.vocab_size, size=max(1, context_len)).tolist() for _ in range(count)]
        self.ids = [f"__calibrate-{tag}-{k}" for k in range(count)]
        self.rng = rng

    def call(self, tokens: int) -> list[TreeForward]:
        """One call's items: ``tokens`` new nodes, one per request while there are requests, else
        binary trees of near-equal size."""
        count = min(len(self.ids), tokens)
        sizes = [tokens // count + (1 if k < tokens % count else 0) for k in range(count)]
        return [
            TreeForward(
                self.ids[k],
                self.contexts[k],
                self.rng.integers(0, self.model.vocab_size, size=n).tolist(),
                binary_tree_parents(n),
            )
            for k, n in enumerate(sizes)
        ]

    def release(self) -> None:
        for rid in self.ids:
            self.model.release(rid)


def _time_rounds(
    probes: Sequence[tuple[_Requests, int]], repeats: int, progress: Callable[[str], None] | None, tag: str
) -> list[float]:
    """Median seconds of each probe (a request set and a node count): a warm-up round (which also
    prefills the contexts), then ``repeats`` rounds that each time every probe once."""
    times: list[list[float]] = [[] for _ in probes]
    for r in range(repeats + 1):
        for k, (reqs, n) in enumerate(probes):
            items = reqs.call(n)
            started = time.perf_counter()
            wait_for(reqs.model.forward_tree(items))  # a GPU runs asynchronously: time the work, not its launch
            if r > 0:
                times[k].append(time.perf_counter() - started)
        if progress is not None and r > 0:
            progress(f"{tag}: round {r}/{repeats}")
    return [statistics.median(ts) for ts in times]


def _request_count(model: CausalLM, largest: int, requests: int) -> int:
    return max(1, min(requests, largest, model.max_requests or requests))


def time_sizes(
    model: CausalLM,
    sizes: Sequence[int],
    repeats: int = REPEATS,
    context_len: int = SHORT_CONTEXT,
    requests: int = CALIBRATION_REQUESTS,
    seed: int = 0,
    tag: str = "v",
    progress: Callable[[str], None] | None = None,
) -> dict[int, float]:
    """Median seconds of one ``forward_tree`` over n new nodes, for each n of ``sizes``, in interleaved rounds."""
    reqs = _Requests(model, _request_count(model, max(sizes), requests), context_len, np.random.default_rng(seed), tag)
    try:
        return dict(zip(sizes, _time_rounds([(reqs, n) for n in sizes], repeats, progress, tag), strict=True))
    finally:
        reqs.release()


def per_context_seconds(
    model: CausalLM, tokens: int, long_context: int, repeats: int = REPEATS, requests: int = CALIBRATION_REQUESTS
) -> float:
    """Seconds per (tree node x context token): the same ``tokens``-node call over contexts of
    :data:`SHORT_CONTEXT` and ``long_context`` tokens, timed in alternation (one after the other
    when the model's KV pool cannot hold both sets of requests at once)."""
    if model.max_requests is not None and model.max_requests < 2:
        t_short = time_sizes(model, [tokens], repeats, SHORT_CONTEXT, requests=1, seed=1, tag="ctx-short")[tokens]
        t_long = time_sizes(model, [tokens], repeats, long_context, requests=1, seed=1, tag="ctx-long")[tokens]
    else:
        count = max(1, _request_count(model, tokens, requests) // 2)  # both sets must fit the KV pool together
        rng = np.random.default_rng(1)
        short, long = (
            _Requests(model, count, SHORT_CONTEXT, rng, "ctx-short"),
            _Requests(model, count, long_context, rng, "ctx-long"),
        )
        try:
            t_short, t_long = _time_rounds([(short, tokens), (long, tokens)], repeats, None, "ctx")
        finally:
            short.release()
            long.release()
    return max(0.0, (t_long - t_short) / (tokens * (long_context - SHORT_CONTEXT)))


def calibrate_table(
    model: CausalLM, max_tokens: int, repeats: int, progress: Callable[[str], None], what: str
) -> CostTable:
    """Seconds of ``model``'s calls by tokens, at every bucket up to ``max_tokens``."""
    seconds = time_sizes(model, [b for b in BUCKETS if b <= max(1, max_tokens)], repeats, tag=what, progress=progress)
    progress(f"{what}: " + ", ".join(f"{n} tokens {s * 1e3:.1f} ms" for n, s in seconds.items()))
    return CostTable(seconds)


def calibrate_costs(
    llm: CausalLM,
    ssms: Sequence[CausalLM],
    max_verify_tokens: int = 64,
    max_frontier_tokens: int = 32,
    repeats: int = REPEATS,
    progress: Callable[[str], None] | None = None,
) -> StepCosts:
    """The cost model of ``llm`` verifying and each SSM drafting (by its index in ``ssms``)."""
    say = progress or log_progress
    verify = calibrate_table(llm, max_verify_tokens, repeats, say, "verify")
    per_context = 0.0
    long_ctx = min(LONG_CONTEXT, llm.max_positions - max_verify_tokens - 1)
    if long_ctx > 2 * SHORT_CONTEXT:
        per_context = per_context_seconds(llm, min(CONTEXT_PROBE_TOKENS, max_verify_tokens), long_ctx, repeats)
        say(f"verify: {per_context * 1e9:.2f} ns per tree node and context token")
    drafts = {i: calibrate_table(ssm, max_frontier_tokens, repeats, say, f"ssm{i}") for i, ssm in enumerate(ssms)}
    return StepCosts(verify, per_context, drafts)


# -- the cold probe ------------------------------------------------------------------------------

PROBE_CONTEXT = 4  # context tokens of the probe's one request: its prefill is the warm-up call, so keep it short


@dataclass(frozen=True)
class ProbeConfig:
    """A cold probe's limits. ``seconds``: the whole probe's budget (warm-up calls included), of
    which the SSMs together get ``draft_share``; ``verify_sizes`` / ``draft_sizes``: tokens per
    call, in the order they are worth measuring (the first two are always measured, whatever they
    cost: one size alone would make extra tree nodes look free); ``rounds``: most calls per size."""

    seconds: float = 1.0
    draft_share: float = 0.2
    # 1 and 4 first: the batch-1 root alone and a small tree, cheap wherever calls grow with their
    # tokens (a 1B model in bf16 without AMX: 180 ms and 470 ms), and their slope predicts the rest
    # well there (8 nodes: 860 ms predicted, 870 measured), so the budget skips them. With AMX, calls
    # of up to 16 nodes cost what one does (~100 ms) and 64 about 1.7x: then the slope is flat, every
    # size fits, and 64 anchors the extrapolation a batch's trees need (a table that ended at a flat
    # 16 would price 200 tokens like 1).
    verify_sizes: tuple[int, ...] = (1, 4, 16, 64, 8, 32, 2)
    draft_sizes: tuple[int, ...] = (1, 4, 16, 8, 32, 2)
    rounds: int = 3


def _predicted_seconds(times: Mapping[int, Sequence[float]], n: int) -> float:
    """What a call of ``n`` tokens should cost: its size's last call, else the line through the
    two largest sizes timed (never falling; the largest alone: its time)."""
    if n in times:
        return times[n][-1]
    sizes = sorted(times)
    big = sizes[-1]
    if len(sizes) < 2:
        return min(times[big])
    small = sizes[-2]
    slope = max(0.0, (min(times[big]) - min(times[small])) / (big - small))
    return min(times[big]) + slope * max(0, n - big)


def probe_table(model: CausalLM, sizes: Sequence[int], budget_seconds: float, rounds: int, tag: str) -> CostTable:
    """Seconds of ``model``'s calls by tokens, from as many calls as fit ``budget_seconds``: one
    request of :data:`PROBE_CONTEXT` context tokens, first a warm-up call (its prefill and the
    first call's one-off costs), then rounds over ``sizes`` in order, skipping a call predicted
    (:func:`_predicted_seconds`) to overrun the budget. The first two sizes are always timed. Each
    size keeps its fastest call: with one to three calls per size the median is no steadier, and
    noise only ever adds time (the real steps then move the table to typical times)."""
    deadline = time.perf_counter() + budget_seconds
    reqs = _Requests(model, 1, PROBE_CONTEXT, np.random.default_rng(2), f"probe-{tag}")
    times: dict[int, list[float]] = {}
    try:
        wait_for(model.forward_tree(reqs.call(1)))
        for _ in range(max(1, rounds)):
            timed_any = False
            for k, n in enumerate(sizes):
                if (k >= 2 or n in times) and time.perf_counter() + _predicted_seconds(times, n) > deadline:
                    continue
                items = reqs.call(n)
                started = time.perf_counter()
                wait_for(model.forward_tree(items))
                times.setdefault(n, []).append(time.perf_counter() - started)
                timed_any = True
            if not timed_any:
                break
    finally:
        reqs.release()
    return CostTable({n: min(ts) for n, ts in times.items()})


def probe_costs(llm: CausalLM, ssms: Sequence[CausalLM], config: ProbeConfig = ProbeConfig()) -> StepCosts:
    """A cold cost model of ``llm`` verifying and each SSM drafting, in about ``config.seconds``
    (:func:`probe_table`). No per-context-token cost: measuring it needs a long context's prefill,
    which alone would overrun the budget; until the cache holds a refined table, the verify table
    absorbs the context work of the steps it observes."""
    started = time.perf_counter()
    verify_budget = config.seconds * (1.0 - config.draft_share) if ssms else config.seconds
    verify = probe_table(llm, config.verify_sizes, verify_budget, config.rounds, "verify")
    left = max(0.0, config.seconds - (time.perf_counter() - started))
    drafts = {
        i: probe_table(ssm, config.draft_sizes, left / len(ssms), config.rounds, f"ssm{i}")
        for i, ssm in enumerate(ssms)
    }
    log.info(
        "cost probe",
        extra={
            "seconds": round(time.perf_counter() - started, 3),
            "verify": {n: round(s, 5) for n, s in verify.as_dict().items()},
        },
    )
    return StepCosts(verify, 0.0, drafts)
