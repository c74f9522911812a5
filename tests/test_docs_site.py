"""The documentation site (mkdocs.yml, docs/, docsgen/): it builds strictly, its generated reference names every
registry entry, no page names an issue number, the README stays short, and the tutorial's copy-paste block runs as
the page shows it, in a fresh clone beside a `make demo` render."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorials" / "main-job.md"
OWN_PARTITION = ROOT / "docs" / "howto" / "own-partition.md"
# Every page a reader sees: the README and the site's sources (the changelog keeps the issue labels on purpose).
PAGES = ["README.md", *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").rglob("*.md"))]
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# The sizes the tutorial page says the suite runs its block at (its shell variables).
# STEP3_FLAGS: one epoch on 8 images may keep the untrained epoch 0, which step 3 refuses unless asked
TINY = {"BUILDINGS": "6", "VIEWS": "2", "SIZE": "16", "EPOCHS": "1", "ROUNDS": "1", "STEP3_FLAGS": "--allow_untrained"}


def _mkdocs():
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
    except ImportError:  # a clear failure, not a skip: CI must build the site
        pytest.fail("mkdocs is not installed: `make test` installs requirements-docs.txt into .venv")
    return build, load_config


def test_the_site_builds_strictly(tmp_path, monkeypatch):
    build, load_config = _mkdocs()
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    site = tmp_path / "site"
    build(load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(site), strict=True))
    for page in ("index.html", "reference/scripts.html", "reference/algorithms.html", "reference/experiment-files.html",
                 "reference/registries.html", "results/main-job.html", "tutorials/main-job.html", "DESIGN.html",
                 "BENCHMARKS.html", "demo/loss_vs_alpha.png"):
        assert (site / page).is_file(), page
    assert 'id="scaffold"' in (site / "reference" / "algorithms.html").read_text()


def _tiny_project(root: Path, page: str) -> Path:
    """A two-page mkdocs project with TaskHet's validation settings; ``page`` is index.md's text."""
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "index.md").write_text(page)
    (root / "docs" / "other.md").write_text("# Other\n\n## A heading\n")
    config = {"site_name": "t", "strict": True, "validation": settings["validation"], "nav": ["index.md", "other.md"]}
    (root / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return root / "mkdocs.yml"


@pytest.mark.parametrize("page, warning", [
    ("# Index\n\n[a](missing.md)\n", "missing.md"),
    ("# Index\n\n[a](other.md#no-such-heading)\n", "no-such-heading"),
    ("# Index\n\n![a plot](demo/plot.png)\n", "demo/plot.png"),
    ("# Index\n\n[a](other.md#a-heading)\n", None),
])
def test_the_strict_settings_refuse_a_broken_link_anchor_or_image(tmp_path, caplog, page, warning):
    build, load_config = _mkdocs()
    from mkdocs.exceptions import Abort

    config = load_config(config_file=str(_tiny_project(tmp_path / "project", page)), site_dir=str(tmp_path / "site"))
    if warning is None:
        build(config)
        return
    with pytest.raises(Abort, match="in strict mode"):
        build(config)
    assert warning in caplog.text


def test_a_page_no_nav_entry_reaches_fails_the_strict_build(tmp_path, caplog):
    build, load_config = _mkdocs()
    from mkdocs.exceptions import Abort

    config_file = _tiny_project(tmp_path / "project", "# Index\n")
    (tmp_path / "project" / "docs" / "orphan.md").write_text("# Orphan\n")
    with pytest.raises(Abort):
        build(load_config(config_file=str(config_file), site_dir=str(tmp_path / "site")))
    assert "orphan.md" in caplog.text


def test_a_howto_page_that_lands_joins_the_nav(tmp_path):
    from docsgen.hooks import HOWTO_SECTION, on_config

    (tmp_path / "howto").mkdir()
    (tmp_path / "howto" / "listed.md").write_text("# Listed\n")
    (tmp_path / "howto" / "ray-cluster.md").write_text("intro\n# Run on a Ray cluster\n")
    config = {"docs_dir": str(tmp_path), "nav": ["index.md", {HOWTO_SECTION: [{"Listed": "howto/listed.md"}]}]}
    assert on_config(config)["nav"][1][HOWTO_SECTION] == [{"Listed": "howto/listed.md"},
                                                           {"Run on a Ray cluster": "howto/ray-cluster.md"}]


def test_a_committed_copy_of_a_generated_page_stops_the_build(tmp_path):
    # A generated page kept in docs/ would go stale: the build refuses it instead of choosing one of the two.
    from mkdocs.structure.files import File, Files

    from docsgen import hooks

    config = {"docs_dir": str(tmp_path), "site_dir": str(tmp_path / "site"), "use_directory_urls": False}
    files = Files([File("reference/algorithms.md", str(tmp_path), str(tmp_path / "site"), False)])
    with pytest.raises(RuntimeError, match="docs/reference/algorithms.md is generated at build time"):
        hooks.on_files(files, config)


# ----- the generated reference -----


def _sections(page: str) -> dict[str, str]:
    """``## title`` -> the section's text, for a generated page."""
    return {part.split("\n", 1)[0].split(" {#")[0]: part for part in page.split("\n## ")[1:]}


