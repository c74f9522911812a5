"""The mechanism study (pipeline/studies/main_job/mechanism.py and mechanism_report.py): its file's checks, its report on hand-made rows, and a tiny
run whose rows must be each setting's own main-job answers, with the stages the settings share run once."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

import run_pipeline
from pipeline.experiment import load_experiment
from pipeline.studies.main_job import mechanism
from pipeline.studies.main_job import mechanism_report as report
from pipeline.studies.main_job.paper import CONSISTENT, NO_EFFECT, SMALLER, UNDECIDED
from tests.test_pipeline import three_seed_edges
from utils.errors import TaskHetError


def mechanism_file(tmp_path: Path, knobs: list | None = None, base: dict | None = None) -> Path:
    base = base or three_seed_edges(tmp_path)
    base["partition"].update(groupings=["label_based", "embedding_based", "property_based"], iid_reference=True)
    config = {"study": "mechanism", "name": "knobs", "base": base,
              "knobs": knobs if knobs is not None else [
                  {"name": "local steps", "base_level": 2, "levels": [{"label": "4", "set": ["federated.local_steps=4"]}]},
                  {"name": "decoder width", "base_level": "default", "levels": [{"label": "8", "set": ["model.decoder_width=8"]}]}]}
    path = tmp_path / "mechanism.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_every_setting_is_validated_as_the_main_job_it_runs(tmp_path):
    config = load_experiment(mechanism_file(tmp_path))
    assert [setting["slug"] for setting in config["settings"]] == ["base", "local_steps-4", "decoder_width-8"]
    base, steps, width = (setting["config"] for setting in config["settings"])
    assert (base["federated"]["local_steps"], steps["federated"]["local_steps"], width["federated"]["local_steps"]) == (2, 4, 2)
    assert width["model"]["decoder_width"] == 8 and base["model"]["decoder_width"] is None
    assert config["knobs"][0]["base_level"] == "2"  # a YAML number is a level's label too


@pytest.mark.parametrize("knobs, message", [
    ([], "knobs must list at least one knob"),
    ([{"name": "x", "levels": [{"label": "a", "set": ["seeds=[0,1,2]"]}]}], r"knobs\[0\] lacks base_level"),
    ([{"name": "x", "base_level": "1", "levels": [{"label": "a", "set": ["federated.local_step=4"]}]}],
     r"knobs\[0\] \(x\), level a: .*federated.local_step"),
    ([{"name": "x", "base_level": "1", "levels": [{"label": "a", "set": ["federated.local_steps=0"]}]}],
     r"knobs\[0\] \(x\), level a: .*federated.local_steps"),
    ([{"name": "x", "base_level": "1", "levels": [{"label": "1", "set": ["federated.local_steps=3"]}]}],
     r"knobs\[0\].levels\[0\].label '1' repeats a level"),
    ([{"name": "x", "base_level": "1", "levels": [{"label": "a", "set": []}]}], r"knobs\[0\].levels\[0\].set must list"),
    ([{"name": "x", "base_level": "1", "levels": [{"label": "a", "set": ["federated.local_steps=3"]}]},
      {"name": "x", "base_level": "1", "levels": [{"label": "b", "set": ["federated.local_steps=5"]}]}], "names a knob twice"),
    ([{"name": "X!", "base_level": "1", "levels": [{"label": "a", "set": ["federated.local_steps=3"]}]},
      {"name": "x", "base_level": "1", "levels": [{"label": "A", "set": ["federated.local_steps=5"]}]}],
     "two settings share the folder name 'x-a'"),
    ([{"name": "x", "base_level": "1", "levels": [{"label": "a", "set": ["use_accelerator=true"]}]}], "sets use_accelerator"),
])
def test_a_bad_knob_is_one_error_naming_it(tmp_path, knobs, message):
    path = mechanism_file(tmp_path, knobs)
    with pytest.raises(TaskHetError, match=message):
        load_experiment(path)
    with pytest.raises(TaskHetError):
        run_pipeline.main([str(path), "--results", str(tmp_path / "results")])
    assert not (tmp_path / "results").exists()


def test_the_settings_together_meet_the_run_limit(tmp_path, monkeypatch):
    from pipeline import sections

    # 3 settings x (3 groupings + iid) x 3 seeds = 36 runs: a limit of 35 refuses the map, 36 lets it through
    monkeypatch.setattr(sections, "MAX_RUNS", 35)
    with pytest.raises(TaskHetError, match="asks for 36 federated runs"):
        load_experiment(mechanism_file(tmp_path))
    monkeypatch.setattr(sections, "MAX_RUNS", 36)
    assert len(load_experiment(mechanism_file(tmp_path))["settings"]) == 3


def test_a_bad_base_names_the_key(tmp_path):
    base = three_seed_edges(tmp_path)
    base["federated"]["n_round"] = 3
    with pytest.raises(TaskHetError, match="base: .*federated.n_round"):
        load_experiment(mechanism_file(tmp_path, base=base))


def hand_rows() -> pd.DataFrame:
    """A hand-made map: the base and two knob levels; p-values chosen so Benjamini–Hochberg over the 3 rows keeps
    exactly the rows with adjusted p <= 0.05 (sorted 0.01, 0.04, 0.5: adjusted 0.03, 0.06, 0.5)."""
    def row(knob, level, change, low, high, p, verdict, control="not detected", role="headline"):
        return {"knob": knob, "level": level, "setting": mechanism.setting_slug(knob, level), "task": "edge_texture",
                "algorithm": "fedavg", "role": role, "paper_percent": 60.0, "n_seeds": 3, "change_percent": change, "change_low": low,
                "change_high": high, "change_p": p, "detectable_percent": 5.0, "verdict": verdict,
                "decided_after_bh_map": False, "control_percent": 1.0, "control_low": -1.0, "control_high": 3.0,
                "control_verdict": control, "iid_above_reference_percent": 50.0, "iid_low": 40.0, "iid_high": 60.0}
    return pd.DataFrame([row("base", "base", 1.0, -2.0, 4.0, 0.5, NO_EFFECT),
                         row("local steps", "50", 8.0, 2.0, 14.0, 0.01, SMALLER, control="detected: worse"),
                         row("decoder width", "96", 3.0, 0.1, 5.9, 0.04, SMALLER)], columns=report.REPORT_COLUMNS)


def test_the_map_adjusts_over_all_its_rows_and_says_where_the_penalty_appears():
    table = hand_rows()
    # decoder width's p = 0.04 is decided alone but not after BH over the map (0.04 x 3 / 2 = 0.06)
    assert report.decided_after_bh(table) == [False, True, False]
    table["decided_after_bh_map"] = report.decided_after_bh(table)
    assert report.conclusion(table) == ("On this data the embedding-based penalty appears when local steps = 50 "
                                           "(edge_texture, fedavg: +8.0% [+2.0%, +14.0%]); under the other settings it "
                                           "does not.")
    assert report.control_sentence(table) == "The positive control was detected in 1 of its 3 rows: local steps = 50."
    nowhere = table.assign(verdict=[NO_EFFECT, UNDECIDED, CONSISTENT], decided_after_bh_map=[False, False, False])
    assert report.conclusion(nowhere).startswith("On this data the embedding-based penalty appears under none of "
                                                    "these settings (the base and 2 knob(s) moved alone: local steps, "
                                                    "decoder width)")
    assert report.control_sentence(table.assign(control_verdict="not run")).startswith("No setting ran")
    # a task that did not learn at a setting says nothing there, even decided after the adjustment
    silent = table.assign(role=["headline", "did not learn: centralized 0.02 is not 5% below zeros 0.02", "headline"])
    assert report.conclusion(silent) == (
        "On this data the embedding-based penalty appears under none of these settings (the base and 2 knob(s) moved "
        "alone: local steps, decoder width): no change is decided above 0 after Benjamini–Hochberg over the map; "
        "local steps = 50 (edge_texture did not learn): that setting says nothing.")
    assert "| local steps | 50 | edge_texture (did not learn) | fedavg | +8.0% [+2.0%, +14.0%] | ≥ 5.0% |" in (
        report.map_markdown(silent))


@pytest.mark.slow
def test_a_tiny_map_reads_each_settings_own_answer_and_shares_stages(tmp_path):
    base = three_seed_edges(tmp_path)
    del base["run_plots"]  # the flag below must reach every setting: by default each run draws its curves
    path = mechanism_file(tmp_path, base=base)
    results = tmp_path / "results"
    run_pipeline.main([str(path), "--results", str(results), "--threads", "1", "--no-run_plots"])
    out = results / "knobs"
    table = pd.read_csv(out / "report.csv")
    assert list(table["setting"]) == ["base", "local_steps-4", "decoder_width-8"]
    for row in table.itertuples(index=False):  # each row is its setting's own main-job answer, control and iid check
        own = pd.read_csv(out / "settings" / row.setting / "report_paper.csv").query("model == 'global'").iloc[0]
        control = pd.read_csv(out / "settings" / row.setting / "report_control.csv").query("model == 'global'").iloc[0]
        iid = pd.read_csv(out / "settings" / row.setting / "report_iid.csv").iloc[0]
        assert (row.change_percent, row.change_low, row.verdict) == (own.change_percent, own.change_low, own.verdict)
        assert (row.control_percent, row.control_verdict) == (control.change_percent, control.verdict)
        assert row.iid_above_reference_percent == iid.above_centralized_percent and row.paper_percent == 60.0
        assert row.role == own.role
    # the local-steps level changes step 4 only: it reuses the base's 3 centralized models and clusters; the decoder
    # width trains 3 models of its own
    assert len(list((out / "centralized").iterdir())) == 6 and len(list((out / "embeddings").iterdir())) == 6
    text = (out / "report.md").read_text()
    assert report.conclusion(table) in text and "![the change per knob level](mechanism.png)" in text
    assert (out / "mechanism.png").stat().st_size > 10_000 and (out / "config.json").is_file()
    losses = pd.read_csv(out / "report_losses.csv")  # each setting's per-α losses, as its own report.csv has them
    assert list(losses["setting"]) == ["base", "local_steps-4", "decoder_width-8"]
    for row in losses.itertuples(index=False):
        own = pd.read_csv(out / "settings" / row.setting / "report.csv").iloc[0]
        assert (row.label_loss_mean, row.embedding_loss_std, row.trivial_zero_loss) == (
            own.label_loss_mean, own.embedding_loss_std, own.trivial_zero_loss)
    assert (out / "losses.png").stat().st_size > 10_000 and "![the losses per setting](losses.png)" in text
    assert "setting 3 of 3 done" in (out / "run.log").read_text()
    assert list((out / "federated").rglob("metrics.csv")) and not list((out / "federated").rglob("curves.png"))
    assert not math.isnan(table["detectable_percent"].iloc[0])


def test_a_task_that_did_not_learn_is_marked_on_its_own_panel_only(tmp_path, figures):
    """Panels are per algorithm × task: keypoints2d did not learn at ε = 50, edges did; only keypoints' panel says so."""
    rows = [{"knob": knob, "level": level, "task": task, "algorithm": "fedavg", "paper_percent": 60.0,
             "role": "did not learn: ..." if (task, level) == ("keypoints2d", "50") else "headline",
             "change_percent": 1.0, "change_low": 0.0, "change_high": 2.0, "control_percent": 1.0, "control_low": 0.0,
             "control_high": 2.0} for knob, level in (("base", "base"), ("privacy", "50"))
            for task in ("edge_texture", "keypoints2d")]
    report.plot_map(pd.DataFrame(rows), tmp_path / "map.png")
    edges, keypoints = figures[0].axes[:2]
    assert [tick.get_text() for tick in edges.get_xticklabels()] == ["base", "privacy\n= 50"]
    assert [tick.get_text() for tick in keypoints.get_xticklabels()] == ["base", "privacy\n= 50\n(did not learn)"]
