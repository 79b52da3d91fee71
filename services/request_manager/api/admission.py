"""Admission: what the public API accepts, and the validated :class:`Live` request a ``GenerateRequest`` becomes.

Pure functions (no I/O): every refusal is an :class:`InvalidArgument` naming the field, which
``rpc_errors`` turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from tokenizers import Tokenizer

from specinfer import wire
from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.constraints import Constraint, Grammars
from specinfer.core.drafts import DEFAULT_MAX_TREE_NODES, merged_tree_nodes
from specinfer.core.errors import check_token_ids
from specinfer.core.iteration import request_seed
from specinfer.core.kv_budget import KVBudget, check_fits_alone
from specinfer.core.requests import GenerationRequest, SpeculationConfig
from specinfer.request_manager.api.text import TextStream
from specinfer.request_manager.scheduling.adaptive import planner_config
from specinfer.request_manager.scheduling.live import Live
from specinfer.request_manager.state.records import validate_id
from specinfer.v1 import api_pb2

# Bounds of the fields not tied to a setting: enough for any real use, small enough that a
# hostile message cannot make validation, Redis records or stop-string matching expensive.
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
CHARS_PER_PROMPT_TOKEN = 32  # a text prompt longer than max_prompt_tokens * this is refused before tokenizing


@dataclass(frozen=True)
class ApiLimits:
    """What the public API accepts and defaults to."""

    vocab_size: int
    max_positions: int
    max_new_tokens: int
    default_expansion: tuple[int, ...]  # a static default tree; empty: none (see default_adaptive)
    default_ssms: tuple[str, ...]
    ssm_names: tuple[str, ...]
    draft_support: int
    llm_name: str
    eos_token_id: int | None
    max_prompt_tokens: int = 8192
    max_tree_nodes: int = DEFAULT_MAX_TREE_NODES  # of the merged tree, root included
    default_adaptive: bool = False  # requests that set nothing speculate adaptively (``--expansion auto``)
    # those the scheduler admits by (SchedulerConfig.kv_budgets): a request must fit each alone
    kv_budgets: tuple[KVBudget, ...] = ()
    # (SSM name, how its drafts reach the LLM's token IDs) as its worker reported
    draft_vocabulary: tuple[tuple[str, str], ...] = ()
    draft_head: bool = False  # the verifier drafts with a draft head: adaptive requests need no SSM

    @property
    def default_speculation(self) -> str:
        """The default as ``ModelInfo.default_speculation`` spells it: "auto", "none" or the widths "1,1,3"."""
        if self.default_adaptive:
            return "auto"
        return ",".join(str(w) for w in self.default_expansion) or "none"


def check_request_id(request_id: str) -> str:
    """``request_id``, or :class:`InvalidArgument` when it cannot name a request: longer than any the server
    gives or accepts, or against the store's rule for IDs inside Redis keys. An empty ID passes: it names no
    request, and a caller that needs one says so."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")
    if request_id:
        try:
            validate_id(request_id, "request_id")
        except ValueError as exc:
            raise InvalidArgument("request_id", str(exc)) from None
    return request_id


def resume_request_id(msg: api_pb2.GenerateRequest) -> str:
    """The ID of the request a ``resume_from`` message reattaches to."""
    if not msg.request_id:
        raise InvalidArgument("request_id", "required with resume_from")
    return check_request_id(msg.request_id)


