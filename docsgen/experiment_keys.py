"""The reference page of every experiment-file key of every study kind, read from the study registry.

Each kind (``pipeline.studies.STUDIES``) carries its schema (every key with its default), its keys' types (the
checks of ``pipeline/schema.py`` that ``load`` applies before step 0) and its keys' help (one line each, written
beside the keys' defaults), so this page lists what a file may set, its default, what it must be and what it does.
A check this module cannot put in words, or a key without its line of help, stops the build.
"""

from __future__ import annotations

import math
from typing import Any

from docsgen.markdown import code, escape, table

SHARED = "every kind"


def _bound(value: float) -> str:
    """A bound as a reader writes it: 1,000,000 (not 1e+06) for a whole number, 0.5 otherwise."""
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    return format(value, "g")


def _interval(low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> str:
    left = "(" if low is None or low_open else "["
    right = ")" if high is None or high_open else "]"
    return f"{left}{_bound(low) if low is not None else '−∞'}, {_bound(high) if high is not None else '∞'}{right}"


def describe_check(check: Any) -> str:
    """What a ``pipeline.schema`` check accepts, in words (an unknown kind of check is an error)."""
    from pipeline import schema

    if isinstance(check, schema.Int):
        return f"integer in {_interval(check.low, check.high)}"
    if isinstance(check, schema.Float):
        return f"number in {_interval(check.low, check.high, check.low_open, check.high_open)}"
    if isinstance(check, schema.Bool):
        return "true or false"
    if isinstance(check, schema.Str):
        if check.choices:
            return "one of " + ", ".join(check.choices)
        return "a plain name (letters, digits, '.', '_', '-')" if check.plain else "a string"
    if isinstance(check, schema.ListOf):
        at_least = f" (at least {check.min_len})" if check.min_len != 1 else ""
        repeats = ", each once" if check.unique else ""
        return f"a list{at_least} of: {describe_check(check.item)}{repeats}"
    if isinstance(check, schema.Optional):
        return f"{describe_check(check.check)}, or null"
    if isinstance(check, schema.Mapping):
        return f"a mapping: {check.what}, e.g. {check.example}"
    if isinstance(getattr(check, "description", None), str):  # a kind's own check that says what it accepts
        return check.description
    raise RuntimeError(f"docsgen/experiment_keys.py cannot describe the check {check!r}: add its kind to describe_check")


def default_of(schema: dict[str, Any], dotted: str) -> Any:
    """The default of a dotted key in a kind's schema."""
    value: Any = schema
    for part in dotted.split("."):
        value = value[part]
    return value


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isfinite(value):
        return format(value, "g")
    return str(value)


def help_of(kind: Any, dotted: str) -> str:
    """What the key does, as the kind says (a key without a line stops the build: say it where the key is defined)."""
    text = " ".join(str(kind.help.get(dotted, "")).split())
    if not text:
        raise RuntimeError(f"study kind {kind.name!r} has no help for its key {dotted!r}: add its line where the kind's "
                           "keys are defined (pipeline/sections.py, pipeline/studies/)")
    return text


def kind_keys(kind: Any) -> dict[str, tuple[str, str, str]]:
    """Dotted key -> (default as YAML would show it, its type in words, what it does), for one study kind."""
    return {dotted: (_shown(default_of(kind.schema, dotted)), describe_check(check), help_of(kind, dotted))
            for dotted, check in kind.types.items()}


def study_kinds() -> dict[str, Any]:
    """Every registered study kind by name."""
    from pipeline.studies import get_study, list_studies

    return {name: get_study(name) for name in list_studies()}


def page() -> str:
    """The experiment-file keys page (Markdown)."""
    from pipeline.studies import MAIN_JOB

    kinds = study_kinds()
    keys = {name: kind_keys(kind) for name, kind in kinds.items()}
    shared = {dotted: entry for dotted, entry in next(iter(keys.values())).items()
              if all(kind_entries.get(dotted) == entry for kind_entries in keys.values())}
    parts = ["# Every experiment-file key",
             "Generated at build time from the study registry (`pipeline/studies/`: each kind's schema, with every "
             "key's default, its keys' checks from `pipeline/schema.py` and their help, written beside the keys in "
             "`pipeline/sections.py` and `pipeline/studies/`; `docsgen/experiment_keys.py`). "
             "`run_pipeline.py FILE` reads the file's `study:` key (none: the main job) and checks every key below "
             "before step 0: an unknown key, a wrong type or a value out of range is one `error:` line naming the "
             "key. Names (tasks, encoders, algorithms and their settings, partition schemes) are then checked against the "
             "[registries](registries.md) and the [algorithms' settings](algorithms.md). A dotted key `a.b` is the key "
             "`b` inside the section `a:`.",
             table(["study kind", "`study:` value", "what it measures"],
                   ([f"[{name}](#{name})", "none (no `study:` key)" if name == MAIN_JOB else code(name),
                     escape(kind.summary)] for name, kind in kinds.items())),
             f"## Keys of {SHARED} {{#shared}}",
             "These keys mean the same, with the same default, type and use, in every kind of file.",
             _key_table(shared)]
    for name, kind in kinds.items():
        own = {dotted: entry for dotted, entry in keys[name].items() if dotted not in shared}
        title = "the main job (a file without `study:`)" if name == MAIN_JOB else f"`study: {name}`"
        parts += [f"## {name} {{#{name}}}", f"{escape(kind.summary)}. The keys of {title} besides "
                  f"[those of every kind](#shared):", _key_table(own)]
    return "\n\n".join(parts) + "\n"


def _key_table(entries: dict[str, tuple[str, str, str]]) -> str:
    return table(["key", "default", "must be", "what it does"],
                 ([code(dotted), code(default), escape(kind), escape(text)]
                  for dotted, (default, kind, text) in entries.items()))
