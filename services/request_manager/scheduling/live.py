"""A request the request manager runs, and what its client streams receive: :class:`Live` (the
running request, its text stream, deadline and subscribers), :class:`StreamEvent` (committed tokens),
:class:`Finish` (how it ended, with its :class:`Usage`) and :data:`MOVED` (another replica took it over).
The scheduler (:mod:`.scheduler`) drives them; admission builds them; the API front doors read them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specinfer.core.iteration import Running, StepOutcome
from specinfer.core.requests import StepStats, TokenLogprob
from specinfer.request_manager.api.text import TextStream


@dataclass(frozen=True)
class Usage:
    """A request's token counts and speculation statistics (named as the public ``Usage`` message's fields)."""

    prompt_tokens: int
    completion_tokens: int
    llm_steps: int
    mean_accepted_tokens: float
    tokens_per_step: float
    mean_tree_size: float
    cached_prompt_tokens: int

    @staticmethod
    def of(prompt_tokens: int, completion_tokens: int, stats: StepStats) -> Usage:
        """The usage of a request with ``stats``, the totals of its verify steps."""
        n = max(1, stats.llm_steps)
        return Usage(
            prompt_tokens,
            completion_tokens,
            stats.llm_steps,
            stats.accepted / n,
            completion_tokens / n,
            stats.tree_size / n,
            stats.cached_prompt,
        )


@dataclass(frozen=True)
class Finish:
    reason: str  # "length" | "eos" | "stop" | "cancelled" | "error"
    usage: Usage
    error: str = ""


@dataclass(frozen=True)
class StreamEvent:
    """New committed tokens of a request (``offset``: index of the first in its output); ``logprobs``: theirs, one
    per token, where the request asks for them."""

    offset: int
    tokens: tuple[int, ...]
    text: str
    finished: Finish | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


class Moved:
    """What a request's subscribers get instead of further events when another replica took it over
    (:data:`MOVED`): they follow it in Redis from there (:meth:`.state.lifecycle.Requests.attach`)."""


MOVED = Moved()


@dataclass
class Live(Running):
    """A request the scheduler is running (the Redis record is the durable copy)."""

    stop_strings: tuple[str, ...] = ()
    text: TextStream | None = None
    deadline: float | None = None  # time.monotonic() after which the request is abandoned
    subscribers: list[asyncio.Queue] = field(default_factory=list)
    stop_reason: str | None = None  # set by cancel(); applied at the next iteration boundary
    finished: Finish | None = None
    final: StreamEvent | None = None  # the finishing event, published once Redis recorded the finish
    moved: bool = False  # another replica took it over; dropped here (its subscribers got MOVED)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when the request asks

    def commit(self, outcome: StepOutcome) -> None:
        super().commit(outcome)
        if outcome.logprobs is not None:
            self.logprobs.extend(outcome.logprobs)

    def usage(self) -> Usage:
        return Usage.of(len(self.request.prompt_tokens), len(self.output), self.stats)

    def publish(self, event: StreamEvent | Moved) -> None:
        for q in self.subscribers:
            q.put_nowait(event)
