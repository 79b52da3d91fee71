"""Service settings: one name per setting, as a CLI flag and as an environment variable.

The setting ``--kv-cache-bytes`` is also read from ``SPECINFER_KV_CACHE_BYTES``; a flag on the
command line wins over the environment, which wins over the default. Lists are comma-separated
strings in both places.

*Configuration errors* (a bad flag or environment value, a model folder that cannot be read, a KV
budget that holds no request, a port in use) are :class:`InvalidArgument` whose ``field`` is the
setting's flag without its dashes (``kv-cache-bytes``), raised where the check is done. Each entry
point (the services' and the CLI's ``main``) parses with a :class:`SettingsParser` and catches them
once: :meth:`SettingsParser.bad_setting` prints one line, ``prog: error: --flag: ...`` as argparse
does, and the process exits with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NoReturn

from specinfer.core import InvalidArgument
from specinfer.serving.security import ClientAuth, ClientTls, ServerSecurity, ServerTls, read_token

ENV_PREFIX = "SPECINFER_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _converter(kind, default):
    """``kind``'s parser of a flag's text; a bad text raises ArgumentTypeError saying what would do
    (argparse prints it after the flag's name)."""
    if kind is str:
        return str
    what = {bool: "on or off", int: "an integer", float: "a number"}.get(kind, kind.__name__)
    example = (
        f", e.g. {default if kind is not bool else ('on' if default else 'off')} (the default)"
        if default is not None
        else ""
    )

    def convert(text: str):
        word = text.strip().lower()
        if kind is bool and word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        try:
            if kind is not bool:
                return kind(text)
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}{example}")

    convert.__name__ = kind.__name__
    return convert


@dataclass(frozen=True)
class _BadEnvValue:
    """The default of a setting whose environment variable does not parse: reported by
    :class:`SettingsParser` when no flag on the command line replaces it (a flag wins over the environment)."""

    message: str


def add_setting(
    parser: SettingsParser, flag: str, kind=str, default=None, help: str = "", secret: bool = False
) -> None:
    """Add ``--flag`` (type ``kind``) whose default is its environment variable when set.
    ``secret``: ``--help`` says whether it is set, never the value (it may come from the environment)."""
    if not isinstance(parser, SettingsParser):  # only it reports a bad environment value
        raise TypeError(f"settings need a SettingsParser, got {type(parser).__name__}")
    env = env_name(flag)
    convert = _converter(kind, default)
    raw = os.environ.get(env)
    value = default
    if raw is not None:
        try:
            value = convert(raw)
        except argparse.ArgumentTypeError as exc:
            value = _BadEnvValue(f"argument {flag} (from {env}): {exc}")
    shown = ("set" if value else "not set") if secret else repr(value)
    parser.add_argument(flag, type=convert, default=value, help=f"{help} [env {env}; default {shown}]")


