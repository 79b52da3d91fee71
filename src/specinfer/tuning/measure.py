"""Measurements the tuner needs: SSM ranks along the LLM's greedy output, and step costs.

Acceptance may be measured with a cheaper LLM that computes the same logits (e.g. the model an
inflated LLM was made from); costs are measured on the LLM that will serve.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.acceptance import nondecreasing
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.on_device import wait_for
from specinfer.tuning.model import CostModel

# a wide tree makes the LLM's greedy continuations cheap to produce (the output is the LLM's own)
CONTINUATION_TREE = ExpansionConfig((2, 2, 2, 1, 1, 1))


def greedy_continuations(
    llm: CausalLM, ssm: CausalLM, prompts: Sequence[Sequence[int]], new_tokens: int, batch: int = 8
) -> list[list[int]]:
    """The LLM's greedy continuation of every prompt (EOS ignored)."""
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=batch))
    spec = SpeculationConfig(CONTINUATION_TREE)
    requests = [
        GenerationRequest(f"tune-{i}", tuple(p), new_tokens, SamplingParams(), spec, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    return [list(r.output_tokens) for r in engine.generate(requests)]


@torch.inference_mode()
def ssm_ranks(ssm: CausalLM, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
    """Rank of each continuation token among the SSM's predictions, given the exact prefix.

    One teacher-forced pass: the chain root (the prompt's last token) + continuation[:-1];
    node i's logits predict continuation[i]."""
    chain = [prompt[-1], *continuation[:-1]]
    (logits,) = ssm.forward_tree(
        [TreeForward("tune-ranks", list(prompt[:-1]), chain, list(range(-1, len(chain) - 1)))]
    )  # [len(chain), vocab]
    ssm.release("tune-ranks")
    target = torch.tensor(continuation, dtype=torch.long, device=logits.device)
    own = logits.gather(1, target[:, None])  # [n, 1]
    return (logits > own).sum(dim=1).cpu().numpy().astype(np.int64)  # tokens strictly more likely


@torch.inference_mode()
def pass_seconds(
    model: CausalLM, contexts: Sequence[Sequence[int]], sizes: Sequence[int], reps: int
) -> dict[int, float]:
    """Median seconds of one batched ``forward_tree`` with ``n`` new nodes per request (a chain;
    the shape does not change the cost) on top of cached contexts, for each ``n`` in ``sizes``.
    Sizes are timed round-robin, so a slow spell of the machine spreads over all of them instead
    of skewing one; the medians are then made non-decreasing in ``n``."""
    ids = [f"tune-cost-{i}" for i in range(len(contexts))]
    model.forward_tree(
        [TreeForward(rid, list(c), [], []) for rid, c in zip(ids, contexts, strict=True)]
    )  # prefill once
    batches = {
        n: [
            TreeForward(rid, list(c), [int(c[-1])] * n, list(range(-1, n - 1)))
            for rid, c in zip(ids, contexts, strict=True)
        ]
        for n in sizes
    }
    for batch in batches.values():  # warm-up
        model.forward_tree(batch)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n, batch in batches.items():
            start = time.perf_counter()
            wait_for(model.forward_tree(batch))  # a device returns before it has computed them
            times[n].append(time.perf_counter() - start)
    for rid in ids:
        model.release(rid)
    ordered = sorted(sizes)
    return dict(zip(ordered, nondecreasing([statistics.median(times[n]) for n in ordered]), strict=True))


def engine_step_seconds(
    llm: CausalLM, ssm: CausalLM, prompts: Sequence[Sequence[int]], widths: Sequence[int], steps: int
) -> float:
    """Median wall time of a real engine step (drafting, verification, commit) for ``widths``."""
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(max_batch=len(prompts)))
    spec = SpeculationConfig(ExpansionConfig(tuple(widths)))
    for i, p in enumerate(prompts):
        engine.add(
            GenerationRequest(
                f"tune-step-{i}", tuple(p), 4 * steps * len(widths), SamplingParams(), spec, ignore_eos=True
            )
        )
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(len(prompts)):
        engine.cancel(f"tune-step-{i}")
    return statistics.median(times)


def cost_model(
    llm: CausalLM,
    ssm: CausalLM,
    contexts: Sequence[Sequence[int]],
    max_nodes: int,
    reps: int,
    calibrate: Sequence[int] = ExpansionConfig.parse(PAPER_EXPANSION).widths,
) -> CostModel:
    """Verify and draft pass times at powers of two up to ``max_nodes`` per request (batch =
    ``len(contexts)``), plus a per-step overhead calibrated on one real engine step."""
    sizes = sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256} & set(range(1, max_nodes + 1)) | {max_nodes})
    verify = pass_seconds(llm, contexts, sizes, reps)
    draft = pass_seconds(ssm, contexts, [n for n in sizes if n <= max(1, max_nodes // 2)], reps)
    model = CostModel(verify, draft)
    measured = engine_step_seconds(llm, ssm, contexts, calibrate, max(3, reps))
    overhead = max(0.0, measured - model.step_seconds(calibrate))
    return CostModel(verify, draft, overhead)
