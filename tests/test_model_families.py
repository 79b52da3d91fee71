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
from devices import on_test_device  # tests/devices.py
from oracles import hf_greedy
from rope_configs import GEMMA3_ROPE, LONGROPE_SWITCH, PARTIAL_ROPE, PHI3_LONGROPE, gemma3_multimodal, llama3_rope
from test_stochastic_engine import free_speculation  # tests/test_stochastic_engine.py
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen3Config,
)

from specinfer.core import ExpansionConfig
from specinfer.core.head_gate import HeadGateConfig
from specinfer.core.planner import PlannerConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.draft_head import DraftHead, HeadConfig, save_head
from specinfer.models.head_drafter import with_head
from specinfer.models.interface import TreeForward
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.models.native import ModelSpec, NativeBackend, NativeOptions, UnsupportedModel
from specinfer.models.native.families.registry import FAMILIES, family_of

MODELS_DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
VOCAB = 128
NEW_TOKENS = 16
TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    **TOKENS,
)
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]  # Gemma 3 has 5 local : 1 global


def _configs():
    return {
        "qwen3": Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
        # Llama 3.2's RoPE scaling (factor 32)
        "llama3.2-tied": LlamaConfig(
            **COMMON, num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=llama3_rope(32.0)
        ),
        "phi3-longrope": Phi3Config(
            **COMMON,
            num_key_value_heads=4,
            original_max_position_embeddings=LONGROPE_SWITCH,
            rope_parameters=PHI3_LONGROPE,
        ),
        "phi3-partial-rope": Phi3Config(
            **COMMON, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=PARTIAL_ROPE
        ),
        # Gemma 2: local/global layers alternating (window 6, inside the prompts), the real soft-caps,
        # query_pre_attn_scalar
        "gemma2": Gemma2Config(
            **COMMON, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6
        ),
        # Gemma 3 1B's shape: 1 KV head, q/k norms, local RoPE base 10k, global 1M
        "gemma3": Gemma3TextConfig(
            **COMMON,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=5,
            layer_types=GEMMA3_LAYERS,
        ),
        # Gemma 3 4B+: the multimodal checkpoint, linear RoPE scaling on the global layers
        "gemma3-multimodal": gemma3_multimodal(
            Gemma3TextConfig(
                **COMMON,
                num_key_value_heads=2,
                head_dim=16,
                sliding_window=6,
                layer_types=GEMMA3_LAYERS,
                rope_parameters=GEMMA3_ROPE,
            )
        ),
        # Mistral past its window (6): the kernel masks, the cache keeps every key
        "mistral-window": MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=6),
    }


def _save_pair(config, out: Path) -> tuple[Path, Path]:
    """A random LLM of ``config`` (logits scaled up so its next-token distributions are peaked, like
    :func:`specinfer.models.tiny.tiny_llama`'s) and its draft: the same model cut to its first layer."""
    torch.manual_seed(0)
    llm = AutoModelForCausalLM.from_config(config).eval()
    decoder = llm.get_decoder()  # the text model (gemma3: beside the vision tower)
    with torch.no_grad():
        for name, p in llm.named_parameters():
            if "norm" in name:  # non-trivial norms, so a forgotten one shows
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2 and "embed" not in name:  # layers that outweigh the token's own embedding in the residual
                p.normal_(0.0, p.shape[1] ** -0.5)
        # peaked through the final norm, not the embeddings: tied ones would scale the residual's
        # copy of the last token too, and the model would mostly repeat it
        if config.model_type.startswith("gemma"):  # Gemma norms multiply by 1 + weight
            decoder.norm.weight.copy_((1.0 + decoder.norm.weight) * 20.0 - 1.0)
        else:
            decoder.norm.weight.mul_(20.0)
    layers = {module: name for name, module in llm.named_modules()}[
        decoder.layers
    ] + "."  # "model.layers." or "model.language_model.layers."
    text = dict(num_hidden_layers=1, layer_types=None)
    small = config.to_dict()
    small.update({"text_config": {**small["text_config"], **text}} if "text_config" in small else text)
    ssm = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small)).eval()
    ssm.load_state_dict(
        {
            k: v
            for k, v in llm.state_dict().items()
            if not k.startswith(layers) or int(k[len(layers) :].split(".")[0]) < 1
        }
    )
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
    options = on_test_device(NativeOptions(kv_cache_bytes=1 << 24, attention="torch", gemm="linear"))
    models = [NativeBackend.load(p, options) for p in (llm, ssm, llm)]
    engine = SpeculativeEngine(models[0], models[1:], EngineConfig(eos_token_id=eos_token_id(llm)))
    return prompts, hf_greedy(llm, prompts, NEW_TOKENS), engine


