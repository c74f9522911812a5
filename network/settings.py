"""Typed, documented hyperparameters: each algorithm's ``Settings`` is a frozen dataclass built from these.

An algorithm file declares its settings once (type, default, one line of help, and
optionally the allowed choices); the command line (``test_fed.py --method X``), the
``--list_methods`` listing and the experiment-file check all read that declaration,
so a setting cannot exist in one place and be missing in another.

Values arrive as strings (command line) or YAML scalars; :func:`build_settings`
converts them to the declared type and names the setting and the algorithm when a
value or a key is wrong. A number is ASCII digits (never '²' or '1_000'), finite, and at
most its setting's ``high`` in magnitude: :data:`MAX_SETTING_INT` / :data:`MAX_SETTING_FLOAT`
unless the setting declares a smaller one (a count that allocates models or repeats
training, such as FedEM's components); ``__post_init__`` checks the rest of its range.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from typing import Any, Mapping

from utils.cli import FLOAT_PATTERN, INTEGER_PATTERN, MAX_NUMBER_CHARS
from utils.errors import TaskHetError

SCALAR_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
# The largest magnitude of a numeric setting that declares no smaller ``high`` (both signs): far beyond any
# meaningful weight, step size or count, and far from float and int64 overflow.
MAX_SETTING_INT = 10**6
MAX_SETTING_FLOAT = 1e9


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None, high: float | None = None) -> Any:
    """A settings field: its default, one line of documentation, for strings the allowed values, and for numbers
    the largest magnitude allowed (``high``; default :data:`MAX_SETTING_INT` or :data:`MAX_SETTING_FLOAT`)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "high": high})


def check(condition: bool, name: str, expected: str, got: object) -> None:
    """Raise ``setting NAME must be EXPECTED, got GOT`` unless ``condition`` holds (checks in ``__post_init__``)."""
    if not condition:
        raise TaskHetError(f"setting {name} must be {expected}, got {got!r}")


@dataclasses.dataclass(frozen=True)
class SettingInfo:
    """One declared setting, as the command line and the docs show it."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None
    high: float | None = None  # a number's largest magnitude (None for str and bool settings)

    @property
    def limit(self) -> str:
        """What --help and --list_methods say of a number's range: ``at most 64 in magnitude``; "" otherwise."""
        if self.high is None:
            return ""
        return f"at most {self.high if self.type is int else format(self.high, 'g')} in magnitude"


@functools.cache  # a pure function of the class, with an immutable result: get_type_hints is most of a run check's cost
def describe(settings_class: type) -> tuple[SettingInfo, ...]:
    """The declared settings of a ``Settings`` dataclass, in declaration order."""
    hints = typing.get_type_hints(settings_class)
    return tuple(SettingInfo(field.name, hints[field.name], field.default, field.metadata.get("help", ""),
                             field.metadata.get("choices"), _high(hints[field.name], field.metadata.get("high")))
                 for field in dataclasses.fields(settings_class))


def _high(kind: type, declared: float | None) -> float | None:
    defaults = {int: MAX_SETTING_INT, float: MAX_SETTING_FLOAT}
    return None if kind not in defaults else declared if declared is not None else defaults[kind]


def build_settings(settings_class: type, values: Mapping[str, Any], owner: str) -> Any:
    """``settings_class(**values)`` with every value converted to its declared type.

    Args:
        settings_class: an algorithm's ``Settings`` dataclass.
        values: setting name -> value (a string from the command line, or a YAML scalar).
        owner: the algorithm's name, for messages.

    Raises:
        TaskHetError: an unknown key (the message lists the algorithm's settings), a value
            of the wrong type, or one its ``__post_init__`` rejects.
    """
    infos = {info.name: info for info in describe(settings_class)}
    unknown = sorted(set(values) - set(infos))
    if unknown:
        known = ", ".join(infos) or "none"
        raise TaskHetError(f"{owner} has no setting {', '.join(unknown)}; its settings: {known}")
    return settings_class(**{name: convert(infos[name], value, owner) for name, value in values.items()})


def convert(info: SettingInfo, value: Any, owner: str) -> Any:
    """``value`` as ``info.type`` (strings are parsed; bools must be real booleans or true/false)."""
    try:
        converted = _convert(info.type, value)
    except (TypeError, ValueError):
        kind = "finite float" if info.type is float and _is_non_finite(value) else info.type.__name__
        raise TaskHetError(f"{owner} setting {info.name} must be a {kind}, got {value!r}") from None
    if info.choices is not None and converted not in info.choices:
        raise TaskHetError(f"{owner} setting {info.name} must be one of {', '.join(info.choices)}, got {value!r}")
    if info.high is not None and not -info.high <= converted <= info.high:
        raise TaskHetError(f"{owner} setting {info.name} must be {info.limit}, got {value!r}")
    return converted


def _is_non_finite(value: Any) -> bool:
    try:
        return not isinstance(value, bool) and not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _convert(kind: type, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(value)
    if isinstance(value, bool):  # YAML's true is not the number 1
        raise TypeError(value)
    if isinstance(value, str):  # ASCII digits only: int() and float() also take '²', '٣' and '1_000'
        pattern = INTEGER_PATTERN if kind is int else FLOAT_PATTERN
        if kind in (int, float) and (len(value.strip()) > MAX_NUMBER_CHARS or not pattern.fullmatch(value.strip())):
            raise ValueError(value)
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if kind is float:
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(value)
        return number
    if kind is str:
        if not isinstance(value, str):
            raise TypeError(value)
        return value
    raise TypeError(f"unsupported setting type {kind}")


def add_settings_arguments(parser: argparse.ArgumentParser, settings_class: type, owner: str) -> None:
    """One ``--name`` flag per setting (values stay strings: :func:`build_settings` converts them)."""
    group = parser.add_argument_group(f"{owner} settings")
    for info in describe(settings_class):
        group.add_argument(f"--{info.name}", default=argparse.SUPPRESS, metavar=info.type.__name__.upper(),
                           help=f"{info.help} (default: {info.default}{'; ' + info.limit if info.limit else ''})")


def settings_table(settings_class: type) -> list[str]:
    """Lines ``name (type, default D): help`` for listings."""
    lines = []
    for info in describe(settings_class):
        choices = f"; one of {', '.join(info.choices)}" if info.choices else ""
        limit = f"; {info.limit}" if info.limit else ""
        lines.append(f"{info.name} ({info.type.__name__}, default {info.default}{choices}{limit}): {info.help}")
    return lines
