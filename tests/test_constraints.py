"""The grammar over a token tree (specinfer.core.constraints) against a brute-force walk: every node's path
replayed on a fresh matcher; the grammar's certain tokens below a tree's leaves likewise, and as draft groups
that MSS always accepts. No torch: the demo LLM's tokenizer.json alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.core import DraftGroup, DraftTree, InvalidArgument, SparseDist, TokenTree
from specinfer.core.constraints import Constraint, Grammars, GrammarState, allowed_tokens, allows, certain_token, only
from specinfer.core.tree import node_depths, path_below_root
from specinfer.core.verify import verify_stochastic

TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "demo" / "llm" / "tokenizer.json"
VOCAB, EOS = 4096, 1
REGEX = Constraint("regex", "(ab|cd)+x")
SCHEMA = Constraint(
    "json_schema",
    '{"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},'
    ' "required": ["n", "ok"], "additionalProperties": false}',
)


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOKENIZER.read_text(), VOCAB, EOS)


def _pieces(grammars: Grammars, texts: list[str]) -> list[int]:
    return sorted({t for s in texts for t in grammars.tokenizer.tokenize_str(s)} | {EOS})


def _brute(grammars: Grammars, constraint: Constraint, output: list[int], tokens, parents):
    """Each node's (reachable, mask) by replaying its path from scratch."""
    out = []
    for u in range(len(tokens)):
        state = grammars.state(constraint, output)
        path = path_below_root(tokens, parents, u)
        ok = True
        for i, t in enumerate(path):
            if not allows(state.mask(), t) or (t == EOS and i < len(path) - 1):
                ok = False
                break
            if t != EOS:
                state.advance([t])
        if not ok:
            out.append((False, None))
        elif path and path[-1] == EOS:
            out.append((True, only(EOS, grammars.words)))
        else:
            out.append((True, state.mask()))
    return out


@st.composite
def trees(draw, pieces: list[int]):
    n = draw(st.integers(1, 14))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [0] + [draw(st.sampled_from(pieces)) for _ in range(1, n)]
    return tokens, parents


@pytest.mark.parametrize(
    "constraint, texts, prefix",
    [
        (REGEX, ["ab", "cd", "abcd", "x", "abx", "a", "b", "c", "d"], ""),
        (SCHEMA, ['{"n":12,"ok":true}', "false", "1", "}", ",", '"', " "], '{"n":1'),
    ],
)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tree_masks_match_a_brute_force_walk(grammars, constraint, texts, prefix, data):
    pieces = _pieces(grammars, texts)
    output = grammars.tokenizer.tokenize_str(prefix) if prefix else []
    tokens, parents = data.draw(trees(pieces))
    state = grammars.state(constraint, output)
    got = state.tree(tokens, parents)
    for u, (ok, mask) in enumerate(_brute(grammars, constraint, output, tokens, parents)):
        assert got.reachable[u] == ok, (u, tokens, parents)
        if ok:
            np.testing.assert_array_equal(got.masks[u], mask)
    # the walk leaves the state where it was
    np.testing.assert_array_equal(state.mask(), grammars.state(constraint, output).mask())


def test_eos_only_where_the_grammar_can_end(grammars):
    state = grammars.state(REGEX)
    assert not allows(state.mask(), EOS)
    state.advance(grammars.tokenizer.tokenize_str("abcd"))
    assert not allows(state.mask(), EOS)
    state.advance(grammars.tokenizer.tokenize_str("x"))
    assert state.complete
    assert allowed_tokens(state.mask(), VOCAB).tolist() == [EOS]  # complete: EOS alone


