"""``specinfer-ssm-worker`` / ``python -m specinfer.ssm_worker``: serve SSMs over gRPC.

Every flag is also an environment variable (``--kv-cache-bytes`` = ``SPECINFER_KV_CACHE_BYTES``).
Example: ``specinfer-ssm-worker --ssm small=/models/ssm,/models/ssm2 --port 50061``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from specinfer.checkpoint import check_checkpoint, eos_token_id, load_tokenizer, model_folder
from specinfer.core import InvalidArgument
from specinfer.core.constraints import Grammars, grammars_for
from specinfer.models.cross_vocab import draft_vocabulary, in_llm_ids, vocabulary_method
from specinfer.models.interface import CausalLM
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
    calibrate_drafters,
    drafter_cost_entry,
    load_model,
    model_identity,
)
from specinfer.serving.server import ServerConfig, serve_model, setup_logging
from specinfer.ssm_worker.servicer import SERVICE_NAME, SsmWorkerServicer
from specinfer.tuning import slot_prior

log = logging.getLogger("specinfer.ssm_worker")


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(
        prog="specinfer-ssm-worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_setting(
        parser,
        "--ssm",
        default=None,
        help="comma-separated SSM checkpoints, NAME=PATH or PATH (named after its folder)",
    )
    add_setting(
        parser,
        "--llm-dir",
        default="",
        help="the LLM's checkpoint folder (config.json, tokenizer.json; no weights are read): "
        "an SSM whose tokenizer differs from the LLM's drafts through the token-level intersection of the two "
        "(docs/models.md). Empty: every SSM must speak the LLM's token IDs",
    )
    add_setting(
        parser,
        "--calibrate-tokens",
        int,
        32,
        "time each SSM's draft passes up to this many frontier tokens at start-up, for the planner (0: off)",
    )
    add_server_settings(parser)
    add_model_settings(parser)
    return parser


def load_servicer(args: argparse.Namespace, metrics: ModelMetrics) -> SsmWorkerServicer:
    paths = {name: str(model_folder(path, f"ssm.{name}")) for name, path in parse_named_paths(args.ssm, "ssm").items()}
    ssms: dict[str, CausalLM] = {}
    methods = {}
    # each SSM's torch calls, its loading first, run in its own thread (ModelThread: one OpenMP team a thread),
    # or all on the event loop's (--model-calls inline)
    threads = {name: ModelThread.from_settings(name, args) for name in paths}
    for name, path in paths.items():
        check_checkpoint(path, f"ssm.{name}")  # before the LLM's vocabulary is compared with its own
        vmap = draft_vocabulary(args.llm_dir, path, f"ssm.{name}") if args.llm_dir else None
        model = threads[name].run(load_model, path, f"ssm.{name}", args)
        ssms[name] = threads[name].run(in_llm_ids, model, vmap)  # tensors of vocabulary size
        methods[name] = vocabulary_method(vmap)
        if vmap is not None:
            log.info(
                "draft vocabulary",
                extra={"ssm": name, "method": methods[name], "shared_tokens": vmap.shared, "ssm_vocab": vmap.ssm_size},
            )
    priors = {name: prior for name, path in paths.items() if (prior := slot_prior(path)) is not None}
    entries = {
        name: drafter_cost_entry(args, model_identity(path, args), methods[name]) for name, path in paths.items()
    }
    costs = {}
    for name, ssm in ssms.items():
        costs |= threads[name].run(calibrate_drafters, {name: ssm}, args.calibrate_tokens, {name: entries[name]})
    grammars = draft_grammars(args.llm_dir, paths, ssms)
    return SsmWorkerServicer(ssms, metrics, costs, priors, methods, grammars, threads)


def draft_grammars(llm_dir: str, paths: dict[str, str], ssms: dict[str, CausalLM]) -> Grammars | None:
    """The grammars that mask constrained requests' drafts: those of the LLM's tokenizer (``llm_dir``), else of the
    first SSM's, whose IDs every SSM here speaks (None without a tokenizer or an EOS token: drafts unmasked)."""
    if not ssms:  # nothing to draft with: the servicer refuses that, naming the setting
        return None
    source = llm_dir or next(iter(paths.values()))
    vocab = next(iter(ssms.values())).vocab_size
    return grammars_for(load_tokenizer(source), vocab, eos_token_id(source))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:  # a bad setting, found here or when the port binds: one line on stderr, exit status 2
        # settings first: a bad TLS or token setting, or a port in use, fails before minutes of model loading
        security = server_security(args, (internal_token(args),))
        server = ServerConfig.from_args(args)
        server.check_ports_free()
        check_ports_free(server.host, {"socket-port": args.socket_port})
        metrics = ServiceMetrics(SERVICE_NAME)
        servicer = load_servicer(args, ModelMetrics(metrics.registry, "ssm"))
        log.info("models loaded", extra={"ssms": servicer.models, "vocab_size": servicer.vocab_size})
        # models load before the server starts, so health turns SERVING only once they can draft
        serve_model(server, SERVICE_NAME, servicer, args.port_file, metrics, security, args.socket_port)
    except InvalidArgument as exc:
        return parser.bad_setting(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
