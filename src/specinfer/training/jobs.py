"""The jobs ``specinfer train-ssm`` and ``specinfer boost-tune`` run: each takes one frozen
config, does the work and returns a report (also written as JSON beside the checkpoints).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specinfer.core import InvalidArgument
from specinfer.training.distill import TrainSettings
from specinfer.training.sources import StudentSource, load_model, val_windows, window_batches

BOOST_REPORT = "boost_report.json"


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
        return Samples(saved["prompts"], saved["continuations"]), Samples(
            saved["heldout_prompts"], saved["heldout_continuations"]
        )
    train_stream, val_stream = cfg.source.tokens(cfg.val_fraction, log)
    g = torch.Generator().manual_seed(cfg.settings.seed)
    prompts = random_windows(train_stream, cfg.samples, cfg.prompt_tokens, g)
    held = random_windows(val_stream, cfg.heldout_samples, cfg.prompt_tokens, g) if cfg.heldout_samples else prompts[:0]
    device = resolve_device(cfg.settings.device)
    with tqdm(total=len(prompts) + len(held), desc="LLM continuations", file=log, mininterval=2.0) as bar:
        cont = greedy_continuations(llm, prompts, cfg.continuation_tokens, 64, device, bar)
        held_cont = greedy_continuations(llm, held, cfg.continuation_tokens, 64, device, bar) if len(held) else cont[:0]
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"prompts": prompts, "continuations": cont, "heldout_prompts": held, "heldout_continuations": held_cont}, path
    )
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
                raise InvalidArgument(
                    "ssms",
                    f"SSMs 0..{k - 1} cover every sample; "
                    "ask for fewer SSMs, more --samples or a larger --cover-tokens",
                )
            missed = f"those SSMs 0..{k - 1} missed" if k else "all"
            print(
                f"boost-tune: SSM {k} trains on {len(idx)} of {len(samples)} samples ({missed})", file=log, flush=True
            )
            s = replace(cfg.settings, seed=cfg.settings.seed + k)
            student = cfg.source.student(llm)
            report = train(
                student,
                llm if s.kd_weight > 0 else None,
                subset_batches(samples, idx, s.batch_size, s.seed),
                s,
                out,
                cfg.source.llm,
                desc=f"ssm-{k}",
                log=log,
            )
            rounds.append({"ssm": k, "trained_on": idx.tolist(), "training": report})
        # coverage of the checkpoint as written (in its saved dtype), not of the in-memory copy
        saved = load_model(out)
        train_matches.append(greedy_matches(saved, samples, 64, device))
        held_matches.append(
            greedy_matches(saved, heldout, 64, device)
            if len(heldout)
            else torch.zeros(0, cfg.continuation_tokens, dtype=torch.bool)
        )
        rounds[k]["coverage_after"] = coverage_summary(train_matches, cfg.cover_tokens)
        if not done.is_file():
            done.write_text(json.dumps(rounds[k]) + "\n")
    report = {
        "config": json.loads(json.dumps({k: v for k, v in asdict(cfg).items() if k != "settings"}, default=str)),
        "settings": asdict(cfg.settings),
        "seconds": round(time.monotonic() - started, 1),
        "ssms": [
            {"ssm": r["ssm"], "path": str(cfg.out / f"ssm-{r['ssm']}"), "trained_on_samples": len(r["trained_on"])}
            for r in rounds
        ],
        "train": coverage_summary(train_matches, cfg.cover_tokens),
        "heldout": coverage_summary(held_matches, cfg.cover_tokens) if len(heldout) else None,
    }
    (cfg.out / BOOST_REPORT).write_text(json.dumps(report, indent=1) + "\n")
    t, h = report["train"], report["heldout"] or report["train"]
    print(
        f"boost-tune: coverage per SSM {t['coverage']} combined {t['combined_coverage']} "
        f"(held-out {h['coverage']} combined {h['combined_coverage']})",
        file=log,
    )
    return report
