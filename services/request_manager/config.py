"""Request-manager configuration, built once from flags / SPECINFER_* environment variables."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from specinfer.checkpoint import check_checkpoint, load_tokenizer
from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.drafts import DEFAULT_DRAFT_SUPPORT
from specinfer.request_manager.records import validate_id
from specinfer.request_manager.redis_server import SOCKET_TIMEOUT_S
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


@dataclass(frozen=True)
class RequestManagerConfig:
    host: str
    port: int
    port_file: str
    redis_url: str  # empty: start an embedded Redis under state_dir
    redis_password: str = field(repr=False)
    redis_username: str
    redis_cluster: bool  # redis_url names a node of a Redis Cluster
    redis_min_replica_acks: int  # replicas that must acknowledge each write (0: none)
    redis_replica_timeout_seconds: float  # how long a write waits for them
    redis_key_prefix: str  # every key of ours starts with it: deployments sharing a Redis keep apart
    state_dir: str
    ssm_workers: tuple[str, ...]
    verifiers: tuple[str, ...]  # LLM verifier replicas: host:port addresses and dns:///host:port names
    model_dir: str  # LLM checkpoint folder: tokenizer.json and the EOS token (no weights are loaded)
    expansion: tuple[
        int, ...
    ]  # default static expansion config; empty: adaptive (see adaptive) or no speculation by default
    adaptive: bool  # requests that set nothing speculate adaptively (--expansion auto)
    default_ssms: tuple[str, ...]
    draft_support: int
    max_batch: int
    max_prefill_tokens: int
    max_queue: int
    max_new_tokens: int
    owner: str
    lease_seconds: float  # the ownership lease's TTL (services/request_manager/ownership.py)
    result_ttl_seconds: float
    rpc_timeout_seconds: float
    grace_seconds: float
    log_level: str
    max_prompt_tokens: int
    max_tree_nodes: int
    security: ServerSecurity  # the public port: TLS and the --auth-token clients must send
    internal: ClientAuth  # calls to workers and verifier: TLS and the --internal-token
    ssm_failure_seconds: float
    server: ServerConfig  # where it listens (gRPC and metrics), from the same settings as host/port
    http_port: int = 0  # the OpenAI-compatible HTTP API (0: off)
    http_port_file: str = ""

    @staticmethod
    def parser() -> SettingsParser:
        p = SettingsParser(
            prog="specinfer-request-manager", description="specinfer request manager: the public gRPC API"
        )
        add_server_settings(p, default_port=50051)
        add_setting(p, "--redis-url", str, "", "Redis URL (redis://, rediss://, unix://); empty: embedded Redis")
        add_setting(p, "--redis-password", str, "", "Redis password", secret=True)
        add_setting(p, "--redis-username", str, "", "Redis ACL user name (empty: the default user)")
        add_setting(p, "--redis-cluster", bool, False, "--redis-url names any node of a Redis Cluster (on/off)")
        add_setting(
            p,
            "--redis-min-replica-acks",
            int,
            0,
            "replicas that must acknowledge each write before tokens are streamed (WAIT), "
            "so an acknowledged token survives a failover (0: off)",
        )
        add_setting(
            p,
            "--redis-key-prefix",
            str,
            "specinfer",
            "prefix of every Redis key (deployments that share a Redis use different ones)",
        )
        add_setting(
            p,
            "--redis-replica-timeout-seconds",
            float,
            1.0,
            "how long a write waits for --redis-min-replica-acks replicas before it fails (retried)",
        )
        add_setting(p, "--state-dir", str, "./specinfer-state", "where the embedded Redis keeps its data")
        add_setting(
            p,
            "--ssm-workers",
            str,
            "",
            "comma-separated SSM worker addresses host:port; dns:///host:port means all addresses of host",
        )
        add_setting(
            p,
            "--verifier",
            str,
            "127.0.0.1:50053",
            "comma-separated LLM verifier replica addresses host:port; dns:///host:port means all addresses of host "
            "(each request runs on one)",
        )
        add_setting(p, "--model-dir", str, "", "LLM checkpoint folder for the tokenizer and EOS token")
        add_setting(
            p,
            "--expansion",
            str,
            "auto",
            "default speculation: 'auto' (adaptive: the planner sizes each step's tree), 'tuned' (the paper's tree), "
            "widths per depth, @FILE (a `specinfer tune` result), 'none'",
        )
        add_setting(p, "--default-ssms", str, "", "comma-separated SSM names used by default (empty: all)")
        add_setting(p, "--draft-support", int, DEFAULT_DRAFT_SUPPORT, "most tokens of a sparse draft distribution")
        add_setting(p, "--max-batch", int, 32, "most requests per iteration")
        add_setting(
            p,
            "--max-prefill-tokens",
            int,
            2048,
            "most tokens of the requests admitted in one iteration, past the first (0: no cap)",
        )
        add_setting(p, "--max-queue", int, 256, "most waiting requests (more get RESOURCE_EXHAUSTED)")
        add_setting(p, "--max-new-tokens", int, 4096, "upper limit of a request's max_new_tokens")
        add_setting(
            p,
            "--owner",
            str,
            socket.gethostname(),
            "ID of this replica (requests in Redis are partitioned by owner; unique per replica)",
        )
        add_setting(
            p,
            "--lease-seconds",
            float,
            10.0,
            "TTL of this replica's ownership lease in Redis, renewed every third of it; "
            "a dead replica's requests resume on another within 1.5 times it",
        )
        add_setting(p, "--result-ttl-seconds", float, 3600.0, "how long finished requests stay in Redis")
        add_setting(p, "--rpc-timeout-seconds", float, 60.0, "timeout of calls to workers and verifier")
        add_setting(p, "--max-prompt-tokens", int, 8192, "most prompt tokens of a request (more: INVALID_ARGUMENT)")
        add_setting(p, "--max-tree-nodes", int, 64, "most nodes of a request's token tree (more: INVALID_ARGUMENT)")
        add_setting(
            p,
            "--ssm-failure-seconds",
            float,
            10.0,
            "timeout of a Speculate call; a worker that fails or exceeds it is taken out until healthy",
        )
        add_setting(p, "--http-port", int, 8000, "port of the OpenAI-compatible HTTP API on --host (0: no HTTP API)")
        add_setting(p, "--http-port-file", str, "", "write the HTTP API's port here once it listens")
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
            host=a.host,
            port=a.port,
            port_file=a.port_file or "",
            redis_url=a.redis_url,
            redis_password=a.redis_password,
            redis_username=a.redis_username,
            redis_cluster=a.redis_cluster,
            redis_min_replica_acks=a.redis_min_replica_acks,
            redis_replica_timeout_seconds=a.redis_replica_timeout_seconds,
            redis_key_prefix=a.redis_key_prefix,
            state_dir=a.state_dir,
            ssm_workers=tuple(split_list(a.ssm_workers)),
            verifiers=tuple(split_list(a.verifier)),
            model_dir=a.model_dir,
            expansion=expansion,
            adaptive=adaptive,
            default_ssms=tuple(split_list(a.default_ssms)),
            draft_support=a.draft_support,
            max_batch=a.max_batch,
            max_prefill_tokens=a.max_prefill_tokens,
            max_queue=a.max_queue,
            max_new_tokens=a.max_new_tokens,
            owner=a.owner,
            lease_seconds=a.lease_seconds,
            result_ttl_seconds=a.result_ttl_seconds,
            rpc_timeout_seconds=a.rpc_timeout_seconds,
            grace_seconds=a.grace_seconds,
            log_level=a.log_level,
            max_prompt_tokens=a.max_prompt_tokens,
            max_tree_nodes=a.max_tree_nodes,
            security=server_security(a, (auth_token,)),
            internal=client_auth(a, internal_token(a)),
            ssm_failure_seconds=a.ssm_failure_seconds,
            server=ServerConfig.from_args(a),
            http_port=a.http_port,
            http_port_file=a.http_port_file,
        )


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
            f"--redis-cluster needs a redis:// or rediss:// --redis-url (a cluster is reached over TCP), got {a.redis_url.split('://')[0]}://",
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
