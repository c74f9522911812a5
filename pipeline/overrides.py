"""``key=value`` overrides of an experiment file on the command line (``run_pipeline.py FILE federated.n_rounds=10
seeds=[0]``), as Hydra users do in FL-bench.

An override names a key by its dotted path in the file (``federated.n_rounds``; a list item the file has as
``grid[0]``) and gives its value in YAML as an experiment file reads it (``10``, ``1e-3``, ``[0, 1]``, ``{mu: 0.1}``,
``true``; utils/plain_yaml.py refuses YAML 1.1's ``010``, ``1:30`` and ``yes``). Every path must be a key of the file's
study kind (checked against the kind's schema here, so a typo is one line naming it); the value then goes into
the file's mapping before the kind loads it, so it meets exactly the checks a value written in the file meets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from utils import plain_yaml
from utils.errors import TaskHetError

# A path: names of ASCII letters, digits and underscores joined by dots, each optionally indexed: grid[0].local_steps
SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[[0-9]{1,4}\])*)", re.ASCII)
INDEX = re.compile(r"\[([0-9]{1,4})\]", re.ASCII)
MAX_OVERRIDES = 64  # a command line, not a second experiment file


@dataclass(frozen=True)
class Override:
    """One ``path=value``: the path as keys and list indexes, the value as YAML read it, the text as given."""

    path: tuple[str | int, ...]
    value: Any
    text: str

    @property
    def key(self) -> str:
        """The dotted key (``grid[0].local_steps``)."""
        return dotted(self.path)


def dotted(path: tuple[str | int, ...]) -> str:
    """A path as the user writes it: ``("grid", 0, "local_steps")`` -> ``grid[0].local_steps``."""
    shown = ""
    for part in path:
        shown += f"[{part}]" if isinstance(part, int) else (f".{part}" if shown else part)
    return shown


def parse_overrides(texts: list[str]) -> list[Override]:
    """Each ``path=value`` as an :class:`Override`; a malformed one, or one key given twice, is one error line."""
    if len(texts) > MAX_OVERRIDES:
        raise TaskHetError(f"{len(texts)} key=value overrides; at most {MAX_OVERRIDES} (write the rest into the file)")
    parsed, seen = [], set()
    for text in texts:
        key, separator, value = text.partition("=")
        if not separator:
            raise TaskHetError(f"override {text!r}: expected KEY=VALUE, e.g. federated.n_rounds=10")
        override = Override(parse_path(key.strip(), text), parse_value(value, text), text)
        if override.key in seen:
            raise TaskHetError(f"override {text!r}: {override.key} is overridden twice")
        seen.add(override.key)
        parsed.append(override)
    return parsed


def parse_path(key: str, text: str) -> tuple[str | int, ...]:
    """``federated.n_rounds`` -> ("federated", "n_rounds"); ``grid[0].local_steps`` -> ("grid", 0, "local_steps")."""
    path: list[str | int] = []
    for segment in key.split("."):
        match = SEGMENT.fullmatch(segment)
        if match is None:
            raise TaskHetError(f"override {text!r}: {key!r} is not a key path (names of letters, digits and _ joined "
                               "by dots, a list item as name[0])")
        path.append(match.group(1))
        path.extend(int(index) for index in INDEX.findall(match.group(2)))
    return tuple(path)


def parse_value(value: str, text: str) -> Any:
    """The value as an experiment file's YAML reads it (``[0, 1]`` is a list, ``1e-3`` a number, nothing null);
    a YAML 1.1 form read differently by other readers (``010`` is 8, ``1:30`` is 90) is refused, as in the file."""
    try:
        parsed = plain_yaml.load(value) if value.strip() else None
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise TaskHetError(f"override {text!r}: the value is not YAML ({problem})") from None
    found = plain_yaml.check_plain(parsed)
    if found is not None:
        inside, scalar = found  # inside: where in a list or mapping value ("" for the value itself)
        key = text.partition("=")[0].strip()
        where = f"{key}{inside if inside.startswith('[') else '.' + inside}: " if inside else ""
        raise TaskHetError(f"override {text!r}: {where}{scalar.reason()}")
    return parsed


def apply_overrides(raw: dict[str, Any], overrides: list[Override], schema: dict[str, Any],
                    free_form: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``raw`` (an experiment file's mapping) with every override applied; each path must be a key of ``schema``
    (a mapping under a free-form key, such as ``federated.algorithms``, takes any name)."""
    for override in overrides:
        if override.path[0] == "study":
            raise TaskHetError(f"override {override.text!r}: the study kind is the file's; write another file")
        check_path(override, schema, free_form)
        set_value(raw, override)
    return raw


def check_path(override: Override, schema: dict[str, Any], free_form: frozenset[str]) -> None:
    """The override's mapping keys must exist in ``schema`` down to a leaf, a list or a free-form mapping."""
    node: Any = schema
    dotted = ""
    for part in override.path:
        if isinstance(part, int) or not isinstance(node, dict) or dotted in free_form:
            return  # inside a list or a free-form mapping: the kind checks the items themselves
        if part not in node:
            allowed = ", ".join(sorted(node))
            where = f" under {dotted}" if dotted else ""
            raise TaskHetError(f"override {override.text!r}: unknown key {override.key!r}; allowed{where}: {allowed}")
        node, dotted = node[part], f"{dotted}.{part}" if dotted else part


def set_value(raw: dict[str, Any], override: Override) -> None:
    """Put the override's value at its path in ``raw``, making mappings the file leaves out (a list item must be
    one the file has: the override changes it in place)."""
    node: Any = raw
    for position, part in enumerate(override.path[:-1]):
        following = override.path[position + 1]
        if isinstance(part, int):
            node = node[list_index(node, override, position)]
            continue
        if not isinstance(node, dict):
            raise TaskHetError(f"override {override.text!r}: {override.key}: {part!r} is not inside a mapping")
        node = node.setdefault(part, [] if isinstance(following, int) else {})
        if node is None:
            raise TaskHetError(f"override {override.text!r}: {override.key}: the file sets {part} to nothing")
    last = override.path[-1]
    if isinstance(last, int):
        last = list_index(node, override, len(override.path) - 1)
    elif not isinstance(node, dict):
        raise TaskHetError(f"override {override.text!r}: {override.key}: not inside a mapping")
    node[last] = override.value


def list_index(node: Any, override: Override, position: int) -> int:
    """The index at ``override.path[position]``, checked against the list ``node`` the file has there (an index
    past its end would otherwise be an IndexError, or a new item no check expects)."""
    index, owner = override.path[position], dotted(override.path[:position])
    if not isinstance(node, list):
        raise TaskHetError(f"override {override.text!r}: {owner} is not a list in the file, so it has no item {index}")
    if index >= len(node):
        indexes = f" (indexes 0 to {len(node) - 1})" if node else ""
        raise TaskHetError(f"override {override.text!r}: {owner} has {len(node)} item{'' if len(node) == 1 else 's'} "
                           f"in the file{indexes}, so no item {index}; set the whole list with {owner}=[...]")
    return index
