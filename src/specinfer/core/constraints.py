"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, grammar), its grammar
state, and the grammar over a token tree.

The constrained distribution at a tree node is the LLM's with every token the grammar forbids after that
node's path set to -inf (before temperature, top-k, top-p), so speculation stays exact against constrained
plain decoding (docs/architecture.md, "Structured outputs"). The side that holds a request's grammar state
(the engine core) walks each drafted tree depth first with the matcher's rollback (:func:`tree_masks`):
nodes whose token the grammar forbids after their parent's path are unreachable (they and their subtrees
are pruned, or under MSS left to be rejected), and every reachable node gets the bitmask of the tokens
allowed *after* it, which travels with the verify job and masks that node's logits.

A *certain token* is the one token the grammar allows after a node's path, where it allows only one (a JSON
schema's keys, punctuation, closing brackets). Its probability under the constrained distribution is 1 whatever
the LLM's logits, so a certain token below a node is accepted whenever that node is: :func:`certain_chains`
finds the chain of certain tokens below each leaf of the reachable tree, which the engine core appends to the
tree before verification (SGLang's jump-forward, inside the tree: no draft pass proposes them).

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
from specinfer.core.tree import node_depths, path_below_root

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


def certain_token(row: np.ndarray) -> int | None:
    """The token mask ``row`` ([W] int32) allows alone; None where it allows none or several."""
    words = np.flatnonzero(row)
    if words.size != 1:
        return None
    bits = int(row[words[0]]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    return int(words[0]) * 32 + bits.bit_length() - 1


def _fill_next(matcher: llguidance.LLMatcher, masks: np.ndarray, row: int, eos: int) -> None:
    """Row ``row`` of ``masks`` ([n, W] int32): the tokens ``matcher`` allows next; EOS alone where the matcher is in
    error (never a row of -inf)."""
    llg_numpy.fill_next_token_bitmask(matcher, masks, row)
    if not masks[row].any():
        masks[row] = only(eos, masks.shape[1])


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
        _fill_next(matcher, masks, u, eos)
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


def path_masks(matcher: llguidance.LLMatcher, paths: Sequence[Sequence[int]], words: int, eos: int) -> np.ndarray:
    """The tokens allowed after each of ``paths`` (token paths below the root of a tree, as :func:`tree_masks`
    takes it, ``matcher`` holding the state after the root), one mask row per path: each path is consumed, its
    row filled and the path rolled back (a drafter's frontier: only the rows it drafts from, no walk of the nodes
    above them). A path that ends with EOS gets EOS alone, as in :func:`tree_masks`. ``matcher`` ends as it began.
    # [len(paths), W] int32"""
    masks = np.zeros((len(paths), words), dtype=np.int32)  # [F, W]
    for row, path in enumerate(paths):
        if path and path[-1] == eos:
            masks[row] = only(eos, words)
            continue
        for t in path:
            if not matcher.consume_token(int(t)):
                raise RuntimeError(f"the grammar refused token {t} of a drafted path: {matcher.get_error()}")
        _fill_next(matcher, masks, row, eos)
        matcher.rollback(len(path))
    return masks


def certain_chains(
    matcher: llguidance.LLMatcher,
    tokens: Sequence[int],
    parents: Sequence[int],
    walked: TreeMasks,
    eos: int,
    room: int,
    max_depth: int,
    max_chain: int,
) -> dict[int, tuple[tuple[int, ...], np.ndarray]]:
    """The chains of certain tokens below the leaves of a tree's reachable part (``walked``: :func:`tree_masks`
    of ``tokens``/``parents`` from ``matcher``'s state), by leaf: the chain's tokens and the mask after each.
    # masks: [k, W] int32

    A chain stops at the first node where the grammar allows several tokens (the verifier's bonus token then
    picks one), before EOS (the bonus token after the chain is EOS anyway), after ``max_chain`` tokens, at depth
    ``max_depth`` below the root (a request's remaining tokens: deeper nodes could not be committed), and where
    the chains so far hold ``room`` nodes (the rows the step may add to the tree). Deeper leaves go first: where
    room runs short, the chains below the longest drafted paths are the ones kept. ``matcher`` ends as it began."""
    depths = node_depths(parents)  # [n]
    reachable_child = [False] * len(tokens)
    for c in range(1, len(tokens)):
        if walked.reachable[c]:
            reachable_child[parents[c]] = True
    leaves = [u for u in walked.kept if not reachable_child[u]]
    leaves.sort(key=lambda u: (-int(depths[u]), u))
    chains: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    for u in leaves:
        limit = min(max_chain, room, max_depth - int(depths[u]))
        first = certain_token(walked.masks[u])
        if limit <= 0 or first is None or first == eos:
            continue
        path = path_below_root(tokens, parents, u)
        for t in path:
            if not matcher.consume_token(t):
                raise RuntimeError(f"the grammar refused token {t} of a reachable path: {matcher.get_error()}")
        chain: list[int] = []
        masks = np.zeros((limit, walked.masks.shape[1]), dtype=np.int32)  # [limit, W]
        token: int | None = first
        while token is not None and token != eos and len(chain) < limit:
            if not matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused its own certain token {token}: {matcher.get_error()}")
            _fill_next(matcher, masks, len(chain), eos)
            chain.append(token)
            token = certain_token(masks[len(chain) - 1])
        matcher.rollback(len(path) + len(chain))
        chains[u] = (tuple(chain), masks[: len(chain)])
        room -= len(chain)
    return chains


class GrammarState:
    """One request's grammar: the matcher after its committed output (the prompt is not matched)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, words: int, eos: int, constraint: Constraint | None = None
    ) -> None:
        self.matcher = matcher
        self.words = words
        self.eos = eos
        self.constraint = constraint  # what the matcher was compiled from

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed ``tokens`` (verification only commits what the masks allow)."""
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"committed token {t} breaks the request's grammar: {self.matcher.get_error()}")

    def tree(self, tokens: Sequence[int], parents: Sequence[int]) -> TreeMasks:
        return tree_masks(self.matcher, tokens, parents, self.words, self.eos)

    def chains(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        walked: TreeMasks,
        room: int,
        max_depth: int,
        max_chain: int,
    ) -> dict[int, tuple[tuple[int, ...], np.ndarray]]:
        """:func:`certain_chains` from this state."""
        return certain_chains(self.matcher, tokens, parents, walked, self.eos, room, max_depth, max_chain)

    def after(self, paths: Sequence[Sequence[int]]) -> np.ndarray:
        """:func:`path_masks` from this state.  # [len(paths), W] int32"""
        return path_masks(self.matcher, paths, self.words, self.eos)

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
        state = GrammarState(self._compile(constraint, constraint.kind).deep_copy(), self.words, self.eos, constraint)
        state.advance(output)
        return state


def grammars_for(tokenizer: Tokenizer | None, vocab_size: int, eos_token_id: int | None) -> Grammars | None:
    """The grammars of structured outputs over the LLM's tokenizer (None without a tokenizer or an EOS token:
    constrained requests are then refused)."""
    if tokenizer is None or eos_token_id is None:
        return None
    return Grammars(tokenizer.to_str(), vocab_size, eos_token_id)
