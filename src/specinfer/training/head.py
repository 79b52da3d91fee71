"""``specinfer train-head``: train a feature-level draft head (:mod:`specinfer.models.draft_head`) for a
local LLM by self-distillation on a text corpus.

Each step draws ``batch_size`` corpus windows of ``seq_len`` tokens (they depend on (seed, step) only, so a
resumed run sees the batches the uninterrupted one would have), runs the LLM on them (the native backend) for
its features ``F`` and feeds the head the pairs ``(F[:, :-1] + noise, E(x[:, 1:]))``. Its predictions ``P``
of ``F[:, 1:]`` are scored as in EAGLE-1: ``(1 - w) * smooth_l1(P, F[:, 1:]) + w * KL(LLM || LM head(P))``,
``w`` = ``--kd-weight``; the targets are the LLM's own distributions, not the corpus's tokens. The noise
(uniform, ``noise`` times the features' std) stands in for the error of the head's own predicted features,
which it reads below depth 1. With ``unroll`` 2 a second, unrolled step (:func:`predict`) reads those
predictions for real and is scored the same way.

Depth-1 accuracy: how often the LM head's argmax of a prediction is the LLM's argmax at that position;
depth 2: the same for the unrolled step (the head's predicted feature with the token after it).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.core import InvalidArgument
from specinfer.models.draft_head import DraftHead, HeadConfig, load_head, save_head
from specinfer.training.distill import CHECKPOINTS, TRAINER_STATE, TrainSettings, lr_at

TRAINING_JSON = "training.json"


@dataclass(frozen=True)
class HeadShape:
    """The head's widths; 0: derived from ``hidden`` (itself from the LLM's feature width, :meth:`resolve`)."""

    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0

    def resolve(self, feature_dim: int, vocab_size: int, norm_eps: float, llm: str) -> HeadConfig:
        """Defaults: hidden min(feature_dim, 1024), heads of 64 dims, GQA 4:1 from 8 heads, SwiGLU ~8/3 hidden."""
        hidden = self.hidden or min(feature_dim, 1024)
        heads = self.heads or max(1, hidden // 64)
        kv_heads = self.kv_heads or (heads // 4 if heads >= 8 and heads % 4 == 0 else heads)
        head_dim = self.head_dim or max(2, hidden // heads // 2 * 2)
        intermediate = self.intermediate or (hidden * 8 // 3 + 63) // 64 * 64
        try:
            return HeadConfig(
                feature_dim, vocab_size, hidden, heads, kv_heads, head_dim, intermediate, norm_eps=norm_eps, llm=llm
            )
        except ValueError as exc:
            raise InvalidArgument("heads", str(exc)) from None


@dataclass(frozen=True)
class TrainHeadConfig:
    """``specinfer train-head``: ``settings`` as train-ssm's (``kd_weight``: the KL term's share of the loss);
    ``dtype``: the LLM's while it computes features; ``resume`` None: resume when ``out`` has a checkpoint."""

    llm: Path
    corpus: tuple[Path, ...]
    out: Path
    settings: TrainSettings
    shape: HeadShape = HeadShape()
    noise: float = 0.1
    unroll: int = 1
    dtype: str = "float32"
    threads: int = 0
    resume: bool | None = None
    log_every: int = 50
    heldout_windows: int = 16
    max_corpus_bytes: int = 0
    val_fraction: float = 0.02
    cache_features: bool = False  # the LLM's features of the stream computed once (training.head_cache)
    draft_vocab: int = 0  # tokens of the draft vocabulary written beside the head (training.head_vocab; 0: none)

    def validate(self) -> None:
        from specinfer.models.loading import check_checkpoint

        self.settings.validate()
        check_checkpoint(self.llm, "llm")
        if self.unroll not in (1, 2):
            raise InvalidArgument("unroll", "1 or 2")
        if self.draft_vocab < 0:
            raise InvalidArgument("draft-vocab", "must be >= 0 (0: the whole vocabulary)")
        if self.noise < 0 or self.log_every <= 0 or self.heldout_windows <= 0:
            name = "noise" if self.noise < 0 else "log-every" if self.log_every <= 0 else "heldout-windows"
            raise InvalidArgument(name, "must be >= 0" if name == "noise" else "must be > 0")
        if self.settings.seq_len < 3:
            raise InvalidArgument("seq-len", "must be >= 3 (a pair and its unrolled successor)")


