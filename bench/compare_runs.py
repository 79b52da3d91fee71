"""How bench/compare.py runs and measures each method (not a script; compare.py imports it): a configuration
(:class:`Case`), what one configuration measured (:class:`Run`, its table row), transformers' ``generate``
(:func:`run_hf`, incremental and assisted) and our in-process engine (:func:`run_ours`), prompts in rounds of
``batch`` concurrent requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.engine import GenerationRequest, SpeculationConfig, SpeculativeEngine

# adaptive rows: which drafters they use (SSMs, suffix drafts, the draft head)
ADAPTIVE_DRAFTERS = {
    "auto": (True, True, True),
    "auto-ssm-only": (True, False, False),
    "suffix-only": (False, True, False),
    "head-only": (False, False, True),
    "auto-no-head": (True, True, False),
}


@dataclass(frozen=True)
class Case:
    """One configuration to run. ``method``: hf-incremental, hf-assisted, incremental, sequence,
    tree or merged; ``expansion``: widths per depth (ours); ``ssms``: indices of the SSMs."""

    method: str
    batch: int
    temperature: float
    expansion: str = ""
    ssms: tuple[int, ...] = (0,)

    @property
    def label(self) -> str:
        tree = f" <{self.expansion}>" if self.expansion else ""
        ssms = f" x{len(self.ssms)} SSMs" if self.method == "merged" else ""
        return f"{self.method}{tree}{ssms}"

    @property
    def nodes(self) -> int:
        """Most tree nodes per SSM, the root included (1 without speculation)."""
        return ExpansionConfig.parse(self.expansion).max_nodes if self.expansion else 1


@dataclass
class Run:
    case: Case
    seconds: float = 0.0
    tokens: int = 0
    llm_steps: int = 0  # LLM forward passes per request, summed over requests (prefill included)
    tree_nodes: int = 0  # verified nodes, summed over steps (ours)
    latencies: list[float] = field(default_factory=list)  # seconds per token
    decode_seconds: float = 0.0  # wall time after the first step of each round
    decode_tokens: int = 0  # tokens committed after the first step

    def add_round(self, start: float, end: float, emissions: Sequence[Sequence[tuple[float, int]]]) -> None:
        """Account one round of concurrent requests (their emissions: (time, tokens))."""
        firsts = [e[0] for e in emissions if e]
        self.seconds += end - start
        self.decode_seconds += end - max(t for t, _ in firsts)
        self.decode_tokens += sum(n for e in emissions for _, n in e) - sum(n for _, n in firsts)
        for e in emissions:
            self.latencies += token_latencies(start, e)

    outputs: list[list[int]] = field(default_factory=list)

    def row(self, baseline: Run | None, batch_baseline: Run | None, hf_batch_baseline: Run | None) -> dict:
        tps = self.tokens / self.seconds
        dtps = self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")
        lat = sorted(self.latencies)
        return {
            "label": self.case.label,
            "method": self.case.method,
            "batch": self.case.batch,
            "temperature": self.case.temperature,
            "expansion": self.case.expansion,
            "ssms": len(self.case.ssms),
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "llm_steps": self.llm_steps,
            "tokens_per_step": round(self.tokens / max(1, self.llm_steps), 3),
            "mean_tree_size": round(self.tree_nodes / self.llm_steps, 2) if self.tree_nodes else 1.0,
            "tokens_per_second": round(tps, 3),
            "decode_tokens_per_second": round(dtps, 3),
            "speedup_vs_hf_incremental": round(tps / (baseline.tokens / baseline.seconds), 3) if baseline else None,
            "decode_speedup_vs_hf_incremental": round(dtps / (baseline.decode_tokens / baseline.decode_seconds), 3)
            if baseline
            else None,
            "speedup_vs_incremental_same_batch": round(tps / (batch_baseline.tokens / batch_baseline.seconds), 3)
            if batch_baseline
            else None,
            "speedup_vs_hf_same_batch": round(tps / (hf_batch_baseline.tokens / hf_batch_baseline.seconds), 3)
            if hf_batch_baseline
            else None,
            "latency_p50_ms": round(1000 * percentile(lat, 50), 1),
            "latency_p99_ms": round(1000 * percentile(lat, 99), 1),
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def token_latencies(start: float, emissions: Sequence[tuple[float, int]]) -> list[float]:
    """Per-token latency of one request from its emissions (time, number of tokens)."""
    out, last = [], start
    for t, n in emissions:
        if n:
            out += [(t - last) / n] * n
            last = t
    return out


class _Timing(BaseStreamer):
    """transformers streamer that timestamps every group of new tokens (the first put is the prompt)."""

    def __init__(self) -> None:
        self.emissions: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:  # [batch] new tokens (the prompt first: [batch, prompt])
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.emissions.append((time.perf_counter(), 1))  # one token for each sequence of the batch

    def end(self) -> None:
        pass


def left_padded(prompts: Sequence[Sequence[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a batch, padded on the left as decoder-only generate
    needs.  # [B, L] each"""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run_hf(case: Case, prompts: Sequence[Sequence[int]], new_tokens: int, llm, ssm, seed: int, progress: tqdm) -> Run:
    """transformers generate, ``case.batch`` prompts at a time (left-padded); EOS does not stop generation."""
    calls = [0]
    hook = llm.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sampling = (
        {"do_sample": True, "temperature": case.temperature, "top_k": 0, "top_p": 1.0}
        if case.temperature > 0
        else {"do_sample": False}
    )
    config = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0, **sampling)
    run = Run(case)
    try:
        with torch.inference_mode():
            for first in range(0, len(prompts), case.batch):
                chunk = prompts[first : first + case.batch]
                ids, mask = (t.to(llm.device) for t in left_padded(chunk))
                torch.manual_seed(seed + first)
                before = calls[0]
                streamer = _Timing()
                start = time.perf_counter()
                out = llm.generate(
                    ids,
                    attention_mask=mask,
                    generation_config=config,
                    streamer=streamer,
                    assistant_model=ssm if case.method == "hf-assisted" else None,
                )
                run.add_round(start, time.perf_counter(), [streamer.emissions] * len(chunk))
                run.llm_steps += (calls[0] - before) * len(chunk)  # per request, as ours count them
                for row in out[:, ids.shape[1] :].tolist():
                    run.tokens += len(row)
                    run.outputs.append(row)
                progress.update(len(chunk))
    finally:
        hook.remove()
    return run


