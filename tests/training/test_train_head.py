"""specinfer train-head / map-head (issue 37): a head trained end to end from the CLI on the demo LLM, resume,
features cached once (--cache-features), a bad flag, and a head mapped onto an inflated copy of a tiny Llama
drafting the same logits there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specinfer.cli import main
from specinfer.models.draft_head import DraftHead, HeadConfig, load_draft_vocab, load_head
from specinfer.models.interface import TreeForward
from specinfer.models.native.backend import NativeBackend, NativeOptions
from specinfer.models.tiny import tiny_llama
from specinfer.training.corpus import stdlib_dir
from specinfer.training.head import Teacher, load_llm, predict
from specinfer.training.head_cache import FeatureCache
from specinfer.training.head_map import map_head

DEMO_LLM = Path(__file__).resolve().parents[2] / "models/demo/llm"
CORPUS = stdlib_dir() / "json"  # a few small stdlib files, present in every CPython
OPTIONS = NativeOptions(dtype=torch.float32, kv_cache_bytes=16 << 20, max_seq_len=64)


def _train(out: Path, steps: int, *extra: str, corpus: Path = CORPUS) -> int:
    return main(
        ["train-head", "--llm", str(DEMO_LLM), "--corpus", str(corpus), "--out", str(out), "--steps", str(steps),
         "--batch-size", "2", "--seq-len", "48", "--log-every", "2", "--heldout-windows", "2", "--threads", "2",
         "--warmup", "2", "--checkpoint-every", "2", "--hidden", "64", "--unroll", "2", "--save-dtype", "float16",
         *extra]
    )  # fmt: skip


@pytest.mark.skipif(not (DEMO_LLM / "config.json").is_file(), reason="no demo LLM")
def test_train_head_from_the_cli_then_resume(tmp_path, capsys):
    out = tmp_path / "head"
    assert _train(out, 3) == 0
    head = load_head(out)
    assert head.config.hidden == 64 and head.config.feature_dim == 256 and head.config.llm.startswith("llama/")
    record = json.loads((out / "training.json").read_text())
    assert record["trained_steps"] == 3 and len(record["losses"]) == 3 and record["resumed_from_step"] == 0
    assert 0.0 <= record["heldout_depth1_accuracy"] <= 1.0 and len(record["accuracy"][0]) == 2  # depths 1 and 2
    config = json.loads((out / "config.json").read_text())
    assert config["trained_steps"] == 3 and config["model_type"] == "specinfer_draft_head"
    assert "held-out depth-1 accuracy" in capsys.readouterr().err
    assert _train(out, 5) == 0  # the checkpoint of step 3 is picked up: two more steps
    record = json.loads((out / "training.json").read_text())
    assert record["resumed_from_step"] == 3 and record["trained_steps"] == 5 and len(record["losses"]) == 5


@pytest.mark.skipif(not (DEMO_LLM / "config.json").is_file(), reason="no demo LLM")
def test_train_head_in_bfloat16_from_a_corpus_of_links(tmp_path):
    """--dtype bfloat16 (the LLM's LM head in bfloat16, the head's features in float32: F.linear refused the mix)
    on a --corpus folder whose subfolders are symbolic links, one of them back up the tree ("no text found")."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "json").symlink_to(CORPUS, target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)
    assert _train(tmp_path / "head", 2, "--dtype", "bfloat16", "--draft-vocab", "300", corpus=corpus) == 0
    record = json.loads((tmp_path / "head/training.json").read_text())
    assert record["trained_steps"] == 2 and all(math.isfinite(x) for x in record["losses"])
    vocab = load_draft_vocab(tmp_path / "head", load_head(tmp_path / "head").config.vocab_size)
    assert vocab is not None and len(vocab) == 300  # --draft-vocab: the corpus's 300 commonest tokens beside the head


