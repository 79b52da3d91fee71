"""Adaptive boost-tuning (SpecInfer, section 3.1): SSM k is fine-tuned only on the samples that
SSMs 0..k-1 all missed, so the SSMs learn different parts of the LLM's behaviour and their
merged token trees cover more of it than any one of them.

The pure parts (which samples are covered, which remain) are functions of tensors; the model
parts run batched, without gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specinfer.training.corpus import step_generator
from specinfer.training.distill import Batch


@dataclass(frozen=True)
class Samples:
    """Prompts cut from the corpus and the LLM's greedy continuations of them."""

    prompts: torch.Tensor  # [N, P] int64
    continuations: torch.Tensor  # [N, C] int64

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, idx: torch.Tensor) -> Samples:
        return Samples(self.prompts[idx], self.continuations[idx])

    def batch(self, idx: torch.Tensor) -> Batch:
        """Teacher-forced training batch of the samples ``idx``: loss only where the next token is
        one of the LLM's continuation tokens."""
        seq = torch.cat([self.prompts[idx], self.continuations[idx]], dim=1)  # [B, P + C]
        ids, labels = seq[:, :-1], seq[:, 1:]
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[:, self.prompts.shape[1] - 1 :] = True
        return ids, labels, mask


@torch.no_grad()
def greedy_continuations(
    llm: torch.nn.Module, prompts: torch.Tensor, length: int, batch_size: int, device: torch.device, progress=None
) -> torch.Tensor:
    """The LLM's greedy continuation of each prompt (argmax at every step, EOS not special).  # [N, length]"""
    llm.eval().to(device)
    out = []
    for b in range(0, len(prompts), batch_size):
        ids = prompts[b : b + batch_size].to(device)  # [B, P]
        res = llm(input_ids=ids, use_cache=True)
        cache, toks = res.past_key_values, []
        nxt = res.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        for _ in range(length):
            toks.append(nxt)
            if len(toks) == length:
                break
            res = llm(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
        out.append(torch.cat(toks, dim=1).cpu())
        if progress is not None:
            progress.update(len(ids))
    return torch.cat(out)


@torch.no_grad()
def greedy_matches(ssm: torch.nn.Module, samples: Samples, batch_size: int, device: torch.device) -> torch.Tensor:
    """Whether the SSM's top-1 token equals the LLM's at each continuation position, with the LLM's
    continuation fed in (teacher forcing).  # [N, C] bool"""
    was_training = ssm.training
    ssm.eval().to(device)
    P, out = samples.prompts.shape[1], []
    for b in range(0, len(samples), batch_size):
        idx = torch.arange(b, min(b + batch_size, len(samples)))
        ids, labels, _ = samples.batch(idx)
        pred = ssm(input_ids=ids.to(device)).logits[:, P - 1 :].argmax(-1).cpu()  # [B, C]
        out.append(pred == labels[:, P - 1 :])
    ssm.train(was_training)
    return torch.cat(out)


def covered(matches: torch.Tensor, cover_tokens: int) -> torch.Tensor:
    """Samples whose first ``cover_tokens`` continuation tokens the SSM predicts all.  # [N] bool"""
    return matches[:, :cover_tokens].all(dim=1)


def matched_prefix(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of matches per sample: the tokens a sequence speculation of the
    whole continuation would get accepted at the sample's first step.  # [N] int64"""
    return matches.long().cumprod(dim=1).sum(dim=1)


def uncovered(covered_by: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """Indices of the samples no SSM in ``covered_by`` covers (all of them when it is empty).  # [K]"""
    hit = torch.zeros(count, dtype=torch.bool)
    for c in covered_by:
        hit |= c
    return torch.nonzero(~hit).flatten()


def subset_batches(samples: Samples, idx: torch.Tensor, batch_size: int, seed: int):
    """Batch source over the samples ``idx`` only: each step draws ``batch_size`` of them at random."""

    def source(step: int) -> Batch:
        pick = torch.randint(0, len(idx), (batch_size,), generator=step_generator(seed, step))
        return samples.batch(idx[pick])

    return source


def coverage_summary(matches: Sequence[torch.Tensor], cover_tokens: int) -> dict:
    """Per-SSM and combined coverage and mean matched prefix of one sample set."""
    per = [covered(m, cover_tokens) for m in matches]
    prefixes = [matched_prefix(m) for m in matches]
    combined = torch.stack(per).any(0) if per else torch.zeros(0, dtype=torch.bool)
    return {
        "samples": int(matches[0].shape[0]) if matches else 0,
        "coverage": [round(float(c.float().mean()), 4) for c in per],
        "combined_coverage": round(float(combined.float().mean()), 4) if per else 0.0,
        "mean_matched_prefix": [round(float(p.float().mean()), 3) for p in prefixes],
        "combined_mean_matched_prefix": round(float(torch.stack(prefixes).max(0).values.float().mean()), 3)
        if prefixes
        else 0.0,
        "top1_agreement": [round(float(m.float().mean()), 4) for m in matches],
    }
