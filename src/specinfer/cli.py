"""Command line: ``specinfer generate`` (in-process speculative generation) and ``specinfer demo``."""

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
    sampling: SamplingParams
    max_new_tokens: int
    dtype: str
    backend: str
    attention: str
    prompts: tuple[str, ...]


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expansion",
        default="auto",
        help=(
            "auto (default): adaptive speculation, the planner sizes each step's tree; tuned: the SSM's installed tuning, else the paper's tree; "
            f"widths per depth, e.g. {PAPER_EXPANSION}; @FILE: a `specinfer tune` result; none: no speculation"
        ),
    )
    p.add_argument("--no-speculation", action="store_true", help="incremental decoding with the LLM alone")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto (default): bfloat16 where the device computes in it natively, else float16 on a GPU, float32 on a CPU",
    )
    p.add_argument("--backend", default="auto", choices=["auto", "native", "reference"], help="model runtime (auto: native where supported)")
    p.add_argument("--attention", default="auto", choices=["auto", "triton", "torch"], help="native tree attention (auto: Triton on CUDA)")


def _build_config(args: argparse.Namespace, llm: Path, ssms: Sequence[Path], prompts: Sequence[str]) -> GenerateConfig:
    keyword = args.expansion.strip().lower()
    speculate = bool(ssms) and not args.no_speculation and keyword not in ("none", "off")
    adaptive = speculate and keyword == "auto"
    return GenerateConfig(
        llm=Path(llm),
        ssms=tuple(Path(s) for s in ssms),
        expansion=ExpansionConfig.parse(resolve_expansion(args.expansion, ssms)) if speculate and not adaptive else None,
        adaptive=adaptive,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed),
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        backend=args.backend,
        attention=args.attention,
        prompts=tuple(prompts),
    )


def run_generate(cfg: GenerateConfig, out=None) -> None:
    """Load the models, generate every prompt as one batch, print text and statistics."""
    import torch

    out = out or sys.stdout
    from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
    from specinfer.models.cross_vocab import draft_vocabulary, in_llm_ids
    from specinfer.models.loading import check_checkpoint, eos_token_id, load_backend, load_tokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    llm = load_backend(cfg.llm, "llm", cfg.dtype, backend=cfg.backend, attention=cfg.attention)
    ssms = []
    for i, path in enumerate(cfg.ssms):
        check_checkpoint(path, f"ssm[{i}]")
        vmap = draft_vocabulary(cfg.llm, path, f"ssm[{i}]")
        ssm = load_backend(path, f"ssm[{i}]", cfg.dtype, backend=cfg.backend, attention=cfg.attention)
        if vmap is not None:  # another tokenizer: it drafts the tokens both vocabularies spell alike
            print(f"--- ssm[{i}] has another tokenizer: drafting the {vmap.shared} tokens of its {vmap.ssm_size} that the LLM's spells alike", file=out)
        ssms.append(in_llm_ids(ssm, vmap))
    tokenizer = load_tokenizer(cfg.llm)
    if tokenizer is None:
        raise InvalidArgument("llm", "has no tokenizer.json, so text prompts cannot be encoded")
    priors = tuple(slot_prior(p) or DEFAULT_SLOT_PRIOR for p in cfg.ssms)  # adaptive speculation's prior: the SSMs' tuning files
    engine = SpeculativeEngine(llm, ssms, EngineConfig(eos_token_id=eos_token_id(cfg.llm), slot_priors=priors))
    spec = SpeculationConfig(cfg.expansion, ssms=tuple(range(len(ssms)))) if cfg.expansion is not None or cfg.adaptive else None
    requests = []
    for i, text in enumerate(cfg.prompts):
        if not text:
            raise InvalidArgument("prompt", "must not be empty")
        requests.append(GenerationRequest(f"cli-{i}", tuple(tokenizer.encode(text).ids), cfg.max_new_tokens, cfg.sampling, spec))
    start = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - start
    for text, res in zip(cfg.prompts, results, strict=True):
        print(f"--- prompt ({len(res.prompt_tokens)} tokens)", file=out)
        print(text, end="" if text.endswith("\n") else "\n", file=out)
        print(f"--- generated ({len(res.output_tokens)} tokens, finish: {res.finish_reason})", file=out)
        print(tokenizer.decode(res.output_tokens, skip_special_tokens=True), file=out)  # no "</s>" in the text, as the servers do
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
        mode = "incremental" if cfg.expansion is None else f"tree <{','.join(map(str, cfg.expansion.widths))}> x {len(ssms)} SSM(s)"
    print(f"=== {len(results)} request(s), {mode}: {total} tokens in {steps} LLM steps ({total / max(1, steps):.2f} tokens/step), {elapsed:.2f} s", file=out)


