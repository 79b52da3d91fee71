"""Acceptance of a draft with another tokenizer (token-level intersection), against drafts that share the LLM's.

Builds, under ``--work`` (each stage skipped when its output exists):
1. ``tokenizer-STYLE/`` for each of ``--styles``: ``sentencepiece``, a SentencePiece-style BPE (``▁``
   for spaces, byte fallback; Llama 2 / Gemma style) of ``--vocab-size`` tokens, and ``byte-level``, a
   byte-level BPE like the LLM's (GPT-2 / Llama 3 / Qwen style) but of ``--bpe-vocab-size`` tokens (other
   merges, other IDs), both trained on the corpus (default: this Python's standard library, tests left
   out, as the shared pair's LLM was trained on);
2. ``cross-STYLE/``: an SSM of ``--arch`` trained from scratch on the corpus in that tokenizer
   (next-token cross-entropy: no distillation, which needs a shared vocabulary);
3. ``same/``: the control, the same SSM trained the same way in the LLM's tokenizer.
Then runs the in-process engine (native backend, fp32) on the LLM with each draft and the pair's own
(distilled) SSM, greedy and temperature 1, a chain of 8 and the paper's tree, and prints a markdown
table: mean tree tokens accepted per verify step, tokens per step, and the share of shared tokens.

    python bench/cross_tokenizer.py --pair ../shared/models/pycode-a --work /tmp/xtok --steps 1500
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import load_prompts

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.cross_vocab import draft_vocabulary, in_llm_ids
from specinfer.models.loading import eos_token_id, load_backend
from specinfer.training.corpus import (
    read_texts,
    source_files,
    stdlib_dir,
    train_sentencepiece_style_tokenizer,
    train_tokenizer,
)
from specinfer.training.distill import TrainSettings, train
from specinfer.training.sources import ArchSpec, corpus_tokens, new_llama, val_windows, window_batches


def build_tokenizer(out: Path, style: str, corpus: tuple[Path, ...], vocab_size: int, max_bytes: int) -> None:
    if (out / "tokenizer.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    texts = read_texts(source_files(corpus), max_bytes)
    trainer = {"sentencepiece": train_sentencepiece_style_tokenizer, "byte-level": train_tokenizer}[style]
    trainer(texts, vocab_size).save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(f'{{"vocab_size": {vocab_size}, "eos_token_id": 1, "bos_token_id": 0}}\n')


def train_ssm(
    out: Path, tokenizer_dir: Path, corpus: tuple[Path, ...], arch: ArchSpec, settings: TrainSettings, max_bytes: int
) -> None:
    """An SSM trained from scratch on the corpus in ``tokenizer_dir``'s tokenizer (next-token cross-entropy)."""
    if (out / "training.json").is_file():
        return
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    train_stream, val_stream = corpus_tokens(tokenizer_dir, corpus, max_bytes, 0.02, sys.stderr)
    model = new_llama(arch, vocab, 1024, seed=settings.seed)
    train(
        model,
        None,
        window_batches(train_stream, settings.batch_size, settings.seq_len, settings.seed),
        settings,
        out,
        tokenizer_dir,
        val_windows(val_stream, settings.seq_len),
        desc=out.name,
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--pair", type=Path, default=Path("../shared/models/pycode-a"), help="folder with llm/, ssm/, prompts.jsonl"
    )
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--corpus", nargs="*", type=Path, default=None, help="default: this Python's standard library")
    ap.add_argument("--styles", default="sentencepiece,byte-level", help="the other tokenizers to train drafts in")
    ap.add_argument("--vocab-size", type=int, default=4096, help="of the SentencePiece-style tokenizer")
    ap.add_argument("--bpe-vocab-size", type=int, default=8192, help="of the byte-level one")
    ap.add_argument("--arch", default="layers=1,hidden=128,heads=2,intermediate=352")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--max-corpus-bytes", type=int, default=12_000_000)
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args()


def build_drafts(args: argparse.Namespace, styles: list[str], llm_dir: Path) -> None:
    """The tokenizers and SSMs under ``--work`` (stages whose output exists are skipped)."""
    corpus = tuple(args.corpus or (stdlib_dir(),))
    settings = TrainSettings(
        steps=args.steps, batch_size=16, seq_len=256, lr=2e-3, kd_weight=0.0, device="cpu", checkpoint_every=500
    )
    arch = ArchSpec.parse(args.arch, "arch")

    started = time.perf_counter()
    for style in styles:
        vocab = args.vocab_size if style == "sentencepiece" else args.bpe_vocab_size
        build_tokenizer(args.work / f"tokenizer-{style}", style, corpus, vocab, args.max_corpus_bytes)
        train_ssm(
            args.work / f"cross-{style}",
            args.work / f"tokenizer-{style}",
            corpus,
            arch,
            settings,
            args.max_corpus_bytes,
        )
    train_ssm(args.work / "same", llm_dir, corpus, arch, settings, args.max_corpus_bytes)
    print(f"built in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def print_rows(name: str, path: Path, llm, llm_dir: Path, prompts: list, new_tokens: int) -> None:
    """One draft's table rows: a chain of 8 and the paper's tree, greedy and temperature 1."""
    vmap = draft_vocabulary(llm_dir, path, "ssm")
    ssm = in_llm_ids(load_backend(path, "ssm", "float32", backend="native"), vmap)
    shared = "all" if vmap is None else f"{vmap.shared} of {vmap.ssm_size}"
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos_token_id(llm_dir)))
    for widths in ("1,1,1,1,1,1,1,1", PAPER_EXPANSION):
        for temp in (0.0, 1.0):
            spec = SpeculationConfig(ExpansionConfig.parse(widths))
            reqs = [
                GenerationRequest(
                    f"{name}-{widths}-{temp}-{i}",
                    p,
                    new_tokens,
                    SamplingParams(temperature=temp, seed=i),
                    spec,
                    ignore_eos=True,
                )
                for i, p in enumerate(prompts)
            ]
            results = engine.generate(reqs)
            steps = [s for r in results for s in r.steps]
            accepted = sum(s.accepted for s in steps) / len(steps)
            tokens = sum(len(r.output_tokens) for r in results) / len(steps)
            vocab = "shared" if vmap is None else "token-intersection"
            print(
                f"| {name} | {vocab} | {shared} | <{widths}> | {temp:g} | {accepted:.2f} | {tokens:.2f} "
                f"| {len(steps)} |",
                flush=True,
            )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    llm_dir = args.pair / "llm"
    styles = [s for s in args.styles.split(",") if s]
    build_drafts(args, styles, llm_dir)

    prompts = load_prompts(args.pair / "prompts.jsonl", llm_dir, args.prompts, 0)
    llm = load_backend(llm_dir, "llm", "float32", backend="native")
    drafts = {
        "pair's SSM (distilled, same tokenizer)": args.pair / "ssm",
        "same (CE, same tokenizer)": args.work / "same",
    }
    drafts.update({f"cross (CE, {style} tokenizer)": args.work / f"cross-{style}" for style in styles})
    print(
        f"LLM {llm_dir}; {len(prompts)} prompts x {args.new_tokens} new tokens (EOS ignored), batch {len(prompts)}; "
        "fp32, native backend"
    )
    print()
    print(
        "| draft | vocabulary | shared tokens | expansion | temperature | accepted / step | tokens / step | LLM steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, path in drafts.items():
        print_rows(name, path, llm, llm_dir, prompts, args.new_tokens)


if __name__ == "__main__":
    main()
