"""Command line ``specinfer``: generation in this process or through a server, the local stack, the
demo, tuning and training (:func:`build_parser` lists the subcommands)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specinfer.core import ExpansionConfig, InvalidArgument, SamplingParams
from specinfer.core.acceptance import DEFAULT_SLOT_PRIOR
from specinfer.core.drafts import PAPER_EXPANSION
from specinfer.training.run import add_training_parsers, training_main
from specinfer.tuning import resolve_expansion, slot_prior
from specinfer.tuning.run import add_tune_parser, tune_main


@dataclass(frozen=True)
class GenerateConfig:
    """Everything ``specinfer generate`` needs, built once from the flags."""

    llm: Path
    ssms: tuple[Path, ...]
    expansion: ExpansionConfig | None  # a static tree; None: adaptive (see ``adaptive``) or no speculation
    adaptive: bool  # adaptive speculation (``--expansion auto``): the planner sizes each step's tree
    suffix: bool  # adaptive trees also drafted from the request's own text (core.suffix)
    sampling: SamplingParams
    max_new_tokens: int
    dtype: str
    backend: str
    attention: str
    prompts: tuple[str, ...]
    offload: bool = False  # the LLM's decoder layers in host memory, streamed layer by layer (docs/offloading.md)
    offload_reserve_bytes: int = 0
    calibration_cache: str = (
        ""  # the cost model's cache folder (engine.calibration_cache.cache_dir; none/off: no cache)
    )


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expansion",
        default="auto",
        help=(
            "auto (default): adaptive speculation, the planner sizes each step's tree; "
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
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
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
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens generated per prompt")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto (default): bfloat16 where the device computes in it natively, "
        "else float16 on a GPU, float32 on a CPU",
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


def _build_config(args: argparse.Namespace, llm: Path, ssms: Sequence[Path], prompts: Sequence[str]) -> GenerateConfig:
    keyword = args.expansion.strip().lower()
    speculate = bool(ssms) and not args.no_speculation and keyword not in ("none", "off")
    adaptive = speculate and keyword == "auto"
    return GenerateConfig(
        llm=Path(llm),
        ssms=tuple(Path(s) for s in ssms),
        expansion=ExpansionConfig.parse(resolve_expansion(args.expansion, ssms))
        if speculate and not adaptive
        else None,
        adaptive=adaptive,
        suffix=not args.no_suffix,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            verification=args.verification,
        ),
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        backend=args.backend,
        attention=args.attention,
        prompts=tuple(prompts),
        offload=args.offload,
        offload_reserve_bytes=args.offload_reserve_bytes,
        calibration_cache=args.calibration_cache,
    )


def _cost_entry(cfg: GenerateConfig, vocabularies: Sequence[str]):
    """Where adaptive speculation's cost model is cached between runs (after loading: the key holds the thread
    count)."""
    from specinfer.engine.calibration_cache import CalibrationCache, ModelIdentity, ModelRuntime, engine_cost_entry

    def identity(path: Path, offload: bool) -> ModelIdentity:
        reserve = cfg.offload_reserve_bytes if offload else 0
        return ModelIdentity.of(
            path,
            ModelRuntime(cfg.dtype, "cpu", cfg.backend, cfg.attention, offload=offload, offload_reserve_bytes=reserve),
        )

    cache = CalibrationCache.from_setting(cfg.calibration_cache, os.environ)
    return engine_cost_entry(
        cache, identity(cfg.llm, cfg.offload), [identity(p, False) for p in cfg.ssms], vocabularies
    )


def run_generate(cfg: GenerateConfig, out=None) -> None:
    """Load the models, generate every prompt as one batch, print text and statistics."""
    import torch

    out = out or sys.stdout
    from specinfer.core.planner import OFFLOAD_PLANNER, PlannerConfig
    from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
    from specinfer.models.cross_vocab import draft_vocabulary, in_llm_ids, vocabulary_method
    from specinfer.models.loading import check_checkpoint, eos_token_id, load_backend, load_tokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    llm = load_backend(
        cfg.llm,
        "llm",
        cfg.dtype,
        backend=cfg.backend,
        attention=cfg.attention,
        offload=cfg.offload,
        offload_reserve_bytes=cfg.offload_reserve_bytes,
    )
    ssms, vocabularies = [], []
    for i, path in enumerate(cfg.ssms):
        check_checkpoint(path, f"ssm[{i}]")
        vmap = draft_vocabulary(cfg.llm, path, f"ssm[{i}]")
        ssm = load_backend(path, f"ssm[{i}]", cfg.dtype, backend=cfg.backend, attention=cfg.attention)
        if vmap is not None:  # another tokenizer: it drafts the tokens both vocabularies spell alike
            print(
                f"--- ssm[{i}] has another tokenizer: drafting the {vmap.shared} tokens of its {vmap.ssm_size} "
                "that the LLM's spells alike",
                file=out,
            )
        ssms.append(in_llm_ids(ssm, vmap))
        vocabularies.append(vocabulary_method(vmap))
    tokenizer = load_tokenizer(cfg.llm)
    if tokenizer is None:
        raise InvalidArgument("llm", "has no tokenizer.json, so text prompts cannot be encoded")
    priors = tuple(
        slot_prior(p) or DEFAULT_SLOT_PRIOR for p in cfg.ssms
    )  # adaptive speculation's prior: the SSMs' tuning files
    planner = (
        OFFLOAD_PLANNER if cfg.offload else PlannerConfig()
    )  # offloaded steps cost a transfer whatever their tokens: larger trees pay
    config = EngineConfig(eos_token_id=eos_token_id(cfg.llm), planner=planner, slot_priors=priors)
    engine = SpeculativeEngine(llm, ssms, config, cost_entry=_cost_entry(cfg, vocabularies) if cfg.adaptive else None)
    spec = (
        SpeculationConfig(cfg.expansion, ssms=tuple(range(len(ssms))), suffix=cfg.suffix)
        if cfg.expansion is not None or cfg.adaptive
        else None
    )
    requests = []
    for i, text in enumerate(cfg.prompts):
        if not text:
            raise InvalidArgument("prompt", "must not be empty")
        requests.append(
            GenerationRequest(f"cli-{i}", tuple(tokenizer.encode(text).ids), cfg.max_new_tokens, cfg.sampling, spec)
        )
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    for text, res in zip(cfg.prompts, results, strict=True):
        print_prompt_header(text, out, len(res.prompt_tokens))
        print(f"--- generated ({len(res.output_tokens)} tokens, finish: {res.finish_reason})", file=out)
        print(
            tokenizer.decode(res.output_tokens, skip_special_tokens=True), file=out
        )  # no "</s>" in the text, as the servers do
        sizes = [s.tree_size for s in res.steps]
        print(
            f"--- LLM steps {res.llm_steps}, tokens per LLM step {res.tokens_per_step:.2f}, "
            f"accepted per step {res.mean_accepted:.2f}, tree size {min(sizes)}-{max(sizes)}",
            file=out,
        )
    total = sum(len(r.output_tokens) for r in results)
    steps = sum(r.llm_steps for r in results)
    if cfg.adaptive:
        mode = f"adaptive trees over {len(ssms)} SSM(s)"
    else:
        mode = (
            "incremental"
            if cfg.expansion is None
            else f"tree <{','.join(map(str, cfg.expansion.widths))}> x {len(ssms)} SSM(s)"
        )
    print(
        f"=== {len(results)} request(s), {mode}: {total} tokens in {steps} LLM steps "
        f"({total / max(1, steps):.2f} tokens/step), {elapsed:.2f} s",
        file=out,
    )


BUNDLED_PAIR = Path(__file__).resolve().parents[2] / "models/demo"  # trained by `specinfer train-demo`, committed


def _demo_models() -> tuple[Path, tuple[Path, ...], str]:
    """The LLM and every SSM (``ssm/``, then ``ssm-1/``, ``ssm-2/``, ... as present) of the demo
    models in ``SPECINFER_DEMO_MODELS`` if set, else of the bundled ``models/demo`` of this
    checkout, else (an install without the checkout) of a tiny random pair built once."""
    candidates = [os.environ.get("SPECINFER_DEMO_MODELS", ""), BUNDLED_PAIR]
    for c in candidates:
        if c and (Path(c) / "llm/config.json").is_file() and (Path(c) / "ssm/config.json").is_file():
            return Path(c) / "llm", _demo_ssms(Path(c)), f"trained models in {c}"
    from specinfer.models.tiny import build_tiny_pair

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specinfer/tiny-pair"
    if not (cache / "ssm/config.json").is_file():
        build_tiny_pair(cache)
    return cache / "llm", (cache / "ssm",), f"tiny random pair in {cache} (no trained pair found; its text is noise)"


def _demo_ssms(folder: Path) -> tuple[Path, ...]:
    """``ssm/`` and the boost-tuned ``ssm-1/``, ``ssm-2/``, ... after it (``specinfer train-demo``):
    served together, their trees merge (merge-based speculation)."""
    ssms = [folder / "ssm"]
    while (folder / f"ssm-{len(ssms)}/config.json").is_file():
        ssms.append(folder / f"ssm-{len(ssms)}")
    return tuple(ssms)


def _add_client_security_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a request manager that requires TLS or a bearer token (flags or SPECINFER_* variables)."""
    from specinfer.serving.config import add_setting

    add_setting(p, "--tls-ca", default="", help="PEM CA of the server: connect with TLS")
    add_setting(p, "--tls-client-cert", default="", help="PEM client certificate (mTLS)")
    add_setting(p, "--tls-client-key", default="", help="PEM key of --tls-client-cert")
    add_setting(
        p,
        "--auth-token",
        default="",
        secret=True,
        help="bearer token of the public API (prefer the variable or the file: argv is visible)",
    )
    add_setting(p, "--auth-token-file", default="", help="file holding --auth-token")


