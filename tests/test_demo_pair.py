"""The bundled demo pair (models/demo, trained by `specinfer train-demo`): small enough to commit,
float16, one tokenizer, exact speculation with its three SSMs merged (in-process and through the
services), and Python-like text."""

from __future__ import annotations

import json
import keyword
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from specinfer.checkpoint import load_tokenizer
from specinfer.cli import BUNDLED_PAIR
from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.loading import load_backend

MODELS = ("llm", "ssm", "ssm-1", "ssm-2")
PAPER_TREE = ExpansionConfig.parse(PAPER_EXPANSION)
PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef read_config(path):\n    ",
]

pytestmark = pytest.mark.skipif(
    not (BUNDLED_PAIR / "llm/config.json").is_file(), reason="models/demo is not in this checkout"
)


def test_bundled_files_are_small_float16_and_share_one_tokenizer():
    files = [f for f in BUNDLED_PAIR.rglob("*") if f.is_file() and "_work" not in f.parts]
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20
    tokenizers = {(BUNDLED_PAIR / m / "tokenizer.json").read_bytes() for m in MODELS}
    assert len(tokenizers) == 1
    for m in MODELS:
        with safe_open(str(BUNDLED_PAIR / m / "model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}, m  # noqa: SIM118 (safe_open has no __iter__)
    report = json.loads((BUNDLED_PAIR / "train_report.json").read_text())
    assert report["recipe"] == "specinfer train-demo" and report["seconds"]["total"] < 40 * 60
    assert len((BUNDLED_PAIR / "prompts.jsonl").read_text().splitlines()) == 200


@pytest.fixture(scope="module")
def greedy_reference():
    """transformers' greedy continuation of each prompt with the demo LLM."""
    tok = load_tokenizer(BUNDLED_PAIR / "llm")
    hf = AutoModelForCausalLM.from_pretrained(str(BUNDLED_PAIR / "llm"), dtype=torch.float32)
    out = {}
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok.encode(p).ids
            gen = hf.generate(
                torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=1
            )
            out[p] = (ids, gen[0, len(ids) :].tolist())
    return out


def test_merged_boosted_ssms_are_exact_and_text_is_python_like(greedy_reference):
    llm = load_backend(BUNDLED_PAIR / "llm", "llm", "float32")
    ssms = [load_backend(BUNDLED_PAIR / m, m, "float32") for m in MODELS[1:]]
    engine = SpeculativeEngine(llm, ssms, EngineConfig(eos_token_id=None))
    tok = load_tokenizer(BUNDLED_PAIR / "llm")
    for ssm_ids in ((0,), (0, 1), (0, 1, 2)):
        spec = SpeculationConfig(PAPER_TREE, ssm_ids)
        reqs = [
            GenerationRequest(f"r{i}", tuple(ids), 48, SamplingParams(), spec, ignore_eos=True)
            for i, (ids, _) in enumerate(greedy_reference.values())
        ]
        results = engine.generate(reqs)
        for res, (prompt, (_, want)) in zip(results, greedy_reference.items(), strict=True):
            assert list(res.output_tokens) == want, (ssm_ids, prompt)
        assert sum(len(r.output_tokens) for r in results) / sum(len(r.steps) for r in results) > 2.0
    text = "".join(tok.decode(want) for _, want in greedy_reference.values())
    assert text.isascii() and sum(c.isprintable() or c in "\n\t" for c in text) == len(text)
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert len(words & set(keyword.kwlist)) >= 3, text  # Python keywords, not byte noise


def test_services_merge_three_ssms(greedy_reference, tmp_path):
    """The local stack with the three SSMs on one worker: the request manager merges their trees,
    and the stream equals transformers' greedy output."""
    from specinfer.client import Client
    from specinfer.launcher import Stack, StackConfig

    cfg = StackConfig(
        llm=BUNDLED_PAIR / "llm",
        ssms=tuple(BUNDLED_PAIR / m for m in MODELS[1:]),
        workers=1,
        port=0,
        state_dir=tmp_path,
        expansion=PAPER_EXPANSION,
        threads=1,
    )
    with Stack(cfg) as stack, Client(stack.address) as client:
        for ids, want in greedy_reference.values():
            messages = list(client.stream(Client.request(ids, 48, ignore_eos=True)))
            got = [t for m in messages for t in m.token_ids]
            assert got == want
            usage = messages[-1].finished.usage
            assert (
                usage.tokens_per_step > 1.5 and usage.mean_tree_size > 21
            )  # three trees merged, more than one paper tree
