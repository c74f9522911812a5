"""The reference page of every federated algorithm, read from the registry and each algorithm's ``Settings``."""

from __future__ import annotations

import sys

from docsgen.markdown import code, escape, first_paragraph, table


def algorithm_names() -> list[str]:
    """Every registered algorithm (``test_fed.py --method``)."""
    from network.algorithms import list_algorithms

    return list_algorithms()


def _traits(algorithm_class: type) -> str:
    """What the class declares about itself, in words."""
    traits = []  # class-level declarations only (``personalized`` may depend on the model, so it is not read here)
    if algorithm_class.result_is_personal:
        traits.append("its result is the clients' own models (one part of the global model, the head or the body, is "
                      "never trained)")
    if algorithm_class.vectorizable:
        traits.append("runs under `--vectorize_clients`")
    if algorithm_class.needs_classifier:
        traits.append("needs a classification task with a linear classifier head")
    return "; ".join(traits) + "." if traits else ""


def settings_rows(settings_class: type) -> list[list[str]]:
    """One row per declared setting: name, type, default, allowed values, help."""
    from network.settings import describe

    rows = []
    for info in describe(settings_class):
        allowed = ", ".join(info.choices) if info.choices else info.limit
        rows.append([code(f"--{info.name}"), info.type.__name__, code(info.default), escape(allowed), escape(info.help)])
    return rows


def section(name: str) -> str:
    """One algorithm's section: paper (its module's first paragraph), summary, traits, settings."""
    from network.algorithms.base import ALGORITHMS

    algorithm_class = ALGORITHMS.get(name)
    module = sys.modules[algorithm_class.__module__]
    parts = [f"## {name} {{#{name}}}", escape(first_paragraph(module.__doc__)),
             f"{escape(first_paragraph(algorithm_class.__doc__))} Source: `{module.__name__.replace('.', '/')}.py`."]
    if algorithm_class.use_when:
        parts.append(f"Use it when: {escape(algorithm_class.use_when)}.")
    parts.append(escape(client_dp_line(algorithm_class)))
    traits = _traits(algorithm_class)
    if traits:
        parts.append(escape(traits))
    rows = settings_rows(algorithm_class.Settings)
    parts.append(table(["setting", "type", "default", "allowed", "help"], rows) if rows else "No settings.")
    return "\n\n".join(parts)


def client_dp_line(algorithm_class: type) -> str:
    """How client-level DP (``--dp_clip``, network/privacy.py) applies to what the algorithm uploads, or why not."""
    if algorithm_class.dp_groups:
        groups = " and ".join(f"`{group}`" for group in algorithm_class.dp_groups)
        return (f"Client-level DP: its upload group{'s' if len(algorithm_class.dp_groups) > 1 else ''} {groups} "
                "clipped together to C on the client and noised once per round on the server (with "
                "`weighting uniform`); private entries never leave the client.")
    return f"Client-level DP: refused, because {algorithm_class.dp_refusal}."


def page() -> str:
    """The algorithms page (Markdown)."""
    from network.algorithms.base import ALGORITHMS

    names = algorithm_names()
    summary = table(["method", "paper", "settings"],
                    ([f"[{name}](#{name})", escape(first_paragraph(sys.modules[ALGORITHMS.get(name).__module__].__doc__)),
                      str(len(settings_rows(ALGORITHMS.get(name).Settings)))] for name in names))
    intro = ("# Every algorithm\n\nGenerated at build time from the registry (`network/algorithms/`, one file per "
             "algorithm) and each algorithm's `Settings` dataclass (`docsgen/algorithms.py`): the same declaration that "
             "`test_fed.py --method X` parses, `test_fed.py --list_methods` prints and an experiment file's "
             "`federated.algorithms` is checked against. A setting is a flag of `test_fed.py --method X`, or a key "
             "under the algorithm's name in an experiment file (`federated.algorithms: {fedprox: {mu: 0.01}}`); a "
             "list of values in a study file's grid is a grid over it. Which method suits which situation, and where "
             "TaskHet departs from the authors' code: [Choosing an algorithm](../explanations/algorithms.md).")
    return "\n\n".join([intro, summary, *(section(name) for name in names)]) + "\n"
