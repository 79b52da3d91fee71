"""Commands: ``specinfer train-ssm``, ``specinfer boost-tune`` and ``specinfer train-demo``.

Each builds one frozen config from its flags, then calls a ``run_*`` function that does the work
and returns a report (also written as JSON beside the checkpoints).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specinfer.core import InvalidArgument
from specinfer.training.distill import TrainSettings

BOOST_REPORT = "boost_report.json"


# ---------------------------------------------------------------- models and data


@dataclass(frozen=True)
class ArchSpec:
    """A Llama shape: ``layers=1,hidden=128,heads=2,intermediate=352`` on the command line."""

    layers: int
    hidden: int
    heads: int
    intermediate: int

    @staticmethod
    def parse(text: str, field: str = "config") -> ArchSpec:
        try:
            kv = dict(part.split("=", 1) for part in text.split(",") if part.strip())
            spec = ArchSpec(**{k.strip(): int(v) for k, v in kv.items()})
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(field, f"expected layers=L,hidden=H,heads=N,intermediate=I, got {text!r} ({exc})") from None
        if min(asdict(spec).values()) <= 0 or spec.hidden % spec.heads:
            raise InvalidArgument(field, f"{text!r}: every value > 0 and hidden divisible by heads")
        return spec


def new_llama(spec: ArchSpec, vocab_size: int, max_positions: int, seed: int, bos: int = 0, eos: int = 1):
    """A freshly initialised Llama with tied input/output embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_model(path: Path):
    """A checkpoint in float32 for training or measuring."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def student_from(init: Path | None, config: str, llm) -> object:
    """The SSM to train: a copy of ``init``, or a new Llama of shape ``config`` sharing the LLM's
    vocabulary and special tokens."""
    if init is not None:
        from specinfer.models.loading import check_checkpoint

        check_checkpoint(init, "init")
        model = load_model(init)
        if model.config.vocab_size != llm.config.vocab_size:
            raise InvalidArgument("init", f"vocabulary {model.config.vocab_size} differs from the LLM's {llm.config.vocab_size}")
        return model
    spec = ArchSpec.parse(config)
    c = llm.config
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    return new_llama(spec, c.vocab_size, c.max_position_embeddings, seed=0, bos=c.bos_token_id or 0, eos=eos if eos is not None else 1)


def corpus_tokens(tokenizer_dir: Path, corpus: tuple[Path, ...], max_bytes: int, val_fraction: float, log):
    """The corpus as (training, validation) token streams in the tokenizer of ``tokenizer_dir``."""
    from specinfer.checkpoint import eos_token_id, load_tokenizer
    from specinfer.training.corpus import encode, read_texts, source_files, split_stream

    tok = load_tokenizer(tokenizer_dir)
    if tok is None:
        raise InvalidArgument("llm", f"{tokenizer_dir} has no tokenizer.json to encode the corpus with")
    try:
        files = source_files(corpus)
    except FileNotFoundError as exc:
        raise InvalidArgument("corpus", str(exc)) from None
    texts = read_texts(files, max_bytes)
    if not texts:
        raise InvalidArgument("corpus", "no text found")
    eos = eos_token_id(tokenizer_dir)
    stream = encode(tok, texts, 1 if eos is None else eos)
    print(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} MB, {len(stream)} tokens", file=log, flush=True)
    return split_stream(stream, val_fraction)


def window_batches(stream, batch_size: int, seq_len: int, seed: int):
    """Batch source of random corpus windows (next-token targets everywhere)."""
    import torch

    from specinfer.training.corpus import random_windows, step_generator

    def source(step: int):
        w = random_windows(stream, batch_size, seq_len + 1, step_generator(seed, step))  # [B, T + 1]
        return w[:, :-1], w[:, 1:], torch.ones(batch_size, seq_len, dtype=torch.bool)

    return source


def val_windows(stream, seq_len: int, count: int = 16, seed: int = 12345):
    import torch

    from specinfer.training.corpus import random_windows

    if len(stream) <= seq_len + 1:
        return []
    w = random_windows(stream, count, seq_len + 1, torch.Generator().manual_seed(seed))
    return [(w[i : i + 8, :-1], w[i : i + 8, 1:], torch.ones(len(w[i : i + 8]), seq_len, dtype=torch.bool)) for i in range(0, count, 8)]


# ---------------------------------------------------------------- train-ssm


@dataclass(frozen=True)
class StudentSource:
    """What an SSM is trained from: the teacher ``llm`` (its tokenizer encodes the corpus), the
    starting point (the checkpoint ``init`` or a new Llama of shape ``config``: exactly one), and
    the ``corpus`` (at most ``max_corpus_bytes`` of it read; 0: all)."""

    llm: Path
    corpus: tuple[Path, ...]
    init: Path | None = None
    config: str = ""
    max_corpus_bytes: int = 0

    def validate(self) -> None:
        if (self.init is None) == (not self.config):
            raise InvalidArgument("init", "give exactly one of --init DIR and --config SHAPE")

    def teacher(self):
        """The LLM as a float32 model."""
        from specinfer.models.loading import check_checkpoint

        check_checkpoint(self.llm, "llm")
        return load_model(self.llm)

    def student(self, llm):
        """A fresh copy of the starting point (every call loads or builds it anew)."""
        return student_from(self.init, self.config, llm)

    def tokens(self, val_fraction: float, log):
        return corpus_tokens(self.llm, self.corpus, self.max_corpus_bytes, val_fraction, log)


@dataclass(frozen=True)
class TrainSsmConfig:
    """``specinfer train-ssm``: distil an SSM toward its source's LLM."""

    source: StudentSource
    out: Path
    settings: TrainSettings
    val_fraction: float = 0.02