@pytest.fixture(scope="module")
def generated():
    from docsgen.pages import generated_pages

    return generated_pages()


def test_every_algorithm_and_setting_is_on_the_algorithms_page(generated):
    from network.algorithms import list_algorithms
    from network.algorithms.base import get_settings_class
    from network.settings import describe

    sections = _sections(generated["reference/algorithms.md"])
    assert sorted(sections) == list_algorithms()
    for name in list_algorithms():
        for info in describe(get_settings_class(name)):
            assert f"`--{info.name}` | {info.type.__name__} | `{info.default}`" in sections[name], (name, info.name)
    assert "`--mu` | float | `0.01`" in sections["fedprox"]  # by hand: FedProx's μ


def test_every_script_and_flag_is_on_the_flags_page(generated):
    from docsgen.scripts import scripts

    sections = _sections(generated["reference/scripts.md"])
    top_level = sorted(path.name for path in ROOT.glob("*.py") if path.name != "losses.py")
    assert sorted(scripts()) == top_level
    for entries in scripts().values():
        for entry in entries:
            options = [option for action in entry.parser()._actions for option in action.option_strings
                       if option not in ("-h", "--help")]
            assert options and all(option in sections[entry.command] for option in options), entry.command
    assert "extract_datapoints_for_experiments.py --family digits" in sections


def test_every_study_kind_and_key_is_on_the_experiment_file_page(generated):
    from pipeline.studies import get_study, list_studies

    page = generated["reference/experiment-files.md"]
    sections = _sections(page)
    for name in list_studies():
        assert name in sections
        for dotted in get_study(name).types:
            assert f"| `{dotted}` |" in sections[name] or f"| `{dotted}` |" in sections["Keys of every kind"], dotted
    # by hand: alphas in (0, MAX_ALPHA = 1e6], a list without repeats (the "]" is escaped in Markdown)
    assert "| `partition.alphas` | `[0.1, 1.0]` | a list of: number in (0, 1,000,000\\], each once |" in sections["main_job"]


def test_every_registry_entry_is_on_the_registries_page(generated):
    from docsgen.registries import registry_names

    sections = _sections(generated["reference/registries.md"])
    for title, names in registry_names().items():
        assert names and all(f"`{name}`" in sections[title] for name in names), title


def test_no_generated_page_names_an_issue_number(generated):
    for path, text in generated.items():
        assert not ISSUE_NUMBER.search(text), (path, ISSUE_NUMBER.search(text))


def test_a_check_or_a_script_the_generator_cannot_describe_stops_the_build(monkeypatch):
    from docsgen import experiment_keys, scripts

    with pytest.raises(RuntimeError, match="cannot describe the check"):
        experiment_keys.describe_check(lambda value, key: value)
    monkeypatch.setattr(scripts, "top_level_scripts", lambda: ["new_tool.py", "test_fed.py"])
    with pytest.raises(RuntimeError, match="does not know the top-level script.* new_tool.py"):
        scripts.page()


