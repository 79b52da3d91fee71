"""Drafts with another tokenizer (token-level intersection): the pure map, tokenizer spellings, the
SSM wrapper against the SSM run directly, and greedy speculative output equal to the LLM's own.

The statistical test of sampling with such a draft is in tests/test_stochastic_engine.py; the services
with one in tests/e2e/test_cross_vocab_stack.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cross_vocab_pair import relabelled_ssm
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import hf_greedy
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from specinfer.checkpoint import token_table, tokenizer_table
from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.vocab_map import TokenTable, VocabMap
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.cross_vocab import CrossVocabularyLM, draft_vocabulary
from specinfer.models.interface import TreeForward
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.training.corpus import train_sentencepiece_style_tokenizer

NEW_TOKENS = 24


def table(*spellings: bytes | None, special: dict[int, str] | None = None, eos: int | None = None) -> TokenTable:
    return TokenTable(tuple(spellings), special or {}, eos)


def test_shared_tokens_pair_by_spelling_special_content_and_eos():
    llm = table(None, None, b"a", b"b", b"ab", b" c", special={0: "<s>", 1: "</s>"}, eos=1)
    ssm = table(b" c", b"ab", None, b"a", None, b"zz", special={2: "<eot>", 4: "<s>"}, eos=2)
    vmap = VocabMap(llm, ssm)
    pairs = dict(zip(vmap.ssm_ids.tolist(), vmap.llm_ids.tolist(), strict=True))
    assert pairs == {0: 5, 1: 4, 3: 2, 2: 1, 4: 0}  # " c", "ab", "a", EOS -> EOS, "<s>" by content
    assert vmap.shared == 5 and vmap.llm_size == 6 and vmap.ssm_size == 6


def test_an_llm_token_the_ssm_lacks_is_spelt_by_greedy_longest_match():
    llm = table(b"abc", b"xyz", b"q", b"", None, eos=None)
    ssm = table(b"a", b"b", b"c", b"ab", b"x", b"yz", None, eos=6)
    vmap = VocabMap(llm, ssm)
    assert vmap.ssm_tokens(0) == (3, 2)  # "ab" + "c"
    assert vmap.ssm_tokens(1) == (4, 5)
    assert vmap.ssm_tokens(2) == (6,)  # no SSM token spells "q": the SSM reads its EOS
    assert vmap.ssm_tokens(3) == (6,) and vmap.ssm_tokens(4) == (6,)
    tokens, ends = vmap.ssm_context([0, 1, 2])
    assert tokens == [3, 2, 4, 5, 6] and ends == [2, 4, 5]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=30, unique=True),
    st.lists(st.binary(min_size=2, max_size=3), max_size=20, unique=True),
    st.lists(st.integers(0, 29), max_size=20),
)
def test_spellings_keep_the_bytes_when_the_ssm_has_every_byte(llm_pieces, ssm_pieces, sequence):
    """Property: with every single byte in the SSM's vocabulary, the SSM spelling of a token sequence
    is the same bytes as the sequence, and the shared tokens are exactly the common spellings."""
    ssm_all = sorted(set(ssm_pieces) | {bytes([b]) for b in range(256)})
    vmap = VocabMap(TokenTable(tuple(llm_pieces)), TokenTable(tuple(ssm_all)))
    seq = [i % len(llm_pieces) for i in sequence]
    tokens, ends = vmap.ssm_context(seq)
    assert b"".join(ssm_all[t] for t in tokens) == b"".join(llm_pieces[i] for i in seq)
    assert len(ends) == len(seq) and (not ends or ends[-1] == len(tokens))
    assert {llm_pieces[t] for t in vmap.llm_ids.tolist()} == set(llm_pieces) & set(ssm_all)
    assert all(ssm_all[s] == llm_pieces[t] for s, t in zip(vmap.ssm_ids.tolist(), vmap.llm_ids.tolist(), strict=True))


TEXTS = ["def f(x):\n    return x  # ünïcödé ✓", "  class  Foo:\tpass\n\n", "print('日本語', 3.14)"]


def test_tokenizer_spellings_are_the_text_bytes(model_pair):
    """Byte-level BPE (the test LLM's) and SentencePiece-style with byte fallback: the spellings of a text's
    tokens, joined, are the text's bytes (special tokens have none)."""
    byte_level = Tokenizer.from_file(str(model_pair.llm / "tokenizer.json"))
    sentencepiece = train_sentencepiece_style_tokenizer(
        [t[:-1] for t in TEXTS] * 20, 556
    )  # the last characters only through byte fallback
    for tok in (byte_level, sentencepiece):
        spellings = tokenizer_table(tok, tok.get_vocab_size(), None).spellings
        for text in TEXTS:
            ids = tok.encode(text).ids
            assert b"".join(spellings[i] for i in ids) == text.encode(), (tok.decoder, text)
    assert any(len(sentencepiece.id_to_token(i)) == 6 for i in sentencepiece.encode(TEXTS[0]).ids), (
        "byte fallback was not exercised"
    )
    specials = tokenizer_table(sentencepiece, sentencepiece.get_vocab_size(), 2)
    assert specials.special == {0: "<s>", 1: "</s>", 2: "<unk>"} and specials.spellings[1] is None


@pytest.fixture(scope="module")
def cross_ssm(model_pair, tmp_path_factory) -> Path:
    return relabelled_ssm(model_pair.llm, model_pair.ssm, tmp_path_factory.mktemp("cross") / "ssm")


def test_draft_vocabulary_picks_the_method_and_refuses_what_it_cannot_map(model_pair, cross_ssm, tmp_path):
    assert draft_vocabulary(model_pair.llm, model_pair.ssm, "ssm") is None  # same tokenizer
    vmap = draft_vocabulary(model_pair.llm, cross_ssm, "ssm")
    assert vmap is not None and 0 < vmap.shared < vmap.ssm_size
    bare = tmp_path / "bare"  # the relabelled SSM without its tokenizer: nothing to map by
    bare.mkdir()
    (bare / "config.json").write_text((cross_ssm / "config.json").read_text())
    with pytest.raises(InvalidArgument, match="tokenizer") as refused:
        draft_vocabulary(model_pair.llm, bare, "ssm")
    assert refused.value.field == "ssm"


def test_the_wrapper_gives_the_ssms_logits_of_the_spelt_tokens(model_pair, cross_ssm):
    """Root, then two depths of a branching tree, then a longer context that accepted a path: each node's
    logits are the SSM's own, run directly on the node's path spelt in SSM tokens, on the shared tokens
    (in LLM IDs), and -inf on the others."""
    vmap = draft_vocabulary(model_pair.llm, cross_ssm, "ssm")
    wrapped = CrossVocabularyLM(load_backend(cross_ssm, "ssm", "float32", backend="native"), vmap)
    hf = AutoModelForCausalLM.from_pretrained(str(cross_ssm), dtype=torch.float32).eval()
    spelt = [t for t in range(3, vmap.llm_size) if len(vmap.ssm_tokens(t)) > 1]
    shared = vmap.llm_ids.tolist()
    context = list(model_pair.prompts[0][:12]) + spelt[:2]
    root = spelt[2]

    def check(ctx, path, row):
        ids = [s for t in [*ctx, *path] for s in vmap.ssm_tokens(t)]
        with torch.inference_mode():
            direct = hf(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(
            row[torch.from_numpy(vmap.llm_ids)], direct[torch.from_numpy(vmap.ssm_ids)], rtol=1e-4, atol=1e-4
        )
        others = torch.ones(vmap.llm_size, dtype=torch.bool)
        others[torch.from_numpy(vmap.llm_ids)] = False
        assert torch.isinf(row[others]).all()

    (root_logits,) = wrapped.forward_tree([TreeForward("r", context, [root], [-1])])
    check(context, [root], root_logits[0])
    a, b = shared[10], spelt[3]  # a shared child and one the SSM must spell with two tokens
    (depth1,) = wrapped.forward_tree([TreeForward("r", context, [a, b], [0, 0])])
    check(context, [root, a], depth1[0])
    check(context, [root, b], depth1[1])
    c = shared[20]
    (depth2,) = wrapped.forward_tree([TreeForward("r", context, [c, c], [1, 2])])
    check(context, [root, a, c], depth2[0])
    check(context, [root, b, c], depth2[1])
    longer = [*context, root, b]  # the verifier accepted root -> b: the SSM's cache adopts that path
    (next_root,) = wrapped.forward_tree([TreeForward("r", longer, [c], [-1])])
    check(longer, [c], next_root[0])
    wrapped.release("r")


def _generate(llm, ssm, prompts, spec, new_tokens=NEW_TOKENS, eos=None):
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos))
    requests = [GenerationRequest(f"p{i}", tuple(p), new_tokens, speculation=spec) for i, p in enumerate(prompts)]
    return engine.generate(requests)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_greedy_with_a_cross_vocabulary_draft_equals_the_llm(model_pair, cross_ssm, backend):
    prompts = model_pair.prompts[:4]
    eos = eos_token_id(model_pair.llm)
    expected = hf_greedy(model_pair.llm, prompts, NEW_TOKENS)
    llm = load_backend(model_pair.llm, "llm", "float32", backend=backend)
    ssm = CrossVocabularyLM(
        load_backend(cross_ssm, "ssm", "float32", backend=backend), draft_vocabulary(model_pair.llm, cross_ssm, "ssm")
    )
    for spec in (SpeculationConfig(ExpansionConfig((1, 1, 3, 1, 1)), ssms=(0,)), SpeculationConfig(None, ssms=(0,))):
        results = _generate(llm, ssm, prompts, spec, eos=eos)
        assert [list(r.output_tokens) for r in results] == expected, spec
        # a trained draft is accepted: accepted paths, adopted by the SSM's cache, were exercised
        assert sum(r.mean_accepted * r.llm_steps for r in results) > len(prompts)


