"""Results pasted into the README and the results pages come from the code and experiment of today's checkout.

Each pasted report carries the fingerprints of the code that computed its numbers and of its validated experiment
(pipeline/fingerprint.py). When either changed after the paste, the page is out of date: rerun the experiment and
paste its report again (each page says how).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline.experiment import load_experiment
from pipeline.readme_report import pasted_block
from pipeline.fingerprint import (LINE_START, code_fingerprint, config_fingerprint, fingerprint_line,
                                  pasted_fingerprints)

ROOT = Path(__file__).resolve().parent.parent
# (page, its block of pasted report, the experiment, the command that makes the report)
PASTES = [("README.md", "demo", "experiments/demo.yaml", "make demo"),
          ("README.md", "mechanism", "experiments/mechanism.yaml", "make mechanism"),
          ("docs/results/main-job.md", "demo", "experiments/demo.yaml", "make demo"),
          ("docs/results/paper-cpu.md", "demo", "experiments/paper_cpu.yaml", "make paper-cpu"),
          ("docs/results/mechanism.md", "demo", "experiments/mechanism.yaml", "make mechanism"),
          ("docs/results/privacy.md", "privacy", "experiments/privacy.yaml", "make privacy"),
          ("docs/results/privacy.md", "digits_privacy", "experiments/digits_privacy.yaml", "make privacy")]


@pytest.mark.parametrize("page, block, experiment, command", PASTES)
def test_each_pasted_answer_was_made_by_todays_code_and_experiment(page, block, experiment, command):
    pasted_text = pasted_block((ROOT / page).read_text(encoding="utf-8"), block)
    assert pasted_text is not None, f"{page} has no {block} report block: paste its report after `{command}`"
    pasted = pasted_fingerprints(pasted_text)
    assert pasted is not None, f"{page} carries no fingerprint line: paste its report again after `{command}`"
    today = (code_fingerprint(), config_fingerprint(load_experiment(ROOT / experiment)))
    assert pasted == today, (f"{page} was pasted from code {pasted[0]} and experiment {pasted[1]}; today's are "
                             f"{today[0]} and {today[1]}: rerun `{command}` and paste its report again "
                             f"({page} says how)")


def copy_of_the_code(to: Path) -> Path:
    for name in ("network", "pipeline", "utils", "losses.py"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, to / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, to / name)
    return to


def test_the_code_fingerprint_moves_with_numeric_code_only(tmp_path):
    root = copy_of_the_code(tmp_path)
    before = code_fingerprint(root)
    assert len(before) == 16 and before == code_fingerprint(root)  # the same files give the same fingerprint
    (root / "pipeline" / "executors.py").write_text("# plumbing: not a number of the report\n")
    assert code_fingerprint(root) == before
    aggregation = root / "network" / "aggregation.py"
    aggregation.write_text(aggregation.read_text() + "\n# one more line\n")
    assert code_fingerprint(root) != before
    aggregation.rename(root / "network" / "aggregation2.py")  # a renamed file is another tree, the same bytes
    moved = code_fingerprint(root)
    assert moved != before and moved != code_fingerprint(copy_of_the_code(tmp_path / "fresh"))


def test_the_experiment_fingerprint_ignores_key_order_and_sees_every_value():
    config = {"name": "demo", "federated": {"n_rounds": 22, "init_lr": 0.2}}
    reordered = {"federated": {"init_lr": 0.2, "n_rounds": 22}, "name": "demo"}
    assert config_fingerprint(config) == config_fingerprint(reordered)
    assert config_fingerprint(config) != config_fingerprint({**config, "federated": {"n_rounds": 23, "init_lr": 0.2}})


def test_the_line_is_read_back_from_a_page_and_a_page_without_it_has_none():
    line = fingerprint_line({"name": "x"})
    assert line.startswith(LINE_START)
    page = f"intro\n<!-- demo report: start -->\n{line}\n\n#### The answer\n"
    assert pasted_fingerprints(page) == (code_fingerprint(), config_fingerprint({"name": "x"}))
    assert pasted_fingerprints("no line here") is None


def test_the_command_prints_todays_line_and_refuses_a_missing_file(capsys, tmp_path):
    from pipeline import fingerprint_cli

    fingerprint_cli.main([str(ROOT / "experiments" / "demo.yaml")])
    assert capsys.readouterr().out == fingerprint_line(load_experiment(ROOT / "experiments" / "demo.yaml")) + "\n"
    with pytest.raises(Exception, match="does not exist"):
        fingerprint_cli.main([str(tmp_path / "missing.yaml")])
