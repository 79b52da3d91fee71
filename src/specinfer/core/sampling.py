"""Sampling parameters and the logit processing shared by drafting and verification.

The LLM's target distribution ``p`` and an SSM's draft distribution ``q`` are both derived from
raw logits by :func:`process_logits` with the request's parameters, so "sampling from the LLM
alone" means sampling from ``process_logits(llm_logits, params)`` and speculative sampling
must reproduce exactly that distribution.

A *sparse distribution* is what crosses the wire for a draft: the support tokens and their
probabilities (renormalised after truncation). Drafts are sampled from exactly the sparse
distribution that is sent, which keeps verification exact whatever the truncation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specinfer.core.errors import InvalidArgument

# How a sampled request's draft tree is verified (``SamplingParams.verification``): "mss",
# multi-step speculative sampling (:mod:`specinfer.core.verify`); "coupled", the Gumbel-max draw
# fixed by the seed (:mod:`specinfer.core.coupled`); "auto", coupled for a request with a seed (so
# that the seed fixes its output), MSS for the others.
VERIFICATIONS = ("auto", "coupled", "mss")
MAX_LOGIT_BIAS = 1024  # most tokens a request biases


@dataclass(frozen=True)
class SamplingParams:
    """How a request turns logits into tokens.

    ``temperature == 0`` means greedy decoding (argmax); ``top_k == 0`` and ``top_p == 1``
    disable those filters. ``seed`` fixes the request's random stream (None: fresh entropy).
    ``verification``: one of :data:`VERIFICATIONS`, see there. ``min_p`` (0: off) keeps, after the
    temperature and before top-k, the tokens at least ``min_p`` times as likely as the most likely one.
    Biases and penalties change the logits before all that (:func:`adjust_logits`, in vLLM's order):
    ``logit_bias`` adds its (token, bias) pairs' biases (OpenAI's); ``repetition_penalty`` (1: off) divides the
    positive logits and multiplies the negative ones of every token of the prompt and the output;
    ``frequency_penalty`` is subtracted once per occurrence of a token in the output, ``presence_penalty`` once
    if it occurs at all (0: off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    verification: str = "auto"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.verification not in VERIFICATIONS:
            raise InvalidArgument(
                "verification", f"must be one of {', '.join(VERIFICATIONS)}, got {self.verification!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidArgument(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidArgument("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidArgument("min_p", f"must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument("logit_bias", f"{len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidArgument("logit_bias", f"keys must be token IDs, got {token!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidArgument("logit_bias", f"the bias of token {token} must be in [-100, 100], got {bias}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidArgument("logit_bias", "names a token twice")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits (:func:`adjust_logits`)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Whether this request samples with coupled verification (:mod:`specinfer.core.coupled`):
        its tokens are then those plain decoding draws with the same seed, whatever speculation does."""
        if self.greedy:
            return False
        return self.verification == "coupled" or (self.verification == "auto" and self.seed is not None)

    @property
    def prunable(self) -> bool:
        """Whether a drafted tree may be cut to any subtree of it before verification: greedy and
        coupled verification walk towards a token fixed before the walk, so no choice of nodes can
        bias them; multi-step speculative sampling may not (see :meth:`~specinfer.core.drafts.DraftTree.subtree`)."""
        return self.greedy or self.coupled


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few tokens: ``tokens[k]`` (distinct) and ``probs[k]`` summing to 1."""

    tokens: np.ndarray  # [k] int64
    probs: np.ndarray  # [k] float64

    def prob_of(self, token: int) -> float:
        hit = np.nonzero(self.tokens == token)[0]
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def dense(self, vocab_size: int) -> np.ndarray:
        out = np.zeros(vocab_size, dtype=np.float64)
        out[self.tokens] = self.probs
        return out


def adjust_logits(
    logits: np.ndarray, prompt: Sequence[int], output: Sequence[int], params: SamplingParams
) -> np.ndarray:
    """The logits of the next token after ``prompt`` and ``output`` with the request's biases, then its penalties
    (see :class:`SamplingParams`; none: unchanged). The reference of the verifier's device code.  # [V] float64"""
    x = np.array(logits, dtype=np.float64)
    for token, bias in params.logit_bias:
        x[token] += bias
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray([*prompt, *output], dtype=np.int64))
        r = params.repetition_penalty
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    if output:
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.size)[: x.size].astype(np.float64)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return x


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, min-p, top-k and top-p, in that order.  # [..., V] float64

    Greedy parameters give a one-hot distribution on the argmax (ties: lowest index), so
    greedy decoding is the temperature -> 0 limit of the same function.
    """
    x = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        out = np.zeros_like(x)
        np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return out
    x = x / params.temperature
    vocab = x.shape[-1]
    if params.min_p > 0.0:  # p >= min_p * max p, in logits: x - max x >= log(min_p)
        x = np.where(x - np.max(x, axis=-1, keepdims=True) < math.log(params.min_p), -np.inf, x)
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - np.max(x, axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        keep_sorted = (cum - sorted_p) < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sparsify(probs: np.ndarray, max_support: int) -> SparseDist:
    """The ``max_support`` most likely tokens of ``probs`` (nonzero ones only), renormalised."""
    probs = np.asarray(probs, dtype=np.float64)
    nonzero = int(np.count_nonzero(probs))
    k = min(max_support, nonzero)
    top = np.argpartition(-probs, k - 1)[:k] if k < probs.size else np.arange(probs.size)
    top = top[probs[top] > 0]
    top = top[np.argsort(-probs[top], kind="stable")]
    p = probs[top]
    return SparseDist(top.astype(np.int64), p / p.sum())


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from ``probs``, nonnegative weights renormalised here.  # [V]

    The same draw as ``rng.choice(len(p), p=p / p.sum())`` (numpy's inverse-CDF method: one uniform, the
    CDF renormalised by its last entry, the first entry above the uniform), without ``choice``'s argument
    checks, which took 60 % of the call: seeded outputs are the same as with ``choice``
    (tests/test_sampling.py checks the two agree)."""
    p = np.asarray(probs, dtype=np.float64)
    cdf = (p / p.sum()).cumsum()  # [V]
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def draw_without_replacement(q: SparseDist, k: int, rng: np.random.Generator) -> list[int]:
    """Up to ``k`` distinct tokens; the i-th is drawn from ``q`` renormalised over the tokens
    not drawn before it (the order matters: verification tries them in this order)."""
    remaining = q.probs.copy()  # [support] q's mass on the tokens not drawn yet
    out: list[int] = []
    for _ in range(min(k, int(np.count_nonzero(remaining)))):
        idx = sample(remaining, rng)
        out.append(int(q.tokens[idx]))
        remaining[idx] = 0.0
    return out


def top_k_tokens(logits: np.ndarray, k: int) -> list[int]:
    """The ``k`` highest-scoring tokens, best first (ties: lowest index)."""
    x = np.asarray(logits)
    k = min(k, x.size)
    top = np.argpartition(-x, k - 1)[:k]
    return [int(t) for t in top[np.lexsort((top, -x[top]))]]


def token_logprob(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` under the raw distribution of ``logits`` (log-softmax: temperature 1, no
    truncation), and the ``top`` most likely tokens with theirs, best first (ties: lowest index). The reference
    of :func:`specinfer.models.on_device.token_logprobs`."""
    x = np.asarray(logits, dtype=np.float64)
    logp = x - x.max()
    logp = logp - math.log(np.exp(logp).sum())
    return float(logp[token]), tuple((t, float(logp[t])) for t in top_k_tokens(logp, top)) if top else ()
