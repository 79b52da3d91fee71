"""``specinfer train-demo``: the recipe that trains the bundled demo models from a local corpus
(default: the running Python's standard library sources, test folders left out).

Stages, each skipped when its output exists, so an interrupted run resumes:
1. a byte-level BPE tokenizer on the corpus;
2. the LLM, a Llama trained from scratch on the corpus (next-token cross-entropy);
3. a base SSM, a one-layer Llama distilled toward the LLM on the corpus (``train-ssm``);
4. ``ssms`` SSMs boost-tuned from the base SSM on the LLM's own continuations (``boost-tune``);
5. the pair assembled in ``out``: ``llm/``, ``ssm/`` (boosted SSM 0), ``ssm-1/`` ...,
   ``prompts.jsonl`` (held out: fragments of the standard library's *test* files) and
   ``train_report.json``. Weights are stored in ``save_dtype`` (float16 by default).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specinfer.training.distill import TrainSettings
from specinfer.training.jobs import BOOST_REPORT, BoostConfig, TrainSsmConfig, run_boost, run_train_ssm
from specinfer.training.sources import ArchSpec, StudentSource, corpus_tokens, new_llama, val_windows, window_batches

WORK = "_work"


@dataclass(frozen=True)
class DemoConfig:
    out: Path
    corpus: tuple[Path, ...]
    prompt_source: tuple[Path, ...]
    vocab_size: int
    llm_arch: ArchSpec
    ssm_arch: ArchSpec
    llm: TrainSettings
    ssm: TrainSettings
    boost: TrainSettings
    ssms: int
    samples: int
    heldout_samples: int
    prompt_tokens: int
    continuation_tokens: int
    cover_tokens: int
    prompts: int
    max_corpus_bytes: int
    max_positions: int = 1024


def add_demo_parser(sub) -> None:
    d = sub.add_parser(
        "train-demo", help="train the demo LLM + boost-tuned SSMs from a local corpus (about 32 min on 2 CPU cores)"
    )
    d.add_argument("--out", default="models/demo", help="where the pair goes (default models/demo)")
    d.add_argument(
        "--corpus", nargs="*", default=None, help="text files or folders (default: this Python's standard library)"
    )
    d.add_argument(
        "--prompt-source",
        nargs="*",
        default=None,
        help="where held-out prompts are cut from (default: the standard library's test folders)",
    )
    d.add_argument(
        "--vocab-size", type=int, default=4096, help="tokens of the byte-level BPE tokenizer trained on the corpus"
    )
    d.add_argument("--llm-arch", default="layers=4,hidden=256,heads=4,intermediate=688", help="shape of the demo LLM")
    d.add_argument("--llm-steps", type=int, default=1100, help="training steps of the LLM")
    d.add_argument("--llm-batch-size", type=int, default=16, help="training windows per LLM step")
    d.add_argument("--llm-seq-len", type=int, default=256, help="tokens per LLM training window")
    d.add_argument("--ssm-arch", default="layers=1,hidden=128,heads=2,intermediate=352", help="shape of each SSM")
    d.add_argument("--ssm-steps", type=int, default=500, help="distillation steps of the base SSM")
    d.add_argument("--ssms", type=int, default=3, help="boost-tuned SSMs")
    d.add_argument("--boost-steps", type=int, default=300, help="steps per boost-tuned SSM")
    d.add_argument(
        "--samples", type=int, default=8192, help="boost-tuning samples (corpus prompts + LLM continuations)"
    )
    d.add_argument(
        "--cover-tokens",
        type=int,
        default=1,
        help="a sample is covered when an SSM predicts this many leading continuation tokens",
    )
    d.add_argument(
        "--heldout-samples", type=int, default=256, help="samples from the corpus's held-out tail, for the report"
    )
    d.add_argument("--prompts", type=int, default=200, help="held-out prompts written to prompts.jsonl")
    d.add_argument("--max-corpus-bytes", type=int, default=0, help="read at most this much of the corpus (0: all)")
    d.add_argument("--seed", type=int, default=1, help="seed of every training run")
    d.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    d.add_argument(
        "--save-dtype",
        default="float16",
        choices=["float32", "float16", "bfloat16"],
        help="dtype of the saved checkpoints",
    )


def demo_config(args: argparse.Namespace) -> DemoConfig:
    from specinfer.training.corpus import stdlib_dir

    common = TrainSettings(
        steps=1, seed=args.seed, device=args.device, save_dtype=args.save_dtype, checkpoint_every=100
    )
    return DemoConfig(
        out=Path(args.out),
        corpus=tuple(Path(p) for p in args.corpus) if args.corpus else (stdlib_dir(),),
        prompt_source=tuple(Path(p) for p in args.prompt_source) if args.prompt_source else (stdlib_dir(),),
        vocab_size=args.vocab_size,
        llm_arch=ArchSpec.parse(args.llm_arch, "llm-arch"),
        ssm_arch=ArchSpec.parse(args.ssm_arch, "ssm-arch"),
        llm=replace(
            common,
            steps=args.llm_steps,
            batch_size=args.llm_batch_size,
            seq_len=args.llm_seq_len,
            lr=2e-3,
            warmup=50,
            kd_weight=0.0,
        ),
        ssm=replace(common, steps=args.ssm_steps, batch_size=32, seq_len=128, lr=3e-3, warmup=30, kd_weight=1.0),
        boost=replace(common, steps=args.boost_steps, batch_size=32, lr=1e-3, warmup=20, kd_weight=0.5),
        ssms=args.ssms,
        samples=args.samples,
        heldout_samples=args.heldout_samples,
        prompt_tokens=48,
        continuation_tokens=16,
        cover_tokens=args.cover_tokens,
        prompts=args.prompts,
        max_corpus_bytes=args.max_corpus_bytes,
    )


def run_demo(cfg: DemoConfig, log=None) -> dict:
    log = log or sys.stderr  # resolved per call: a default of sys.stderr would pin the stream at import
    from specinfer.training.corpus import source_files
    from specinfer.training.distill import train

    work = cfg.out / WORK
    work.mkdir(parents=True, exist_ok=True)
    times = _StageTimes(work / "seconds.json")

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        with times.stage("tokenizer"):
            _train_tokenizer(cfg, tok_dir, log)

    llm_dir = cfg.out / "llm"
    if not (llm_dir / "training.json").is_file():
        with times.stage("llm"):
            train_stream, val_stream = corpus_tokens(tok_dir, cfg.corpus, cfg.max_corpus_bytes, 0.02, log)
            model = new_llama(cfg.llm_arch, cfg.vocab_size, cfg.max_positions, seed=cfg.llm.seed)
            s = cfg.llm
            train(
                model,
                None,
                window_batches(train_stream, s.batch_size, s.seq_len, s.seed),
                s,
                llm_dir,
                tok_dir,
                val_windows(val_stream, s.seq_len),
                desc="llm",
                log=log,
            )

    base = work / "ssm-base"
    if not (base / "training.json").is_file():
        with times.stage("ssm_base"):
            source = StudentSource(
                llm_dir, cfg.corpus, config=_shape(cfg.ssm_arch), max_corpus_bytes=cfg.max_corpus_bytes
            )
            run_train_ssm(TrainSsmConfig(source, base, cfg.ssm), log)

    boost = BoostConfig(
        StudentSource(llm_dir, cfg.corpus, init=base, max_corpus_bytes=cfg.max_corpus_bytes),
        cfg.ssms,
        work / "boost",
        cfg.boost,
        samples=cfg.samples,
        heldout_samples=cfg.heldout_samples,
        prompt_tokens=cfg.prompt_tokens,
        continuation_tokens=cfg.continuation_tokens,
        cover_tokens=cfg.cover_tokens,
    )
    if not (work / "boost" / BOOST_REPORT).is_file():
        with times.stage("boost"):
            run_boost(boost, log)
    boost_report = json.loads((work / "boost" / BOOST_REPORT).read_text())

    for k in range(cfg.ssms):
        _copy_checkpoint(work / "boost" / f"ssm-{k}", cfg.out / ("ssm" if k == 0 else f"ssm-{k}"))
    _write_prompts(cfg, log)
    report = {
        "recipe": "specinfer train-demo",
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
        # wall seconds of each stage when it ran (an interrupted stage: its last, resumed run)
        "seconds": times.seconds | {"total": round(sum(times.seconds.values()), 1)},
        "corpus_files": len(source_files(cfg.corpus)),
        "llm": _training_summary(llm_dir),
        "ssm_base": _training_summary(base),
        "boost": {k: boost_report[k] for k in ("ssms", "train", "heldout")},
    }
    (cfg.out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"train-demo: {cfg.out} in {report['seconds']['total'] / 60:.1f} min", file=log)
    return report


class _StageTimes:
    """Wall seconds per stage, kept in a file so a resumed recipe reports every stage's time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}

    @contextmanager
    def stage(self, name: str):
        """Record the wall time of the ``with`` body as stage ``name``."""
        started = time.monotonic()
        yield
        self.seconds[name] = round(time.monotonic() - started, 1)
        self.path.write_text(json.dumps(self.seconds) + "\n")


