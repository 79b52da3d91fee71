"""Request-manager configuration, built once from flags / SPECINFER_* environment variables.

Each setting is declared once: a field of :class:`RequestManagerConfig` with its default, and in its
metadata its flag's help (:func:`setting`). :meth:`RequestManagerConfig.parser` adds one flag per such
field (the flag's type and default are the field default's) and :meth:`RequestManagerConfig.from_namespace`
reads them back. The settings every service has (``--host``, ``--port``, ``--tls-*``, ...) come from
:func:`specinfer.serving.config.add_server_settings`; a few fields are built from other flags by hand
(``expansion`` and ``adaptive`` from ``--expansion``, ``security``, ``internal``, ``server``)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specinfer.checkpoint import check_checkpoint, load_tokenizer
from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT, DEFAULT_MAX_TREE_NODES
from specinfer.request_manager.state.records import validate_id
from specinfer.request_manager.state.redis_client import SOCKET_TIMEOUT_S
from specinfer.serving.config import (
    SettingsParser,
    add_client_tls_settings,
    add_server_settings,
    add_setting,
    client_auth,
    internal_token,
    server_security,
    split_list,
)
from specinfer.serving.security import ClientAuth, ServerSecurity, read_token
from specinfer.serving.server import ServerConfig
from specinfer.tuning import resolve_expansion

FLAG = "specinfer.flag"  # the field metadata key of a setting's Flag


@dataclass(frozen=True)
class Flag:
    """The command-line setting of a field: ``--NAME`` (the field's name, dashed, unless ``name`` says
    otherwise) with its help; ``secret``: neither ``--help`` nor the config's repr shows the value;
    ``text``: the flag's default where the field is built from the flag's text by hand and has none."""

    help: str
    name: str = ""
    secret: bool = False
    text: str | None = None

    def flag(self, field_name: str) -> str:
        return "--" + (self.name or field_name.replace("_", "-"))

    def dest(self, field_name: str) -> str:
        return self.flag(field_name)[2:].replace("-", "_")


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    name: str = "",
    secret: bool = False,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A field set by the flag ``--NAME`` (:class:`Flag`), defaulting to ``default`` (or ``factory()``,
    when the parser is built). A tuple is a comma-separated list on the command line."""
    metadata = {FLAG: Flag(help, name, secret)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, repr=not secret, metadata=metadata)


def flag_default(f: dataclasses.Field) -> Any:
    """The default of ``f``'s flag: the field's default, a tuple as its comma-separated text."""
    flag: Flag = f.metadata[FLAG]
    if flag.text is not None:
        return flag.text
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return ",".join(value) if isinstance(value, tuple) else value


def reads_own_flag(f: dataclasses.Field) -> bool:
    """``f`` is set from its flag as it parses (not built by hand from the flag's text)."""
    return FLAG in f.metadata and f.metadata[FLAG].text is None


def flag_value(f: dataclasses.Field, a: argparse.Namespace) -> Any:
    """``f``'s value from its parsed flag: a comma-separated list as a tuple."""
    value = getattr(a, f.metadata[FLAG].dest(f.name))
    return tuple(split_list(value)) if isinstance(f.default, tuple) else value


EXPANSION_HELP = (
    "default speculation: 'auto' (adaptive: the planner sizes each step's tree), 'tuned' (the paper's tree), "
    "widths per depth, @FILE (a `specinfer tune` result), 'none'"
)


