"""Commands: ``specinfer train-ssm``, ``specinfer boost-tune`` and ``specinfer train-demo``.

Each builds one frozen config from its flags and runs its job (:mod:`specinfer.training.jobs`,
:mod:`specinfer.training.demo`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specinfer.training.demo import add_demo_parser, demo_config, run_demo
from specinfer.training.distill import TrainSettings
from specinfer.training.jobs import BoostConfig, TrainSsmConfig, run_boost, run_train_ssm
from specinfer.training.sources import StudentSource


def add_settings_flags(
    p: argparse.ArgumentParser,
    steps: int,
    batch: int,
    seq: int | None,
    lr: float,
    kd: float,
    save_dtype: str = "float32",
) -> None:
    """``seq`` None: the windows' length is set elsewhere (boost-tune: prompt + continuation)."""
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=batch, help="training windows per optimizer step")
    if seq is not None:
        p.add_argument("--seq-len", type=int, default=seq, help="tokens per training window")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument(
        "--kd-weight",
        type=float,
        default=kd,
        help="1: match the LLM's distributions (KL); 0: its tokens / the corpus's (CE); between: a mix",
    )
    p.add_argument(
        "--kd-temperature", type=float, default=1.0, help="softmax temperature of both distributions in the KL term"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=200, help="steps between resumable checkpoints (out/checkpoints/step-N)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the sampling of windows")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument(
        "--save-dtype",
        default=save_dtype,
        choices=["float32", "float16", "bfloat16"],
        help="dtype of the saved checkpoint",
    )


def settings_from(args: argparse.Namespace) -> TrainSettings:
    return TrainSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=getattr(args, "seq_len", 0) or args.prompt_tokens + args.continuation_tokens - 1,
        lr=args.lr,
        warmup=args.warmup,
        kd_weight=args.kd_weight,
        kd_temperature=args.kd_temperature,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        device=args.device,
        save_dtype=args.save_dtype,
    )


def _add_student_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--llm", required=True, help="the LLM's checkpoint folder (teacher; its tokenizer encodes the corpus)"
    )
    p.add_argument("--init", type=Path, help="checkpoint folder the SSM starts from")
    p.add_argument(
        "--config", default="", help="or a new SSM of this shape: layers=1,hidden=128,heads=2,intermediate=352"
    )
    p.add_argument(
        "--corpus",
        nargs="+",
        required=True,
        help="text files or folders (folders: their .py files, test folders left out)",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-corpus-bytes", type=int, default=0, help="read at most this much of the corpus (0: all)")


def add_training_parsers(sub) -> None:
    t = sub.add_parser(
        "train-ssm", help="distil a small causal LM toward an LLM on a local corpus (resumable, CPU or GPU)"
    )
    _add_student_flags(t)
    add_settings_flags(t, steps=1000, batch=32, seq=128, lr=2e-3, kd=1.0)
    b = sub.add_parser("boost-tune", help="adaptive boost-tuning: SSM k learns the samples SSMs 0..k-1 missed")
    _add_student_flags(b)
    b.add_argument("--ssms", type=int, default=2, help="how many SSMs")
    b.add_argument("--samples", type=int, default=8192, help="training samples (corpus prompts + LLM continuations)")
    b.add_argument(
        "--heldout-samples", type=int, default=256, help="samples from the corpus's held-out tail, for the report"
    )
    b.add_argument("--prompt-tokens", type=int, default=48, help="corpus tokens of each sample's prompt")
    b.add_argument(
        "--continuation-tokens",
        type=int,
        default=16,
        help="the LLM's greedy tokens after each prompt (what the SSMs learn)",
    )
    b.add_argument(
        "--cover-tokens",
        type=int,
        default=1,
        help="a sample is covered when an SSM predicts this many leading continuation tokens "
        "(1: later SSMs learn where the earlier ones miss the next token: the merged tree's first depths)",
    )
    add_settings_flags(b, steps=300, batch=32, seq=None, lr=1e-3, kd=0.5)
    add_demo_parser(sub)


def training_main(args: argparse.Namespace) -> int:
    if args.command == "train-demo":
        run_demo(demo_config(args))
        return 0
    source = StudentSource(
        Path(args.llm), tuple(Path(c) for c in args.corpus), args.init, args.config, args.max_corpus_bytes
    )
    if args.command == "train-ssm":
        run_train_ssm(TrainSsmConfig(source, Path(args.out), settings_from(args)))
        return 0
    cfg = BoostConfig(
        source,
        args.ssms,
        Path(args.out),
        settings_from(args),
        args.samples,
        args.heldout_samples,
        args.prompt_tokens,
        args.continuation_tokens,
        args.cover_tokens,
    )
    run_boost(cfg)
    return 0
