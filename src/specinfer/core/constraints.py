"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, grammar), its grammar
state, and the grammar over a token tree.

The constrained distribution at a tree node is the LLM's with every token the grammar forbids after that
node's path set to -inf (before temperature, top-k, top-p), so speculation stays exact against constrained
plain decoding (docs/architecture.md, "Structured outputs"). The side that holds a request's grammar state
(the engine core) walks each drafted tree depth first with the matcher's rollback (:func:`tree_masks`):
nodes whose token the grammar forbids after their parent's path are unreachable (they and their subtrees
are pruned, or under MSS left to be rejected), and every reachable node gets the bitmask of the tokens
allowed *after* it, which travels with the verify job and masks that node's logits.

Masks are xgrammar's and llguidance's layout: per node ``ceil(vocab / 32)`` int32 words, token ``t`` allowed
when bit ``t % 32`` of word ``t // 32`` is set. EOS is allowed only where the grammar can end; once it is
complete, only EOS. The library is llguidance (no torch: the request manager runs without it; it rolls back
any number of tokens). Grammars are compiled once per constraint and tokenizer (:class:`Grammars`) and
copied per request.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from specinfer.core.errors import InvalidArgument

if TYPE_CHECKING:
    from tokenizers import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "grammar")
ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (OpenAI's response_format json_object)
# JSON's separators fixed (", " and ": "), no other whitespace: a model fond of newlines would otherwise spend its
# tokens on them (a schema's "x-guidance" key may ask otherwise)
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. ``kind``: ``json_schema`` (``text`` is the schema as JSON),
    ``json_object`` (any JSON object; no text), ``regex`` (Rust regex syntax, the whole output) or ``grammar``
    (Lark as llguidance takes it, or GBNF as llama.cpp writes it)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument("constraint", f"kind must be one of {KINDS}, got {self.kind!r}")

    def grammar(self, field: str) -> str:
        """The llguidance grammar of this constraint (not yet checked against a tokenizer); ``field`` names the
        request field in errors."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, JSON_OPTIONS)
        if not self.text.strip():
            raise InvalidArgument(field, "must not be empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as e:
                raise InvalidArgument(field, f"is not JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidArgument(field, "must be a JSON object (a JSON schema)")
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        try:
            return llguidance.grammar_from("grammar", self.text)
        except ValueError as e:
            raise InvalidArgument(field, str(e)) from None


@dataclass(frozen=True)
class TreeMasks:
    """The grammar over one token tree: ``reachable[u]``, whether node u's path is allowed (the root always);
    ``masks[u]``, the tokens allowed after node u (zero rows at unreachable nodes).  # masks: [n, W] int32"""

    reachable: tuple[bool, ...]
    masks: np.ndarray

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(u for u, ok in enumerate(self.reachable) if ok)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allows(row: np.ndarray, token: int) -> bool:
    """Whether mask ``row`` ([W] int32) allows ``token``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token IDs mask ``row`` allows, ascending.  # [k]"""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype=np.int32).view(np.uint8), bitorder="little")
    return np.nonzero(bits[:vocab_size])[0]


def only(token: int, words: int) -> np.ndarray:
    """The mask allowing ``token`` alone.  # [W] int32"""
    row = np.zeros(words, dtype=np.int32)
    row[token >> 5] = np.int32(np.uint32(1 << (token & 31)).view(np.int32))
    return row


def tree_masks(
    matcher: llguidance.LLMatcher, tokens: Sequence[int], parents: Sequence[int], words: int, eos: int
) -> TreeMasks:
    """The grammar over a tree (``tokens``/``parents`` as :class:`~specinfer.core.tree.TokenTree`'s) whose root
    is the last committed token, ``matcher`` holding the state after it. Depth first: at each reachable node its
    mask, then each child whose token the mask allows is consumed, visited and rolled back. Nothing follows
    an EOS node (its mask allows EOS alone: the verifier needs a finite row). ``matcher`` ends as it began."""
    n = len(tokens)
    children: list[list[int]] = [[] for _ in range(n)]
    for c in range(1, n):
        children[parents[c]].append(c)
    masks = np.zeros((n, words), dtype=np.int32)  # [n, W]
    reachable = [False] * n
    reachable[0] = True

    def visit(u: int) -> None:
        llg_numpy.fill_next_token_bitmask(matcher, masks, u)
        if not masks[u].any():  # a matcher in error: never a row of -inf
            masks[u] = only(eos, words)
        for c in children[u]:
            if not allows(masks[u], tokens[c]):
                continue
            reachable[c] = True
            if tokens[c] == eos:
                masks[c] = only(eos, words)
                continue
            if not matcher.consume_token(tokens[c]):
                raise RuntimeError(f"the grammar refused token {tokens[c]} its own mask allowed: {matcher.get_error()}")
            visit(c)
            matcher.rollback(1)

    visit(0)
    return TreeMasks(tuple(reachable), masks)


class GrammarState:
    """One request's grammar: the matcher after its committed output (the prompt is not matched)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, eos: int) -> None:
        self.matcher = matcher
        self.words = words
        self.eos = eos

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed ``tokens`` (verification only commits what the masks allow)."""
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"committed token {t} breaks the request's grammar: {self.matcher.get_error()}")

    def tree(self, tokens: Sequence[int], parents: Sequence[int]) -> TreeMasks:
        return tree_masks(self.matcher, tokens, parents, self.words, self.eos)

    def mask(self) -> np.ndarray:
        """The tokens allowed next.  # [W] int32"""
        return self.tree([0], [-1]).masks[0]

    @property
    def complete(self) -> bool:
        """The output so far is a whole match (EOS may follow)."""
        return self.matcher.is_accepting()


class Grammars:
    """The grammars of one tokenizer (``tokenizer_json``: its ``tokenizer.json`` text; ``vocab_size``: the LLM's
    logits width, which may exceed the tokenizer's): each constraint compiled once (the last ``cache_size``
    kept) and copied per request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int, cache_size: int = 128) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self.vocab_size = vocab_size
        self.eos = eos_token_id
        self.words = mask_words(vocab_size)
        self.cache_size = cache_size
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()

    def _compile(self, constraint: Constraint, field: str) -> llguidance.LLMatcher:
        matcher = self._compiled.get(constraint)
        if matcher is not None:
            self._compiled.move_to_end(constraint)
            return matcher
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar(field), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(field, f"invalid {constraint.kind.replace('_', ' ')}: {matcher.get_error().strip()}")
        self._compiled[constraint] = matcher
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return matcher

    def check(self, constraint: Constraint, field: str | None = None) -> None:
        """:class:`InvalidArgument` naming ``field`` (default: the constraint's kind) unless the constraint compiles."""
        self._compile(constraint, field or constraint.kind)

    def state(self, constraint: Constraint, output: Sequence[int] = ()) -> GrammarState:
        """A request's grammar state after its committed ``output``."""
        state = GrammarState(self._compile(constraint, constraint.kind).deep_copy(), self.words, self.eos)
        state.advance(output)
        return state


def grammars_for(tokenizer: Tokenizer | None, vocab_size: int, eos_token_id: int | None) -> Grammars | None:
    """The grammars of structured outputs over the LLM's tokenizer (None without a tokenizer or an EOS token:
    constrained requests are then refused)."""
    if tokenizer is None or eos_token_id is None:
        return None
    return Grammars(tokenizer.to_str(), vocab_size, eos_token_id)
