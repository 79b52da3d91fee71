"""``specinfer-llm-verifier`` / ``python -m specinfer.llm_verifier``: serve the LLM over gRPC.

Every flag is also an environment variable (``--kv-cache-bytes`` = ``SPECINFER_KV_CACHE_BYTES``).
Example: ``specinfer-llm-verifier --llm /models/llm --port 50051``. With ``--tensor-parallel N
--pipeline-parallel M`` the LLM runs on N*M ranks (:mod:`specinfer.llm_verifier.ranks`,
docs/parallelism.md): this process is rank 0, serves gRPC and starts the others, unless an
outside launcher (torchrun) set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence

import torch

from specinfer.checkpoint import eos_token_id, load_tokenizer, model_folder
from specinfer.core import InvalidArgument
from specinfer.core.constraints import grammars_for
from specinfer.llm_verifier.ranks import (
    Launch,
    exit_with_parent,
    plan_launch,
    rank_device,
    spawn_ranks,
    stop_ranks,
    watch_ranks,
)
from specinfer.llm_verifier.servicer import SERVICE_NAME, LlmVerifierServicer
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.head_drafter import with_head
from specinfer.models.loading import check_checkpoint
from specinfer.models.native import ModelSpec, NativeOptions, UnsupportedModel
from specinfer.models.native.parallel import check_layout, close_groups, exit_rank, load_driver, run_rank
from specinfer.serving.config import (
    SettingsParser,
    add_model_settings,
    add_server_settings,
    add_setting,
    check_ports_free,
    internal_token,
    parse_named_paths,
    server_security,
)
from specinfer.serving.metrics import ModelMetrics, ServiceMetrics
from specinfer.serving.runner import (
    ModelThread,
    calibrate_verifier,
    load_model,
    model_identity,
    verifier_cost_entry,
)
from specinfer.serving.security import ServerSecurity
from specinfer.serving.server import ServerConfig, serve, serve_model, setup_logging
from specinfer.serving.socket_calls import model_sockets

log = logging.getLogger("specinfer.llm_verifier")

STOP_RANKS_SECONDS = 10.0  # after a clean shutdown, how long the other ranks get to exit


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog="specinfer-llm-verifier", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_setting(
        parser,
        "--llm",
        default=None,
        help="the LLM checkpoint, PATH or NAME=PATH (default name: the folder's) (required)",
    )
    add_server_settings(parser)
    add_model_settings(parser)
    add_setting(
        parser,
        "--tensor-parallel",
        int,
        1,
        help="ranks each layer is split across (native backend; divides the heads, KV heads and MLP width)",
    )
    add_setting(
        parser,
        "--pipeline-parallel",
        int,
        1,
        help="pipeline stages, each a contiguous range of layers (native backend)",
    )
    add_setting(
        parser,
        "--offload",
        bool,
        False,
        help="LLM decoder layers in host memory, streamed to the device layer by layer (native backend)",
    )
    add_setting(
        parser,
        "--offload-reserve-bytes",
        int,
        0,
        help="most device memory offloading may use: staging buffers and resident weights (0: no bound)",
    )
    add_setting(
        parser,
        "--head",
        str,
        "",
        help="a draft head for the LLM (a folder from specinfer train-head): adaptive requests also draft "
        "with it, next to the features, as each step is verified (native backend, one process)",
    )
    add_setting(
        parser,
        "--calibrate-tokens",
        int,
        64,
        help="time verify calls up to this many tree tokens at start-up, for the planner (0: off)",
    )
    add_setting(
        parser,
        "--rank-timeout-seconds",
        float,
        60.0,
        help="with several ranks: how long a collective waits for a peer before the service fails",
    )
    return parser


def llm_path(args: argparse.Namespace) -> tuple[str, str]:
    paths = parse_named_paths(args.llm, "llm")
    if len(paths) != 1:
        raise InvalidArgument("llm", f"name exactly one checkpoint, got {len(paths)}")
    ((name, path),) = paths.items()
    return name, str(model_folder(path, "llm"))


def load_servicer(args: argparse.Namespace, metrics: ModelMetrics) -> LlmVerifierServicer:
    name, path = llm_path(args)
    thread = ModelThread.from_settings(name, args)  # every torch call of the model, its loading first, runs there
    llm = thread.run(load_model, path, "llm", args, args.offload, args.offload_reserve_bytes)
    grammars = None
    if args.head:
        llm = thread.run(with_head, llm, args.head, path)
        # the head's drafts of constrained requests are masked by their grammar
        grammars = grammars_for(load_tokenizer(path), llm.vocab_size, eos_token_id(path))
    entry = verifier_cost_entry(args, model_identity(path, args, args.offload, args.offload_reserve_bytes))
    costs = thread.run(calibrate_verifier, llm, args.calibrate_tokens, entry)
    return LlmVerifierServicer(name, llm, metrics, costs, grammars, thread)


def plan_parallel(args: argparse.Namespace, environ: Mapping[str, str]) -> Launch | None:
    """The launch of a parallel verifier (None: one process); raises :class:`InvalidArgument`
    naming the setting that does not fit the model."""
    tp, pp = args.tensor_parallel, args.pipeline_parallel
    for field, value in (("tensor-parallel", tp), ("pipeline-parallel", pp)):
        if value < 1:
            raise InvalidArgument(field, f"must be >= 1, got {value}")
    if tp * pp == 1:
        return None
    if args.head:
        raise InvalidArgument("head", "a draft head drafts from the features of an LLM in one process (parallel 1)")
    if args.offload_reserve_bytes and not args.offload:  # the single process's load_backend says the same
        raise InvalidArgument("offload-reserve-bytes", "bounds offloading's device memory: it needs --offload")
    if args.backend == "reference":
        raise InvalidArgument("backend", "tensor and pipeline parallelism need the native backend")
    if args.dtype not in DTYPE_CHOICES:
        raise InvalidArgument("dtype", f"must be one of {', '.join(DTYPE_CHOICES)}, got {args.dtype!r}")
    _, path = llm_path(args)
    try:
        spec = ModelSpec.from_dir(check_checkpoint(path, "llm"))
    except UnsupportedModel as exc:
        raise InvalidArgument(
            "backend", f"tensor and pipeline parallelism need the native backend, which cannot run {path}: {exc}"
        ) from exc
    check_layout(spec, tp, pp)
    return plan_launch(tp, pp, args.rank_timeout_seconds, environ)


def native_options(args: argparse.Namespace, launch: Launch) -> NativeOptions:
    device = rank_device(args.device, launch.local_rank)
    dtype = DTYPES[resolve_dtype(args.dtype, device)]
    return NativeOptions(
        dtype,
        device,
        args.kv_cache_bytes,
        args.max_seq_len,
        args.attention,
        kv_block_size=args.kv_block_size,
        offload=args.offload,
        offload_reserve_bytes=args.offload_reserve_bytes,
        prefix_caching=args.prefix_caching,
        quantize=args.quantize,
    )


def run_other_rank(args: argparse.Namespace, launch: Launch) -> int:
    """Ranks 1..: replay rank 0's operations until it shuts them down."""
    exit_with_parent()
    try:
        run_rank(llm_path(args)[1], native_options(args, launch), launch.layout, launch.rendezvous)
    except Exception:
        log.exception("rank failed", extra={"rank": launch.layout.rank})
        logging.shutdown()
        os._exit(1)  # not sys.exit: a failed process group may hold threads that never end
    close_groups()
    log.info("rank stopped", extra={"rank": launch.layout.rank})
    exit_rank(0)


