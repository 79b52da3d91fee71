"""Draft vocabularies of draft heads (:mod:`specinfer.models.draft_head`, :mod:`specinfer.training.head_vocab`): the
corpus's commonest tokens, the LM head's rows alone computed for them, drafts only from them, and greedy output
unchanged."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from oracles import hf_greedy  # noqa: E402  tests/oracles.py
from test_stochastic_engine import free_speculation  # noqa: E402  tests/test_stochastic_engine.py

from specinfer.core.errors import InvalidArgument  # noqa: E402
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine  # noqa: E402
from specinfer.models.draft_head import (  # noqa: E402
    DraftHead,
    HeadConfig,
    frequent_tokens,
    load_draft_vocab,
    save_draft_vocab,
    save_head,
)
from specinfer.models.head_drafter import with_head  # noqa: E402
from specinfer.models.loading import eos_token_id, load_backend  # noqa: E402
from specinfer.training.head_vocab import run_head_vocab  # noqa: E402


def test_frequent_tokens_most_frequent_first_ties_by_lower_id():
    stream = torch.tensor([5, 5, 3, 3, 9, 1, 5])
    assert frequent_tokens(stream, 10, 4).tolist() == [5, 3, 1, 9]
    assert frequent_tokens(stream, 10, 7).tolist() == [5, 3, 1, 9, 0, 2, 4]  # unseen tokens by ID
    assert frequent_tokens(stream, 10, 99).tolist() == [5, 3, 1, 9, 0, 2, 4, 6, 7, 8]


@pytest.fixture(scope="module")
def llm(model_pair):
    return load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=1 << 26)


@pytest.mark.parametrize("width", ["narrower", "as wide"])
def test_logits_after_rows_are_the_whole_heads_rows(llm, width):
    """With a draft vocabulary, the LM head after a map gives the same logits at its tokens, in its order, and those
    alone (folded with a narrower map, or applied after a map as wide as the features)."""
    model = llm.runner.model
    feature_dim = llm.feature_dim
    k = feature_dim // 2 if width == "narrower" else feature_dim
    torch.manual_seed(0)
    proj = torch.randn(feature_dim, k) / k**0.5  # [feature_dim, k]
    x = torch.randn(3, k)  # [N, k]
    rows = torch.tensor([0, 7, 11, llm.vocab_size - 1])
    whole = model.logits_after(proj)(x)  # [N, vocab]
    part = model.logits_after(proj, rows)(x)  # [N, K]
    assert part.shape == (3, len(rows)) and part.dtype == torch.float32
    torch.testing.assert_close(part, whole[:, rows], rtol=1e-5, atol=1e-5)


def test_head_with_a_draft_vocabulary_drafts_from_it_and_output_is_plain_decodings(model_pair, llm, tmp_path):
    head_dir = tmp_path / "head"
    demo_head = model_pair.llm.parent / "head"
    if (demo_head / "config.json").is_file():
        shutil.copytree(demo_head, head_dir)
    else:  # exactness does not depend on what the head drafts
        torch.manual_seed(0)
        c = HeadConfig(llm.feature_dim, llm.vocab_size, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64)
        save_head(DraftHead(c), head_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    size = llm.vocab_size // 4
    run_head_vocab(head_dir, model_pair.llm, (corpus,), size)
    vocab = load_draft_vocab(head_dir, llm.vocab_size)
    assert vocab is not None and len(vocab) == size
    allowed = set(vocab.tolist())

    spec = SpeculationConfig(None, ssms=(), suffix=False, head=True)
    engine = SpeculativeEngine(
        with_head(llm, head_dir, model_pair.llm),
        [],
        EngineConfig(eos_token_id=eos_token_id(model_pair.llm)),
        free_speculation(),
    )
    drafted = []
    inner = engine.llm.head.forward_tree_columns  # greedy passes rank the draft vocabulary's columns alone

    def forward_tree_columns(batch):
        drafted.extend(t for item in batch if item.parents[0] >= 0 for t in item.tokens)  # nodes below the roots
        return inner(batch)

    engine.llm.head.forward_tree_columns = forward_tree_columns
    prompts = [tuple(p[:40]) for p in model_pair.prompts[:2]]
    requests = [GenerationRequest(f"v{i}", p, 24, speculation=spec, ignore_eos=True) for i, p in enumerate(prompts)]
    outputs = [list(r.output_tokens) for r in engine.generate(requests)]
    assert outputs == hf_greedy(model_pair.llm, prompts, 24, ignore_eos=True)
    assert drafted, "the head drafted below its roots"
    assert set(drafted) <= allowed


def test_a_draft_vocabulary_outside_the_llms_is_refused(model_pair, llm, tmp_path):
    torch.manual_seed(0)
    c = HeadConfig(llm.feature_dim, llm.vocab_size, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64)
    save_head(DraftHead(c), tmp_path)
    save_draft_vocab(tmp_path, torch.tensor([1, llm.vocab_size]))
    with pytest.raises(InvalidArgument, match=r"head.*token IDs must be distinct"):
        with_head(llm, tmp_path)
    with pytest.raises(InvalidArgument, match="draft-vocab"):
        run_head_vocab(tmp_path, model_pair.llm, (tmp_path / "config.json",), llm.vocab_size + 1)