def _client_auth(args: argparse.Namespace):
    from specinfer.serving.security import ClientAuth, ClientTls, read_token

    try:
        auth = ClientAuth(
            ClientTls.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key),
            read_token(args.auth_token, args.auth_token_file, "auth-token"),
        )
        auth.tls.credentials()
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None
    return auth


def _stack_security(args: argparse.Namespace):
    """``specinfer up``: the server files, and the client side the launcher and the request manager use."""
    from specinfer.launcher import StackSecurity
    from specinfer.serving.security import read_token

    try:
        auth_token = read_token(args.auth_token, args.auth_token_file, "auth-token")
        internal = read_token(args.internal_token, args.internal_token_file, "internal-token")
        return StackSecurity(
            args.tls_cert,
            args.tls_key,
            args.tls_ca,
            args.tls_client_ca,
            args.tls_client_cert,
            args.tls_client_key,
            auth_token,
            internal,
        )
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every flag's default, except where its help already says it (a setting
    says its own, and never a secret's value, which may come from the environment)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.required:  # a required flag has no default to show
            return action.help
        return super()._get_help_string(action)


DESCRIPTION = """Tree-based speculative inference (SpecInfer): small speculative models (SSMs) draft token
trees, the LLM verifies every branch in one pass; the output is the LLM's own. Run one
subcommand; SUBCOMMAND --help lists its flags and their defaults."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (``main`` runs it; tests check the README's commands with it)."""
    from specinfer.serving.config import SettingsParser, add_setting

    # errors are one line with exit status 2; its subcommands' parsers are SettingsParsers too
    parser = SettingsParser(prog="specinfer", description=DESCRIPTION, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    gen = sub.add_parser(
        "generate", help="speculative generation: through a running server (--server) or in this process (--llm)"
    )
    gen.add_argument("--server", help="address of a running request manager (host:port); streams the text")
    gen.add_argument("--llm", help="Hugging Face checkpoint folder of the LLM (in-process generation)")
    gen.add_argument(
        "--ssm",
        action="append",
        default=[],
        help="an SSM's checkpoint folder, PATH or NAME=PATH (repeat for several: trees are merged)",
    )
    _add_generation_flags(gen)
    _add_client_security_flags(gen)
    gen.add_argument("prompt", nargs="+", help="prompt text(s); several are generated as one batch")
    up = sub.add_parser("up", help="start Redis, the request manager, SSM workers and the verifier as local processes")
    up.add_argument("--llm", help="LLM checkpoint folder (default: the demo models' LLM)")
    up.add_argument(
        "--ssm",
        action="append",
        default=[],
        help="an SSM's checkpoint folder, PATH (served under its folder's name) or NAME=PATH; "
        "repeat for several, whose trees merge (default: the demo models' SSMs when --llm is not given, else none)",
    )
    up.add_argument("--workers", type=int, default=1, help="SSM worker processes")
    up.add_argument(
        "--verifiers", type=int, default=1, help="LLM verifier replicas (each request runs on one; docs/scaling.md)"
    )
    up.add_argument(
        "--request-managers",
        type=int,
        default=1,
        help="request-manager processes (more than one share a Redis the launcher starts)",
    )
    up.add_argument("--port", type=int, default=50051, help="public API port")
    up.add_argument(
        "--state-dir",
        default="./specinfer-state",
        help="the request managers' Redis data and the processes' logs (logs-*/)",
    )
    up.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "native", "reference"],
        help="model runtime (auto: native where supported)",
    )
    up.add_argument(
        "--expansion",
        default="auto",
        help="default speculation of the request manager: auto (adaptive), tuned, widths, @FILE, none",
    )
    up.add_argument(
        "--http-port", type=int, default=8000, help="port of the OpenAI-compatible HTTP API on 127.0.0.1 (0: off)"
    )
    up.add_argument(
        "--verifier-threads",
        type=int,
        default=0,
        help="torch threads of the LLM verifier (0: torch's default, every core)",
    )
    up.add_argument(
        "--ssm-threads",
        type=int,
        default=1,
        help="torch threads of each SSM worker (0: torch's default); few, not to crowd the verifier",
    )
    _add_client_security_flags(up)
    add_setting(
        up, "--tls-cert", default="", help="PEM certificate (valid for 127.0.0.1) every process serves TLS with"
    )
    add_setting(up, "--tls-key", default="", help="PEM key of --tls-cert")
    add_setting(
        up, "--tls-client-ca", default="", help="PEM CA: every port requires client certificates it signed (mTLS)"
    )
    add_setting(up, "--internal-token", default="", secret=True, help="bearer token between the services")
    add_setting(up, "--internal-token-file", default="", help="file holding --internal-token")
    add_tune_parser(sub)
    add_training_parsers(sub)
    demo = sub.add_parser(
        "demo", help="start the local stack with the demo models and stream a few generations through gRPC"
    )
    _add_generation_flags(demo)
    demo.add_argument("--prompts", type=int, default=1, help="how many prompts of the demo set")
    demo.add_argument(
        "--in-process", action="store_true", help="run the engine in this process instead of the services"
    )
    demo.add_argument(
        "--one-ssm", action="store_true", help="draft with the demo's first SSM only, not all of them merged"
    )
    for subparser in sub.choices.values():  # tune's and training's parsers are built elsewhere
        subparser.formatter_class = _HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            from specinfer.launcher import StackConfig, run_up
            from specinfer.serving.config import named_paths

            # flags the user gave are served as given; the demo models fill in what is missing (an LLM
            # of one's own has no demo SSMs: without --ssm it runs alone)
            named = named_paths(args.ssm, "ssm")
            demo_llm, demo_ssms, _ = (None, (), "") if args.llm else _demo_models()
            llm = Path(args.llm) if args.llm else demo_llm
            ssm_paths = tuple(Path(p) for p in named.values()) if args.ssm else demo_ssms
            cfg = StackConfig(
                llm,
                tuple(f"{n}={p}" for n, p in named.items()) if args.ssm else ssm_paths,
                args.workers,
                args.port,
                Path(args.state_dir),
                args.backend,
                resolve_expansion(args.expansion, ssm_paths),
                threads=args.verifier_threads,
                ssm_threads=args.ssm_threads,
                security=_stack_security(args),
                http_port=args.http_port,
                verifiers=args.verifiers,
                request_managers=args.request_managers,
            )
            if cfg.verifiers < 1:
                raise InvalidArgument("verifiers", f"must be at least 1, got {cfg.verifiers}")
            return run_up(cfg)
        if args.command == "tune":
            return tune_main(args)
        if args.command in ("train-ssm", "boost-tune", "train-demo"):
            return training_main(args)
        if args.command == "generate" and args.server:
            return _generate_remote(args)
        if args.command == "generate":
            from specinfer.serving.config import named_paths

            if not args.llm:
                raise InvalidArgument("llm", "give --llm (in-process) or --server (a running stack)")
            run_generate(_build_config(args, args.llm, list(named_paths(args.ssm, "ssm").values()), args.prompt))
        else:
            llm, ssms, what = _demo_models()
            ssms = ssms[:1] if args.one_ssm else ssms
            print(f"=== demo models: {what}; drafting with {', '.join(s.name for s in ssms)}")
            prompts = _demo_prompts(llm, args.prompts)
            if args.in_process:
                run_generate(_build_config(args, llm, ssms, prompts))
            else:
                return _demo_stack(args, llm, ssms, prompts)
    except InvalidArgument as exc:  # a bad setting: one line on stderr, exit status 2
        return parser.bad_setting(exc)
    return 0


