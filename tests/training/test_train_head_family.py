"""specinfer train-head on an LLM of a family it has not seen in any other test (issue 37 acceptance): the demo
LLM rewritten as a Qwen2 checkpoint (q/k/v biases, Qwen2's config keys and model type), a head trained for it
end to end from the CLI, and drafting with that head beats drafting with an SSM cut from the same LLM (its
first layer) in tokens per LLM step on the same prompts, greedy output unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from oracles import hf_greedy  # noqa: E402  tests/oracles.py
from test_stochastic_engine import free_speculation  # noqa: E402  tests/test_stochastic_engine.py

from specinfer.cli import main  # noqa: E402
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine  # noqa: E402
from specinfer.models.head_drafter import with_head  # noqa: E402
from specinfer.models.loading import load_backend  # noqa: E402
from specinfer.training.corpus import stdlib_dir  # noqa: E402

DEMO_LLM = Path(__file__).resolve().parents[2] / "models/demo/llm"
CORPUS = stdlib_dir() / "json"
NEW_TOKENS = 24


def _qwen2(path: Path, layers: int) -> None:
    """The demo LLM as a Qwen2 checkpoint at ``path`` (zero q/k/v biases: the same function, another family's
    format and config keys) with its first ``layers`` layers, and the demo tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(DEMO_LLM, dtype=torch.float32)
    c = llama.config
    config = Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True, rms_norm_eps=c.rms_norm_eps,
        rope_theta=10000.0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_() if name.endswith("bias") else p.copy_(llama.state_dict()[name])
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_LLM / name, path / name)


@pytest.mark.skipif(not (DEMO_LLM / "tokenizer.json").is_file(), reason="no demo tokenizer")
def test_a_head_trained_for_an_unseen_family_beats_its_ssm(tmp_path, model_pair):
    _qwen2(tmp_path / "llm", 4)
    _qwen2(tmp_path / "ssm", 1)  # an SSM cut from the same LLM: its first layer
    code = main(
        ["train-head", "--llm", str(tmp_path / "llm"), "--corpus", str(CORPUS), "--out", str(tmp_path / "head"),
         "--steps", "150", "--batch-size", "4", "--seq-len", "64", "--threads", "2", "--log-every", "150",
         "--heldout-windows", "2", "--lr", "3e-3"]
    )  # fmt: skip
    assert code == 0
    prompts = [tuple(p[:32]) for p in model_pair.prompts[:4]]
    expected = hf_greedy(tmp_path / "llm", prompts, NEW_TOKENS, ignore_eos=True)
    llm = with_head(
        load_backend(tmp_path / "llm", "llm", "float32", backend="native"), tmp_path / "head", tmp_path / "llm"
    )
    ssm = load_backend(tmp_path / "ssm", "ssm", "float32", backend="native")
    # verify tokens and SSM passes almost free: every plan drafts its most nodes, so tokens per step measure
    # the drafts alone, not what the cost model thinks of this tiny model
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(), free_speculation())
    per_step = {}
    for name, spec in {
        "ssm": SpeculationConfig(None, ssms=(0,), suffix=False, head=False),
        "head": SpeculationConfig(None, ssms=(), suffix=False, head=True),
    }.items():
        requests = [GenerationRequest(f"{name}-{i}", p, NEW_TOKENS, speculation=spec, ignore_eos=True)
                    for i, p in enumerate(prompts)]  # fmt: skip
        results = engine.generate(requests)
        assert [list(r.output_tokens) for r in results] == expected, name
        per_step[name] = sum(len(r.output_tokens) for r in results) / sum(r.llm_steps for r in results)
    assert per_step["head"] > per_step["ssm"], per_step
