"""``python -m specinfer.request_manager`` / ``specinfer-request-manager``: the public API service."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from specinfer.core import InvalidArgument
from specinfer.request_manager.app import RequestManagerApp
from specinfer.request_manager.config import RequestManagerConfig
from specinfer.request_manager.startup import StartUpError
from specinfer.request_manager.state.redis_server import RedisStartError, StateDirInUse
from specinfer.serving.config import check_ports_free
from specinfer.serving.server import setup_logging

log = logging.getLogger("specinfer.request_manager")


async def serve(cfg: RequestManagerConfig) -> int:
    """Run the request manager until SIGTERM/SIGINT. The port opens at once (health NOT_SERVING,
    calls UNAVAILABLE) and serves once the verifier answers and it holds its ownership lease (another
    process with the same --owner makes it wait: :mod:`.state.ownership`); SSM workers that are down join
    when they come up. Whatever this starts (the embedded Redis, channels, the scheduler, the lease) is
    stopped or released on every way out, a failed start-up included (:class:`.app.RequestManagerApp`)."""
    app = RequestManagerApp(cfg)
    try:
        await app.start()
        return await app.run_until_stopped()
    finally:
        await app.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = RequestManagerConfig.parser()
    try:  # a bad setting, found here or when a port binds: one line on stderr, exit status 2
        cfg = RequestManagerConfig.from_namespace(parser.parse_args(argv))
        check_ports_free(
            cfg.host, {"port": cfg.port, "http-port": cfg.http_port, "metrics-port": cfg.server.metrics_port or -1}
        )
        setup_logging(cfg.log_level)
        return asyncio.run(serve(cfg))
    except InvalidArgument as exc:
        return parser.bad_setting(exc)
    except (StartUpError, StateDirInUse, RedisStartError) as exc:
        log.error("cannot start", extra={"error": str(exc)})
        print(f"specinfer-request-manager: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
