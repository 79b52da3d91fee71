"""The newer Llama-shaped families on the native backend end to end: greedy speculative output
(native LLM verifying a native draft's trees) equals transformers' greedy ``generate`` (fp32), and
what the native blocks cannot follow is refused rather than run wrong.

Per-step logits against transformers are in ``tests/test_native.py``, TP=2 against one process in
``tests/parallel/test_parallel_logits.py``; each uses the same real config shapes in miniature.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracles import hf_greedy
from rope_configs import LONGROPE_SWITCH, PARTIAL_ROPE, PHI3_LONGROPE, llama3_rope
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen3Config

from specinfer.core import ExpansionConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.interface import TreeForward
from specinfer.models.loading import eos_token_id
from specinfer.models.native import ModelSpec, NativeBackend, NativeOptions, UnsupportedModel

VOCAB = 128
NEW_TOKENS = 16
TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256, **TOKENS)


def _configs():
    return {
        "qwen3": Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
        # Llama 3.2's RoPE scaling (factor 32)
        "llama3.2-tied": LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=llama3_rope(32.0)),
        "phi3-longrope": Phi3Config(**COMMON, num_key_value_heads=4, original_max_position_embeddings=LONGROPE_SWITCH, rope_parameters=PHI3_LONGROPE),
        "phi3-partial-rope": Phi3Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=PARTIAL_ROPE),
    }


def _save_pair(config, out: Path) -> tuple[Path, Path]:
    """A random LLM of ``config`` (logits scaled up so its next-token distributions are peaked, like
    :func:`specinfer.models.tiny.tiny_llama`'s) and its draft: the same model cut to its first layer."""
    torch.manual_seed(0)
    llm = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in llm.named_parameters():
            if "norm" in name:  # non-trivial norms, so a forgotten one shows
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2 and "embed" not in name:  # layers that outweigh the token's own embedding in the residual
                p.normal_(0.0, p.shape[1] ** -0.5)
        # peaked through the final norm, not the embeddings: tied ones would scale the residual's
        # copy of the last token too, and the model would mostly repeat it
        llm.model.norm.weight.mul_(20.0)
    small_config = AutoConfig.for_model(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": None})
    ssm = AutoModelForCausalLM.from_config(small_config).eval()
    ssm.load_state_dict({k: v for k, v in llm.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 1})
    llm.save_pretrained(out / "llm")
    ssm.save_pretrained(out / "ssm")
    return out / "llm", out / "ssm"


@pytest.fixture(scope="module", params=list(_configs()))
def family(request, tmp_path_factory):
    """Prompts, transformers' greedy continuations, and an engine of native backends: the LLM and two
    drafts, the one-layer cut (often rejected) and the LLM itself (always accepted: deep trees verified)."""
    llm, ssm = _save_pair(_configs()[request.param], tmp_path_factory.mktemp(request.param))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 30)]
    options = NativeOptions(kv_cache_bytes=1 << 24, attention="torch", gemm="linear")
    models = [NativeBackend.load(p, options) for p in (llm, ssm, llm)]
    engine = SpeculativeEngine(models[0], models[1:], EngineConfig(eos_token_id=eos_token_id(llm)))
    return prompts, hf_greedy(llm, prompts, NEW_TOKENS), engine


@pytest.mark.parametrize("expansion", ["1,1,1,1", "2,2,1"])
@pytest.mark.parametrize("ssm", [0, 1])
def test_greedy_speculation_equals_transformers(family, expansion, ssm):
    prompts, expected, engine = family
    spec = SpeculationConfig(ExpansionConfig.parse(expansion), ssms=(ssm,))
    requests = [GenerationRequest(f"{expansion}-{ssm}-{i}", tuple(p), NEW_TOKENS, speculation=spec) for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    assert [r.output_tokens for r in results] == expected
    if ssm == 1:
        assert sum(len(r.output_tokens) for r in results) > sum(r.llm_steps for r in results)  # trees were accepted
    assert not engine.llm.cached_requests()


def test_longrope_runs_only_up_to_its_switch(tmp_path):
    """Past ``original_max_position_embeddings`` transformers recomputes every position with the long
    factors; the native backend stops there instead of mixing short- and long-factor keys."""
    llm, _ = _save_pair(_configs()["phi3-longrope"], tmp_path)
    assert ModelSpec.from_dir(llm).positions_limit == LONGROPE_SWITCH
    native = NativeBackend.load(llm, NativeOptions(kv_cache_bytes=1 << 22, attention="torch", gemm="linear"))
    assert native.max_positions == LONGROPE_SWITCH
    with pytest.raises(ValueError, match="KV rows"):
        native.forward_tree([TreeForward("long", list(range(3, 3 + LONGROPE_SWITCH + 1)), [3], [-1])])


def test_qwen3_mixed_sliding_layers_are_refused():
    """Qwen3 with ``use_sliding_window`` windows only its upper layers: per-layer windows are not in the kernel yet."""
    config = Qwen3Config(**COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    with pytest.raises(UnsupportedModel, match="mixed sliding/full"):
        ModelSpec.from_config(config.to_dict())


def test_llama_with_mlp_biases_is_refused():
    """Native Llama blocks have no MLP biases: a config with them goes to the reference backend instead of losing them."""
    config = LlamaConfig(**COMMON, mlp_bias=True)
    with pytest.raises(UnsupportedModel, match="mlp_bias"):
        ModelSpec.from_config(config.to_dict())


def test_phi3_config_of_the_older_layout():
    """Phi-3's hub configs from before transformers 5: ``rope_scaling`` with the LongRoPE factors and
    ``original_max_position_embeddings`` at the top level; Phi-4-mini's ``partial_rotary_factor`` there too."""
    factors = [1.0] * 48
    phi3 = {
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": factors, "long_factor": factors},
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "hidden_act": "silu",
    }
    spec = ModelSpec.from_config(phi3)
    assert (spec.rope_type, spec.rope_switch, spec.positions_limit, spec.rotary_dim) == ("longrope", 4096, 4096, 96)
    phi4_mini = {**phi3, "rope_scaling": None, "partial_rotary_factor": 0.75, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8}
    spec = ModelSpec.from_config(phi4_mini)
    assert (spec.rope_type, spec.rope_switch, spec.positions_limit, spec.head_dim, spec.rotary_dim) == ("default", None, 131072, 128, 96)