def run_ours(
    case: Case, prompts: Sequence[Sequence[int]], new_tokens: int, engine: SpeculativeEngine, seed: int, progress: tqdm
) -> Run:
    """Our in-process engine, prompts in rounds of ``case.batch`` concurrent requests."""
    if case.method in ADAPTIVE_DRAFTERS:
        # auto: every drafter merged (SSMs, the text's own suffix drafts, a draft head if the LLM has one); the
        # others one kind alone, or all but the head
        ssms, suffix, head = ADAPTIVE_DRAFTERS[case.method]
        spec = SpeculationConfig(None, case.ssms if ssms else (), suffix=suffix, head=head)
    else:
        spec = SpeculationConfig(ExpansionConfig.parse(case.expansion), case.ssms) if case.expansion else None
    run = Run(case)
    for first in range(0, len(prompts), case.batch):
        chunk = prompts[first : first + case.batch]
        requests = [
            GenerationRequest(
                f"{case.label}-{case.batch}-{case.temperature}-{first + i}",
                tuple(p),
                new_tokens,
                SamplingParams(temperature=case.temperature, seed=seed + first + i),
                spec,
                ignore_eos=True,
            )
            for i, p in enumerate(chunk)
        ]
        emissions: dict[str, list[tuple[float, int]]] = {r.request_id: [] for r in requests}
        seen = dict.fromkeys(emissions, 0)
        done = {}
        start = time.perf_counter()
        for r in requests:
            engine.add(r)
        while engine.has_work:
            finished = engine.step()
            now = time.perf_counter()
            for result in [*engine.running(), *finished]:
                n = len(result.output_tokens)
                emissions[result.request_id].append((now, n - seen[result.request_id]))
                seen[result.request_id] = n
            for result in finished:
                done[result.request_id] = result
                progress.update(1)
        run.add_round(start, time.perf_counter(), [emissions[r.request_id] for r in requests])
        for r in requests:
            result = done[r.request_id]
            run.tokens += len(result.output_tokens)
            run.llm_steps += len(result.steps)
            run.tree_nodes += sum(s.tree_size for s in result.steps)
            run.outputs.append(list(result.output_tokens))
    return run
