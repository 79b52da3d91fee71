"""``specinfer-llm-verifier`` / ``python -m specinfer.llm_verifier``: serve the LLM over gRPC.

Every flag is also an environment variable (``--kv-cache-bytes`` = ``SPECINFER_KV_CACHE_BYTES``).
Example: ``specinfer-llm-verifier --llm /models/llm --port 50051``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from specinfer.core import InvalidArgument
from specinfer.llm_verifier.servicer import SERVICE_NAME, LlmVerifierServicer
from specinfer.serving.config import add_model_settings, add_server_settings, add_setting, internal_token, parse_named_paths, server_security
from specinfer.serving.runner import load_model
from specinfer.serving.server import ServerConfig, serve, setup_logging

log = logging.getLogger("specinfer.llm_verifier")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specinfer-llm-verifier", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_setting(parser, "--llm", default=None, help="the LLM checkpoint, PATH or NAME=PATH (default name: the folder's) (required)")
    add_server_settings(parser)
    add_model_settings(parser)
    return parser


def load_servicer(args: argparse.Namespace) -> LlmVerifierServicer:
    paths = parse_named_paths(args.llm, "llm")
    if len(paths) != 1:
        raise InvalidArgument("llm", f"name exactly one checkpoint, got {len(paths)}")
    ((name, path),) = paths.items()
    return LlmVerifierServicer(name, load_model(path, "llm", args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        # settings first: a bad TLS or token setting fails before minutes of model loading
        security = server_security(args, (internal_token(args),))
        servicer = load_servicer(args)
    except InvalidArgument as exc:
        log.error("bad settings", extra={"error": str(exc)})
        return 2
    llm = servicer.llm
    log.info("model loaded", extra={"llm": servicer.name, "vocab_size": llm.vocab_size, "max_positions": llm.max_positions, "max_requests": llm.max_requests})
    # the model loads before the server starts, so health turns SERVING only once it can verify
    asyncio.run(serve(ServerConfig(args.host, args.port, args.grace_seconds), [SERVICE_NAME], servicer.register, args.port_file, security=security))
    return 0


if __name__ == "__main__":
    sys.exit(main())