# ----- the pages a reader sees -----


@pytest.mark.parametrize("page", PAGES)
def test_no_page_names_an_issue_number(page):
    found = ISSUE_NUMBER.search((ROOT / page).read_text())
    assert not found, f"{page} names {found.group(0)!r}: say what changed (CHANGELOG.md), not which issue asked for it"


def test_the_readme_is_short_and_keeps_its_two_commands_and_the_report_markers():
    from pipeline.readme_report import END, START

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make demo   # sets up .venv, then runs the main job on embedded synthetic buildings" in readme
    assert "make test   # sets up .venv, then runs the test suite (what CI runs: .ci/run)" in readme
    assert readme.count(START) == 1 and readme.count(END) == 1


DURATION = re.compile(r"\b\d+ min \d+ s\b")  # a measured wall clock or CPU time, as the pages write it
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _cut_at_headings(text: str) -> list[str]:
    """A page cut at its headings: the unit a measurement's date must sit in."""
    return re.split(r"(?m)^(?=#{1,4} )", text)


def test_every_measured_time_is_on_one_page_with_its_date():
    """A measurement is stated on one page (the others link to it), so two copies cannot drift apart, and the section
    stating it names the day it was measured."""
    pages_of: dict[str, set[str]] = {}
    for page in PAGES:
        for section in _cut_at_headings((ROOT / page).read_text()):
            times = DURATION.findall(section)
            assert not times or DATE.search(section), f"{page}: {times[0]} in a section without its measurement date"
            for time in times:
                pages_of.setdefault(time, set()).add(page)
    repeated = {time: sorted(pages) for time, pages in pages_of.items() if len(pages) > 1}
    assert not repeated, f"measured times stated on more than one page (state once, link from the others): {repeated}"


def test_the_readme_and_the_algorithm_guide_list_every_algorithm():
    from network.algorithms import list_algorithms

    readme = (ROOT / "README.md").read_text()
    guide = (ROOT / "docs" / "explanations" / "algorithms.md").read_text()
    from network.algorithms.base import ALGORITHMS

    for name in list_algorithms():
        assert f"\n- `{name}`: " in readme, name
        row = next(line for line in guide.splitlines() if line.startswith(f"| [{name}](../reference/algorithms.md#{name}) |"))
        use_when = ALGORITHMS.get(name).use_when
        assert use_when and row.endswith(f"| {use_when} |"), name  # the guide says what the code says


def test_every_link_of_the_readme_and_the_changelog_reaches_a_file():
    # The site's strict build checks its own pages; these two live outside it, at the repository's root.
    for document in ("README.md", "CHANGELOG.md"):
        links = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", (ROOT / document).read_text())
        missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
        assert not missing, f"{document} links {missing}"


def _block(page: Path, marker: str) -> str:
    """The fenced bash block of ``page`` between ``<!-- {marker}: start -->`` and ``<!-- {marker}: end -->``."""
    text = page.read_text()
    between = text.split(f"<!-- {marker}: start -->")[1].split(f"<!-- {marker}: end -->")[0]
    return re.search(r"```bash\n(.*?)```", between, re.DOTALL).group(1)


def test_the_readme_shows_the_five_minute_block_of_its_how_to_page():
    assert f"```bash\n{_block(OWN_PARTITION, 'own partition block')}```" in (ROOT / "README.md").read_text()


# ----- the tutorial's copy-paste block, run as written -----