@dataclass(frozen=True, kw_only=True)
class RequestManagerConfig:
    """The request manager's settings, its fields in the order of ``--help``."""

    # where it listens, logging and shutdown: the settings every service has (add_server_settings)
    host: str
    port: int = 50051
    port_file: str
    log_level: str
    grace_seconds: float
    redis_url: str = setting("", "Redis URL (redis://, rediss://, unix://); empty: embedded Redis")
    redis_password: str = setting("", "Redis password", secret=True)
    redis_username: str = setting("", "Redis ACL user name (empty: the default user)")
    redis_cluster: bool = setting(False, "--redis-url names any node of a Redis Cluster (on/off)")
    redis_min_replica_acks: int = setting(
        0,
        "replicas that must acknowledge each write before tokens are streamed (WAIT), "
        "so an acknowledged token survives a failover (0: off)",
    )
    redis_key_prefix: str = setting(
        "specinfer", "prefix of every Redis key (deployments that share a Redis use different ones)"
    )
    redis_replica_timeout_seconds: float = setting(
        1.0, "how long a write waits for --redis-min-replica-acks replicas before it fails (retried)"
    )
    state_dir: str = setting("./specinfer-state", "where the embedded Redis keeps its data")
    ssm_workers: tuple[str, ...] = setting(
        (), "comma-separated SSM worker addresses host:port; dns:///host:port means all addresses of host"
    )
    verifiers: tuple[str, ...] = setting(
        ("127.0.0.1:50053",),
        "comma-separated LLM verifier replica addresses host:port; dns:///host:port means all addresses of host "
        "(each request runs on one)",
        name="verifier",
    )
    # LLM checkpoint folder: tokenizer.json and the EOS token (no weights are loaded)
    model_dir: str = setting("", "LLM checkpoint folder for the tokenizer and EOS token")
    # the default static expansion config (widths per depth); empty: adaptive (see adaptive) or no speculation
    expansion: tuple[int, ...] = field(metadata={FLAG: Flag(EXPANSION_HELP, text="auto")})
    adaptive: bool  # requests that set nothing speculate adaptively (--expansion auto)
    default_ssms: tuple[str, ...] = setting((), "comma-separated SSM names used by default (empty: all)")
    draft_support: int = setting(DEFAULT_DRAFT_SUPPORT, "most tokens of a sparse draft distribution")
    max_batch: int = setting(32, "most requests per iteration")
    max_prefill_tokens: int = setting(
        2048, "most tokens of the requests admitted in one iteration, past the first (0: no cap)"
    )
    max_queue: int = setting(256, "most waiting requests (more get RESOURCE_EXHAUSTED)")
    max_new_tokens: int = setting(4096, "upper limit of a request's max_new_tokens")
    owner: str = setting(
        help="ID of this replica (requests in Redis are partitioned by owner; unique per replica)",
        factory=socket.gethostname,
    )
    lease_seconds: float = setting(  # the ownership lease's TTL (services/request_manager/state/ownership.py)
        10.0,
        "TTL of this replica's ownership lease in Redis, renewed every third of it; "
        "a dead replica's requests resume on another within 1.5 times it",
    )
    result_ttl_seconds: float = setting(3600.0, "how long finished requests stay in Redis")
    rpc_timeout_seconds: float = setting(60.0, "timeout of calls to workers and verifier")
    max_prompt_tokens: int = setting(8192, "most prompt tokens of a request (more: INVALID_ARGUMENT)")
    max_tree_nodes: int = setting(
        DEFAULT_MAX_TREE_NODES, "most nodes of a request's token tree (more: INVALID_ARGUMENT)"
    )
    speculation_gate: bool = setting(
        True,
        "per batch size, measure whether adaptive speculation commits more tokens per second than none and keep "
        "the faster (docs/speculation.md; on/off; off: speculate as the planner plans, every step)",
    )
    ssm_failure_seconds: float = setting(
        10.0, "timeout of a Speculate call; a worker that fails or exceeds it is taken out until healthy"
    )
    http_port: int = setting(8000, "port of the OpenAI-compatible HTTP API on --host (0: no HTTP API)")
    http_port_file: str = setting("", "write the HTTP API's port here once it listens")
    security: ServerSecurity  # the public port: TLS and the --auth-token clients must send
    internal: ClientAuth  # calls to workers and verifier: TLS and the --internal-token
    server: ServerConfig  # where it listens (gRPC and metrics), from the same settings as host/port

    @staticmethod
    def parser() -> SettingsParser:
        p = SettingsParser(
            prog="specinfer-request-manager", description="specinfer request manager: the public gRPC API"
        )
        add_server_settings(p, default_port=FIELDS["port"].default)
        for f in FIELDS.values():
            if FLAG in f.metadata:
                flag: Flag = f.metadata[FLAG]
                default = flag_default(f)
                add_setting(p, flag.flag(f.name), type(default), default, flag.help, secret=flag.secret)
        add_setting(
            p,
            "--auth-token",
            str,
            "",
            "bearer token clients of the public API (gRPC and HTTP) must send (empty: none)",
            secret=True,
        )
        add_setting(p, "--auth-token-file", str, "", "file holding --auth-token")
        add_client_tls_settings(p)
        return p

    @staticmethod
    def from_args(argv: Sequence[str] | None = None) -> RequestManagerConfig:
        return RequestManagerConfig.from_namespace(RequestManagerConfig.parser().parse_args(argv))

    @staticmethod
    def from_namespace(a: argparse.Namespace) -> RequestManagerConfig:
        """From the parsed settings of :meth:`parser`; raises :class:`InvalidArgument` naming the bad one."""
        if not a.lease_seconds > 0:  # NaN included
            raise InvalidArgument("lease-seconds", f"must be positive, got {a.lease_seconds}")
        try:
            validate_id(a.owner, "owner")
        except ValueError as exc:
            raise InvalidArgument("owner", str(exc)) from None
        try:
            auth_token = read_token(a.auth_token, a.auth_token_file, "auth-token")
        except ValueError as exc:
            raise InvalidArgument("auth-token", str(exc)) from None
        check_redis(a)
        if a.model_dir:
            check_model_dir(a.model_dir)
        keyword = a.expansion.strip().lower()
        adaptive = keyword == "auto"
        expansion = (
            ()
            if adaptive or keyword in ("", "none", "off")
            else ExpansionConfig.parse(resolve_expansion(a.expansion)).widths
        )
        return RequestManagerConfig(
            **{f.name: flag_value(f, a) for f in FIELDS.values() if reads_own_flag(f)},
            host=a.host,
            port=a.port,
            port_file=a.port_file or "",
            log_level=a.log_level,
            grace_seconds=a.grace_seconds,
            expansion=expansion,
            adaptive=adaptive,
            security=server_security(a, (auth_token,)),
            internal=client_auth(a, internal_token(a)),
            server=ServerConfig.from_args(a),
        )