def _demo_stack(args: argparse.Namespace, llm: Path, ssms: Sequence[Path], prompts: list[str]) -> int:
    """Start verifier, SSM worker and request manager (with its embedded Redis) as local
    processes, stream the prompts through the public gRPC API, stop everything. Its state and logs
    live in a temporary folder, removed afterwards."""
    import tempfile

    from specinfer.launcher import Stack, StackConfig

    print("=== starting the local stack (LLM verifier, SSM worker, request manager + Redis) ...", flush=True)
    expansion = resolve_expansion(args.expansion, ssms)
    with (
        tempfile.TemporaryDirectory(prefix="specinfer-demo-") as state,
        Stack(StackConfig(llm, tuple(ssms), 1, 0, Path(state), args.backend, expansion)) as s,
    ):
        for p in s.processes:
            print(f"    {p.name:16s} {p.address}", flush=True)
        for prompt in prompts:
            if _stream(s.address, args, prompt) != 0:
                return 2
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream each prompt's text from a running request manager."""
    auth = _client_auth(args)
    for prompt in args.prompt:
        if _stream(args.server, args, prompt, auth) != 0:
            return 2
    return 0


def print_prompt_header(prompt: str, out=None, tokens: int | None = None) -> None:
    """The ``--- prompt`` header and the prompt, before each generation's text: in-process and
    streamed output look alike (``tokens``: the prompt's length, where known before generating)."""
    out = out or sys.stdout
    print("--- prompt" + (f" ({tokens} tokens)" if tokens is not None else ""), file=out, flush=True)
    print(prompt, end="" if prompt.endswith("\n") else "\n", file=out, flush=True)