def load_llm(path: Path, dtype: str, device: str, windows: int, seq_len: int):
    """The LLM on the native backend with KV rows for ``windows`` windows of ``seq_len`` tokens."""
    from specinfer.models.dtypes import DTYPES
    from specinfer.models.native.backend import NativeBackend, NativeOptions
    from specinfer.models.native.kv_pool import KVPool
    from specinfer.models.native.spec import ModelSpec

    spec = ModelSpec.from_dir(path)
    if seq_len > spec.positions_limit:
        raise InvalidArgument("seq-len", f"the LLM has {spec.positions_limit} positions")
    per_row = KVPool.bytes_per_token(spec, DTYPES[dtype])
    options = NativeOptions(DTYPES[dtype], device, per_row * (seq_len + 1) * windows, seq_len, max_tree_nodes=1)
    return NativeBackend.load(path, options)


class Teacher:
    """The LLM's side of a batch: features, embeddings and logits of windows of tokens."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.device = llm.device

    def features(self, windows: torch.Tensor) -> torch.Tensor:
        """Features of every position of each window  # [B, S] -> [B, S, feature_dim] float32."""
        from specinfer.models.interface import TreeForward

        batch = [TreeForward(f"w{i}", w[:-1].tolist(), [int(w[-1])], [-1]) for i, w in enumerate(windows)]
        try:
            _, feats = self.llm.forward_tree_features(batch)
        finally:
            for b in batch:
                self.llm.release(b.request_id)
        return torch.stack([f.float() for f in feats]).clone()  # out of inference mode: autograd may read it

    def embeds(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, feature_dim] float32
        with torch.inference_mode():
            rows = self.llm.embed_rows(tokens.reshape(-1).to(self.device)).float()
        return rows.clone().view(*tokens.shape, -1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [..., feature_dim] -> [..., vocab] float32
        # the head trains in float32; the LLM's LM head is in its own dtype (bfloat16 with --dtype bfloat16), and
        # the cast keeps the gradient of the distillation term flowing back into the head's features
        rows = features.reshape(-1, features.shape[-1]).to(self.llm.options.dtype)
        return self.llm.lm_logits(rows).float().view(*features.shape[:-1], -1)


def predict(head: DraftHead, feats: torch.Tensor, embeds: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """Predictions of pairs ``(feats[:, j], embeds[:, j])``  # [B, N, F] x2: teacher-forced (feature j + 1),
    and with ``unroll`` 2 also those of pairs ``(first[:, j], embeds[:, j + 1])`` that read the first step's
    prediction ``first[:, j]`` of feature j + 1 (feature j + 2), attending to the true pairs before them and to
    themselves, as a drafted node does.  # [[B, N, F]] or [[B, N, F], [B, N - 1, F]]"""
    c = head.config
    b, n, _ = feats.shape
    x = head.inputs(feats, embeds)  # [B, N, hidden]
    q, k, v = head.keys_values(x.reshape(b * n, -1), torch.arange(n, device=x.device).repeat(b), n)
    q, k, v = (t.view(b, n, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, heads, N, head_dim]
    gqa = c.heads != c.kv_heads
    first = head.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2))
    if unroll < 2:
        return [first]
    x2 = head.inputs(first[:, :-1], embeds[:, 1:])  # pairs at positions 1 .. N - 1
    q2, k2, v2 = head.keys_values(x2.reshape(b * (n - 1), -1), torch.arange(1, n, device=x.device).repeat(b), n)
    q2, k2, v2 = (t.view(b, n - 1, -1, c.head_dim).transpose(1, 2) for t in (q2, k2, v2))
    keys, values = torch.cat([k[:, :, :-1], k2], 2), torch.cat([v[:, :, :-1], v2], 2)  # true pairs, then itself
    eye = torch.eye(n - 1, dtype=torch.bool, device=x.device)
    mask = torch.cat([torch.ones_like(eye).tril(), eye], 1)  # [N - 1, 2 (N - 1)]
    attended = F.scaled_dot_product_attention(q2, keys, values, attn_mask=mask, enable_gqa=gqa)
    return [first, head.finish(x2, attended.transpose(1, 2))]


def step_loss(
    head: DraftHead,
    teacher: Teacher,
    windows: torch.Tensor,
    s: TrainSettings,
    noise: float,
    unroll: int,
    gen=None,
    feats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The loss of a batch of windows  # [B, S] and the head's accuracy at each depth (vs the LLM's argmax).
    ``gen``: the noise's generator (None: no noise, for measuring); ``feats``: the windows' features if known
    (a :class:`~specinfer.training.head_cache.FeatureCache`). Training with ``kd_weight`` 0 computes no logits
    (the LM head's products are then most of a step) and reports no accuracy."""
    feats = teacher.features(windows) if feats is None else feats  # [B, S, F]
    embeds = teacher.embeds(windows[:, 1:])  # [B, S - 1, F]: the token after each pair's feature
    if s.kd_weight == 0 and gen is not None:
        preds = predict(head, _noisy(feats[:, :-1], noise, gen), embeds, unroll)
        return sum(F.smooth_l1_loss(p, feats[:, 1 + d :]) for d, p in enumerate(preds)), []
    with torch.no_grad():
        target_logp = F.log_softmax(teacher.logits(feats[:, 1:]) / s.kd_temperature, -1)  # [B, S - 1, V]
    inputs = _noisy(feats[:, :-1], noise, gen)
    loss, accuracy = torch.zeros((), device=feats.device), []
    for depth, pred in enumerate(predict(head, inputs, embeds, unroll)):
        target, logp = feats[:, 1 + depth :], target_logp[:, depth:]
        logits = teacher.logits(pred)
        kl = F.kl_div(F.log_softmax(logits / s.kd_temperature, -1), logp, log_target=True, reduction="none")
        part = (1 - s.kd_weight) * F.smooth_l1_loss(pred, target) + s.kd_weight * s.kd_temperature**2 * kl.sum(
            -1
        ).mean()
        loss = loss + part
        accuracy.append(float((logits.argmax(-1) == logp.argmax(-1)).float().mean()))
    return loss, accuracy


def _noisy(inputs: torch.Tensor, noise: float, gen) -> torch.Tensor:
    """``inputs`` plus uniform noise of ``noise`` times their std (none without a generator)."""
    if gen is None or noise <= 0:
        return inputs
    u = torch.rand(inputs.shape, generator=gen).to(inputs.device) * 2 - 1
    return inputs + u * (noise * float(inputs.std()))


@torch.no_grad()
def heldout_accuracy(head: DraftHead, teacher: Teacher, windows: torch.Tensor, s: TrainSettings) -> list[float]:
    """Depth-1 and depth-2 (unrolled) accuracy on held-out windows, 8 at a time, no noise."""
    was = head.training
    head.eval()
    sums, count = [0.0, 0.0], 0
    for i in range(0, len(windows), 8):
        part = windows[i : i + 8]
        _, acc = step_loss(head, teacher, part, s, 0.0, 2)
        sums = [a + b * len(part) for a, b in zip(sums, acc, strict=True)]
        count += len(part)
    head.train(was)
    return [round(a / count, 4) for a in sums]


def new_head(cfg: TrainHeadConfig, teacher: Teacher) -> DraftHead:
    from specinfer.models.draft_head import llm_signature

    raw = json.loads((cfg.llm / "config.json").read_text())
    eps = float((raw.get("text_config") or raw).get("rms_norm_eps", 1e-6))
    config = cfg.shape.resolve(teacher.llm.feature_dim, teacher.llm.vocab_size, eps, llm_signature(raw))
    torch.manual_seed(cfg.settings.seed)
    head = DraftHead(config)
    return head.to(teacher.device)


def _checkpoint(head: DraftHead, opt, step: int, record: dict, out: Path, keep: int) -> None:
    """``out/checkpoints/step-N``: the head and (written last) the optimizer state and record so far."""
    folder = out / CHECKPOINTS / f"step-{step}"
    save_head(head, folder)
    tmp = folder / (TRAINER_STATE + ".tmp")
    torch.save({"step": step, "optimizer": opt.state_dict(), "record": record}, tmp)
    tmp.rename(folder / TRAINER_STATE)
    old = sorted((out / CHECKPOINTS).glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def _resume(cfg: TrainHeadConfig, head: DraftHead, opt, log) -> tuple[int, dict]:
    """The step to start at and the record so far (losses, accuracies, seconds), from the newest checkpoint."""
    from specinfer.training.distill import latest_checkpoint

    record = {"losses": [], "accuracy": [], "heldout": [], "seconds": 0.0}
    if cfg.resume is False:
        shutil.rmtree(cfg.out / CHECKPOINTS, ignore_errors=True)
    last = latest_checkpoint(cfg.out)
    if last is None:
        return 0, record
    saved = load_head(last, device=head.final_norm.device)
    if saved.config != head.config:
        raise InvalidArgument("resume", f"{last} holds a head of another shape ({saved.config}); give --no-resume")
    head.load_state_dict(saved.state_dict())
    state = torch.load(last / TRAINER_STATE, map_location=head.final_norm.device, weights_only=False)
    opt.load_state_dict(state["optimizer"])
    print(f"train-head: resuming from {last} (step {state['step']}/{cfg.settings.steps})", file=log, flush=True)
    return state["step"], state["record"]


def _optimizer(head: DraftHead, s: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in head.parameters() if p.ndim >= 2]
    rest = [p for p in head.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95))


def run_train_head(cfg: TrainHeadConfig, log=None) -> dict:
    """Train (or resume training) a head into ``cfg.out``; returns the report also in ``out/training.json``."""
    from tqdm import tqdm

    from specinfer.training.corpus import random_windows, step_generator
    from specinfer.training.distill import resolve_device
    from specinfer.training.head_vocab import write_draft_vocab
    from specinfer.training.sources import corpus_tokens

    log = log or sys.stderr  # resolved per call: a default of sys.stderr would pin the stream at import
    cfg.validate()
    s = cfg.settings
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train_stream, val_stream = corpus_tokens(cfg.llm, cfg.corpus, cfg.max_corpus_bytes, cfg.val_fraction, log)
    if min(len(train_stream), len(val_stream)) <= s.seq_len:
        raise InvalidArgument("corpus", f"too short for windows of {s.seq_len} tokens (train and held-out parts)")
    device = str(resolve_device(s.device))
    teacher = Teacher(load_llm(cfg.llm, cfg.dtype, device, max(8, s.batch_size), s.seq_len))
    if cfg.draft_vocab > teacher.llm.vocab_size:  # refused before the features are cached and the head trained
        raise InvalidArgument("draft-vocab", f"must be at most the LLM's vocabulary, {teacher.llm.vocab_size}")
    heldout = random_windows(val_stream, cfg.heldout_windows, s.seq_len, torch.Generator().manual_seed(12345))
    cache = _feature_cache(cfg, teacher, train_stream, log) if cfg.cache_features else None
    head = new_head(cfg, teacher).train()
    opt = _optimizer(head, s)
    start, record = _resume(cfg, head, opt, log)
    params = sum(p.numel() for p in head.parameters())
    print(f"train-head: head {head.config} ({params / 1e6:.2f} M parameters)", file=log, flush=True)
    began = time.monotonic() - record["seconds"]
    bar = tqdm(total=s.steps, initial=start, desc="train-head", file=log, dynamic_ncols=True, mininterval=2.0)
    for step in range(start, s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        gen = step_generator(s.seed, step)
        if cache is None:
            windows, feats = random_windows(train_stream, s.batch_size, s.seq_len, gen), None
        else:
            windows, feats = cache.windows(s.batch_size, s.seq_len, gen)
        loss, acc = step_loss(head, teacher, windows, s, cfg.noise, cfg.unroll, gen, feats)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), s.grad_clip)
        opt.step()
        record["losses"].append(round(loss.item(), 4))
        record["accuracy"].append([round(a, 4) for a in acc])
        bar.update(1)
        done = step + 1
        if done % cfg.log_every == 0 or done == s.steps:
            held = heldout_accuracy(head, teacher, heldout, s)
            record["heldout"].append({"step": done, "depth1": held[0], "depth2": held[1]})
            recent = record["losses"][-cfg.log_every :]
            bar.write(
                f"train-head: step {done}/{s.steps} loss {sum(recent) / len(recent):.4f} "
                f"held-out depth-1 accuracy {held[0]:.3f} depth-2 {held[1]:.3f}",
                file=log,
            )
        if done % s.checkpoint_every == 0 or done == s.steps:
            record["seconds"] = round(time.monotonic() - began, 1)
            _checkpoint(head, opt, done, record, cfg.out, s.keep_checkpoints)
    bar.close()
    report = _finish(cfg, head, teacher, heldout, record, start, time.monotonic() - began, log)
    if cfg.draft_vocab:
        write_draft_vocab(cfg.out, torch.cat([train_stream, val_stream]), head.config.vocab_size, cfg.draft_vocab, log)
    return report


def _feature_cache(cfg: TrainHeadConfig, teacher: Teacher, stream: torch.Tensor, log):
    from tqdm import tqdm

    from specinfer.training.head_cache import FeatureCache

    s = cfg.settings
    with tqdm(total=len(stream), desc="LLM features", unit="tok", file=log, mininterval=5.0) as bar:
        return FeatureCache.build(teacher, stream, s.seq_len, max(8, s.batch_size), bar)


def _finish(cfg: TrainHeadConfig, head, teacher, heldout, record: dict, start: int, seconds: float, log) -> dict:
    """Write the head (``--save-dtype``) with its training record, and ``training.json``; log the result."""
    s = cfg.settings
    held = record["heldout"][-1] if record["heldout"] and record["heldout"][-1]["step"] == s.steps else None
    if held is None:
        d1, d2 = heldout_accuracy(head, teacher, heldout, s)
        held = {"step": s.steps, "depth1": d1, "depth2": d2}
    params = sum(p.numel() for p in head.parameters())
    report = {
        "trained_steps": s.steps,
        "resumed_from_step": start,
        "seconds": round(seconds, 1),
        "first_loss": record["losses"][0] if record["losses"] else None,
        "final_loss": round(sum(record["losses"][-20:]) / max(1, len(record["losses"][-20:])), 4),
        "heldout_depth1_accuracy": held["depth1"],
        "heldout_depth2_accuracy": held["depth2"],
        "parameters": params,
        "llm_path": str(cfg.llm),
        "training": {**asdict(replace(cfg, settings=None)), "settings": asdict(s)},
    }
    report = json.loads(json.dumps(report, default=str))
    save_head(head, cfg.out, report, dtype=s.save_dtype)
    (cfg.out / TRAINING_JSON).write_text(json.dumps({**report, **record}, indent=1) + "\n")
    size = (cfg.out / "model.safetensors").stat().st_size
    print(
        f"train-head: {cfg.out} ({params / 1e6:.2f} M parameters, {size / 1e6:.1f} MB) in {seconds:.0f} s; "
        f"held-out accuracy depth 1 {held['depth1']:.3f}, depth 2 {held['depth2']:.3f}",
        file=log,
    )
    return report
