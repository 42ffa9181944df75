"""The runtime's command line, generated from :mod:`.config` in both directions.

- :func:`to_argv`: a configuration -> the ``loraserve-runtime`` flags that reproduce it
  (the operator's container args);
- :func:`add_arguments` and :func:`config_from_namespace`: the parser of those flags and
  the configuration a parse describes (the runtime's start-up).

Each field declares its flag with :func:`.config.setting`; the value's shape follows from
the field's type: ``bool`` is a ``--x/--no-x`` switch, an enum or a field with choices
takes one of them, a ``tuple`` takes one or more values, a ``dict`` is a repeated
``NAME=VALUE`` flag, an optional (``X | None``) is left out while None. Flags that are
not fields (the admin token's file, the drain timeout, logging) stay in ``runtime.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .config import FLAG, GROUP, NO_FLAG, Flag, RuntimeConfig


class Shape(enum.Enum):
    """How a field's value is spelt on the command line."""

    SWITCH = "switch"  # bool: --x / --no-x
    VALUE = "value"  # one value
    VALUES = "values"  # tuple: --x A B C
    PAIRS = "pairs"  # dict: --x K=V --x K2=V2


@dataclass(frozen=True)
class Setting:
    """One configuration field that is a flag."""

    section: str | None
    """The :class:`RuntimeConfig` section holding it; None for a top-level field."""
    name: str
    flag: Flag
    shape: Shape
    kind: type
    """The value's type: ``int``, ``float``, ``str``, ``bool`` or an enum (of each item for tuples)."""
    default: Any
    group: str

    @property
    def path(self) -> str:
        """The policy's field path, e.g. ``speculative.num_draft_tokens``."""
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute (argparse's own naming of the flag)."""
        return self.flag.name.removeprefix("--").replace("-", "_")


def _kind_and_shape(hint: Any) -> tuple[type, Shape]:
    """The value type and shape of a field annotation (``int | None``, ``tuple[str, ...]``...)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = args  # an optional: the flag is simply absent while None
        args = list(typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is tuple:
        return args[0], Shape.VALUES
    if origin is dict:
        return str, Shape.PAIRS
    if hint is bool:
        return bool, Shape.SWITCH
    return hint, Shape.VALUE


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _section_settings(cls: type, section: str | None, group: str) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(FLAG)
        if flag is None:
            continue
        kind, shape = _kind_and_shape(hints[f.name])
        yield Setting(section, f.name, flag, shape, kind, _default(f), group)


@functools.cache
def settings() -> tuple[Setting, ...]:
    """Every flagged field, in argv order (the declaration order of :class:`RuntimeConfig`)."""
    found: list[Setting] = []
    hints = typing.get_type_hints(RuntimeConfig)
    for f in dataclasses.fields(RuntimeConfig):
        if GROUP in f.metadata:
            found += _section_settings(hints[f.name], f.name, f.metadata[GROUP])
        elif FLAG in f.metadata:
            found += [s for s in _section_settings(RuntimeConfig, None, "device") if s.name == f.name]
    return tuple(found)


def unflagged() -> dict[str, str]:
    """Configuration fields deliberately without a flag: field path -> why."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(RuntimeConfig)
    for f in dataclasses.fields(RuntimeConfig):
        if GROUP in f.metadata:
            for g in dataclasses.fields(hints[f.name]):
                if NO_FLAG in g.metadata:
                    out[f"{f.name}.{g.name}"] = g.metadata[NO_FLAG]
        elif NO_FLAG in f.metadata:
            out[f.name] = f.metadata[NO_FLAG]
    return out


# --------------------------------------------------------------------------- config -> argv


def _word(setting: Setting, value: Any) -> str:
    if setting.flag.render is not None:
        return setting.flag.render(value)
    return value.value if isinstance(value, enum.Enum) else str(value)


def _words(setting: Setting, value: Any) -> list[str]:
    """The argv words of one field's value (none for None or an empty list)."""
    name = setting.flag.name
    if value is None:
        return []
    if setting.shape is Shape.SWITCH:
        return [name if value else "--no-" + name.removeprefix("--")]
    if setting.shape is Shape.VALUES:
        return [name, *(_word(setting, v) for v in value)] if value else []
    if setting.shape is Shape.PAIRS:
        return [word for key, item in sorted(value.items()) for word in (name, f"{key}={item}")]
    return [name, _word(setting, value)]


def _holder(config: RuntimeConfig, setting: Setting) -> Any:
    return config if setting.section is None else getattr(config, setting.section)


def to_argv(config: RuntimeConfig) -> list[str]:
    """The ``loraserve-runtime`` flags that reproduce ``config`` (the admin token excluded).

    Every field is written, defaults included, so a pod's command line states its whole
    configuration and does not depend on the image's defaults; a gated field only while
    its section is enabled.
    """
    argv: list[str] = []
    for setting in settings():
        holder = _holder(config, setting)
        if setting.flag.gated and not holder.enabled:
            continue
        argv += _words(setting, getattr(holder, setting.name))
    return argv


# --------------------------------------------------------------------------- argv -> config


def _choices(setting: Setting) -> list[str] | None:
    if setting.flag.choices is not None:
        return list(setting.flag.choices)
    if issubclass(setting.kind, enum.Enum):
        return [member.value for member in setting.kind]
    return None


def _argument(setting: Setting) -> dict[str, Any]:
    """``add_argument`` keywords of one field."""
    flag = setting.flag
    options: dict[str, Any] = {"help": flag.help}
    if flag.metavar:
        options["metavar"] = flag.metavar
    if flag.required:
        return {**options, "required": True}
    default = None if flag.derive is not None else setting.default
    if setting.shape is Shape.SWITCH:
        return {**options, "action": argparse.BooleanOptionalAction, "default": default}
    if setting.shape is Shape.PAIRS:
        return {**options, "action": "append", "default": []}
    kind = str if issubclass(setting.kind, enum.Enum) else setting.kind
    options["type"] = str.upper if flag.upper else kind
    if choices := _choices(setting):
        options["choices"] = choices
    if setting.shape is Shape.VALUES:
        return {**options, "nargs": "+", "default": list(default)}
    return {**options, "default": default.value if isinstance(default, enum.Enum) else default}


def add_arguments(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Add a flag for every configuration field; returns the ``--help`` groups by title
    (so that callers add their own flags beside them)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for setting in settings():
        if setting.group not in groups:
            groups[setting.group] = parser.add_argument_group(setting.group)
        groups[setting.group].add_argument(setting.flag.name, **_argument(setting))
    return groups


def _value(setting: Setting, raw: Any) -> Any:
    """A parsed flag value as the field's value (raises ``FlagError`` via the field's hook)."""
    if setting.flag.parse is not None:
        return setting.flag.parse(raw)
    if raw is None:
        return None
    if setting.shape is Shape.VALUES:
        return tuple(raw)
    if issubclass(setting.kind, enum.Enum):
        return setting.kind(raw)
    return raw


def config_from_namespace(namespace: argparse.Namespace) -> RuntimeConfig:
    """The :class:`RuntimeConfig` a parse of :func:`add_arguments`' flags describes.

    No I/O and no validation beyond the flags' own conversions (``FlagError``); the
    policy judges the result.
    """
    config = RuntimeConfig()
    derived: list[Setting] = []
    for setting in settings():
        value = _value(setting, getattr(namespace, setting.dest))
        if value is None and setting.flag.derive is not None:
            derived.append(setting)
            continue
        setattr(_holder(config, setting), setting.name, value)
    for setting in derived:  # after the rest of the section is known
        holder = _holder(config, setting)
        setattr(holder, setting.name, setting.flag.derive(holder))
    return config