BUNDLED_PAIR = Path(__file__).resolve().parents[2] / "models/demo"  # trained by `specinfer train-demo`, committed


def _demo_models() -> tuple[Path, Path, str]:
    """The pair in ``SPECINFER_DEMO_MODELS`` if set, else the bundled demo pair of this checkout,
    else (an install without the checkout) a tiny random pair built once."""
    candidates = [os.environ.get("SPECINFER_DEMO_MODELS", ""), BUNDLED_PAIR]
    for c in candidates:
        if c and (Path(c) / "llm/config.json").is_file() and (Path(c) / "ssm/config.json").is_file():
            return Path(c) / "llm", Path(c) / "ssm", f"trained pair in {c}"
    from specinfer.models.tiny import build_tiny_pair

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specinfer/tiny-pair"
    if not (cache / "ssm/config.json").is_file():
        build_tiny_pair(cache)
    return cache / "llm", cache / "ssm", f"tiny random pair in {cache} (no trained pair found; its text is noise)"


def _add_client_security_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a request manager that requires TLS or a bearer token (flags or SPECINFER_* variables)."""
    from specinfer.serving.config import add_setting

    add_setting(p, "--tls-ca", default="", help="PEM CA of the server: connect with TLS")
    add_setting(p, "--tls-client-cert", default="", help="PEM client certificate (mTLS)")
    add_setting(p, "--tls-client-key", default="", help="PEM key of --tls-client-cert")
    add_setting(p, "--auth-token", default="", secret=True, help="bearer token of the public API (prefer the variable or the file: argv is visible)")
    add_setting(p, "--auth-token-file", default="", help="file holding --auth-token")


def _client_auth(args: argparse.Namespace):
    from specinfer.serving.security import ClientAuth, ClientTls, read_token

    try:
        auth = ClientAuth(
            ClientTls.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key), read_token(args.auth_token, args.auth_token_file, "auth-token")
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
        return StackSecurity(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_ca, args.tls_client_cert, args.tls_client_key, auth_token, internal)
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    from specinfer.serving.config import SettingsParser, add_setting

    parser = SettingsParser(prog="specinfer", description=__doc__)  # its subcommands' parsers are SettingsParsers too
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative generation: through a running server (--server) or in this process (--llm)")
    gen.add_argument("--server", help="address of a running request manager (host:port); streams the text")
    gen.add_argument("--llm", help="Hugging Face checkpoint folder of the LLM (in-process generation)")
    gen.add_argument("--ssm", action="append", default=[], help="checkpoint folder of an SSM (repeat for several: trees are merged)")
    _add_generation_flags(gen)
    _add_client_security_flags(gen)
    gen.add_argument("prompt", nargs="+", help="prompt text(s); several are generated as one batch")
    up = sub.add_parser("up", help="start Redis, the request manager, SSM workers and the verifier as local processes")
    up.add_argument("--llm", help="LLM checkpoint folder (default: the demo pair)")
    up.add_argument("--ssm", action="append", default=[], help="SSM checkpoint folder (repeat for several; default: the demo pair's)")
    up.add_argument("--workers", type=int, default=1, help="SSM worker processes")
    up.add_argument("--verifiers", type=int, default=1, help="LLM verifier replicas (each request runs on one; docs/scaling.md)")
    up.add_argument("--request-managers", type=int, default=1, help="request-manager processes (more than one share a Redis the launcher starts)")
    up.add_argument("--port", type=int, default=50051, help="public API port")
    up.add_argument("--state-dir", default="./specinfer-state", help="embedded Redis data")
    up.add_argument("--backend", default="auto", choices=["auto", "native", "reference"])
    up.add_argument("--expansion", default="auto", help="default speculation of the request manager: auto (adaptive), tuned, widths, @FILE, none")
    up.add_argument("--http-port", type=int, default=8000, help="port of the OpenAI-compatible HTTP API on 127.0.0.1 (0: off)")
    up.add_argument("--verifier-threads", type=int, default=0, help="torch threads of the LLM verifier (0: torch's default, every core)")
    up.add_argument("--ssm-threads", type=int, default=1, help="torch threads of each SSM worker (0: torch's default); few, not to crowd the verifier")
    _add_client_security_flags(up)
    add_setting(up, "--tls-cert", default="", help="PEM certificate (valid for 127.0.0.1) every process serves TLS with")
    add_setting(up, "--tls-key", default="", help="PEM key of --tls-cert")
    add_setting(up, "--tls-client-ca", default="", help="PEM CA: every port requires client certificates it signed (mTLS)")
    add_setting(up, "--internal-token", default="", secret=True, help="bearer token between the services")
    add_setting(up, "--internal-token-file", default="", help="file holding --internal-token")
    add_tune_parser(sub)
    add_training_parsers(sub)
    demo = sub.add_parser("demo", help="start the local stack with the demo model pair and stream a few generations through gRPC")
    _add_generation_flags(demo)
    demo.add_argument("--prompts", type=int, default=1, help="how many prompts of the demo set")
    demo.add_argument("--in-process", action="store_true", help="run the engine in this process instead of the services")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            from specinfer.launcher import StackConfig, run_up

            llm, ssms = (Path(args.llm), tuple(Path(s) for s in args.ssm)) if args.llm else _demo_models()[:2]
            if not isinstance(ssms, tuple):
                ssms = (ssms,)
            cfg = StackConfig(
                llm,
                ssms,
                args.workers,
                args.port,
                Path(args.state_dir),
                args.backend,
                resolve_expansion(args.expansion, ssms),
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
            if not args.llm:
                raise InvalidArgument("llm", "give --llm (in-process) or --server (a running stack)")
            run_generate(_build_config(args, args.llm, args.ssm, args.prompt))
        else:
            llm, ssm, what = _demo_models()
            print(f"=== demo models: {what}")
            prompts = _demo_prompts(llm, args.prompts)
            if args.in_process:
                run_generate(_build_config(args, llm, [ssm], prompts))
            else:
                return _demo_stack(args, llm, ssm, prompts)
    except InvalidArgument as exc:  # a bad setting: one line on stderr, exit status 2
        return parser.bad_setting(exc)
    return 0


def _demo_stack(args: argparse.Namespace, llm: Path, ssm: Path, prompts: list[str]) -> int:
    """Start verifier, SSM worker and request manager (with its embedded Redis) as local
    processes, stream the prompts through the public gRPC API, stop everything."""
    import tempfile

    from specinfer.launcher import Stack, StackConfig

    state = Path(tempfile.mkdtemp(prefix="specinfer-demo-"))
    print("=== starting the local stack (LLM verifier, SSM worker, request manager + Redis) ...", flush=True)
    with Stack(StackConfig(llm, (ssm,), 1, 0, state, args.backend, resolve_expansion(args.expansion, [ssm]))) as stack:
        for p in stack.processes:
            print(f"    {p.name:16s} {p.address}", flush=True)
        for prompt in prompts:
            print("--- prompt", flush=True)
            print(prompt, end="" if prompt.endswith("\n") else "\n", flush=True)
            print("--- generated (streamed through gRPC)", flush=True)
            if _stream(stack.address, args, prompt) != 0:
                return 2
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream each prompt's text from a running request manager."""
    auth = _client_auth(args)
    for prompt in args.prompt:
        if _stream(args.server, args, prompt, auth) != 0:
            return 2
    return 0


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
        # auto: the server's default (adaptive speculation unless the server runs otherwise)
        expansion=() if args.no_speculation or keyword in ("auto", "none", "off") else ExpansionConfig.parse(resolve_expansion(args.expansion)).widths,
        speculation=not args.no_speculation and keyword not in ("none", "off"),
    )
    with Client(address, auth=auth) as client:
        try:
            for msg in client.stream(request):
                print(msg.text, end="", flush=True)
                if msg.HasField("finished"):
                    u = msg.finished.usage
                    print(
                        f"\n--- {u.completion_tokens} tokens in {u.llm_steps} LLM steps ({u.tokens_per_step:.2f} tokens per LLM step, "
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
