"""Settings from the environment: one typed reader for the ranks and the exporter.

Every ``RANKSCOPE_*`` option is a field of a frozen configuration dataclass
(``rankscope.config.MonitorConfig``, ``rankscope.exporter.config.ExporterConfig``).
Its default is written once, on the field; ``from_env`` reads
``RANKSCOPE_<FIELD>`` for each field (or the variables a ``setting()`` field
names instead), parses it by the field's type, lets explicit values win, and
the dataclass's ``__post_init__`` validates the result. A value that is wrong
raises ``ConfigError`` naming the variable or option, at start-up. An explicit
value is never swapped for the default: ``0`` is a value, and is validated
like any other.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

PREFIX = "RANKSCOPE_"
DEFAULT_PORT = 9400
DEFAULT_ADDR = "127.0.0.1"
WILDCARD_ADDRS = ("0.0.0.0", "::", "")


def metrics_url(addr: str, port: int) -> str:
    """The /metrics URL of an exporter listening on ``addr:port``, as this node reaches it (one
    bound to every address answers on loopback)."""
    addr = DEFAULT_ADDR if addr in WILDCARD_ADDRS else addr
    return f"http://[{addr}]:{port}/metrics" if ":" in addr else f"http://{addr}:{port}/metrics"

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the option.

    Validation that names the wrong field with ``field=`` lets ``from_env``
    name where the value came from instead (its variable or command-line
    option): ``ConfigError("must be > 0", field="retention_s")``.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.problem = message


def setting(*, env: str | tuple[str, ...] = (), option: str | None = None, **field_args: Any) -> Any:
    """A dataclass field that ``from_env`` reads from the variables ``env``
    (the first one set; none when empty) instead of ``RANKSCOPE_<FIELD>``.
    ``option`` names an explicit value in errors, e.g. its command-line flag.
    Other arguments are ``dataclasses.field``'s (``default``, ``default_factory``)."""
    return dataclasses.field(metadata={"env": (env,) if isinstance(env, str) else env, "option": option},
                             **field_args)


def parse(name: str, raw: str, typ: Any) -> Any:
    """``raw`` as ``typ`` (int, float, bool, str, Path, or ``X | None``); ``name`` is for the error."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if args:                     # Optional[X] / X | None
        typ = args[0]
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
    except ValueError:
        kind = "a boolean (true/false)" if typ is bool else f"a number ({typ.__name__})"
        raise ConfigError(f"{name}={raw!r} is not {kind}") from None
    if typ is Path:
        return Path(raw)
    return raw


def env_value(env: Mapping[str, str], names: str | tuple[str, ...], typ: Any, default: T) -> T:
    """The first of ``names`` that is set and not empty, parsed as ``typ``; else ``default``."""
    for name in (names,) if isinstance(names, str) else names:
        raw = env.get(name, "")
        if raw != "":
            return parse(name, raw, typ)
    return default


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **explicit: Any) -> T:
    """An instance of the dataclass ``cls``: explicit values (not None) win over
    ``RANKSCOPE_<FIELD>`` variables (or a ``setting()``'s own), which win over
    the fields' defaults. A validation error for a field (``ConfigError(...,
    field=...)``) is raised again naming the value's origin: the variable it
    was read from, else the field's ``option`` (or its name)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(explicit) - names
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        origin[f.name] = f.metadata.get("option") or f.name
        if explicit.get(f.name) is not None:
            value = explicit[f.name]
            values[f.name] = Path(value) if hints[f.name] in (Path, Path | None) else value
            continue
        for var in f.metadata.get("env", (PREFIX + f.name.upper(),)):
            if env.get(var, "") != "":
                values[f.name] = parse(var, env[var], hints[f.name])
                origin[f.name] = var
                break
    try:
        return cls(**values)
    except ConfigError as e:
        if e.field not in origin:
            raise
        raise type(e)(f"{origin[e.field]}: {e.problem}") from None


def default_node(env: Mapping[str, str] | None = None) -> str:
    """The node label: RANKSCOPE_NODE, Slurm's or Kubernetes' node name, or the hostname."""
    env = os.environ if env is None else env
    return env_value(env, ("RANKSCOPE_NODE", "SLURMD_NODENAME", "NODE_NAME"), str, "") or socket.gethostname()
