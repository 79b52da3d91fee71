"""Commands: ``specinfer train-ssm``, ``boost-tune``, ``train-demo``, ``train-head``, ``map-head``, ``head-vocab`` and
``chat-corpus``.

Each builds one frozen config from its flags and runs its job (:mod:`specinfer.training.jobs`,
:mod:`specinfer.training.demo`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specinfer.checkpoint import model_folder
from specinfer.training.demo import add_demo_parser, demo_config, run_demo
from specinfer.training.distill import TrainSettings
from specinfer.training.jobs import BoostConfig, TrainSsmConfig, run_boost, run_train_ssm
from specinfer.training.sources import StudentSource

TRAINING_COMMANDS = ("train-ssm", "boost-tune", "train-demo", "train-head", "map-head", "head-vocab", "chat-corpus")


def add_settings_flags(
    p: argparse.ArgumentParser,
    steps: int,
    batch: int,
    seq: int | None,
    lr: float,
    kd: float,
    save_dtype: str = "float32",
    kd_help: str = "1: match the LLM's distributions (KL); 0: its tokens / the corpus's (CE); between: a mix",
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
        help=kd_help,
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
    _add_corpus_flags(p)
    p.add_argument("--init", type=Path, help="checkpoint folder the SSM starts from")
    p.add_argument(
        "--config", default="", help="or a new SSM of this shape: layers=1,hidden=128,heads=2,intermediate=352"
    )


def _add_corpus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--llm", required=True, help="the LLM's checkpoint folder (teacher; its tokenizer encodes the corpus)"
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
    _add_head_parsers(sub)


def _add_head_parsers(sub) -> None:
    h = sub.add_parser("train-head", help="train an EAGLE-style draft head on an LLM's features (self-distillation)")
    _add_corpus_flags(h)
    kd_help = "share of the KL term (LLM's distribution vs the LM head on the prediction); the rest: smooth L1"
    add_settings_flags(h, steps=1000, batch=8, seq=256, lr=1e-3, kd=0.1, kd_help=kd_help)
    for name, what in (
        ("hidden", "head width (0: min(LLM feature width, 1024))"),
        ("heads", "query heads (0: hidden / 64)"),
        ("kv-heads", "KV heads (0: heads / 4 from 8 heads, else heads)"),
        ("head-dim", "dims per head (0: hidden / heads)"),
        ("intermediate", "SwiGLU width (0: ~8/3 hidden)"),
    ):
        h.add_argument(f"--{name}", type=int, default=0, help=what)
    h.add_argument("--noise", type=float, default=0.1, help="uniform noise on the input features, times their std")
    h.add_argument("--unroll", type=int, default=1, choices=[1, 2], help="2: also train on the head's own predictions")
    h.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="the LLM's dtype")
    h.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    h.add_argument("--log-every", type=int, default=50, help="steps between held-out accuracy lines")
    h.add_argument("--heldout-windows", type=int, default=16, help="windows of the corpus's held-out tail measured")
    h.add_argument(
        "--cache-features",
        action="store_true",
        help="compute the LLM's features of the corpus once, not every step (small corpora read for several epochs)",
    )
    h.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continue from out/checkpoints (default: when there is one)",
    )
    h.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="also write a draft vocabulary: the head drafts from the corpus's this many most frequent tokens "
        "(0: from the whole vocabulary)",
    )
    v = sub.add_parser("head-vocab", help="give a trained draft head a draft vocabulary: its corpus's commonest tokens")
    v.add_argument("--head", required=True, type=Path, help="the head's checkpoint folder (written into)")
    v.add_argument("--llm", required=True, type=Path, help="the head's LLM (its tokenizer encodes the corpus)")
    v.add_argument("--corpus", nargs="+", required=True, type=Path, help="text files or folders")
    v.add_argument("--size", type=int, default=8192, help="tokens in the draft vocabulary")
    v.add_argument("--max-corpus-bytes", type=int, default=0, help="read at most this much of the corpus (0: all)")
    m = sub.add_parser("map-head", help="map a draft head onto an inflated copy of its LLM (inflate_llm.py)")
    m.add_argument("--head", required=True, type=Path, help="the head's checkpoint folder")
    m.add_argument("--llm", required=True, type=Path, help="the inflated LLM's checkpoint folder")
    m.add_argument("--out", required=True, type=Path, help="output folder of the mapped head")
    c = sub.add_parser("chat-corpus", help="a chat model's own answers to a prompt set: a corpus for train-head")
    c.add_argument("--llm", required=True, help="the chat model's checkpoint folder or GGUF file")
    c.add_argument("--prompts", required=True, type=Path, help='JSON lines {"prompt": ..., "split": "train"}')
    c.add_argument("--out", required=True, type=Path, help="output folder (conversations.txt: the corpus)")
    c.add_argument("--split", default="train", help="answer the prompts of this split only")
    c.add_argument("--max-new-tokens", type=int, default=256, help="most tokens of an answer")
    c.add_argument("--batch-size", type=int, default=16, help="answers generated at once")
    c.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="the LLM's dtype (bfloat16 ran ~5x slower than float32 on an AVX2 CPU without bf16 units)",
    )
    c.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    c.add_argument("--seed", type=int, default=0, help="seed of the sampled answers (with --temperature)")
    c.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")


def _head_main(args: argparse.Namespace) -> int:
    from specinfer.training.head import HeadShape, TrainHeadConfig, run_train_head
    from specinfer.training.head_map import run_map_head
    from specinfer.training.head_vocab import run_head_vocab

    if args.command == "map-head":
        run_map_head(args.head, args.llm, args.out)
        return 0
    if args.command == "head-vocab":
        run_head_vocab(args.head, model_folder(args.llm, "llm"), tuple(args.corpus), args.size, args.max_corpus_bytes)
        return 0
    shape = HeadShape(args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate)
    cfg = TrainHeadConfig(
        model_folder(args.llm, "llm"),
        tuple(Path(c) for c in args.corpus),
        Path(args.out),
        settings_from(args),
        shape,
        args.noise,
        args.unroll,
        args.dtype,
        args.threads,
        args.resume,
        args.log_every,
        args.heldout_windows,
        args.max_corpus_bytes,
        cache_features=args.cache_features,
        draft_vocab=args.draft_vocab,
    )
    run_train_head(cfg)
    return 0


def training_main(args: argparse.Namespace) -> int:
    if args.command == "train-demo":
        run_demo(demo_config(args))
        return 0
    if args.command in ("train-head", "map-head", "head-vocab"):
        return _head_main(args)
    if args.command == "chat-corpus":
        from specinfer.training.chat_corpus import ChatCorpusConfig, run_chat_corpus

        run_chat_corpus(
            ChatCorpusConfig(
                model_folder(args.llm, "llm"),
                args.prompts,
                args.out,
                args.split,
                args.max_new_tokens,
                args.batch_size,
                args.dtype,
                args.temperature,
                args.seed,
                args.threads,
            )
        )
        return 0
    source = StudentSource(
        model_folder(args.llm, "llm"),
        tuple(Path(c) for c in args.corpus),
        args.init,
        args.config,
        args.max_corpus_bytes,
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