def _checkout(folder: Path) -> Path:
    """A folder that looks like a fresh clone: the repository's files (linked), the venv, no data/ or results/."""
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {"data", "results", "site", ".git", ".venv"}:
            (folder / entry.name).symlink_to(entry)
    (folder / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return folder


def _render_like_make_demo(checkout: Path) -> Path:
    """What `make demo` leaves: a render in a hash-named subfolder of data/synthetic (data.root + the settings' key)."""
    from steps import render

    out = checkout / "data" / "synthetic" / "3f9a1c0d2b7e"
    render.main(["--out", str(out), "--n_buildings", "2", "--n_views", "1", "--image_size", "8", "--workers", "1",
                 "--no-progress"])
    return out


@pytest.mark.slow
def test_the_tutorial_block_runs_as_written_beside_a_make_demo_render(tmp_path):
    """The page's own block at the sizes it documents for the suite (6 buildings × 2 views at 16 px, 1 epoch, 1 round),
    in a fresh clone that also holds what `make demo` renders. Every step reads the block's own data: each config.json
    names data/tutorial, so a step left without --data_path (which in a bare fresh clone would look for the missing
    data/synthetic, and here would find the demo's folder) is caught by name; and the demo's render is untouched."""
    checkout = _checkout(tmp_path / "clone")
    demo = _render_like_make_demo(checkout)
    before = sorted(path.relative_to(demo) for path in demo.rglob("*"))
    env = {**os.environ, **TINY}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", _block(TUTORIAL, "tutorial block")], cwd=checkout,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    buildings = (checkout / "data" / "tutorial" / "synthetic_buildings.csv").read_text().strip().splitlines()
    assert len(buildings) == 1 + int(TINY["BUILDINGS"])  # the sizes the page names reached step 0
    metrics = (checkout / "results" / "tutorial" / "test_federated" / "depth-scaffold" / "metrics.csv").read_text()
    rounds = {int(line.split(",")[0]) for line in metrics.strip().splitlines()[1:]}
    assert rounds == {0, 1}
    read_from = {path.parent.relative_to(checkout).as_posix(): json.loads(path.read_text())["args"].get("data_path")
                 for path in (checkout / "results" / "tutorial").rglob("config.json")}
    data_steps = {name: data_path for name, data_path in read_from.items() if data_path is not None}
    assert len(data_steps) >= 4 and set(map(os.path.normpath, data_steps.values())) == {"data/tutorial"}, read_from
    assert sorted(path.relative_to(demo) for path in demo.rglob("*")) == before  # the demo's render untouched


def test_the_home_page_lists_every_howto_page_and_shows_the_readmes_answer(tmp_path, monkeypatch):
    from docsgen import hooks

    (tmp_path / "howto").mkdir()
    (tmp_path / "howto" / "b-second.md").write_text("# Second\n\n```bash\nmake x\n```\n\nDoes [two](../DATA.md) "
                                                    "things. Then more.\n")
    (tmp_path / "howto" / "a-first.md").write_text("# First | one\nIntro line one\ncontinued | here.\n\nNext.\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- demo report: start -->\n\nanswer ![plot](docs/demo/x.png)\n\n"
                      "<!-- demo report: end -->\n")
    page = SimpleNamespace(file=SimpleNamespace(src_uri="index.md"))
    monkeypatch.setattr(hooks, "README", readme)
    text = hooks.on_page_markdown("A\n<!-- the answer -->\nB\n<!-- how-to index -->\n", page,
                                  {"docs_dir": str(tmp_path)}, None)
    assert text == ("A\nanswer ![plot](demo/x.png)\nB\n| how to | what it does |\n|---|---|\n"
                    "| [First \\| one](howto/a-first.md) | Intro line one continued \\| here. |\n"
                    "| [Second](howto/b-second.md) | Does two things. |\n")
    other = SimpleNamespace(file=SimpleNamespace(src_uri="howto/a-first.md"))
    assert hooks.on_page_markdown("<!-- the answer -->", other, {"docs_dir": str(tmp_path)}, None) == "<!-- the answer -->"


def test_the_home_page_shows_the_answer_and_links_every_howto_page():
    from docsgen import hooks

    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert hooks.ANSWER in index and hooks.HOWTO_INDEX in index
    table = hooks.howto_index(ROOT / "docs")
    for path in (ROOT / "docs" / "howto").glob("*.md"):
        assert f"](howto/{path.name})" in table
    assert "#### The answer per task" in hooks.readme_answer(ROOT / "README.md")
