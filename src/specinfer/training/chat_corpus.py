"""``specinfer chat-corpus``: a chat model's own answers to a prompt set, as a corpus for ``train-head``.

A draft head drafts what its LLM will say, so it is best trained on text the LLM itself wrote (EAGLE trains on
regenerated conversations). A *prompt set* is a JSON-lines file, one ``{"prompt": "...", "split": "train"}`` a
line (``split`` absent: train); only the prompts of the chosen split are answered, so a held-out split stays
unseen by training. Each prompt is rendered as one user message through the LLM's chat template (as the OpenAI
chat API renders it), answered by the LLM on our engine (native backend, batched, no speculation; greedy unless
``temperature`` > 0), and the whole conversation (the template's rendering of the user message and the answer)
is appended to ``OUT/conversations.txt``, the file ``train-head --corpus`` reads. ``OUT/answers.jsonl`` keeps
each prompt, its answer, token counts and finish reason; ``OUT/corpus.json`` the settings and totals. Both files
grow as answers finish, so an interrupted run leaves a usable corpus, and a rerun answers only the prompts
``answers.jsonl`` lacks; a run that ends rewrites both in the prompt set's order.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specinfer.core import InvalidArgument

CONVERSATIONS = "conversations.txt"
ANSWERS = "answers.jsonl"


@dataclass(frozen=True)
class ChatCorpusConfig:
    """``specinfer chat-corpus``: answer the ``split`` prompts of ``prompts`` with ``llm`` into ``out``, at most
    ``max_new_tokens`` tokens each and ``batch_size`` answers generated at once, the LLM in ``dtype``."""

    llm: Path
    prompts: Path
    out: Path
    split: str = "train"
    max_new_tokens: int = 256
    batch_size: int = 16
    dtype: str = "float32"
    temperature: float = 0.0
    seed: int = 0
    threads: int = 0

    def validate(self) -> None:
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(name.replace("_", "-"), "must be > 0")
        if self.temperature < 0:
            raise InvalidArgument("temperature", "must be >= 0")


def read_prompts(path: Path, split: str) -> list[str]:
    """The prompts of ``split`` in the JSON-lines prompt set ``path`` (lines without ``split`` are train)."""
    if not path.is_file():
        raise InvalidArgument("prompts", f"{path} is not a file")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument("prompts", f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InvalidArgument("prompts", f'{path}:{n}: needs a non-empty string "prompt"')
        if row.get("split", "train") == split:
            prompts.append(row["prompt"])
    if not prompts:
        raise InvalidArgument("prompts", f"{path} has no prompt of split {split!r}")
    return prompts


def conversation(template, prompt: str, answer: str | None = None) -> str:
    """The chat template's text of ``prompt`` as one user message: with ``answer`` the whole conversation,
    without it the prompt the model answers (the assistant's turn opened)."""
    messages = [{"role": "user", "content": prompt}]
    if answer is None:
        return template.render(messages, add_generation_prompt=True)
    return template.render([*messages, {"role": "assistant", "content": answer}], add_generation_prompt=False)


def _answered(path: Path) -> dict[str, dict]:
    """The rows of an earlier, interrupted run's ``answers.jsonl`` by prompt (a torn last line is dropped)."""
    rows = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[row["prompt"]] = row
    return rows


def _engine(cfg: ChatCorpusConfig, longest_prompt: int):
    """The engine with KV rows for ``batch_size`` answers: each request's cache sized to the longest prompt and
    an answer, not the model's whole context (8192 positions for SmolLM2), which on a CPU's contiguous cache of
    the default size held two requests at a time."""
    from specinfer.engine import EngineConfig, SpeculativeEngine
    from specinfer.models.dtypes import DTYPES
    from specinfer.models.loading import eos_token_id, load_backend
    from specinfer.models.native.backend import NativeOptions
    from specinfer.models.native.kv_pool import KVPool
    from specinfer.models.native.spec import ModelSpec

    rows = longest_prompt + cfg.max_new_tokens + 1
    per_row = KVPool.bytes_per_token(ModelSpec.from_dir(cfg.llm), DTYPES[cfg.dtype])
    kv_bytes = per_row * (rows + NativeOptions.max_tree_nodes) * cfg.batch_size  # a slot also holds tree rows
    llm = load_backend(cfg.llm, "llm", cfg.dtype, backend="native", kv_cache_bytes=kv_bytes, max_seq_len=rows)
    return SpeculativeEngine(llm, [], EngineConfig(max_batch=cfg.batch_size, eos_token_id=eos_token_id(cfg.llm)))


def run_chat_corpus(cfg: ChatCorpusConfig, log=None) -> dict:
    """Answer the prompts, write ``out`` (see the module), return the totals written to ``out/corpus.json``."""
    log = log or sys.stderr  # resolved per call: a default of sys.stderr would pin the stream at import
    import torch
    from tqdm import tqdm

    from specinfer.checkpoint import check_checkpoint, load_tokenizer
    from specinfer.core.sampling import SamplingParams
    from specinfer.engine import GenerationRequest
    from specinfer.request_manager.api.chat_template import ChatTemplate

    cfg.validate()
    check_checkpoint(cfg.llm, "llm")
    template, tokenizer = ChatTemplate.load(cfg.llm), load_tokenizer(cfg.llm)
    if template is None or tokenizer is None:
        raise InvalidArgument("llm", f"{cfg.llm} has no chat template or no tokenizer.json: not a chat model")
    prompts = read_prompts(cfg.prompts, cfg.split)
    cfg.out.mkdir(parents=True, exist_ok=True)
    done = _answered(cfg.out / ANSWERS)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    todo = [(i, p) for i, p in enumerate(prompts) if p not in done]
    encoded = {i: tuple(tokenizer.encode(conversation(template, p)).ids) for i, p in todo}
    engine = _engine(cfg, max(map(len, encoded.values()), default=1))
    for i, prompt in encoded.items():  # the template writes the special tokens
        sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i)
        engine.add(GenerationRequest(str(i), prompt, cfg.max_new_tokens, sampling))
    start = time.perf_counter()
    with (
        tqdm(total=len(prompts), initial=len(done), desc="chat-corpus", file=log, mininterval=5.0) as bar,
        open(cfg.out / ANSWERS, "a") as answers,
        open(cfg.out / CONVERSATIONS, "a") as conversations,
    ):
        while engine.has_work:  # continuous batching: a finished answer's slot goes to the next prompt
            for res in engine.step():
                p = prompts[int(res.request_id)]
                done[p] = row = {
                    "prompt": p,
                    "answer": tokenizer.decode(res.output_tokens, skip_special_tokens=True).strip(),
                    "prompt_tokens": len(res.prompt_tokens),
                    "answer_tokens": len(res.output_tokens),
                    "finish_reason": res.finish_reason,
                }
                answers.write(json.dumps(row, ensure_ascii=False) + "\n")  # kept as it comes: a rerun resumes
                conversations.write(conversation(template, p, row["answer"]))
                answers.flush()
                conversations.flush()
                bar.update(1)
    rows = [done[p] for p in prompts]  # the files again, in the prompt set's order
    (cfg.out / CONVERSATIONS).write_text("".join(conversation(template, r["prompt"], r["answer"]) for r in rows))
    (cfg.out / ANSWERS).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    report = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "conversations": len(rows),
        "answer_tokens": sum(r["answer_tokens"] for r in rows),
        "cut_at_max_new_tokens": sum(r["finish_reason"] == "length" for r in rows),
        "seconds_this_run": round(time.perf_counter() - start, 1),
    }
    (cfg.out / "corpus.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"chat-corpus: {cfg.out / CONVERSATIONS} ({report['conversations']} conversations)", file=log)
    return report