def run_train_ssm(cfg: TrainSsmConfig, log=None) -> dict:
    log = log or sys.stderr  # resolved per call: a default of sys.stderr would pin the stream at import
    cfg.settings.validate()
    cfg.source.validate()
    llm = cfg.source.teacher()
    student = cfg.source.student(llm)
    train_stream, val_stream = cfg.source.tokens(cfg.val_fraction, log)
    s = cfg.settings
    from specinfer.training.distill import train

    report = train(
        student,
        llm if s.kd_weight > 0 else None,
        window_batches(train_stream, s.batch_size, s.seq_len, s.seed),
        s,
        cfg.out,
        cfg.source.llm,
        val_windows(val_stream, s.seq_len),
        desc="train-ssm",
        log=log,
    )
    print(f"train-ssm: {cfg.out} (final loss {report['final_loss']}, validation CE {report.get('val_loss')})", file=log)
    return report


# ---------------------------------------------------------------- boost-tune


@dataclass(frozen=True)
class BoostConfig:
    """``specinfer boost-tune``: ``ssms`` SSMs, each fine-tuned from ``init`` (or a new
    ``config`` shape) on the samples every earlier SSM missed. ``samples`` training samples and
    ``heldout_samples`` from the corpus's held-out tail, each ``prompt_tokens`` of corpus and the
    LLM's ``continuation_tokens`` greedy tokens; covered = the first ``cover_tokens`` predicted."""

    source: StudentSource
    ssms: int
    out: Path
    settings: TrainSettings
    samples: int = 8192
    heldout_samples: int = 256
    prompt_tokens: int = 48
    continuation_tokens: int = 16
    cover_tokens: int = 1
    val_fraction: float = 0.05

    def validate(self) -> None:
        for name in ("ssms", "samples", "prompt_tokens", "continuation_tokens", "cover_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(name.replace("_", "-"), "must be > 0")
        if self.cover_tokens > self.continuation_tokens:
            raise InvalidArgument("cover-tokens", "must be <= --continuation-tokens")
        self.source.validate()
        self.settings.validate()


def _make_samples(cfg: BoostConfig, llm, log):
    """Prompts from the corpus and the LLM's greedy continuations (cached in ``out/samples.pt``)."""
    import torch
    from tqdm import tqdm

    from specinfer.training.boost import Samples, greedy_continuations
    from specinfer.training.corpus import random_windows
    from specinfer.training.distill import resolve_device

    path = cfg.out / "samples.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        return Samples(saved["prompts"], saved["continuations"]), Samples(saved["heldout_prompts"], saved["heldout_continuations"])
    train_stream, val_stream = cfg.source.tokens(cfg.val_fraction, log)
    g = torch.Generator().manual_seed(cfg.settings.seed)
    prompts = random_windows(train_stream, cfg.samples, cfg.prompt_tokens, g)
    held = random_windows(val_stream, cfg.heldout_samples, cfg.prompt_tokens, g) if cfg.heldout_samples else prompts[:0]
    device = resolve_device(cfg.settings.device)
    with tqdm(total=len(prompts) + len(held), desc="LLM continuations", file=log, mininterval=2.0) as bar:
        cont = greedy_continuations(llm, prompts, cfg.continuation_tokens, 64, device, bar)
        held_cont = greedy_continuations(llm, held, cfg.continuation_tokens, 64, device, bar) if len(held) else cont[:0]
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.save({"prompts": prompts, "continuations": cont, "heldout_prompts": held, "heldout_continuations": held_cont}, path)
    return Samples(prompts, cont), Samples(held, held_cont)


def run_boost(cfg: BoostConfig, log=None) -> dict:
    """Boost-tune ``cfg.ssms`` SSMs into ``out/ssm-0`` ... and write ``out/boost_report.json``.
    Resumable: finished SSMs are kept, an unfinished one resumes from its last checkpoint."""
    log = log or sys.stderr  # resolved per call: a default of sys.stderr would pin the stream at import
    import torch

    from specinfer.training.boost import coverage_summary, covered, greedy_matches, subset_batches, uncovered
    from specinfer.training.distill import resolve_device, train

    cfg.validate()
    started = time.monotonic()
    llm = cfg.source.teacher()
    device = resolve_device(cfg.settings.device)
    samples, heldout = _make_samples(cfg, llm, log)
    train_matches, held_matches, rounds = [], [], []
    for k in range(cfg.ssms):
        out = cfg.out / f"ssm-{k}"
        done = out / "boost.json"
        idx = uncovered([covered(m, cfg.cover_tokens) for m in train_matches], len(samples))
        if done.is_file():
            rounds.append(json.loads(done.read_text()))
        else:
            if len(idx) == 0:
                raise InvalidArgument("ssms", f"SSMs 0..{k - 1} cover every sample; ask for fewer SSMs, more --samples or a larger --cover-tokens")
            missed = f"those SSMs 0..{k - 1} missed" if k else "all"
            print(f"boost-tune: SSM {k} trains on {len(idx)} of {len(samples)} samples ({missed})", file=log, flush=True)
            s = replace(cfg.settings, seed=cfg.settings.seed + k)
            student = cfg.source.student(llm)
            report = train(
                student, llm if s.kd_weight > 0 else None, subset_batches(samples, idx, s.batch_size, s.seed), s, out, cfg.source.llm, desc=f"ssm-{k}", log=log
            )
            rounds.append({"ssm": k, "trained_on": idx.tolist(), "training": report})
        # coverage of the checkpoint as written (in its saved dtype), not of the in-memory copy
        saved = load_model(out)
        train_matches.append(greedy_matches(saved, samples, 64, device))
        held_matches.append(greedy_matches(saved, heldout, 64, device) if len(heldout) else torch.zeros(0, cfg.continuation_tokens, dtype=torch.bool))
        rounds[k]["coverage_after"] = coverage_summary(train_matches, cfg.cover_tokens)
        if not done.is_file():
            done.write_text(json.dumps(rounds[k]) + "\n")
    report = {
        "config": json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k != "settings"}, default=str)),
        "settings": asdict(cfg.settings),
        "seconds": round(time.monotonic() - started, 1),
        "ssms": [{"ssm": r["ssm"], "path": str(cfg.out / f"ssm-{r['ssm']}"), "trained_on_samples": len(r["trained_on"])} for r in rounds],
        "train": coverage_summary(train_matches, cfg.cover_tokens),
        "heldout": coverage_summary(held_matches, cfg.cover_tokens) if len(heldout) else None,
    }
    (cfg.out / BOOST_REPORT).write_text(json.dumps(report, indent=1) + "\n")
    t, h = report["train"], report["heldout"] or report["train"]
    print(
        f"boost-tune: coverage per SSM {t['coverage']} combined {t['combined_coverage']} (held-out {h['coverage']} combined {h['combined_coverage']})", file=log
    )
    return report