def _stream(address: str, args: argparse.Namespace, prompt: str, auth=None) -> int:
    """Stream one generation's text to stdout; 0 on success, 2 on an RPC error."""
    import grpc

    from specinfer.client import Client

    keyword = args.expansion.strip().lower()
    request = Client.request(
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        verification="" if args.verification == "auto" else args.verification,
        # auto: the server's default (adaptive speculation unless the server runs otherwise)
        expansion=()
        if args.no_speculation or keyword in ("auto", "none", "off")
        else ExpansionConfig.parse(resolve_expansion(args.expansion)).widths,
        speculation=not args.no_speculation and keyword not in ("none", "off"),
        suffix=False if args.no_suffix else None,
    )
    print_prompt_header(prompt)
    print("--- generated (streamed)", flush=True)
    with Client(address, auth=auth) as client:
        try:
            for msg in client.stream(request):
                print(msg.text, end="", flush=True)
                if msg.HasField("finished"):
                    u = msg.finished.usage
                    print(
                        f"\n--- {u.completion_tokens} tokens in {u.llm_steps} LLM steps "
                        f"({u.tokens_per_step:.2f} tokens per LLM step, "
                        f"mean tree size {u.mean_tree_size:.1f}), finish: {api_reason(msg.finished.reason)}",
                        flush=True,
                    )
        except grpc.RpcError as exc:
            print(f"specinfer: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
    return 0


def api_reason(reason: int) -> str:
    from specinfer.v1 import api_pb2

    return api_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def _demo_prompts(llm: Path, count: int) -> list[str]:
    import json

    prompts_file = llm.parent / "prompts.jsonl"
    if prompts_file.is_file():
        lines = prompts_file.read_text().splitlines()
        return [json.loads(line)["text"] for line in lines[1 : 1 + count]]  # the first one loops at once
    return ["def fibonacci(n):\n", "class Stack:\n"][:count]


if __name__ == "__main__":
    raise SystemExit(main())
