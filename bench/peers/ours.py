"""Our side of ``bench/peers/llama_cpp.py``: the rows of specinfer, in this process
(:class:`SpeculativeEngine`, batch 1) and, optionally, through the local stack (``specinfer up``'s
services, gRPC streaming), on the same prompts, new tokens, threads and dtype as llama.cpp's rows.

Every row measures *decode* tokens/s as llama.cpp does: the first LLM step of a request (the
prompt's prefill and its first token) is left out; tokens after it / seconds after it."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Method:
    """``kind``: incremental, tree or auto; ``expansion``: widths per depth (tree)."""

    kind: str
    expansion: str = ""

    @property
    def setting(self) -> str:
        return {"incremental": "--no-speculation", "auto": "auto (adaptive)"}.get(self.kind, f"tree <{self.expansion}>")


@dataclass
class Sample:
    """One request: decode tokens and seconds (after the first step), all tokens, LLM steps, text."""

    decode_tokens: int
    decode_seconds: float
    tokens: int
    steps: int
    text: str


def methods(trees: Sequence[str], ssm: Path | None) -> list[Method]:
    """Incremental, each static tree (``tuned``: the SSM's installed tuning, else the paper's), auto; without an SSM,
    incremental and auto (drafts from the request's own text)."""
    from specinfer.tuning import resolve_expansion

    if ssm is None:
        return [Method("incremental"), Method("auto")]

    widths = list(dict.fromkeys(resolve_expansion(t, [ssm]) for t in trees if t.strip()))
    return [Method("incremental"), *(Method("tree", w) for w in widths), Method("auto")]


class InProcess:
    """The LLM (``quantize``: its weights, docs/quantization.md) and the SSM (None: none) loaded once; one engine
    serves every method (batch 1)."""

    def __init__(
        self, llm: Path, ssm: Path | None, dtype: str, threads: int, quantize: str = "none", log=print
    ) -> None:
        import torch

        from specinfer.core.acceptance import DEFAULT_SLOT_PRIOR
        from specinfer.engine import EngineConfig, SpeculativeEngine
        from specinfer.engine.calibrate import calibrate_costs
        from specinfer.models.loading import eos_token_id, load_backend, load_tokenizer
        from specinfer.tuning import slot_prior

        torch.set_num_threads(threads)
        self.tokenizer = load_tokenizer(llm)
        self.llm = load_backend(llm, "llm", dtype, backend="native", quantize=quantize)
        ssms = [] if ssm is None else [load_backend(ssm, "ssm", dtype, backend="native")]
        self.ssm_ids = tuple(range(len(ssms)))
        started = time.perf_counter()
        costs = calibrate_costs(self.llm, ssms, max_verify_tokens=64)
        log(f"ours: cost model calibrated in {time.perf_counter() - started:.1f} s (before any clock starts)")
        priors = () if ssm is None else (slot_prior(ssm) or DEFAULT_SLOT_PRIOR,)
        config = EngineConfig(max_batch=1, eos_token_id=eos_token_id(llm), slot_priors=priors)
        self.engine = SpeculativeEngine(self.llm, ssms, config, costs)
        self.count = 0

    def run(self, prompt: str, method: Method, new_tokens: int) -> Sample:
        from specinfer.core import ExpansionConfig, SamplingParams
        from specinfer.engine import GenerationRequest, SpeculationConfig

        spec = None
        if method.kind == "auto":
            spec = SpeculationConfig(None, self.ssm_ids)
        elif method.kind == "tree":
            spec = SpeculationConfig(ExpansionConfig.parse(method.expansion), self.ssm_ids)
        self.count += 1
        ids = tuple(self.tokenizer.encode(prompt).ids)
        request = GenerationRequest(f"peer-{self.count}", ids, new_tokens, SamplingParams(temperature=0.0), spec)
        first: tuple[float, int] | None = None
        self.engine.add(request)
        result = None
        while self.engine.has_work:
            finished = self.engine.step()
            now = time.perf_counter()
            for res in [*self.engine.running(), *finished]:
                if first is None:
                    first = (now, len(res.output_tokens))
                result = res
        end = time.perf_counter()
        assert result is not None and first is not None
        n = len(result.output_tokens)
        text = self.tokenizer.decode(result.output_tokens, skip_special_tokens=True)
        return Sample(n - first[1], end - first[0], n, len(result.steps), text)

    def warm_up(self, prompt: str, all_methods: Sequence[Method]) -> None:
        """Lazy initialisation, allocator and thread pools, not timed."""
        for method in all_methods:
            self.run(prompt, method, 4)


class ThroughServices:
    """The local stack (LLM verifier, SSM worker, request manager as processes), gRPC streaming."""

    def __init__(self, llm: Path, ssm: Path | None, dtype: str, threads: int, log=print) -> None:
        from specinfer.client import Client
        from specinfer.launcher import Stack, StackConfig

        state = Path(tempfile.mkdtemp(prefix="specinfer-peer-"))  # outside the repository
        cfg = StackConfig(
            llm=llm,
            ssms=() if ssm is None else (ssm,),
            port=0,
            state_dir=state,
            expansion="auto",
            threads=threads,
            extra_env=(("SPECINFER_DTYPE", dtype),),
        )
        started = time.perf_counter()
        self.stack = Stack(cfg).__enter__()
        self.client = Client(self.stack.address, timeout=3600)
        log(f"services: stack up in {time.perf_counter() - started:.0f} s (state and logs in {state})")

    def run(self, prompt: str, method: Method, new_tokens: int) -> Sample:
        from specinfer.core import ExpansionConfig

        widths = ExpansionConfig.parse(method.expansion).widths if method.kind == "tree" else ()
        req = self.client.request(
            prompt,
            new_tokens,
            expansion=widths,
            speculation=method.kind != "incremental",
            adaptive=method.kind == "auto",
        )
        first: tuple[float, int] | None = None
        tokens, steps, text = 0, 0, ""
        for msg in self.client.stream(req):
            tokens += len(msg.token_ids)
            text += msg.text
            if first is None and msg.token_ids:
                first = (time.perf_counter(), tokens)
            if msg.HasField("finished"):
                steps = msg.finished.usage.llm_steps
        end = time.perf_counter()
        first = first or (end, tokens)
        return Sample(tokens - first[1], end - first[0], tokens, steps, text)

    def warm_up(self, prompt: str, all_methods: Sequence[Method]) -> None:
        for method in all_methods:
            self.run(prompt, method, 4)

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.stack.__exit__(None, None, None)