def serve_parallel(
    args: argparse.Namespace, launch: Launch, argv: Sequence[str], metrics: ServiceMetrics, security: ServerSecurity
) -> int:
    """Rank 0: start the other ranks (spawned launch), load its shard, serve, watch the ranks."""
    children = spawn_ranks(launch, argv) if launch.spawn else []
    name, path = llm_path(args)
    try:
        backend, driver = load_driver(path, native_options(args, launch), launch.layout, launch.rendezvous)
    except Exception:
        log.exception("loading the parallel model failed")
        stop_ranks(children, 0.0)
        logging.shutdown()
        os._exit(1)
    layout = launch.layout
    entry = verifier_cost_entry(
        args, model_identity(path, args, args.offload, args.offload_reserve_bytes), (layout.tp, layout.pp)
    )
    servicer = LlmVerifierServicer(
        name, backend, ModelMetrics(metrics.registry, "llm"), calibrate_verifier(backend, args.calibrate_tokens, entry)
    )
    log.info(
        "model loaded",
        extra={
            "llm": name,
            "tensor_parallel": layout.tp,
            "pipeline_parallel": layout.pp,
            "max_requests": backend.max_requests,
        },
    )

    async def on_stop() -> None:
        await servicer.runner.call(lambda _model: driver.shutdown())

    code = asyncio.run(
        serve(
            ServerConfig.from_args(args),
            [SERVICE_NAME],
            servicer.register,
            args.port_file,
            on_stop,
            metrics=metrics,
            watch=lambda: watch_ranks(children, driver),
            security=security,
            sockets=model_sockets(servicer.socket_server, args.socket_port, security, metrics),
        )
    )
    if code == 0:
        stop_ranks(children, STOP_RANKS_SECONDS)
        close_groups()
        return 0
    stop_ranks(children, 0.0)
    logging.shutdown()
    os._exit(code)  # the model thread may be blocked in a collective with a dead peer: do not join it


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:  # a bad setting, found here or when the port binds: one line on stderr, exit status 2
        # settings first: a bad TLS or token setting, or a port in use, fails before minutes of model loading
        security = server_security(args, (internal_token(args),))
        server = ServerConfig.from_args(args)
        metrics = ServiceMetrics(SERVICE_NAME)
        launch = plan_parallel(args, os.environ)
        if launch is None or launch.layout.rank == 0:
            server.check_ports_free()
            check_ports_free(server.host, {"socket-port": args.socket_port})
        if launch is None:
            servicer = load_servicer(args, ModelMetrics(metrics.registry, "llm"))
            llm = servicer.llm
            extra = {
                "llm": servicer.name,
                "vocab_size": llm.vocab_size,
                "max_positions": llm.max_positions,
                "max_requests": llm.max_requests,
            }
            log.info("model loaded", extra=extra)
            # the model loads before the server starts, so health turns SERVING only once it can verify
            serve_model(server, SERVICE_NAME, servicer, args.port_file, metrics, security, args.socket_port)
            return 0
    except InvalidArgument as exc:
        return parser.bad_setting(exc)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    return run_other_rank(args, launch) if launch.layout.rank else serve_parallel(args, launch, argv, metrics, security)


if __name__ == "__main__":
    sys.exit(main())
