"""``specinfer generate``: its flags, :class:`GenerateConfig`, generation in this process (:func:`run_generate`: the
prompts as one batch) and from a request manager (:mod:`specinfer.remote_cmd`); ``specinfer demo`` runs it too."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specinfer.cli_output import print_logprobs, print_prompt_header
from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.constraints import Constraint
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.tuning import static_expansion

if TYPE_CHECKING:
    from specinfer.engine.loading import EngineModels


@dataclass(frozen=True)
class GenerateConfig:
    """Everything ``specinfer generate`` needs, built once from the flags."""

    models: EngineModels  # the checkpoints and how they run
    expansion: ExpansionConfig | None  # a static tree; None: adaptive (see ``adaptive``) or no speculation
    adaptive: bool  # adaptive speculation (``--expansion auto``): the planner sizes each step's tree
    suffix: bool  # adaptive trees also drafted from the request's own text (core.suffix)
    sampling: SamplingParams
    max_new_tokens: int
    prompts: tuple[str, ...]
    logprobs: int | None = None  # print each output token's logprob and this many alternatives (None: not)
    constraint: Constraint | None = None  # structured outputs: what every output must match (None: anything)


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    """The speculation, sampling and model flags ``specinfer generate`` and ``specinfer demo`` share."""
    _add_speculation_flags(p)
    _add_sampling_flags(p)
    _add_runtime_flags(p)


def _add_speculation_flags(p: argparse.ArgumentParser) -> None:
    from specinfer.serving.config import add_setting

    add_setting(
        p,
        "--expansion",
        default="auto",
        help=(
            "auto: adaptive speculation, the planner sizes each step's tree; "
            "tuned: the SSM's installed tuning, else the paper's tree; "
            f"widths per depth, e.g. {PAPER_EXPANSION}; @FILE: a `specinfer tune` result; none: no speculation"
        ),
    )
    p.add_argument("--no-speculation", action="store_true", help="incremental decoding with the LLM alone")
    p.add_argument(
        "--no-suffix",
        action="store_true",
        help="adaptive trees without the model-free drafts from the prompt's and output's own text",
    )
    p.add_argument(
        "--head",
        default=None,
        help="a draft head of the LLM (a folder from specinfer train-head): adaptive trees also draft with it",
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the most likely tokens up to this probability (1: all)",
    )
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (none: a random draw)")
    p.add_argument(
        "--verification",
        default="auto",
        choices=["auto", "coupled", "mss"],
        help="how sampled trees are verified: coupled (a seed fixes the output, equal to --no-speculation's), "
        "mss (multi-step speculative sampling); auto: coupled when --seed is given",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="after the temperature, keep the tokens at least this times as likely as the best (0: off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2: on every token the output holds")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2: per occurrence in the output")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 0 (1: off): on the prompt's and output's tokens"
    )
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="after the text, each output token's log-probability under the LLM and its N most likely alternatives",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per prompt")
    shape = p.add_mutually_exclusive_group()  # structured outputs: at most one constraint
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", metavar="R", help="the whole output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar")


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto (default): bfloat16 where the device computes in it natively, "
        "else float16 on a GPU, float32 on a CPU",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device of the LLM and the SSMs: cpu (default), cuda or cuda:N (on CUDA the native runtime "
        "replays its steps as CUDA graphs)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "native", "reference"],
        help="model runtime (auto: native where supported)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="native tree attention (auto: Triton on CUDA)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8", "int4"],
        help="the LLM's and SSMs' decoder layer projections kept as int8 or int4 (native backend; on an x86-64 "
        "CPU with AVX2 our kernels, fast in float32 and bfloat16; on other CPUs fast with --dtype bfloat16)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="the LLM's decoder layers in host memory, streamed to the device layer by layer (native backend)",
    )
    p.add_argument(
        "--offload-reserve-bytes",
        type=int,
        default=0,
        help="most device memory offloading may use (0: no bound; needs --offload)",
    )
    p.add_argument(
        "--calibration-cache",
        default="",
        help="folder caching adaptive speculation's step cost model between runs "
        "(default: $SPECINFER_CALIBRATION_CACHE, "
        "else $XDG_CACHE_HOME/specinfer/calibration, else ~/.cache/specinfer/calibration; none or off: no cache)",
    )


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The structured-output flags as a :class:`Constraint` (files read here; a missing one names its flag)."""
    if args.json_object:
        return Constraint("json_object")
    if args.regex is not None:
        return Constraint("regex", args.regex)
    for kind in ("json_schema", "grammar"):
        path = getattr(args, kind)
        if path is not None:
            try:
                return Constraint(kind, Path(path).read_text())
            except OSError as e:
                raise InvalidArgument(f"--{kind.replace('_', '-')}", f"cannot read {path}: {e.strerror}") from None
    return None


