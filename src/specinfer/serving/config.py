"""Service settings: one name per setting, as a CLI flag and as an environment variable.

The setting ``--kv-cache-bytes`` is also read from ``SPECINFER_KV_CACHE_BYTES``; a flag on the
command line wins over the environment, which wins over the default. Lists are comma-separated
strings in both places.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from specinfer.core import InvalidArgument
from specinfer.serving.security import ClientAuth, ClientTls, ServerSecurity, ServerTls, read_token

ENV_PREFIX = "SPECINFER_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _flag_type(kind):
    if kind is bool:
        return lambda s: s.strip().lower() in ("1", "true", "yes", "on")
    return kind


def add_setting(parser: argparse.ArgumentParser, flag: str, kind=str, default=None, help: str = "", secret: bool = False) -> None:
    """Add ``--flag`` (type ``kind``) whose default is its environment variable when set.
    ``secret``: ``--help`` says whether it is set, never the value (it may come from the environment)."""
    env = env_name(flag)
    convert = _flag_type(kind)
    raw = os.environ.get(env)
    value = convert(raw) if raw is not None else default
    shown = ("set" if value else "not set") if secret else repr(value)
    parser.add_argument(flag, type=convert, default=value, help=f"{help} [env {env}; default {shown}]")


def split_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def add_server_settings(parser: argparse.ArgumentParser, default_port: int = 0) -> None:
    """Settings every service has: where it listens, logging and shutdown."""
    add_setting(parser, "--host", default="127.0.0.1", help="address to listen on")
    add_setting(parser, "--port", int, default_port, help="port to listen on (0: pick a free one)")
    add_setting(parser, "--port-file", default=None, help="write the bound port to this file once serving (for launchers and tests)")
    add_setting(parser, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_setting(parser, "--grace-seconds", float, 10.0, help="on SIGTERM, how long in-flight calls may finish")
    add_setting(parser, "--metrics-port", int, -1, help="HTTP port of the Prometheus /metrics endpoint (-1: none; 0: pick a free one)")
    add_setting(parser, "--metrics-port-file", default=None, help="write the bound metrics port to this file (for launchers and tests)")
    add_setting(parser, "--tls-cert", default="", help="PEM certificate chain: serve TLS (with --tls-key)")
    add_setting(parser, "--tls-key", default="", help="PEM private key of --tls-cert")
    add_setting(parser, "--tls-client-ca", default="", help="PEM CA: require client certificates it signed (mTLS)")
    add_setting(parser, "--internal-token", default="", secret=True, help="bearer token of the calls between services (workers and verifier require it)")
    add_setting(parser, "--internal-token-file", default="", help="file holding --internal-token")


def add_client_tls_settings(parser: argparse.ArgumentParser) -> None:
    """How a service calls others over TLS (the request manager calls workers and verifier)."""
    add_setting(parser, "--tls-ca", default="", help="PEM CA of the services called (any of the three --tls-* flags: call with TLS)")
    add_setting(parser, "--tls-client-cert", default="", help="PEM client certificate for mTLS")
    add_setting(parser, "--tls-client-key", default="", help="PEM private key of --tls-client-cert")


def internal_token(args: argparse.Namespace) -> str:
    """The token of the calls between services (empty: none), checked while parsing settings."""
    try:
        return read_token(args.internal_token, args.internal_token_file, "internal-token")
    except ValueError as exc:
        raise InvalidArgument("internal-token", str(exc)) from None


def client_auth(args: argparse.Namespace, token: str) -> ClientAuth:
    """How this service calls others: the ``--tls-ca``/``--tls-client-*`` settings and ``token``."""
    try:
        auth = ClientAuth(ClientTls.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key), token)
        auth.tls.credentials()  # unreadable files fail now, with the setting's name
        return auth
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None


def server_security(args: argparse.Namespace, tokens: tuple[str, ...]) -> ServerSecurity:
    """The port's TLS from the ``--tls-*`` server settings; ``tokens``: the bearer tokens it accepts."""
    try:
        security = ServerSecurity(ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca), tuple(t for t in tokens if t))
        security.tls.credentials()  # unreadable files fail now, with the setting's name
        return security
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None


def add_model_settings(parser: argparse.ArgumentParser) -> None:
    """Settings of the services that run models (see :func:`specinfer.models.loading.load_backend`)."""
    add_setting(parser, "--backend", default="auto", help="auto, native or reference")
    add_setting(parser, "--dtype", default="auto", help="auto (bf16 where the device has bf16 arithmetic, else fp16 on GPU, fp32), float32, float16, bfloat16")
    add_setting(parser, "--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    add_setting(parser, "--kv-cache-bytes", int, 1 << 30, help="KV pool memory per model (native backend)")
    add_setting(parser, "--kv-block-size", int, 16, help="tokens per KV block of a paged KV pool (native backend; 0: one contiguous slot per request)")
    add_setting(parser, "--prefix-caching", bool, True, help="with --kv-block-size > 0: requests share the KV blocks of common prompt prefixes (on/off)")
    add_setting(parser, "--max-seq-len", int, 0, help="most positions of a request, prompt and output (native backend; 0: the model's limit)")
    add_setting(parser, "--attention", default="auto", help="tree attention of the native backend: auto, triton or torch")
    add_setting(parser, "--torch-threads", int, 0, help="CPU threads of torch (0: torch's default)")
    add_setting(
        parser,
        "--calibration-cache",
        default="",
        help="folder of the start-up calibration's cache: a model calibrated once under the same settings starts without timing its passes again "
        "(empty: $XDG_CACHE_HOME/specinfer/calibration, else ~/.cache/specinfer/calibration; none or off: no cache)",
    )


def model_name(path: str | os.PathLike) -> str:
    """The name a checkpoint ``PATH`` is served under when none is given: its folder's name
    (``models/demo/ssm-1`` -> ``ssm-1``)."""
    return os.path.basename(os.path.normpath(path))


def named_paths(specs: Iterable[str | os.PathLike], field: str) -> dict[str, str]:
    """The one naming rule of model checkpoints, wherever they are given (``specinfer up`` and
    ``generate``'s ``--ssm``, the SSM worker's ``--ssm``, the verifier's ``--llm``): each spec is
    ``NAME=PATH`` or ``PATH``, which is named after its folder (:func:`model_name`). Returns
    ``{name: path}`` in the given order; two specs of one name (e.g. two folders called ``ssm``)
    are an error that says how to tell them apart."""
    out: dict[str, str] = {}
    for spec in specs:
        part = str(spec).strip()
        name, sep, path = part.partition("=")
        if not sep:
            name, path = model_name(part), part
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise InvalidArgument(field, f"expected NAME=PATH or PATH, got {part!r}")
        if name in out:
            raise InvalidArgument(field, f"name {name!r} is given twice ({out[name]} and {path}): name them apart with NAME=PATH")
        out[name] = path
    return out


def parse_named_paths(text: str | None, field: str) -> dict[str, str]:
    """``NAME=PATH,PATH2`` -> ``{NAME: PATH, <folder name of PATH2>: PATH2}`` (:func:`named_paths`)."""
    return named_paths(split_list(text), field)