@pytest.mark.skipif(not (DEMO_LLM / "config.json").is_file(), reason="no demo LLM")
def test_cached_features_are_the_llms_per_chunk_and_train_without_logits(tmp_path):
    """--cache-features: each chunk's features are the LLM's on that chunk alone, a window's are the cache's at
    its positions; with --kd-weight 0 the steps compute no logits (no accuracy per step), the held-out does."""
    teacher = Teacher(load_llm(DEMO_LLM, "float32", "cpu", 4, 16))
    stream = torch.arange(100)  # distinct tokens: a window's first one is its offset
    cache = FeatureCache.build(teacher, stream, 16, 4)
    assert cache.features.shape == (96, 256) and torch.equal(cache.stream, stream[:96])
    torch.testing.assert_close(cache.features[32:48], teacher.features(stream[32:48][None])[0], atol=1e-5, rtol=0)
    tokens, feats = cache.windows(3, 10, torch.Generator().manual_seed(0))
    for t, f in zip(tokens, feats, strict=True):
        assert torch.equal(t, torch.arange(int(t[0]), int(t[0]) + 10)) and torch.equal(f, cache.features[t])
    assert _train(tmp_path / "head", 2, "--cache-features", "--kd-weight", "0") == 0
    record = json.loads((tmp_path / "head/training.json").read_text())
    assert record["accuracy"] == [[], []] and all(math.isfinite(x) for x in record["losses"])
    assert 0.0 <= record["heldout_depth1_accuracy"] <= 1.0


def test_train_head_without_the_llm_folder_is_a_bad_setting(tmp_path, capsys):
    code = main(["train-head", "--llm", str(tmp_path / "nope"), "--corpus", str(CORPUS), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "llm" in err


def _inflate(small, h: int, big: int):
    """``small`` widened to hidden ``big`` as /work/shared/tools/inflate_llm.py does (heads kept): extra
    residual dims stay zero, readers of the residual get random extra columns, norms w * sqrt(h / H), eps * h / H."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = small.config
    config = LlamaConfig(**{**c.to_dict(), "hidden_size": big, "head_dim": h // c.num_attention_heads,
                            "rms_norm_eps": c.rms_norm_eps * h / big})  # fmt: skip
    torch.manual_seed(1)
    wide = LlamaForCausalLM(config).eval()
    src = small.state_dict()
    with torch.no_grad():
        for name, t in wide.state_dict().items():
            s = src[name]
            if name.endswith("norm.weight"):
                t.fill_(1.0)
                t[:h] = s * math.sqrt(h / big)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                t.zero_()
                t[:h] = s
            else:  # embed_tokens (extra columns zero), q/k/v, gate/up, lm_head (random extra columns)
                t.normal_(std=0.0 if "embed_tokens" in name else 0.02)
                t[:, :h] = s
    return wide


def _features(path: Path, seq: list[int]) -> tuple[NativeBackend, torch.Tensor]:
    llm = NativeBackend.load(path, OPTIONS)
    _, feats = llm.forward_tree_features([TreeForward("r", seq[:-1], [seq[-1]], [-1])])
    return llm, feats[0].clone()


def test_a_mapped_head_drafts_the_same_logits_on_the_inflated_llm(tmp_path):
    small = tiny_llama(vocab_size=97, hidden_size=64, layers=2, heads=4, kv_heads=2, seed=0)
    small.save_pretrained(tmp_path / "small")
    _inflate(small, 64, 128).save_pretrained(tmp_path / "wide")
    torch.manual_seed(0)
    head = DraftHead(HeadConfig(64, 97, hidden=48, heads=4, kv_heads=2, head_dim=12, intermediate=96))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.2 * torch.randn_like(p))
    head.eval()
    mapped = map_head(head, 128)
    assert mapped.config.feature_dim == 128 and mapped.config.norm_eps == pytest.approx(head.config.norm_eps / 2)
    seq = torch.randint(3, 97, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    (a, fa), (b, fb) = _features(tmp_path / "small", seq), _features(tmp_path / "wide", seq)
    torch.testing.assert_close(fb[:, :64], fa, atol=1e-4, rtol=1e-4)
    assert torch.equal(fb[:, 64:], torch.zeros_like(fb[:, 64:]))  # the inflation's features: the small ones padded
    tokens = torch.tensor(seq[1:])
    with torch.no_grad():
        for depth, (pa, pb) in enumerate(
            zip(predict(head, fa[None, :-1], a.embed_rows(tokens)[None], 2),
                predict(mapped, fb[None, :-1], b.embed_rows(tokens)[None], 2), strict=True)
        ):  # fmt: skip
            assert pb.abs()[..., 64:].max() == 0, depth
            torch.testing.assert_close(b.lm_logits(pb[0]), a.lm_logits(pa[0]), atol=1e-4, rtol=1e-4)
