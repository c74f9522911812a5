"""Every generated page of the site, by its path under docs/ (what the mkdocs hook adds to the build)."""

from __future__ import annotations

from typing import Callable

from docsgen import algorithms, experiment_keys, flower_partitioners, registries, scripts

GENERATED: dict[str, Callable[[], str]] = {
    "reference/scripts.md": scripts.page,
    "reference/algorithms.md": algorithms.page,
    "reference/experiment-files.md": experiment_keys.page,
    "reference/registries.md": registries.page,
    "reference/flower-partitioners.md": flower_partitioners.page,
}


def generated_pages() -> dict[str, str]:
    """Path under docs/ -> the page's Markdown, written now from the code."""
    return {path: write() for path, write in GENERATED.items()}