FIELDS = {f.name: f for f in dataclasses.fields(RequestManagerConfig)}


def check_model_dir(path: str) -> None:
    """``--model-dir`` is a checkpoint folder whose tokenizer (when it has one) loads: read now, not when
    the verifier has answered, so a bad folder is a bad setting."""
    check_checkpoint(path, "model-dir")
    try:
        load_tokenizer(path)
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise InvalidArgument("model-dir", f"{path}/tokenizer.json cannot be read: {exc}") from None


def check_redis(a: argparse.Namespace) -> None:
    """The Redis settings fit together: a cluster or replicas need an external Redis (--redis-url); the
    embedded one is a single server without replicas."""
    if a.redis_cluster and not a.redis_url:
        raise InvalidArgument(
            "redis-cluster",
            "--redis-cluster needs --redis-url naming a node of the cluster (the embedded Redis is no cluster)",
        )
    if a.redis_cluster and not a.redis_url.startswith(("redis://", "rediss://")):
        raise InvalidArgument(
            "redis-url",
            "--redis-cluster needs a redis:// or rediss:// --redis-url (a cluster is reached over TCP), "
            f"got {a.redis_url.split('://')[0]}://",
        )
    if a.redis_min_replica_acks < 0:
        raise InvalidArgument("redis-min-replica-acks", f"must be >= 0, got {a.redis_min_replica_acks}")
    if a.redis_min_replica_acks and not a.redis_url:
        raise InvalidArgument(
            "redis-min-replica-acks", "--redis-min-replica-acks needs --redis-url (the embedded Redis has no replicas)"
        )
    if not a.redis_key_prefix or "{" in a.redis_key_prefix or "}" in a.redis_key_prefix:
        raise InvalidArgument(
            "redis-key-prefix",
            f"must be non-empty and free of braces (Redis Cluster hash tags), got {a.redis_key_prefix!r}",
        )
    if not 0 < a.redis_replica_timeout_seconds < SOCKET_TIMEOUT_S:
        raise InvalidArgument(
            "redis-replica-timeout-seconds",
            f"must be > 0 and below the Redis socket timeout of {SOCKET_TIMEOUT_S:g} s, "
            f"got {a.redis_replica_timeout_seconds}",
        )