# ---------------------------------------------------------------- flags


def add_settings_flags(p: argparse.ArgumentParser, steps: int, batch: int, seq: int | None, lr: float, kd: float, save_dtype: str = "float32") -> None:
    """``seq`` None: the windows' length is set elsewhere (boost-tune: prompt + continuation)."""
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default {steps})")
    p.add_argument("--batch-size", type=int, default=batch)
    if seq is not None:
        p.add_argument("--seq-len", type=int, default=seq, help="tokens per training window")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW, warm-up then cosine)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--kd-weight", type=float, default=kd, help="1: match the LLM's distributions (KL); 0: its tokens / the corpus's (CE); between: a mix")
    p.add_argument("--kd-temperature", type=float, default=1.0)
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between resumable checkpoints (out/checkpoints/step-N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_argument("--save-dtype", default=save_dtype, choices=["float32", "float16", "bfloat16"])


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
    p.add_argument("--llm", required=True, help="the LLM's checkpoint folder (teacher; its tokenizer encodes the corpus)")
    p.add_argument("--init", type=Path, help="checkpoint folder the SSM starts from")
    p.add_argument("--config", default="", help="or a new SSM of this shape: layers=1,hidden=128,heads=2,intermediate=352")
    p.add_argument("--corpus", nargs="+", required=True, help="text files or folders (folders: their .py files, test folders left out)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-corpus-bytes", type=int, default=0, help="read at most this much of the corpus (0: all)")


def add_training_parsers(sub) -> None:
    t = sub.add_parser("train-ssm", help="distil a small causal LM toward an LLM on a local corpus (resumable, CPU or GPU)")
    _add_student_flags(t)
    add_settings_flags(t, steps=1000, batch=32, seq=128, lr=2e-3, kd=1.0)
    b = sub.add_parser("boost-tune", help="adaptive boost-tuning: SSM k learns the samples SSMs 0..k-1 missed")
    _add_student_flags(b)
    b.add_argument("--ssms", type=int, default=2, help="how many SSMs")
    b.add_argument("--samples", type=int, default=8192, help="training samples (corpus prompts + LLM continuations)")
    b.add_argument("--heldout-samples", type=int, default=256, help="samples from the corpus's held-out tail, for the report")
    b.add_argument("--prompt-tokens", type=int, default=48)
    b.add_argument("--continuation-tokens", type=int, default=16)
    b.add_argument(
        "--cover-tokens",
        type=int,
        default=1,
        help="a sample is covered when an SSM predicts this many leading continuation tokens "
        "(1: later SSMs learn where the earlier ones miss the next token: the merged tree's first depths)",
    )
    add_settings_flags(b, steps=300, batch=32, seq=None, lr=1e-3, kd=0.5)
    from specinfer.training.demo import add_demo_parser

    add_demo_parser(sub)


def training_main(args: argparse.Namespace) -> int:
    if args.command == "train-demo":
        from specinfer.training.demo import demo_config, run_demo

        run_demo(demo_config(args))
        return 0
    source = StudentSource(Path(args.llm), tuple(Path(c) for c in args.corpus), args.init, args.config, args.max_corpus_bytes)
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


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Replace ``dst`` by the model files of ``src`` (no training state)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            shutil.copyfile(f, dst / f.name)
