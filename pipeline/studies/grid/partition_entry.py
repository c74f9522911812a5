"""A grid study's partition entry, checked: ``{scheme: nc_shards, groups_per_client: 5}`` with its step-3b options, the
study's own keys (``situation``, ``class_groups``) and step 4's unequal local work (errors name the YAML key).

A partition entry takes the scheme's parameters and any other option of step 3b's command line (so a partition
option step 3b gains is a study option with no change here), each converted as step 3b's parser converts it; the
options the study sets itself (manifest, output folder, clients, seed, client-test share, groups) and the runtime
flags are refused with the key named.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.schema import Bool, Float, Int, ListOf, Str
from pipeline.studies.grid.runs import Partition
from utils.errors import TaskHetError

# Step-3b options a study sets itself (from federated.* and the seeds, or a class_groups file), never a partition entry.
STUDY_SET_OPTIONS = ("manifest", "out", "n_clients", "seed", "client_test_fraction", "groups", "help")
STUDY_KEYS = ("scheme", "situation", "class_groups")  # the keys of a partition entry that are not step-3b options
# Step 4's unequal local work (network/local_work.py): a situation's clients may each do their own number of steps.
WORK_KEYS = ("straggler_fraction", "straggler_share", "local_steps_range")


def step3b_options() -> dict[str, argparse.Action]:
    """Step 3b's options a partition entry may set: every flag of its parser but the study's own and the runtime ones."""
    from steps import assign as step3b
    from utils import cli

    runtime = argparse.ArgumentParser(add_help=False)
    cli.add_runtime_flags(runtime)
    excluded = {action.dest for action in runtime._actions} | set(STUDY_SET_OPTIONS)
    return {action.dest: action for action in step3b.build_parser()._actions if action.dest not in excluded}


class PartitionCheck:
    """A partition entry: ``{scheme: nc_shards, groups_per_client: 5}``, with ``situation``, ``class_groups`` and any
    step-3b option (see the module doc); returns a :class:`Partition`."""

    def __init__(self, n_labels: int | None) -> None:
        self.n_labels = n_labels

    def __call__(self, value: Any, key: str) -> Partition:
        from partitioning.partition import list_schemes, scheme_parameters

        if not isinstance(value, dict) or "scheme" not in value:
            raise TaskHetError(f"{key} must be a mapping with a scheme, e.g. {{scheme: nc_shards, groups_per_client: 5}}, "
                               f"got {value!r}")
        scheme = value["scheme"]
        if scheme not in list_schemes():
            raise TaskHetError(f"{key}.scheme {scheme!r} is unknown; choose from: {', '.join(list_schemes())}")
        options = step3b_options()
        scheme_takes = [name for name in scheme_parameters(scheme) if name != "seed"]
        any_scheme_takes = {name for other in list_schemes() for name in scheme_parameters(other)}
        params = {}
        for name, item in value.items():
            if name in STUDY_KEYS or name in WORK_KEYS:
                continue
            if name not in options:
                raise TaskHetError(f"{key}.{name}: not a step-3b option a study may set; a partition entry takes "
                                   f"scheme, situation, class_groups, {', '.join(WORK_KEYS)} and: "
                                   f"{', '.join(sorted(options))}")
            if name in any_scheme_takes and name not in scheme_takes:
                raise TaskHetError(f"{key}.{name}: scheme {scheme} does not take it; it takes: "
                                   f"{', '.join(scheme_takes) or 'nothing'}")
            params[name] = convert_option(options[name], item, f"{key}.{name}")  # '0.1' and 0.1: one partition
        situation = value.get("situation")
        if situation is not None:
            situation = Str(plain=True)(situation, f"{key}.situation")
        class_groups = None
        if value.get("class_groups") is not None:
            class_groups = check_class_groups(value["class_groups"], f"{key}.class_groups", self.n_labels)
            per_client = params.get("groups_per_client")
            if per_client is not None and per_client > len(class_groups):
                raise TaskHetError(f"{key}.groups_per_client {per_client} exceeds the {len(class_groups)} class groups")
        return Partition(scheme, tuple(sorted(params.items())), situation, class_groups, local_work(value, key))


def local_work(entry: dict[str, Any], key: str) -> tuple[tuple[str, Any], ...]:
    """The unequal-local-work keys of a partition entry, checked as step 4 checks its flags (errors name the key)."""
    from network.local_work import LocalWork, parse_steps_range

    types = {"straggler_fraction": Float(0, 1), "straggler_share": Float(0, 1, low_open=True),
             "local_steps_range": Str()}
    work = {name: types[name](entry[name], f"{key}.{name}") for name in WORK_KEYS if name in entry}
    try:
        LocalWork(work.get("straggler_fraction", 0.0), work.get("straggler_share", 0.5),
                  parse_steps_range(work.get("local_steps_range")))
    except TaskHetError as error:
        raise TaskHetError(f"{key}: {error}") from None
    return tuple(sorted(work.items()))


def convert_option(action: argparse.Action, value: Any, key: str) -> Any:
    """A step-3b option's YAML value as step 3b's parser would read it (its type and choices; a flag: true/false)."""
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        return Bool()(value, key)
    if action.dest == "alpha":
        return Float(0, low_open=True)(value, key)
    if action.dest == "groups_per_client":
        return Int(1)(value, key)
    if isinstance(value, (bool, list, dict)) or value is None:
        raise TaskHetError(f"{key} must be a single value as step 3b's --{action.dest} takes it, got {value!r}")
    try:
        converted = action.type(str(value)) if action.type is not None else str(value)
    except (argparse.ArgumentTypeError, ValueError, TaskHetError) as error:
        raise TaskHetError(f"{key}: {error}") from None
    if action.choices is not None and converted not in action.choices:
        raise TaskHetError(f"{key} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return converted


def check_class_groups(value: Any, key: str, n_labels: int | None) -> tuple[tuple[int, ...], ...]:
    """At least two non-empty lists of class indices that together hold every class 0..n_labels − 1 exactly once."""
    if n_labels is None:
        raise TaskHetError(f"{key}: class groups need integer class labels (data.source digits, cifar10 or cifar100)")
    groups = ListOf(ListOf(Int(0, n_labels - 1)), min_len=2, unique=False)(value, key)
    classes = [label for group in groups for label in group]
    repeated = sorted({label for label in classes if classes.count(label) > 1})
    missing = sorted(set(range(n_labels)) - set(classes))
    if repeated or missing:
        problem = f"class {repeated[0]} is in two groups" if repeated else f"classes {missing} are in no group"
        raise TaskHetError(f"{key}: every class 0..{n_labels - 1} must be in exactly one group; {problem}")
    return tuple(tuple(group) for group in groups)