class SettingsParser(argparse.ArgumentParser):
    """An argument parser for settings (:func:`add_setting`) whose errors are one line on stderr,
    ``prog: error: message`` (argparse prints its usage first), with exit status 2. Its subcommands'
    parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self._with_default(message)}\n")

    def _with_default(self, message: str) -> str:
        """argparse's ``argument --flag: invalid int value: 'x'`` with the flag's default, a value that works."""
        flag = re.match(r"argument (--[\w-]+): invalid \w+ value", message)
        action = self._option_string_actions.get(flag.group(1)) if flag else None
        if action is None or action.default in (None, argparse.SUPPRESS):
            return message
        return f"{message}; e.g. {flag.group(1)} {action.default} (the default)"

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        for value in vars(parsed).values():
            if isinstance(value, _BadEnvValue):
                self.error(value.message)
        return parsed, extras

    def bad_setting(self, exc: InvalidArgument) -> int:
        """Print the configuration error ``exc`` as this parser's one error line, naming the setting as
        its flag; the exit status of a bad setting, 2, for ``main`` to return."""
        print(f"{self.prog}: error: {self._flag(exc.field)}: {exc.message}", file=sys.stderr)
        return 2

    def _flag(self, field: str) -> str:
        """``field`` as a flag when it names one of this parser's (or a subcommand's) options, e.g. ``--llm``
        for ``llm``, ``--min-p`` for ``min_p`` and ``--ssm (ssm.a)`` for ``ssm.a`` (the SSM named a); else as it is."""
        base = re.split(r"[.\[]", field, maxsplit=1)[0]
        flag = "--" + base.replace("_", "-")
        if not self._has_option(flag):
            return field
        return flag if base == field else f"{flag} ({field})"

    def _has_option(self, flag: str) -> bool:
        if flag in self._option_string_actions:
            return True
        subcommands = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return any(
            isinstance(p, SettingsParser) and p._has_option(flag) for a in subcommands for p in a.choices.values()
        )


def check_ports_free(host: str, ports: Mapping[str, int]) -> None:
    """:class:`InvalidArgument` naming the setting of the first port of ``ports`` (setting -> port; 0: any
    free one and negative: none, which always pass) that another process holds on ``host``: checked before
    minutes of model loading, so that a port in use fails at once (the bind itself reports it too)."""
    for setting, port in ports.items():
        if port <= 0:
            continue
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except (socket.gaierror, UnicodeError) as exc:
            raise InvalidArgument(
                "host", f"{host!r} is not an address of this machine ({exc}); e.g. 127.0.0.1 or 0.0.0.0"
            ) from None
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(
                socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
            )  # as the servers bind: a closed port in TIME_WAIT is free
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise port_in_use(setting, host, port, exc) from None


def port_in_use(setting: str, host: str, port: int, exc: BaseException) -> InvalidArgument:
    """The configuration error of a port that cannot be bound (``--http-port 0`` turns the HTTP API off)."""
    zero = "0 for no HTTP API" if setting == "http-port" else "0 for any free one"
    return InvalidArgument(setting, f"cannot listen on {host}:{port} ({exc}); pick a free port, or {zero}")


def split_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def add_server_settings(parser: argparse.ArgumentParser, default_port: int = 0) -> None:
    """Settings every service has: where it listens, logging and shutdown."""
    add_setting(parser, "--host", default="127.0.0.1", help="address to listen on")
    add_setting(parser, "--port", int, default_port, help="port to listen on (0: pick a free one)")
    add_setting(
        parser,
        "--port-file",
        default=None,
        help="write the bound port to this file once serving (for launchers and tests)",
    )
    add_setting(parser, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_setting(parser, "--grace-seconds", float, 10.0, help="on SIGTERM, how long in-flight calls may finish")
    add_setting(
        parser,
        "--parent-pid",
        int,
        0,
        help="stop gracefully once this process, the launcher that started us, is gone (0: never; launchers)",
    )
    add_setting(
        parser,
        "--metrics-port",
        int,
        -1,
        help="HTTP port of the Prometheus /metrics endpoint (-1: none; 0: pick a free one)",
    )
    add_setting(
        parser,
        "--metrics-port-file",
        default=None,
        help="write the bound metrics port to this file (for launchers and tests)",
    )
    add_setting(parser, "--tls-cert", default="", help="PEM certificate chain: serve TLS (with --tls-key)")
    add_setting(parser, "--tls-key", default="", help="PEM private key of --tls-cert")
    add_setting(parser, "--tls-client-ca", default="", help="PEM CA: require client certificates it signed (mTLS)")
    add_setting(
        parser,
        "--internal-token",
        default="",
        secret=True,
        help="bearer token of the calls between services (workers and verifier require it)",
    )
    add_setting(parser, "--internal-token-file", default="", help="file holding --internal-token")


def add_client_tls_settings(parser: argparse.ArgumentParser) -> None:
    """How a service calls others over TLS (the request manager calls workers and verifier)."""
    add_setting(
        parser,
        "--tls-ca",
        default="",
        help="PEM CA of the services called (any of the three --tls-* flags: call with TLS)",
    )
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
        security = ServerSecurity(
            ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca), tuple(t for t in tokens if t)
        )
        security.tls.credentials()  # unreadable files fail now, with the setting's name
        return security
    except ValueError as exc:
        raise InvalidArgument("tls", str(exc)) from None


def add_socket_setting(parser: argparse.ArgumentParser) -> None:
    """``--socket-port`` of the model services (:mod:`specinfer.serving.socket_calls`)."""
    add_setting(
        parser,
        "--socket-port",
        int,
        0,
        help="where the request manager's per-step calls (Verify, Speculate) are also answered over a plain socket, "
        "cheaper per message than gRPC (same host, TLS and token; request managers learn the port from "
        "GetInfo/ListModels): 0 a free port, -1 none",
    )


def add_model_settings(parser: argparse.ArgumentParser) -> None:
    """Settings of the services that run models (see :func:`specinfer.models.loading.load_backend`)."""
    # here, not at the top: the request manager reads this module and runs no model (no torch)
    from specinfer.models.native.backend import DEFAULT_GRAPH_TOKENS, DEFAULT_GRAPH_WARMUP_SECONDS

    add_setting(parser, "--backend", default="auto", help="auto, native or reference")
    add_socket_setting(parser)
    add_setting(
        parser,
        "--dtype",
        default="auto",
        help="auto (bf16 where the device has bf16 arithmetic, else fp16 on GPU, fp32), float32, float16, bfloat16",
    )
    add_setting(parser, "--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    add_setting(
        parser,
        "--quantize",
        default="none",
        help="none, int8 or int4: the decoder layers' projections kept quantized (native backend)",
    )
    add_setting(parser, "--kv-cache-bytes", int, 1 << 30, help="KV pool memory per model (native backend)")
    add_setting(
        parser,
        "--kv-block-size",
        int,
        16,
        help="tokens per KV block of a paged KV pool (native backend; 0: one contiguous slot per request)",
    )
    add_setting(
        parser,
        "--prefix-caching",
        bool,
        True,
        help="with --kv-block-size > 0: requests share the KV blocks of common prompt prefixes (on/off)",
    )
    add_setting(
        parser,
        "--max-seq-len",
        int,
        0,
        help="most positions of a request, prompt and output (native backend; 0: the model's limit)",
    )
    add_setting(
        parser, "--attention", default="auto", help="tree attention of the native backend: auto, triton or torch"
    )
    add_setting(
        parser,
        "--cuda-graph-tokens",
        int,
        DEFAULT_GRAPH_TOKENS,
        help="on a CUDA device, steps of at most this many tokens replay CUDA graphs (native backend; 0: never)",
    )
    add_setting(
        parser,
        "--cuda-graph-warmup-seconds",
        float,
        DEFAULT_GRAPH_WARMUP_SECONDS,
        help="on a CUDA device, at start-up capture the CUDA graphs of the step shapes a server meets for at most "
        "this long, so that serving captures none (native backend; 0: each shape on its first step)",
    )
    add_setting(parser, "--torch-threads", int, 0, help="CPU threads of torch (0: torch's default)")
    add_setting(
        parser,
        "--model-calls",
        default="inline",
        help="where model calls run: inline (on the event loop, no hand-off between threads; health checks wait for "
        "a call) or thread (a thread of their own: the loop answers during long calls)",
    )
    add_setting(
        parser,
        "--calibration-cache",
        default="",
        help="folder of the start-up calibration's cache: "
        "a model calibrated once under the same settings starts without timing its passes again "
        "(empty: $XDG_CACHE_HOME/specinfer/calibration, else ~/.cache/specinfer/calibration; none or off: no cache)",
    )


def model_name(path: str | os.PathLike) -> str:
    """The name a checkpoint ``PATH`` is served under when none is given: its folder's name
    (``models/demo/ssm-1`` -> ``ssm-1``), or a GGUF file's without the suffix (``q/small.gguf`` -> ``small``)."""
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") and len(base) > len(".gguf") else base


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
            raise InvalidArgument(
                field, f"name {name!r} is given twice ({out[name]} and {path}): name them apart with NAME=PATH"
            )
        out[name] = path
    return out


def parse_named_paths(text: str | None, field: str) -> dict[str, str]:
    """``NAME=PATH,PATH2`` -> ``{NAME: PATH, <folder name of PATH2>: PATH2}`` (:func:`named_paths`)."""
    return named_paths(split_list(text), field)
