"""The Fed-LT study report (issue 20): which split is each method's local model, the worst 10% of clients, the
universal and fine-tuned rows, the paired verdicts of the summary, and the study file that drives it."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from pipeline.studies.fed_lt import claim_lines, local_split, report_table, run_rows, write_report
from pipeline.studies.grid.runs import Partition, StudyRun, Variant
from pipeline.experiment import load_experiment as load_study

ROOT = Path(__file__).resolve().parent.parent


def metrics(path: Path, rows: list[tuple[str, str, str, float]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([(0, "test", "global", "top1", 0.0)] + [(3, *row) for row in rows],
                 columns=["round", "split", "client", "metric", "value"]).to_csv(path / "metrics.csv", index=False)
    return path


def run(algorithm: str, seed: int, **settings) -> StudyRun:
    return StudyRun(Partition("dirichlet_per_class", (("alpha", 0.5),)), 4, Variant(algorithm, tuple(settings.items())), seed)


def test_each_method_is_read_from_its_local_model_split():
    personal = pd.DataFrame({"split": ["test", "client_test", "client_test_personal"]})
    plain = pd.DataFrame({"split": ["test", "client_test", "client_test_finetuned"]})
    assert local_split("fedavg", plain) == "client_test" and local_split("fedloge", personal) == "client_test_personal"
    assert local_split("fedbabu", plain) == "client_test_finetuned"


def test_run_rows_take_the_final_round_worst_ten_percent_and_the_extra_rows(tmp_path):
    clients = [(f"c{index}", 0.1 * index) for index in range(1, 12)]  # 11 clients: worst 10% = the 2 lowest
    rows = [("test", "global", "top1", 0.7), ("test", "global", "top1_tail", 0.2),
            ("test", "model:universal", "top1", 0.6),
            *[("client_test_personal", client, "top1", value) for client, value in clients],
            *[("client_test_personal_masked", client, "top1", min(1.0, value + 0.1)) for client, value in clients],
            ("client_test_personal", "mean", "top1", 123.0)]  # summary rows are not clients
    fedloge = run_rows(run("fedloge", 0), metrics(tmp_path / "a", rows))
    main, universal = fedloge
    assert main["method"] == "fedloge" and main["global"] == 0.7 and main["global_tail"] == 0.2
    assert math.isnan(main["global_head"])
    assert main["local"] == pytest.approx(0.6) and main["local_worst10"] == pytest.approx(0.15)
    assert main["local_std"] == pytest.approx(pd.Series([v for _, v in clients]).std(ddof=0))
    assert main["local_masked_worst10"] == pytest.approx(0.25)
    assert universal["method"] == "fedloge (universal)" and universal["global"] == 0.6 and math.isnan(universal["local"])
    fedavg = run_rows(run("fedavg", 0), metrics(tmp_path / "b", [("test", "global", "top1", 0.5),
                                                                 ("client_test", "c1", "top1", 0.4),
                                                                 ("client_test_finetuned", "c1", "top1", 0.9)]))
    assert [row["method"] for row in fedavg] == ["fedavg", "fedavg+ft"]
    assert fedavg[0]["local"] == 0.4 and fedavg[1]["local"] == 0.9 and fedavg[1]["global"] == 0.5


def test_the_summary_verdicts_are_paired_by_seed():
    runs = pd.DataFrame([
        {"partition": "p", "method": method, "seed": seed, "global": value, "local": local, "local_masked": local}
        for method, values, locals_ in (("fedloge-etf_steps20", (0.60, 0.62, 0.64), (0.80, 0.70, 0.90)),
                                         ("fedavg", (0.50, 0.53, 0.54), (0.81, 0.69, 0.91)),
                                         ("fedrod", (0.61, 0.60, 0.70), (0.70, 0.60, 0.80)))
        for seed, value, local in zip(range(3), values, locals_)])
    lines = claim_lines(runs)
    # Global: vs fedavg the differences are +0.10, +0.09, +0.10 (interval above 0); vs fedrod −0.01, +0.02, −0.06.
    assert lines[0].startswith("- p, fedloge-etf_steps20, global accuracy: **not shown**: no clear difference from "
                               "fedrod") and "better than fedavg (+9.7 pts" in lines[0]
    # Local: vs fedrod exactly +0.10 each seed (zero variance: undecided, utils/statistics.py); vs fedavg −0.01, +0.01, −0.01.
    assert "**not shown**" in lines[1] and "fedrod (+10.0 pts; undecided: zero variance" in lines[1]
    assert "better than" not in lines[1]
    table = report_table(runs.assign(**{column: float("nan") for column in
                                        ("global_head", "global_middle", "global_tail", "global_many", "global_medium",
                                         "global_few", "local_std", "local_worst10", "local_masked_std",
                                         "local_masked_worst10")}))
    assert table.set_index("method").loc["fedavg", "global_mean"] == pytest.approx(0.52333333)


def test_the_embedded_study_file_is_valid_and_asks_for_the_protocol():
    config = load_study(ROOT / "experiments" / "digits_lt_fedloge.yaml")
    assert config["study"] == "fed_lt" and config["federated"]["local_test"] == "proportional"
    assert config["data"]["imbalance_factor"] == 0.1
    from pipeline.studies.grid.runs import study_runs

    methods = {"fedloge", "fedrod", "fedbabu", "fedavg", "fedprox", "ditto", "fedrep", "ccvr"}
    assert {run.variant.algorithm for run in study_runs(config)} == methods
    for name in ("cifar10_lt_fedloge", "cifar100_lt_fedloge"):
        study = load_study(ROOT / "experiments" / f"{name}.yaml")
        assert study["federated"]["n_clients"] == 40 and {run.variant.algorithm for run in study_runs(study)} == methods


def test_write_report_writes_the_tables_and_the_summary(tmp_path):
    run_dirs = {}
    for seed in range(3):
        for algorithm, value in (("fedloge", 0.7 + seed / 100), ("fedavg", 0.5 + seed % 2 / 100)):
            run_dirs[run(algorithm, seed)] = metrics(tmp_path / f"{algorithm}{seed}", [
                ("test", "global", "top1", value), ("test", "model:universal", "top1", 0.6),
                ("client_test_personal" if algorithm == "fedloge" else "client_test", "c1", "top1", value)])
    config = {"name": "t", "task": "digit_class", "seeds": [0, 1, 2], "data": {"source": "digits", "imbalance_factor": 0.1},
              "federated": {"n_clients": 2, "client_fraction": 1.0, "local_test": "proportional", "finetune_steps": 0}}
    write_report(config, tmp_path, run_dirs, {}, "cmd")
    text = (tmp_path / "report.md").read_text()
    assert "global accuracy: **holds**" in text and "| dirichlet_per_class-a0.5 | fedloge (universal) | 60.0" in text