def test_invalid_constraints_name_their_field(grammars):
    for constraint, field in [
        (Constraint("json_schema", '{"type": "foo"}'), "response_format"),
        (Constraint("json_schema", "{not json"), "json_schema"),
        (Constraint("regex", "(ab"), "regex"),
        (Constraint("grammar", "start: undefined_rule"), "grammar"),
        (Constraint("regex", ""), "regex"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            grammars.check(constraint, field)
        assert err.value.field == field
    with pytest.raises(InvalidArgument):
        Constraint("xml", "")
    grammars.check(Constraint("grammar", 'root ::= "a" [0-9]+'))  # GBNF is taken too
    grammars.check(Constraint("json_object"))


def test_a_committed_token_the_grammar_forbids_is_a_bug(grammars):
    state = grammars.state(REGEX)
    with pytest.raises(RuntimeError):
        state.advance(grammars.tokenizer.tokenize_str("x"))


def _replayed(grammars: Grammars, constraint: Constraint, output: list[int], path: list[int]) -> GrammarState:
    state = grammars.state(constraint, output)
    state.advance(path)
    return state


@pytest.mark.parametrize(
    "constraint, texts, prefix",
    [
        (REGEX, ["ab", "cd", "abcd", "x", "abx", "a", "b", "c", "d"], ""),
        (SCHEMA, ['{"n":12,"ok":true}', "false", "1", "}", ",", '"', " ", ", ", '"ok"'], ""),
        (SCHEMA, ['{"n":12,"ok":true}', "false", "1", "}", ",", '"', " ", ", ", '"ok"'], '{"n":1'),
    ],
)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_certain_chains_are_the_grammars_only_tokens(grammars, constraint, texts, prefix, data):
    """Below every leaf of the reachable tree, the chain is each token the grammar allows alone after the path
    so far, with the mask after it, up to the bounds; the walk leaves the state where it was."""
    pieces = _pieces(grammars, texts)
    output = grammars.tokenizer.tokenize_str(prefix) if prefix else []
    tokens, parents = data.draw(trees(pieces))
    room, max_depth, max_chain = (
        data.draw(st.integers(0, 40)),
        data.draw(st.integers(0, 30)),
        data.draw(st.integers(0, 16)),
    )
    state = grammars.state(constraint, output)
    walked = state.tree(tokens, parents)
    chains = state.chains(tokens, parents, walked, room, max_depth, max_chain)
    np.testing.assert_array_equal(state.mask(), grammars.state(constraint, output).mask())
    assert sum(len(chain) for chain, _ in chains.values()) <= room
    depths = node_depths(parents)
    leaves = {u for u in walked.kept if not any(walked.reachable[c] and parents[c] == u for c in range(len(tokens)))}
    assert set(chains) <= leaves
    for u in leaves:
        chain, masks = chains.get(u, ((), np.zeros((0, grammars.words), dtype=np.int32)))
        assert len(chain) <= min(max_chain, max(0, max_depth - int(depths[u])))
        replay = _replayed(grammars, constraint, output, path_below_root(tokens, parents, u))
        for t, mask in zip(chain, masks, strict=True):
            assert certain_token(replay.mask()) == t != EOS
            replay.advance([t])
            np.testing.assert_array_equal(mask, replay.mask())
        # the chain stops where the grammar allows several tokens (or EOS), or at a bound
        bounded = len(chain) == max_chain or int(depths[u]) + len(chain) >= max_depth
        if not bounded and sum(len(c) for c, _ in chains.values()) < room:
            assert certain_token(replay.mask()) in (None, EOS)


def test_a_fixed_schema_has_long_certain_chains(grammars):
    """A schema's keys and punctuation are certain: from the start, '{"n":' is one chain (the space after it is
    not: this tokenizer has tokens of a space and digits)."""
    state = grammars.state(SCHEMA)
    walked = state.tree([0], [-1])
    chains = state.chains([0], [-1], walked, room=64, max_depth=64, max_chain=16)
    chain, _ = chains[0]
    assert grammars.tokenizer.decode_str(list(chain)) == '{"n":'
    assert certain_token(only(7, grammars.words)) == 7
    assert certain_token(np.zeros(grammars.words, dtype=np.int32)) is None
    row = only(7, grammars.words)
    row[0] |= 1
    assert certain_token(row) is None


def test_chains_extend_a_draft_tree_as_certain_groups():
    q = SparseDist(np.array([5, 6]), np.array([0.75, 0.25]))
    draft = DraftTree(TokenTree((1, 5, 6), (-1, 0, 0)), (DraftGroup(0, (1, 2), q),), (1.0, 0.5, 0.2))
    longer = draft.with_chains({2: (9, 10), 0: (11,)})
    assert longer.tree.tokens == (1, 5, 6, 9, 10, 11)
    assert longer.tree.parents == (-1, 0, 0, 2, 3, 0)
    assert longer.scores == (1.0, 0.5, 0.2, 0.2, 0.2, 1.0)
    assert longer.groups[0] == draft.groups[0]
    assert [(g.parent, g.children, g.q.tokens.tolist(), g.q.probs.tolist()) for g in longer.groups[1:]] == [
        (2, (3,), [9], [1.0]),
        (3, (4,), [10], [1.0]),
        (0, (5,), [11], [1.0]),
    ]
    with pytest.raises(ValueError):
        draft.with_chains({0: (6,)})  # a chain may not repeat a child


@pytest.mark.parametrize("seed", range(20))
def test_mss_always_accepts_a_certain_token(seed):
    """Under MSS a certain token's try accepts with p(x)/q(x) = 1/1, also after forbidden siblings drawn from a
    draft distribution were rejected: their residual max(0, p - q) keeps all of p on the certain token."""
    rng = np.random.default_rng(seed)
    vocab, certain_id = 16, 3
    drafted = SparseDist(np.array([4, 5, 3]), np.array([0.5, 0.3, 0.2]))
    draft = DraftTree(TokenTree((0, 4, 5), (-1, 0, 0)), (DraftGroup(0, (1, 2), drafted),)).with_chains(
        {0: (certain_id, 8)}
    )
    p = np.zeros(vocab)
    p[certain_id] = 1.0  # the masked distribution at the root: the grammar allows 3 alone
    after = np.zeros(vocab)
    after[8] = 1.0
    rest = np.full(vocab, 1.0 / vocab)

    def target(u: int) -> np.ndarray:
        return {0: p, 3: after}.get(u, rest)

    result = verify_stochastic(draft, target, rng)
    assert result.accepted_tokens == (certain_id, 8)
