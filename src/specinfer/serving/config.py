"""Service settings: one name per setting, as a CLI flag and as an environment variable.

The setting ``--kv-cache-bytes`` is also read from ``SPECINFER_KV_CACHE_BYTES``; a flag on the
command line wins over the environment, which wins over the default. Lists are comma-separated
strings in both places.
"""

from __future__ import annotations

import argparse
import os

from specinfer.core import InvalidArgument

ENV_PREFIX = "SPECINFER_"


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _flag_type(kind):
    if kind is bool:
        return lambda s: s.strip().lower() in ("1", "true", "yes", "on")
    return kind


def add_setting(parser: argparse.ArgumentParser, flag: str, kind=str, default=None, help: str = "") -> None:
    """Add ``--flag`` (type ``kind``) whose default is its environment variable when set."""
    env = env_name(flag)
    convert = _flag_type(kind)
    raw = os.environ.get(env)
    value = convert(raw) if raw is not None else default
    parser.add_argument(flag, type=convert, default=value, help=f"{help} [env {env}; default {value!r}]")


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


def add_model_settings(parser: argparse.ArgumentParser) -> None:
    """Settings of the services that run models (see :func:`specinfer.models.loading.load_backend`)."""
    add_setting(parser, "--backend", default="auto", help="auto, native or reference")
    add_setting(parser, "--dtype", default="float32", help="float32, float16 or bfloat16")
    add_setting(parser, "--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    add_setting(parser, "--kv-cache-bytes", int, 1 << 30, help="KV pool memory per model (native backend)")
    add_setting(parser, "--attention", default="auto", help="tree attention of the native backend: auto, triton or torch")
    add_setting(parser, "--torch-threads", int, 0, help="CPU threads of torch (0: torch's default)")


def parse_named_paths(text: str | None, field: str) -> dict[str, str]:
    """``NAME=PATH,PATH2`` -> ``{NAME: PATH, <folder name of PATH2>: PATH2}``; names must be distinct."""
    out: dict[str, str] = {}
    for part in split_list(text):
        name, sep, path = part.partition("=")
        if not sep:
            path = part
            name = os.path.basename(os.path.normpath(part))
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise InvalidArgument(field, f"expected NAME=PATH or PATH, got {part!r}")
        if name in out:
            raise InvalidArgument(field, f"name {name!r} is given twice")
        out[name] = path
    return out