def test_a_context_past_the_ssms_positions_moves_its_window(model_pair, tmp_path):
    """An SSM of 40 positions drafting for 70-token sequences reads a window that jumps; output stays exact."""
    short = relabelled_ssm(model_pair.llm, model_pair.ssm, tmp_path / "short", max_positions=40)
    prompts = [p[:30] for p in model_pair.prompts[:2]]
    expected = hf_greedy(model_pair.llm, prompts, 40, ignore_eos=True)
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native")
    ssm = CrossVocabularyLM(
        load_backend(short, "ssm", "float32", backend="native"), draft_vocabulary(model_pair.llm, short, "ssm")
    )
    engine = SpeculativeEngine(llm, [ssm], EngineConfig())
    spec = SpeculationConfig(ExpansionConfig((2, 1, 1)), ssms=(0,))
    results = engine.generate(
        [GenerationRequest(f"w{i}", tuple(p), 40, speculation=spec, ignore_eos=True) for i, p in enumerate(prompts)]
    )
    assert [list(r.output_tokens) for r in results] == expected
    assert ssm.max_positions > 70


def test_cli_generate_accepts_a_draft_with_another_tokenizer(model_pair, cross_ssm, capsys):
    from specinfer.cli import main

    assert (
        main(["generate", "--llm", str(model_pair.llm), "--ssm", str(cross_ssm), "--max-new-tokens", "8", "def main("])
        == 0
    )
    out = capsys.readouterr().out
    assert "another tokenizer" in out and "tokens/step" in out


def test_token_table_reads_the_checkpoint(model_pair, cross_ssm):
    llm, ssm = token_table(model_pair.llm), token_table(cross_ssm)
    assert llm.size == 4096
    assert ssm.eos is not None and ssm.special[ssm.eos] == llm.special[llm.eos]