@pytest.mark.parametrize("expansion", ["1,1,1,1", "2,2,1"])
@pytest.mark.parametrize("ssm", [0, 1])
def test_greedy_speculation_equals_transformers(family, expansion, ssm):
    prompts, expected, engine = family
    spec = SpeculationConfig(ExpansionConfig.parse(expansion), ssms=(ssm,))
    requests = [
        GenerationRequest(f"{expansion}-{ssm}-{i}", tuple(p), NEW_TOKENS, speculation=spec)
        for i, p in enumerate(prompts)
    ]
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


def test_qwen_mixed_sliding_layers_get_per_layer_windows():
    """Qwen2/Qwen3 with ``use_sliding_window`` window only the layers from ``max_window_layers`` on, as
    ``layer_types`` says (transformers 5) or, in older configs without it, as transformers derives them;
    a uniform window (Mistral) no longer limits positions. Logits: the qwen3-mixed-window and
    mistral-window checkpoints of tests/test_native.py."""
    config = Qwen3Config(
        **COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=32, max_window_layers=1
    )
    assert ModelSpec.from_config(config.to_dict()).layer_windows == (None, 32, 32)
    older = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    assert ModelSpec.from_config(older).layer_windows == (None, 32, 32)
    assert ModelSpec.from_config({**older, "use_sliding_window": False}).layer_windows == (None, None, None)
    mistral = ModelSpec.from_config(MistralConfig(**COMMON, sliding_window=16).to_dict())
    assert (mistral.layer_windows, mistral.positions_limit) == ((16, 16, 16), 256)


