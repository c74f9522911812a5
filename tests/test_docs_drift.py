"""Docs and help that had drifted from the code: each is checked against its source of truth."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
STEP_MODULES = ["render", "select_scenes", "select_cifar", "select_digits", "train_centralized", "search_centralized",
                "embed", "assign", "meter", "explain", "federated", "merge", "download"]


def _flat(text: str) -> str:
    return " ".join(text.split())


TUTORIAL = "docs/tutorials/main-job.md"  # the page that says what `make demo` runs


def _number(pattern: str, text: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match, f"{TUTORIAL} no longer says {pattern!r}; update this test with the page"
    return match.groups()


def test_the_tutorial_describes_the_demo_file_it_runs():
    readme = _flat((ROOT / TUTORIAL).read_text())
    demo = yaml.safe_load((ROOT / "experiments" / "demo.yaml").read_text())
    synthetic, federated, partition = demo["data"]["synthetic"], demo["federated"], demo["partition"]
    # "The whole job from one file": the paragraph about make demo
    buildings, classes, per_class, views = _number(r"renders (\d+) synthetic buildings \((\d+) scene classes × (\d+)\) × (\d+) views",
                                                   readme)
    assert int(buildings) == synthetic["n_buildings"] and int(views) == synthetic["n_views"]
    assert int(classes) == demo["data"]["top_k_classes"] and int(classes) * int(per_class) == synthetic["n_buildings"]
    from pipeline.experiment import load_experiment
    from pipeline.studies.main_job.config import count_combinations

    n_runs = count_combinations(load_experiment(ROOT / "experiments" / "demo.yaml"))  # the control's α included
    algorithms, seeds, runs = _number(r"× (\d+) algorithms × (\d+) seeds \((\d+) federated runs\)", readme)
    assert (int(algorithms), int(seeds), int(runs)) == (len(federated["algorithms"]), len(demo["seeds"]), n_runs)
    tasks = _number(r"runs (\d+) tasks \(([a-z0-9_, ]+)\)", readme)
    assert int(tasks[0]) == len(demo["tasks"]) and tasks[1].split(", ") == demo["tasks"]
    # the list of shipped experiment files: the experiments/demo.yaml bullet
    bullet = readme[readme.index("`experiments/demo.yaml`: "):][:700]
    assert int(_number(r"^`experiments/demo.yaml`: (\d+) synthetic buildings", bullet)[0]) == synthetic["n_buildings"]
    clients, sampled = _number(r"(\d+) clients \((\d+) sampled per round\)", bullet)
    assert int(clients) == partition["n_clients"] and int(sampled) == round(federated["client_fraction"] * int(clients))
    rounds, steps = _number(r"(\d+) rounds × (\d+) local SGD steps", bullet)
    assert (int(rounds), int(steps)) == (federated["n_rounds"], federated["local_steps"])
    momentum, lr, batch, kp_rounds = _number(r"\(momentum ([\d.]+), lr ([\d.]+), batch (\d+); keypoints2d (\d+) rounds", bullet)
    assert int(kp_rounds) == federated["per_task"]["keypoints2d"]["n_rounds"]
    assert (float(momentum), float(lr), int(batch)) == (federated["momentum"], federated["init_lr"], federated["batch_size"])
    # the experiments/paper_cpu.yaml bullet: its tasks' rounds and its run count
    paper = yaml.safe_load((ROOT / "experiments" / "paper_cpu.yaml").read_text())
    paper_bullet = readme[readme.index("`experiments/paper_cpu.yaml` (`make paper-cpu`): "):][:700]
    per_task = paper["federated"]["per_task"]
    rounds = _number(r"edge_texture (\d+) rounds, keypoints2d (\d+) rounds,\s+normal (\d+) through", paper_bullet)
    assert [int(value) for value in rounds] == [per_task[task]["n_rounds"] for task in ("edge_texture", "keypoints2d", "normal")]
    assert sorted(paper["tasks"]) == sorted(task for task in per_task if task in paper_bullet)
    paper_runs = count_combinations(load_experiment(ROOT / "experiments" / "paper_cpu.yaml"))
    assert int(_number(r"(\d+) federated runs", paper_bullet)[0]) == paper_runs
    assert ("client_tests: test_split" in bullet) == (partition.get("client_tests") == "test_split")
    width, size = _number(r"decoder width (\d+)\) at (\d+) px", bullet)
    assert (int(width), int(size)) == (demo["model"]["decoder_width"], demo["model"]["image_size"])
    alphas = _number(r"α ∈ \{([\d., ]+)\} plus iid", bullet)[0]
    assert [float(value) for value in alphas.split(", ")] == partition["alphas"]
    assert int(_number(r"(\d+) seeds\. Its comments", bullet)[0]) == len(demo["seeds"])


def test_weights_help_names_every_encoders_weights():
    from models.encoders import build_encoder, list_encoders

    names = set()
    for encoder in list_encoders():
        names |= set(build_encoder(encoder, "none").pretrained)
    assert "dino" in names
    for module, flag in (("train_centralized", "--weights"), ("federated", "--weights")):
        parser = importlib.import_module(f"steps.{module}").build_parser()
        help_text = next(action.help for action in parser._actions if flag in action.option_strings)
        offered = set(re.findall(r"[a-z_]+", help_text.split("(")[0]))
        assert names <= offered, f"steps/{module}.py {flag} help lacks {sorted(names - offered)}"


@pytest.mark.parametrize("name", STEP_MODULES)
def test_help_never_states_a_default_twice(name):
    text = _flat(importlib.import_module(f"steps.{name}").build_parser().format_help())
    assert not re.search(r"\(default: [^)]*\) \(default:", text), re.search(r".{60}\(default: [^)]*\) \(default:.{20}", text)


def test_the_flower_app_help_names_itself(capsys):
    from network.flower.app import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m network.flower.app") and "test_fed.py's flags" in _flat(out)


DOCUMENTS = ["README.md", "CHANGELOG.md", *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_image_a_document_shows_is_in_the_repository(document):
    # The README once linked the demo's plots under /tmp, a folder nobody else has (readme_report --images fixes it);
    # the documentation site's strict build checks its pages too, this test also the README and the changelog.
    path = ROOT / document
    links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", path.read_text())
    missing = [link for link in links if link.startswith("/") or not (path.parent / link).is_file()]
    assert not missing, f"{document} shows images that are not in the repository: {missing}"


THREAD_PAGES = ["docs/reference/outputs.md", "docs/tutorials/main-job.md"]


@pytest.mark.parametrize("page", THREAD_PAGES)
def test_the_thread_default_the_docs_name_is_the_codes(page):
    # Two pages once said the default was one thread per core (torch's own choice), while every --help says 1.
    from utils.cli import DEFAULT_THREADS

    text = _flat((ROOT / page).read_text())
    assert DEFAULT_THREADS == 1, "the pages below say one thread: update them with utils/cli.py DEFAULT_THREADS"
    assert not re.search(r"default[^.;]{0,30}one thread per core", text), page
    said = {"docs/reference/outputs.md": "The default is 1, as every `--help` says",
            "docs/tutorials/main-job.md": "One torch thread per step, the default every step's `--help` names"}[page]
    assert said in text
    steps_help = _flat(importlib.import_module("steps.federated").build_parser().format_help())
    assert f"torch CPU threads of this step (default: {DEFAULT_THREADS})" in steps_help


def test_every_experiment_key_says_what_it_does():
    from pipeline.studies import get_study, list_studies

    for name in list_studies():
        kind = get_study(name)
        assert set(kind.help) == set(kind.types), (name, set(kind.help) ^ set(kind.types))
        empty = [key for key, text in kind.help.items() if not isinstance(text, str) or len(text.split()) < 3]
        assert not empty, (name, empty)


def test_the_experiment_key_page_prints_each_keys_help_and_a_key_without_one_stops_it(monkeypatch):
    import dataclasses

    from docsgen import experiment_keys
    from pipeline.studies import get_study

    page = experiment_keys.page()  # Markdown escapes "[", "]" and "_" outside code spans
    assert ("| `federated.n_rounds` | `10` | integer in \\[1, 10,000\\] | step 4: federated rounds of every run |"
            in page)
    assert "| `use_accelerator` | `true` | true or false | use CUDA or MPS where present (false: the CPU only) |" in page
    assert ("| `federated.init_from` | `scratch` | one of scratch, centralized | the federated runs' starting model: "
            "scratch (untrained) or centralized (step 2's model) |") in page
    kind = get_study("fed_lt")
    bare = dataclasses.replace(kind, help={key: text for key, text in kind.help.items() if key != "task"})
    monkeypatch.setattr(experiment_keys, "study_kinds", lambda: {"fed_lt": bare})
    with pytest.raises(RuntimeError, match="study kind 'fed_lt' has no help for its key 'task'"):
        experiment_keys.page()
