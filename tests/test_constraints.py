"""The grammar over a token tree (specinfer.core.constraints) against a brute-force walk: every node's path
replayed on a fresh matcher. No torch: the demo LLM's tokenizer.json alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.core import InvalidArgument
from specinfer.core.constraints import Constraint, Grammars, allowed_tokens, allows, only
from specinfer.core.tree import path_below_root

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
