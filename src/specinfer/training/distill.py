"""The training loop: a student causal LM learns from a teacher's distributions (distillation)
and/or from the data's next tokens, with periodic Hugging Face checkpoints and exact resume.

A *batch source* is a function of the step number that returns ``(input_ids, labels, mask)``;
batches depend only on (seed, step), so a resumed run sees exactly the batches the uninterrupted
run would have seen.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.models.dtypes import DTYPES

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids [B, T], labels [B, T], mask [B, T] bool
BatchSource = Callable[[int], Batch]
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer.pt"


@dataclass(frozen=True)
class TrainSettings:
    """``kd_weight``: 1 = learn the teacher's distribution only (distillation), 0 = the data's next
    tokens only (no teacher needed); in between, a mix. ``kd_temperature`` softens both sides of
    the KL term. The learning rate warms up linearly for ``warmup`` steps, then follows a cosine
    down to ``min_lr_ratio`` of its peak."""

    steps: int
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    kd_weight: float = 1.0
    kd_temperature: float = 1.0
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    device: str = "auto"
    save_dtype: str = "float32"

    def validate(self) -> None:
        from specinfer.core import InvalidArgument

        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(name.replace("_", "-"), "must be > 0")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise InvalidArgument("kd-weight", "must be in [0, 1]")
        if self.lr <= 0 or self.kd_temperature <= 0:
            raise InvalidArgument("lr" if self.lr <= 0 else "kd-temperature", "must be > 0")
        if self.save_dtype not in DTYPES:
            raise InvalidArgument("save-dtype", f"one of {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidArgument("device", "auto, cpu, cuda or cuda:N")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(step: int, s: TrainSettings) -> float:
    """Learning rate of ``step`` (0-based): linear warm-up, then cosine decay."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def distill_loss(
    student_logits: torch.Tensor,  # [B, T, V]
    teacher_logits: torch.Tensor | None,  # [B, T, V]
    labels: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T] bool: positions that count
    kd_weight: float,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(1 - kd_weight) * cross-entropy on ``labels`` + kd_weight * KL(teacher || student), both
    averaged over the masked positions; the KL is scaled by temperature^2 (Hinton et al.)."""
    s = student_logits[mask].float()  # [M, V]
    loss = torch.zeros((), device=s.device)
    if kd_weight < 1.0 or teacher_logits is None:
        loss = (1.0 - kd_weight if teacher_logits is not None else 1.0) * F.cross_entropy(s, labels[mask])
    if teacher_logits is not None and kd_weight > 0.0:
        t = teacher_logits[mask].float()  # [M, V]
        kl = F.kl_div(
            F.log_softmax(s / temperature, -1),
            F.log_softmax(t / temperature, -1),
            log_target=True,
            reduction="batchmean",
        )
        loss = loss + kd_weight * temperature**2 * kl
    return loss


def save_model(model: torch.nn.Module, out: Path, dtype: str, tokenizer_dir: Path | None) -> None:
    """A Hugging Face checkpoint folder (config, safetensors, generation config, tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    m = (
        model
        if DTYPES[dtype] == torch.float32 and next(model.parameters()).device.type == "cpu"
        else copy.deepcopy(model).cpu()
    )
    m = m.to(DTYPES[dtype])
    m.config.dtype = DTYPES[dtype]
    m.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out / name)


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint under ``out/checkpoints`` (one with its trainer state)."""
    root = out / CHECKPOINTS
    done = [p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file()] if root.is_dir() else []
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Batch], device: torch.device) -> float:
    """Mean next-token cross-entropy (nats/token) over the masked positions of ``batches``."""
    model.eval()
    total, count = 0.0, 0
    for ids, labels, mask in batches:
        logits = model(input_ids=ids.to(device)).logits
        total += float(
            F.cross_entropy(logits[mask.to(device)].float(), labels.to(device)[mask.to(device)], reduction="sum")
        )
        count += int(mask.sum())
    model.train()
    return total / max(1, count)


def train(
    student: torch.nn.Module,
    teacher: torch.nn.Module | None,
    batches: BatchSource,
    settings: TrainSettings,
    out: Path,
    tokenizer_dir: Path | None,
    val_batches: list[Batch] | None = None,
    desc: str = "train",
    log=None,
) -> dict:
    """Train ``student`` for ``settings.steps`` steps (resuming from the newest checkpoint under
    ``out`` if there is one) and write the final model to ``out``; returns the report, also
    written to ``out/training.json``."""
    from tqdm import tqdm

    log = log or sys.stderr
    settings.validate()
    if teacher is None and settings.kd_weight > 0:
        raise ValueError("distillation (kd_weight > 0) needs a teacher")
    device = resolve_device(settings.device)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    student.to(device).train()
    if teacher is not None:
        teacher.to(device).eval().requires_grad_(False)
    opt = _optimizer(student, settings)
    start, losses = _resume(student, opt, out, device, settings, desc, log)
    started = time.monotonic()
    bar = tqdm(total=settings.steps, initial=start, desc=desc, file=log, dynamic_ncols=True, mininterval=2.0)
    for step in range(start, settings.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings)
        ids, labels, mask = (t.to(device) for t in batches(step))
        teacher_logits = None
        if teacher is not None and settings.kd_weight > 0:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=ids).logits
        loss = distill_loss(
            student(input_ids=ids).logits, teacher_logits, labels, mask, settings.kd_weight, settings.kd_temperature
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), settings.grad_clip)
        opt.step()
        losses.append(round(loss.item(), 4))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        done = step + 1
        if done % settings.checkpoint_every == 0 and done < settings.steps:
            _checkpoint(student, opt, done, losses, out, settings, tokenizer_dir)
    bar.close()
    report = {
        "steps": settings.steps,
        "resumed_from_step": start,
        "seconds": round(time.monotonic() - started, 1),
        "first_loss": losses[0] if losses else None,
        "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
        "settings": asdict(settings),
        "parameters": sum(p.numel() for p in student.parameters()),
    }
    if val_batches:
        report["val_loss"] = round(evaluate(student, val_batches, device), 4)
    save_model(student, out, settings.save_dtype, tokenizer_dir)
    (out / "training.json").write_text(json.dumps({**report, "losses": losses}, indent=1) + "\n")
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    return report


def _optimizer(student: torch.nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW, with weight decay on the matrices only (not on norms and biases)."""
    decay = [p for n, p in student.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in student.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )


def _resume(
    student: torch.nn.Module,
    opt: torch.optim.Optimizer,
    out: Path,
    device: torch.device,
    settings: TrainSettings,
    desc: str,
    log,
) -> tuple[int, list[float]]:
    """The step to start at and the losses so far: from the newest checkpoint under ``out`` (its weights and
    optimizer state loaded), else 0 and none."""
    resume = latest_checkpoint(out)
    if resume is None:
        return 0, []
    from safetensors.torch import load_file

    state = torch.load(resume / TRAINER_STATE, map_location=device, weights_only=False)
    weights = load_file(resume / "model.safetensors", device=str(device))
    student.load_state_dict(weights, strict=False)  # tied weights are saved once
    opt.load_state_dict(state["optimizer"])
    start, losses = state["step"], state["losses"]
    print(f"{desc}: resuming from {resume} (step {start}/{settings.steps})", file=log, flush=True)
    return start, losses


def _checkpoint(
    student, opt, step: int, losses: list[float], out: Path, s: TrainSettings, tokenizer_dir: Path | None
) -> None:
    """Write ``out/checkpoints/step-N`` (a loadable float32 checkpoint plus the optimizer state,
    written last so a half-written folder is never resumed from); keep the newest few."""
    folder = out / CHECKPOINTS / f"step-{step}"
    save_model(student, folder, "float32", tokenizer_dir)
    tmp = folder / (TRAINER_STATE + ".tmp")
    torch.save({"step": step, "optimizer": opt.state_dict(), "losses": losses}, tmp)
    tmp.rename(folder / TRAINER_STATE)
    old = sorted((p for p in (out / CHECKPOINTS).glob("step-*")), key=lambda p: int(p.name.split("-")[1]))
    for p in old[: -s.keep_checkpoints]:
        shutil.rmtree(p, ignore_errors=True)