def _shape(a: ArchSpec) -> str:
    return ",".join(f"{k}={v}" for k, v in asdict(a).items())


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """Replace ``dst`` by the model files of ``src`` (no training state)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            shutil.copyfile(f, dst / f.name)


def _training_summary(folder: Path) -> dict:
    r = json.loads((folder / "training.json").read_text())
    return {k: r.get(k) for k in ("parameters", "steps", "seconds", "final_loss", "val_loss")}


def _train_tokenizer(cfg: DemoConfig, tok_dir: Path, log) -> None:
    from transformers import PreTrainedTokenizerFast

    from specinfer.training.corpus import SPECIAL_TOKENS, read_texts, source_files, train_tokenizer

    texts = read_texts(source_files(cfg.corpus), cfg.max_corpus_bytes)
    print(f"tokenizer: byte-level BPE, vocabulary {cfg.vocab_size}, on {len(texts)} files", file=log, flush=True)
    tok = train_tokenizer(texts, cfg.vocab_size)
    bos, eos, unk = SPECIAL_TOKENS
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk).save_pretrained(tok_dir)


def _write_prompts(cfg: DemoConfig, log) -> None:
    """Held-out prompts: fragments of files the models never saw (the test folders)."""
    from specinfer.training.corpus import code_prompts, read_texts, source_files

    files = source_files(cfg.prompt_source, tests=True)
    if not files:  # no test folders: fall back to the corpus's last files (the validation tail)
        files = source_files(cfg.corpus)[-20:]
    prompts = code_prompts(read_texts(files), cfg.prompts, seed=cfg.llm.seed)
    with open(cfg.out / "prompts.jsonl", "w") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i:03d}", "text": text}) + "\n")
    print(f"prompts: {len(prompts)} held-out prompts from {len(files)} files", file=log)