def build_config(args: argparse.Namespace, llm: Path, ssms: Sequence[Path], prompts: Sequence[str]) -> GenerateConfig:
    """The in-process run of ``prompts`` on ``llm`` and ``ssms`` that the generation flags ask for."""
    keyword = args.expansion.strip().lower()
    static = static_expansion(args.expansion, ssms)
    speculate = bool(ssms) and not args.no_speculation and keyword not in ("none", "off")
    adaptive = speculate and keyword == "auto"
    if args.head and not args.no_speculation and keyword == "auto":  # a head alone drafts adaptive trees
        speculate = adaptive = True
    from specinfer.engine.loading import EngineModels

    models = EngineModels(
        llm=Path(llm),
        ssms=tuple(Path(s) for s in ssms),
        head=Path(args.head) if args.head else None,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        attention=args.attention,
        offload=args.offload,
        offload_reserve_bytes=args.offload_reserve_bytes,
        quantize=args.quantize,
        calibration_cache=args.calibration_cache,
    )
    return GenerateConfig(
        models=models,
        expansion=static if speculate and not adaptive else None,
        adaptive=adaptive,
        suffix=not args.no_suffix,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            verification=args.verification,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            min_p=args.min_p,
        ),
        max_new_tokens=args.max_new_tokens,
        prompts=tuple(prompts),
        logprobs=args.logprobs,
        constraint=constraint_of(args),
    )


def _requests(cfg: GenerateConfig, tokenizer, n_ssms: int) -> list:
    from specinfer.engine import GenerationRequest, SpeculationConfig

    spec = (
        SpeculationConfig(cfg.expansion, ssms=tuple(range(n_ssms)), suffix=cfg.suffix, head=cfg.models.head is not None)
        if cfg.expansion is not None or cfg.adaptive
        else None
    )
    requests = []
    for i, text in enumerate(cfg.prompts):
        if not text:
            raise InvalidArgument("prompt", "must not be empty")
        prompt = tuple(tokenizer.encode(text).ids)
        requests.append(
            GenerationRequest(
                f"cli-{i}",
                prompt,
                cfg.max_new_tokens,
                cfg.sampling,
                spec,
                logprobs=cfg.logprobs,
                constraint=cfg.constraint,
            )
        )
    return requests


def run_generate(cfg: GenerateConfig, out=None) -> None:
    """Load the models, generate every prompt as one batch, print text and statistics."""
    import torch

    out = out or sys.stdout
    from specinfer.engine.loading import engine_of, load_models
    from specinfer.models.loading import load_tokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    loaded = load_models(cfg.models, out)
    tokenizer = load_tokenizer(cfg.models.llm)
    if tokenizer is None:
        raise InvalidArgument("llm", "has no tokenizer.json, so text prompts cannot be encoded")
    engine = engine_of(cfg.models, loaded, constraints=cfg.constraint is not None, tokenizer=tokenizer)
    requests = _requests(cfg, tokenizer, len(loaded.ssms))
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    _print_results(cfg, results, tokenizer, len(loaded.ssms), elapsed, out)


def _print_results(cfg: GenerateConfig, results: list, tokenizer, n_ssms: int, elapsed: float, out) -> None:
    """Each prompt's text and statistics, then one line over the batch."""
    for text, res in zip(cfg.prompts, results, strict=True):
        print_prompt_header(text, out, len(res.prompt_tokens))
        print(f"--- generated ({len(res.output_tokens)} tokens, finish: {res.finish_reason})", file=out)
        print(
            tokenizer.decode(res.output_tokens, skip_special_tokens=True), file=out
        )  # no "</s>" in the text, as the servers do
        if cfg.logprobs is not None:
            spell = lambda t: repr(tokenizer.decode([t]))  # noqa: E731
            print_logprobs(res.logprobs, spell, out)
        sizes = [s.tree_size for s in res.steps]
        print(
            f"--- LLM steps {res.llm_steps}, tokens per LLM step {res.tokens_per_step:.2f}, "
            f"accepted per step {res.mean_accepted:.2f}, tree size {min(sizes)}-{max(sizes)}",
            file=out,
        )
    total = sum(len(r.output_tokens) for r in results)
    steps = sum(r.llm_steps for r in results)
    if cfg.adaptive:
        mode = f"adaptive trees over {n_ssms} SSM(s)" + (" and a draft head" if cfg.models.head is not None else "")
    else:
        mode = (
            "incremental"
            if cfg.expansion is None
            else f"tree <{','.join(map(str, cfg.expansion.widths))}> x {n_ssms} SSM(s)"
        )
    print(
        f"=== {len(results)} request(s), {mode}: {total} tokens in {steps} LLM steps "
        f"({total / max(1, steps):.2f} tokens/step), {elapsed:.2f} s",
        file=out,
    )