def prompt_tokens(msg: api_pb2.GenerateRequest, limits: ApiLimits, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The prompt as token IDs, from ``prompt.text`` (tokenized) or ``prompt.token_ids``."""
    which = msg.WhichOneof("prompt")
    most = limits.max_prompt_tokens
    if which == "text":
        if not msg.text:
            raise InvalidArgument("prompt.text", "must not be empty")
        if tokenizer is None:
            raise InvalidArgument("prompt.text", "this server has no tokenizer; send prompt.token_ids")
        if len(msg.text) > most * CHARS_PER_PROMPT_TOKEN:
            raise InvalidArgument("prompt.text", f"{len(msg.text)} characters is too long (the limit is {most} tokens)")
        ids = tuple(tokenizer.encode(msg.text).ids)
        if len(ids) > most:
            raise InvalidArgument("prompt.text", f"{len(ids)} tokens; at most {most}")
        return ids
    if which == "token_ids":
        ids = tuple(msg.token_ids.ids)
        if not ids:
            raise InvalidArgument("prompt.token_ids", "must not be empty")
        if len(ids) > most:
            raise InvalidArgument("prompt.token_ids", f"{len(ids)} tokens; at most {most}")
        return check_token_ids("prompt.token_ids", ids, limits.vocab_size)
    raise InvalidArgument("prompt", "set prompt.text or prompt.token_ids")


def speculation(msg: api_pb2.SpeculationParams, limits: ApiLimits) -> SpeculationConfig | None:
    """The request's speculation (None: incremental decoding), the server's defaults filling what is unset:
    ``disabled``: none; ``expansion``: a static tree; ``adaptive``, or nothing set on a server whose default
    is adaptive: the planner sizes each step's tree (``SpeculationConfig(None, ...)``)."""
    if msg.disabled:
        return None
    if msg.adaptive and msg.expansion:
        raise InvalidArgument("speculation.adaptive", "set either adaptive or expansion, not both")
    adaptive = msg.adaptive or (not msg.expansion and limits.default_adaptive)
    expansion = None if adaptive else _static_expansion(tuple(msg.expansion) or limits.default_expansion, limits)
    if not adaptive and expansion is None:
        return None
    if len(msg.ssms) > len(limits.ssm_names):
        raise InvalidArgument("speculation.ssms", f"lists {len(msg.ssms)} SSMs; the server has {len(limits.ssm_names)}")
    names = tuple(msg.ssms) or limits.default_ssms
    unknown = [n for n in names if n not in limits.ssm_names]
    if unknown:
        raise InvalidArgument(
            "speculation.ssms", f"unknown SSM {unknown[0]!r} (have: {', '.join(limits.ssm_names) or 'none'})"
        )
    if len(set(names)) != len(names):
        raise InvalidArgument("speculation.ssms", "lists an SSM twice")
    if not names and not (adaptive and limits.draft_head):
        raise InvalidArgument("speculation.ssms", "no SSM is available; set speculation.disabled")
    if expansion is not None:
        nodes = merged_tree_nodes(expansion, len(names))
        if nodes > limits.max_tree_nodes:
            raise InvalidArgument(
                "speculation.expansion",
                f"up to {nodes} tree nodes with {len(names)} SSM(s); at most {limits.max_tree_nodes}",
            )
    suffix = msg.suffix if msg.HasField("suffix") else True
    head = msg.head if msg.HasField("head") else True
    ssms = tuple(limits.ssm_names.index(n) for n in names)
    return SpeculationConfig(expansion, ssms, limits.draft_support, suffix, head)


def _static_expansion(widths: tuple[int, ...], limits: ApiLimits) -> ExpansionConfig | None:
    """The static tree of ``widths`` (None: no widths, no speculation)."""
    if not widths:
        return None
    most = limits.max_tree_nodes
    if len(widths) >= most:  # checked first: the node count of a deep tree is a huge number
        raise InvalidArgument(
            "speculation.expansion", f"{len(widths)} depths; a tree of at most {most} nodes has fewer"
        )
    return wire.expansion_from_proto(widths)


def _check_stops(msg: api_pb2.GenerateRequest, limits: ApiLimits, tokenizer: Tokenizer | None) -> None:
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument("stop_token_ids", f"{len(msg.stop_token_ids)} IDs; at most {MAX_STOP_TOKEN_IDS}")
    if len(msg.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in msg.stop):
        raise InvalidArgument(
            "stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"
        )
    if any(not s for s in msg.stop):
        raise InvalidArgument("stop", "an empty stop string would stop at once")
    check_token_ids("stop_token_ids", msg.stop_token_ids, limits.vocab_size)
    if msg.stop and tokenizer is None:
        raise InvalidArgument("stop", "stop strings need a tokenizer, which this server lacks; use stop_token_ids")


def _check_length(prompt: tuple[int, ...], max_new_tokens: int, limits: ApiLimits) -> None:
    if max_new_tokens <= 0:
        raise InvalidArgument("max_new_tokens", "must be > 0")
    if max_new_tokens > limits.max_new_tokens:
        raise InvalidArgument("max_new_tokens", f"must be at most {limits.max_new_tokens}, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > limits.max_positions:
        raise InvalidArgument(
            "max_new_tokens",
            f"prompt ({len(prompt)} tokens) + max_new_tokens exceeds the model's {limits.max_positions} positions",
        )


def check_kv_fit(request: GenerationRequest, limits: ApiLimits) -> None:
    """Refuses a request the scheduler's KV budgets could never run
    (:func:`~specinfer.core.kv_budget.check_fits_alone`)."""
    check_fits_alone(request, limits.kv_budgets, len(limits.ssm_names), planner_config(limits.max_tree_nodes))


def constraint(msg: api_pb2.GenerateRequest, grammars: Grammars | None) -> Constraint | None:
    """The request's ``constraint`` oneof, compiled once to check it (:class:`InvalidArgument` naming the field)."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object" and not msg.json_object:
        raise InvalidArgument("json_object", "must be true when set")
    out = Constraint(kind, "" if kind == "json_object" else getattr(msg, kind))
    if grammars is None:
        raise InvalidArgument(kind, "needs the LLM's tokenizer and EOS token, which this server lacks")
    grammars.check(out, kind)
    return out


def build_live(
    msg: api_pb2.GenerateRequest,
    limits: ApiLimits,
    tokenizer: Tokenizer | None,
    deadline: float | None,
    grammars: Grammars | None = None,
) -> Live:
    """A validated :class:`Live` request from the wire message (``deadline``: ``time.monotonic()`` after which it is
    abandoned; None: never). A request without an ID gets a random one, a sampling request without a seed a random
    seed. ``grammars``: the tokenizer's, for a request with a constraint (None: refused)."""
    request_id = check_request_id(msg.request_id or uuid.uuid4().hex)
    _check_stops(msg, limits, tokenizer)  # bounded before the prompt is tokenized
    prompt = prompt_tokens(msg, limits, tokenizer)
    _check_length(prompt, msg.max_new_tokens, limits)
    sampling = wire.sampling_from_proto(msg.sampling, vocab_size=limits.vocab_size)
    request = GenerationRequest(
        request_id=request_id,
        prompt_tokens=prompt,
        max_new_tokens=int(msg.max_new_tokens),
        sampling=sampling,
        speculation=speculation(msg.speculation, limits),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=wire.logprobs_from_proto(msg, "logprobs"),
        constraint=constraint(msg, grammars),
    )
    if request.logprobs is not None and request.logprobs > limits.vocab_size:  # each record holds that many
        vocabulary = f"a {limits.vocab_size}-token vocabulary"
        raise InvalidArgument("logprobs", f"asks {request.logprobs} alternatives of {vocabulary}")
    check_kv_fit(request, limits)
    seed = request_seed(sampling)
    text = (
        TextStream(tokenizer, tuple(msg.stop), wire.skip_special_tokens_from_proto(msg))
        if tokenizer is not None
        else None
    )
    return Live(request, seed, tuple(msg.stop), text, deadline)
