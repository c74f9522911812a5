"""mkdocs hooks (mkdocs.yml ``hooks:``): the generated reference pages, and the how-to pages that exist.

``on_files`` adds the pages of :mod:`docsgen.pages`, written from the code at every build, so none can be stale.
``on_config`` lists in the nav every ``docs/howto/*.md`` that the nav does not name yet (title: its first
heading), so a how-to page that lands is linked at once and never an orphan the strict build refuses.
``on_page_markdown`` replaces the line ``<!-- how-to index -->`` of the home page with a table of every how-to
page (its title and its first sentence), for the same reason, and the line ``<!-- the answer -->`` with the answer
pasted into the README (between its demo-report markers), so the site's first page shows the same answer as the
repository's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs loads this file by path; the generators import the project's packages
    sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File, Files  # noqa: E402

HOWTO_SECTION = "How-to guides"
HOWTO_INDEX = "<!-- how-to index -->"
ANSWER = "<!-- the answer -->"
README = ROOT / "README.md"
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


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


def _first_sentence(path: Path) -> str:
    """The first sentence of the page's first paragraph of prose (after its title, outside code blocks), on one
    line, its links reduced to their text (a link relative to the how-to folder would be broken on the home page)."""
    paragraph: list[str] = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        prose = not fenced and line.strip() and not line.startswith(("#", "|", "<!--", "!", ">", "-", "*"))
        if prose:
            paragraph.append(line.strip())
        elif paragraph:
            break
    text = LINK.sub(r"\1", " ".join(paragraph))
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def howto_index(docs_dir: Path) -> str:
    """A Markdown table: every docs/howto/*.md, its title linked, and its first sentence."""
    rows = ["| how to | what it does |", "|---|---|"]
    for path in sorted((docs_dir / "howto").glob("*.md")):
        title, summary = (text.replace("|", r"\|") for text in (_title(path), _first_sentence(path)))  # a pipe ends a cell
        rows.append(f"| [{title}](howto/{path.name}) | {summary} |")
    return "\n".join(rows)


def readme_answer(readme: Path) -> str:
    """The block the README holds between its demo-report markers, its ``docs/`` links made relative to docs/."""
    from pipeline.readme_report import END, START

    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise RuntimeError(f"{readme} has no {START} ... {END} block to show on the home page")
    block = text[text.index(START) + len(START):text.index(END)].strip("\n")
    return block.replace("](docs/", "](")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs' hook signature)
    """The home page's answer and how-to index, made from the README and the how-to pages as they are now."""
    if page.file.src_uri != "index.md":
        return markdown
    markdown = markdown.replace(ANSWER, readme_answer(README))
    return markdown.replace(HOWTO_INDEX, howto_index(Path(config["docs_dir"])))


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
