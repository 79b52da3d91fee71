"""Generation requests, results and step statistics (pure data, shared by the engine and the services)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specinfer.core.constraints import Constraint
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT, ExpansionConfig
from specinfer.core.errors import InvalidArgument
from specinfer.core.sampling import SamplingParams


@dataclass(frozen=True)
class SpeculationConfig:
    """How one request speculates.

    ``expansion``: a static tree (every SSM in ``ssms`` drafts it, the trees are merged), or None
    for *adaptive* speculation (``speculation: auto``): each step the planner decides whether to
    speculate, how many nodes the request's dynamic tree may hold and which one of ``ssms``
    drafts it (see :mod:`specinfer.core.adaptive`).
    ``ssms``: indices of the engine's SSMs the request may draft with (none: an adaptive request that
    drafts from its own text alone).
    ``draft_support``: most tokens kept in a sparse draft distribution q under sampling.
    ``suffix``: adaptive greedy and coupled requests also draft from their own text, model-free
    (:mod:`specinfer.core.suffix`): the trees are merged and the planner's cut keeps what pays.
    ``head``: adaptive requests also draft with the verifier's draft head where it has one
    (:mod:`specinfer.models.head_drafter`), merged and cut the same way.
    """

    expansion: ExpansionConfig | None
    ssms: tuple[int, ...] = (0,)
    draft_support: int = DEFAULT_DRAFT_SUPPORT
    suffix: bool = True
    head: bool = True

    def __post_init__(self) -> None:
        if not self.ssms and not (self.adaptive and (self.suffix or self.head)):
            raise InvalidArgument(
                "speculation.ssms",
                "name at least one SSM, or draft without one (adaptive with suffix or head drafts), "
                "or turn speculation off",
            )
        if len(set(self.ssms)) != len(self.ssms):
            raise InvalidArgument("speculation.ssms", f"lists an SSM twice: {self.ssms}")
        if self.draft_support <= 0:
            raise InvalidArgument("speculation.draft_support", f"must be > 0, got {self.draft_support}")

    @property
    def adaptive(self) -> bool:
        return self.expansion is None

    def expansion_for(self, ssm_index: int, remaining: int) -> ExpansionConfig | None:
        """What static tree SSM ``ssm_index`` drafts for a request with ``remaining`` tokens to go,
        or None (adaptive requests get theirs from the planner).

        The bonus token always comes on top of the tree, so never draft past the token budget.
        """
        if self.expansion is None:
            return None
        depth = min(self.expansion.depth, remaining - 1)
        if ssm_index not in self.ssms or depth <= 0:
            return None
        return ExpansionConfig(self.expansion.widths[:depth])


MAX_LOGPROBS = 20  # most alternatives a request may ask for at each token (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class TokenLogprob:
    """The LLM's log-probability of one committed ``token``, and the ``top`` alternatives at its position as
    (token, logprob) pairs, most likely first. Log-probabilities are the LLM's raw distribution at that position
    (log-softmax of its logits: temperature 1, before top-k and top-p), whatever the request samples with, as
    vLLM reports by default; greedy and sampled requests alike."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. ``speculation=None`` decodes incrementally (a tree of just the root). ``logprobs``: report
    each output token's :class:`TokenLogprob` with this many alternatives (0: the token's own alone; None: none).
    ``constraint``: what the output must match (:mod:`specinfer.core.constraints`; None: anything); it ends
    with EOS once the grammar is complete, so it does not go with ``ignore_eos``."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    speculation: SpeculationConfig | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.constraint is not None and self.ignore_eos:
            raise InvalidArgument("ignore_eos", "cannot go with a constraint (a complete output ends with EOS)")
        if len(self.prompt_tokens) == 0:
            raise InvalidArgument("prompt", "must not be empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens", f"must be a positive integer, got {self.max_new_tokens}")
        check_logprobs(self.logprobs)


def check_logprobs(top: int | None, field_name: str = "logprobs") -> None:
    """InvalidArgument naming ``field_name`` unless ``top`` is None or a count of alternatives we report."""
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
        raise InvalidArgument(field_name, f"must be an integer from 0 to {MAX_LOGPROBS}, got {top!r}")


@dataclass(frozen=True)
class StepStats:
    """Counters of LLM verify steps of one request: one step (``llm_steps`` 1, the default) or
    the totals of several (their sum, ``a + b``).

    ``accepted``: tree tokens the LLM agreed with (the bonus token not counted); ``tree_size``:
    nodes of the verified trees, roots included; ``committed``: tokens appended to the output
    (accepted + bonus, fewer when a stop condition cut a step short); ``cached_prompt``: prompt
    tokens the LLM took from its prefix cache instead of computing them (only a request's first
    step has any: :meth:`specinfer.core.iteration.Running.outcome`). The request store keeps all
    but ``committed`` as the ``llm_steps``, ``accepted_tokens``, ``tree_nodes`` and
    ``cached_prompt_tokens`` of a request.
    """

    llm_steps: int = 1
    accepted: int = 0
    tree_size: int = 0
    committed: int = 0
    cached_prompt: int = 0

    def __post_init__(self) -> None:
        for name in ("llm_steps", "accepted", "tree_size", "committed", "cached_prompt"):
            value = getattr(self, name)
            # bool is an int subclass; a flag passed here is a caller bug, not a count.
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StepStats.{name} must be a non-negative int, got {value!r}")

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(
            self.llm_steps + other.llm_steps,
            self.accepted + other.accepted,
            self.tree_size + other.tree_size,
            self.committed + other.committed,
            self.cached_prompt + other.cached_prompt,
        )


@dataclass
class GenerationResult:
    """A request's output so far and its ``steps``: one :class:`StepStats` per verify step."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    output_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "eos" | "stop"
    steps: list[StepStats] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when the request asked

    @property
    def llm_steps(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_step(self) -> float:
        """Mean committed tokens per LLM verify step (accepted + bonus)."""
        return len(self.output_tokens) / max(1, len(self.steps))

    @property
    def mean_accepted(self) -> float:
        return sum(s.accepted for s in self.steps) / max(1, len(self.steps))

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens the LLM took from its prefix cache instead of computing them."""
        return sum(s.cached_prompt for s in self.steps)
