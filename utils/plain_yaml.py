"""YAML whose plain scalars mean what a reader of the text means: decimal numbers, true and false.

PyYAML follows YAML 1.1, which reads ``010`` as 8 (octal), ``0x10`` as 16, ``1:30`` as 90 (base 60), ``1_0`` as 10
and ``yes``/``no``/``on``/``off`` as booleans, while it leaves ``1e-3`` a string. A key then silently gets a value
its writer never meant (``n_rounds: 010`` runs 8 rounds). :func:`load` reads plain decimal integers (``10``,
``-3``) and floats (``0.1``, ``1e-3``, ``1.5E+2``, ``.5``) as numbers and ``true``/``false`` as booleans; every
other form YAML 1.1 would turn into a number or a boolean, and a decimal with a leading zero (``09``), is refused
by :func:`check_plain` naming where it is, so the writer picks the decimal number or quotes it as a string.
Quoted scalars are always strings, as in any YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import yaml

INT_TAG, FLOAT_TAG, BOOL_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
AMBIGUOUS_TAG = "tag:taskhet,2026:ambiguous"
PLAIN_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
# A dot or an exponent makes a float; the integer part has no leading zero (01.5 is refused as 010 is)
PLAIN_FLOAT = re.compile(r"[-+]?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
PLAIN_BOOL = re.compile(r"true|True|TRUE|false|False|FALSE")
# YAML 1.1's infinities and not-a-number read the same in YAML 1.2 (the schema's checks refuse them by name)
SPECIAL_FLOAT = re.compile(r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")
# 09 and 012.5 stay strings or become octal in YAML 1.1, by the digits they hold: never a number here
LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?")
ACCEPTED = "a plain decimal number (10, -3, 0.1, 1e-3), true or false, or a quoted string"


@dataclass(frozen=True)
class Ambiguous:
    """A plain scalar this loader refuses, kept as read until :func:`check_plain` names its key."""

    text: str
    line: int  # 1-based, in the text given to load

    def reason(self) -> str:
        """What YAML 1.1 would have made of it and what to write instead (one clause)."""
        meant = yaml.safe_load(self.text)
        read = "a leading zero makes some numbers octal in YAML 1.1" if isinstance(meant, str) else \
            f"YAML 1.1 reads it as {meant!r}"
        return f"{self.text} is ambiguous ({read}); write {ACCEPTED}"


class PlainLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.1's number and boolean forms narrowed to plain decimals and true/false."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)  # YAML 1.1's reading
        if kind is not yaml.ScalarNode or not implicit[0]:  # a quoted or tagged scalar is what it says
            return tag
        if PLAIN_INT.fullmatch(value):
            return INT_TAG
        if PLAIN_FLOAT.fullmatch(value):
            return FLOAT_TAG  # 1e-3 too, which YAML 1.1 leaves a string
        if (tag == BOOL_TAG and PLAIN_BOOL.fullmatch(value)) or (tag == FLOAT_TAG and SPECIAL_FLOAT.fullmatch(value)):
            return tag
        if tag in (INT_TAG, FLOAT_TAG, BOOL_TAG) or LEADING_ZERO.fullmatch(value):
            return AMBIGUOUS_TAG
        return tag


def _construct_ambiguous(loader: PlainLoader, node: yaml.ScalarNode) -> Ambiguous:
    return Ambiguous(node.value, node.start_mark.line + 1)


PlainLoader.add_constructor(AMBIGUOUS_TAG, _construct_ambiguous)


def load(text: str) -> Any:
    """``text`` read by :class:`PlainLoader` (refused forms stay :class:`Ambiguous`: pass the value to
    :func:`check_plain`); a syntax error is ``yaml.YAMLError`` as with ``yaml.safe_load``."""
    return yaml.load(text, Loader=PlainLoader)  # noqa: S506  (a SafeLoader: no Python objects)


def find_ambiguous(value: Any, path: str = "") -> Iterator[tuple[str, Ambiguous]]:
    """Every refused scalar in ``value`` with its dotted key (``federated.n_rounds``, ``seeds[1]``); a refused
    mapping key (``on:``) is named by its own text."""
    if isinstance(value, Ambiguous):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key.text if isinstance(key, Ambiguous) else str(key)
            dotted = f"{path}.{name}" if path else name
            if isinstance(key, Ambiguous):
                yield dotted, key
            yield from find_ambiguous(item, dotted)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from find_ambiguous(item, f"{path}[{index}]")


def check_plain(value: Any) -> tuple[str, Ambiguous] | None:
    """The first refused scalar of a loaded value with its dotted key ("" for the value itself), or None."""
    return next(find_ambiguous(value), None)