def test_gemma_configs_of_the_hub_layouts():
    """The hub's Gemma config.json files (before transformers 5): Gemma 2 2B (no layer_types: local
    and global alternate), Gemma 3 1B (rope_local_base_freq, sliding_window_pattern) and Gemma 3 4B,
    whose text_config names a few fields only and leaves the rest to transformers' defaults."""
    gemma2 = {
        "model_type": "gemma2",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "max_position_embeddings": 8192,
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "vocab_size": 256000,
    }
    spec = ModelSpec.from_config(gemma2)
    assert spec.layer_windows[:4] == (4096, None, 4096, None) and len(spec.layer_windows) == 26
    assert (spec.attn_softcap, spec.final_softcap, spec.query_pre_attn_scalar, spec.qk_norm, spec.tie_embeddings) == (
        50.0,
        30.0,
        256.0,
        False,
        True,
    )
    assert (spec.rope_type, spec.rope_theta, spec.local_rope_theta, spec.positions_limit) == (
        "default",
        10000.0,
        None,
        8192,
    )
    gemma3_1b = {
        "model_type": "gemma3_text",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "vocab_size": 262144,
    }
    spec = ModelSpec.from_config(gemma3_1b)
    assert spec.layer_windows[:6] == (512,) * 5 + (None,) and spec.layer_windows[24:] == (512, 512)
    assert (spec.attn_softcap, spec.final_softcap, spec.qk_norm, spec.kv_heads) == (None, None, True, 1)
    assert (spec.rope_type, spec.rope_theta, spec.local_rope_theta) == ("default", 1e6, 1e4)
    gemma3_4b = {
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    spec = ModelSpec.from_config(gemma3_4b)
    assert (spec.arch, spec.vocab_size, spec.heads, spec.kv_heads, spec.head_dim, spec.layers) == (
        "gemma3",
        262208,
        8,
        4,
        256,
        34,
    )
    assert (spec.rope_type, spec.rope_theta, spec.local_rope_theta, spec.layer_windows[5], spec.layer_windows[6]) == (
        "linear",
        1e6,
        1e4,
        None,
        1024,
    )


def test_gemma_variants_the_native_blocks_do_not_run_are_refused():
    """EmbeddingGemma's bidirectional attention and another MLP activation go to the reference backend."""
    config = Gemma3TextConfig(**COMMON, use_bidirectional_attention=True).to_dict()
    with pytest.raises(UnsupportedModel, match="bidirectional"):
        ModelSpec.from_config(config)
    with pytest.raises(UnsupportedModel, match="hidden_activation"):
        ModelSpec.from_config({**Gemma2Config(**COMMON).to_dict(), "hidden_activation": "gelu"})


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3-multimodal"])
def test_backend_auto_picks_native_for_gemma(name, tmp_path):
    llm, _ = _save_pair(_configs()[name], tmp_path)
    assert isinstance(load_backend(llm, "llm", dtype="float32", kv_cache_bytes=1 << 22), NativeBackend)


def test_llama_with_mlp_biases_is_refused():
    """Native Llama blocks have no MLP biases: a config with them goes to the reference backend instead of losing
    them."""
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
    phi4_mini = {
        **phi3,
        "rope_scaling": None,
        "partial_rotary_factor": 0.75,
        "hidden_size": 3072,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
    }
    spec = ModelSpec.from_config(phi4_mini)
    assert (spec.rope_type, spec.rope_switch, spec.positions_limit, spec.head_dim, spec.rotary_dim) == (
        "default",
        None,
        131072,
        128,
        96,
    )


def test_head_drafts_equal_transformers(family, tmp_path):
    """Every family drafts with a draft head (random: exactness does not depend on what it drafts): its
    features, embedding and LM head (Gemma's scaled embeddings and soft-capped logits included) feed head
    trees that are verified, and greedy output stays transformers'."""
    prompts, expected, engine = family
    llm = engine.llm
    torch.manual_seed(0)
    save_head(DraftHead(HeadConfig(llm.feature_dim, llm.vocab_size, 32, 4, 2, 8, 64)), tmp_path / "head")
    config = EngineConfig(
        eos_token_id=engine.config.eos_token_id, planner=PlannerConfig(head_gate=HeadGateConfig(measure=False))
    )
    with_a_head = SpeculativeEngine(with_head(llm, tmp_path / "head"), [], config, free_speculation())
    spec = SpeculationConfig(None, ssms=(), suffix=False, head=True)
    requests = [GenerationRequest(f"head-{i}", tuple(p), NEW_TOKENS, speculation=spec) for i, p in enumerate(prompts)]
    assert [r.output_tokens for r in with_a_head.generate(requests)] == expected
    assert with_a_head.adaptive.totals.drafter_steps.get("head", 0) > 0, "head trees were verified"
    assert not llm.cached_requests()


def _documented_model_types() -> set[str]:
    """The model_types of docs/models.md's table of the families the native runtime runs."""
    table = MODELS_DOC.read_text().split("## Families", 1)[1].split("\n\n", 2)[1]
    return {row.split("|")[1].strip().strip("`") for row in table.splitlines()[2:]}


def test_the_registry_holds_every_family_the_runtime_supports():
    """Every model_type docs/models.md lists has its family in the registry and nothing else does; each reads
    transformers' default config of its model_type into a spec of that type and answers every question the
    runtime asks of a family."""
    assert set(FAMILIES) == _documented_model_types()
    for model_type, family in FAMILIES.items():
        spec = ModelSpec.from_config(AutoConfig.for_model(model_type).to_dict())
        assert (spec.arch, family.model_type) == (model_type, model_type)
        assert spec.family is family is family_of(model_type)
        assert isinstance(family.rope, bool) and isinstance(family.gated_mlp, bool)
        assert callable(family.weights) and callable(family.blocks)


@pytest.mark.parametrize("model_type", ["mamba", None])
def test_an_unknown_model_type_is_refused_naming_it(model_type):
    """A checkpoint no family runs is refused by the registry with its model_type in the message (the reference
    backend runs it)."""
    with pytest.raises(UnsupportedModel, match=f"model_type {model_type!r} is not one of"):
        ModelSpec.from_config({"model_type": model_type, "vocab_size": VOCAB})
    with pytest.raises(UnsupportedModel, match=repr(model_type)):
        family_of(model_type)
