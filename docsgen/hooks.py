"""mkdocs hooks (mkdocs.yml ``hooks:``): the generated reference pages, and the how-to pages that exist.

``on_files`` adds the pages of :mod:`docsgen.pages`, written from the code at every build, so none can be stale.
``on_config`` lists in the nav every ``docs/howto/*.md`` that the nav does not name yet (title: its first
heading), so a how-to page that lands is linked at once and never an orphan the strict build refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs loads this file by path; the generators import the project's packages
    sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File, Files  # noqa: E402

HOWTO_SECTION = "How-to guides"


def _named_pages(nav: object) -> set[str]:
    """Every page path the nav names, at any depth."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_named_pages(value) for value in nav.values()))
    if isinstance(nav, list):
        return set().union(*(_named_pages(item) for item in nav))
    return set()


def _title(path: Path) -> str:
    heading = next((line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("# ")), None)
    return heading[2:].strip() if heading else path.stem.replace("-", " ")


def on_config(config):  # noqa: ANN001, ANN201 (mkdocs' hook signature)
    """Add every docs/howto/*.md the nav does not name to its how-to section."""
    nav = config["nav"]
    named = _named_pages(nav)
    howto_dir = Path(config["docs_dir"]) / "howto"
    section = next(item for item in nav if isinstance(item, dict) and HOWTO_SECTION in item)[HOWTO_SECTION]
    for path in sorted(howto_dir.glob("*.md")):
        page = path.relative_to(config["docs_dir"]).as_posix()
        if page not in named:
            section.append({_title(path): page})
    return config


def on_files(files: Files, config) -> Files:  # noqa: ANN001 (mkdocs' hook signature)
    """Add the generated reference pages (written from the code now)."""
    from docsgen.pages import GENERATED, generated_pages

    for path in GENERATED:  # a copy kept in docs/ would go stale: refuse it rather than pick one of the two
        if files.get_file_from_path(path) is not None:
            raise RuntimeError(f"docs/{path} is generated at build time (docsgen/pages.py); remove the file from docs/")
    for path, text in generated_pages().items():
        files.append(File.generated(config, path, content=text))
    return files
