"""The reference page of every registry a user names things from: tasks, encoders, data families, partition schemes
and their skews, groupings and the sparse mask rules."""

from __future__ import annotations

from typing import Callable

from docsgen.markdown import code, escape, first_paragraph, table


def registry_names() -> dict[str, list[str]]:
    """Registry title -> every name registered in it (what the page must list)."""
    from datasets.family import list_families
    from models.encoders import list_encoders
    from models.tasks import list_tasks
    from partitioning.allocation import SIZE_SKEWS
    from partitioning.groupings import GROUPINGS
    from partitioning.partition import list_schemes
    from partitioning.skews import list_skews
    from partitioning.temporal import TEMPORAL_KINDS
    from sparse.rules import list_rules

    return {"Tasks": list_tasks(), "Encoders": list_encoders(), "Data families": list_families(),
            "Partition schemes": list_schemes(), "Groupings": list(GROUPINGS), "Size skews": SIZE_SKEWS.names(),
            "Temporal skews": list(TEMPORAL_KINDS), "Per-client skews": list_skews(), "Mask rules": list_rules()}


def _tasks() -> str:
    from models.tasks import get_task, list_tasks

    rows = []
    for name in list_tasks():
        task = get_task(name)
        channels = "K (from the data family)" if task.out_channels is None else str(task.out_channels)
        rows.append([code(name), task.kind, code(task.domain), channels, code(task.activation),
                     code(task.loss_fn.__name__), code(task.primary_metric)])
    return table(["task", "kind", "target key", "output channels", "activation", "loss (`losses.py`)",
                  "metric reports quote"], rows)


def _encoders() -> str:
    from models.encoders import ENCODERS, list_encoders

    rows = []
    for name in list_encoders():
        encoder = ENCODERS.get(name)
        rows.append([code(name), escape(first_paragraph(encoder.__doc__)), code(encoder.default_weights),
                     str(encoder.decoder_width)])
    return table(["encoder", "what", "default `--weights`", "decoder width"], rows)


def _families() -> str:
    from datasets.family import get_family, list_families

    rows = []
    for name in list_families():
        family = get_family(name)
        rows.append([code(name), escape(first_paragraph(type(family).__doc__)), code(family.input_key),
                     code(family.label_column), code(family.source_column or "none"),
                     ", ".join(code(task) for task in family.tasks)])
    return table(["family", "what", "input key", "label column", "source column (`natural`)", "tasks"], rows)


def _schemes() -> str:
    from partitioning.partition import list_schemes, scheme_parameters
    from partitioning.partitioner import SCHEMES

    rows = [[code(name), escape(first_paragraph(SCHEMES.get(name).__doc__)),
             ", ".join(code(f"--{parameter}") for parameter in scheme_parameters(name)) or "none"]
            for name in list_schemes()]
    return table(["`--scheme`", "sampling model", "parameters (step 3b flags)"], rows)


def _groupings() -> str:
    from partitioning import groupings

    return ("Experiment files (`partition.groupings`) and `test_fed.py --type` name the two kinds of groups: "
            + ", ".join(code(name) for name in groupings.GROUPINGS) + ". " + escape(first_paragraph(groupings.__doc__)))


def _size_skews() -> str:
    from partitioning.allocation import SIZE_SKEWS

    rows = [[code(name), escape(first_paragraph(SIZE_SKEWS.get(name).__doc__))] for name in SIZE_SKEWS.names()]
    return "Quantity skew, step 3b's `--size_skew NAME:VALUE` (`partition.size_skew`):\n\n" + table(["name", "sizes"], rows)


def _temporal() -> str:
    from partitioning.temporal import TEMPORAL_HELP, TEMPORAL_KINDS

    return (f"Step 3b's `--temporal` (`partition.temporal`) kinds: {', '.join(code(kind) for kind in TEMPORAL_KINDS)}. "
            f"Its values: {escape(TEMPORAL_HELP)}.")


def _skews() -> str:
    from partitioning.skews import get_skew, list_skews

    rows = [[code(name), get_skew(name).kind, escape(first_paragraph(type(get_skew(name)).__doc__))]
            for name in list_skews()]
    return table(["skew", "kind", "what a client gets"], rows)


def _rules() -> str:
    from sparse.rules import get_rule, list_rules

    rows = [[code(name), escape(get_rule(name).summary), "yes" if get_rule(name).needs_scores else "no"]
            for name in list_rules()]
    return table(["`mask_rule`", "what it fine-tunes", "reads sensitivity scores"], rows)


SECTIONS: dict[str, Callable[[], str]] = {
    "Tasks": _tasks, "Encoders": _encoders, "Data families": _families, "Partition schemes": _schemes,
    "Groupings": _groupings, "Size skews": _size_skews, "Temporal skews": _temporal, "Per-client skews": _skews,
    "Mask rules": _rules,
}


def page() -> str:
    """The registries page (Markdown)."""
    missing = sorted(set(registry_names()) - set(SECTIONS))
    if missing:
        raise RuntimeError(f"docsgen/registries.py has no section for {', '.join(missing)}")
    parts = ["# Tasks, encoders, data families, partitions",
             "Generated at build time from the registries (`docsgen/registries.py`): every name a flag or an "
             "experiment file may use. A new entry is one registered module; it appears here on the next build."]
    for title, section in SECTIONS.items():
        parts += [f"## {title}", section()]
    return "\n\n".join(parts) + "\n"
