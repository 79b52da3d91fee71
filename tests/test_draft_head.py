"""Draft heads (:mod:`specinfer.models.draft_head`) and the LLM features they read
(:meth:`NativeBackend.forward_tree_features`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specinfer.models.draft_head import DraftHead, HeadConfig, is_head_dir, load_head, save_head  # noqa: E402
from specinfer.models.interface import TreeForward  # noqa: E402
from specinfer.models.native.backend import NativeBackend, NativeOptions  # noqa: E402

# gemm pinned: "auto" times each product's forms at load, and two loads (compared bit for bit below) could pick
# different ones on a busy machine; CI failed so
OPTIONS = NativeOptions(dtype=torch.float32, kv_cache_bytes=64 << 20, max_seq_len=512, gemm="linear")


@pytest.fixture(scope="module")
def llm(model_pair):
    return NativeBackend.load(model_pair.llm, OPTIONS)


def test_features_are_what_the_lm_head_reads(llm, model_pair):
    """Features of a chain then tree nodes: the LM head on the nodes' features gives forward_tree's logits
    exactly, and the chain's features are the chain's positions (the same as a fresh cache computing them)."""
    context = model_pair.prompts[0][:30]
    logits, features = llm.forward_tree_features([TreeForward("f", context, [7, 8, 9], [-1, 0, 0])])
    assert features[0].shape == (len(context) + 3, llm.feature_dim)
    assert torch.equal(llm.lm_logits(features[0][-3:]), logits[0])
    plain = NativeBackend.load(model_pair.llm, OPTIONS).forward_tree([TreeForward("f", context, [7, 8, 9], [-1, 0, 0])])
    assert torch.equal(plain[0], logits[0])
    # the last context token's feature predicts the root: its logits are a one-token forward's on the context
    last = NativeBackend.load(model_pair.llm, OPTIONS).forward_tree(
        [TreeForward("g", context[:-1], [context[-1]], [-1])]
    )[0]
    torch.testing.assert_close(llm.lm_logits(features[0][len(context) - 1 : len(context)]), last)
    # a cache that holds the context computes the new nodes alone
    _, again = llm.forward_tree_features([TreeForward("f", [*context, 7], [8], [-1])])
    assert again[0].shape == (1, llm.feature_dim)


@pytest.mark.parametrize("width", [8, 512])
def test_lm_logits_after_a_map_into_features(llm, width):
    """The LM head after a linear map into features, folded into one product where the map's input is narrower
    than a feature (a draft head's width): the logits of the mapped rows, up to rounding."""
    torch.manual_seed(0)
    proj = torch.randn(llm.feature_dim, width) / width**0.5  # [feature_dim, width]
    x = torch.randn(5, width)
    torch.testing.assert_close(llm.lm_logits_after(proj)(x), llm.lm_logits(x @ proj.T), atol=1e-4, rtol=1e-4)


def _tiny_head(feature_dim: int = 32, vocab: int = 50) -> DraftHead:
    torch.manual_seed(0)
    head = DraftHead(HeadConfig(feature_dim, vocab, hidden=24, heads=4, kv_heads=2, head_dim=6, intermediate=40))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return head


def test_head_forward_equals_its_step_by_step_parts():
    """Training's causal forward and drafting's parts (keys/values, an attention the caller masks, finish)
    compute the same predictions."""
    head = _tiny_head()
    features, embeds = torch.randn(1, 7, 32), torch.randn(1, 7, 32)
    whole = head(features, embeds)[0]  # [7, 32]
    x = head.inputs(features[0], embeds[0])
    q, k, v = head.keys_values(x, torch.arange(7), 7)
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))  # 2 query heads per kv head
    scores = torch.einsum("qhd,khd->hqk", q, k) / 6**0.5
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(head.finish(x, attended), whole)


def test_save_and_load(tmp_path):
    head = _tiny_head()
    save_head(head, tmp_path / "h", {"trained_steps": 3})
    assert is_head_dir(tmp_path / "h") and not is_head_dir(tmp_path)
    loaded = load_head(tmp_path / "h")
    assert loaded.config == head.config
    features, embeds = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    torch.testing.assert_close(loaded(features, embeds), head(features, embeds))
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm/config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not a draft head"):
        load_head(tmp_path / "llm")
