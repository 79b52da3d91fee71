"""Generation requests, results and per-step statistics (pure data, shared by the engine and the services)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT, ExpansionConfig
from specinfer.core.errors import InvalidArgument
from specinfer.core.sampling import SamplingParams


@dataclass(frozen=True)
class SpeculationConfig:
    """How one request speculates.

    ``ssms``: indices of the engine's SSMs to draft with (several: their trees are merged).
    ``draft_support``: most tokens kept in a sparse draft distribution q under sampling.
    """

    expansion: ExpansionConfig
    ssms: tuple[int, ...] = (0,)
    draft_support: int = DEFAULT_DRAFT_SUPPORT

    def __post_init__(self) -> None:
        if not self.ssms:
            raise InvalidArgument("speculation.ssms", "name at least one SSM, or turn speculation off")
        if len(set(self.ssms)) != len(self.ssms):
            raise InvalidArgument("speculation.ssms", f"lists an SSM twice: {self.ssms}")
        if self.draft_support <= 0:
            raise InvalidArgument("speculation.draft_support", f"must be > 0, got {self.draft_support}")

    def expansion_for(self, ssm_index: int, remaining: int) -> ExpansionConfig | None:
        """What SSM ``ssm_index`` drafts for a request with ``remaining`` tokens to go, or None.

        The bonus token always comes on top of the tree, so never draft past the token budget.
        """
        depth = min(self.expansion.depth, remaining - 1)
        if ssm_index not in self.ssms or depth <= 0:
            return None
        return ExpansionConfig(self.expansion.widths[:depth])


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. ``speculation=None`` decodes incrementally (a tree of just the root)."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    speculation: SpeculationConfig | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if len(self.prompt_tokens) == 0:
            raise InvalidArgument("prompt", "must not be empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidArgument("max_new_tokens", f"must be a positive integer, got {self.max_new_tokens}")


@dataclass(frozen=True)
class StepStats:
    """One LLM verify step of one request: tree size (nodes incl. the root), accepted tokens
    (tree tokens the LLM agreed with), the bonus token, and how many tokens were committed
    (accepted + bonus, fewer when a stop condition cut the step short)."""

    tree_size: int
    accepted: int
    bonus_token: int
    committed: int


@dataclass
class GenerationResult:
    request_id: str
    prompt_tokens: tuple[int, ...]
    output_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" | "eos" | "stop"
    steps: list[StepStats] = field(default_factory=list)

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


def commit_tokens(new_tokens: tuple[int, ...], remaining: int, eos_token_id: int | None, stop_token_ids: frozenset[int]) -> tuple[tuple[int, ...], str | None]:
    """The prefix of a step's tokens (accepted + bonus) to commit, and the finish reason if the
    request ends with them: ``eos`` / ``stop`` include the stopping token, ``length`` cuts at
    ``remaining`` tokens."""
    out = []
    for token in new_tokens:
        out.append(token)
        if token == eos_token_id:
            return tuple(out), "eos"
        if token in stop_token_ids:
            return tuple(out), "stop"
        if len(out) >= remaining:
            return tuple(out), "length"
    return tuple(out), None
