"""Nothing half-done looks finished (issue 13, root 5): atomic rewrites, stale temporaries, verified stages."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from utils.stages import MARKER, is_done, run_stage
from utils import run_dir
from utils.run_dir import TEMP_PREFIX, TEMP_SUFFIX, MetricsCSV, atomic_write_text


def test_a_kill_during_the_metrics_rewrite_loses_no_rows(tmp_path, monkeypatch):
    metrics = MetricsCSV(tmp_path / "metrics.csv", ["round", "value"])
    metrics.write([{"round": r, "value": float(r)} for r in range(5)])
    before = (tmp_path / "metrics.csv").read_bytes()

    def killed(source, target):
        raise KeyboardInterrupt("kill -9 between writing and renaming")

    monkeypatch.setattr(run_dir.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        metrics.truncate_after("round", 2)
    assert (tmp_path / "metrics.csv").read_bytes() == before
    monkeypatch.undo()
    metrics.truncate_after("round", 2)
    assert list(pd.read_csv(tmp_path / "metrics.csv")["round"]) == [0, 1, 2]
    assert not list(tmp_path.glob(f"{TEMP_PREFIX}*"))


def test_stray_temporaries_are_gone_after_a_resume(tmp_path):
    from tests.test_engine import make_engine

    make_engine(tmp_path, "fedavg", rounds=2).run()
    stray = [tmp_path / f"{TEMP_PREFIX}abc{TEMP_SUFFIX}", tmp_path / "client_states" / f"{TEMP_PREFIX}x{TEMP_SUFFIX}"]
    for path in stray:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"\0" * 1024)
    keep = tmp_path / "notes.tmp"  # not ours: never touched
    keep.write_text("mine")
    make_engine(tmp_path, "fedavg", rounds=3).run()
    assert not any(path.exists() for path in stray) and keep.exists()


def test_a_finished_stage_whose_output_was_deleted_or_truncated_is_redone(tmp_path):
    calls = []

    def work():
        calls.append(1)
        atomic_write_text(tmp_path / "stage" / "best.pt", "weights" * 10)
        (tmp_path / "stage" / "metrics.csv").write_text("round,value\n0,1.0\n")

    assert run_stage(tmp_path / "stage", {"a": 1}, work) and is_done(tmp_path / "stage")
    assert not run_stage(tmp_path / "stage", {"a": 1}, work) and len(calls) == 1
    recorded = json.loads((tmp_path / "stage" / MARKER).read_text())["outputs"]
    assert recorded == {"best.pt": 70, "metrics.csv": 18}
    os.remove(tmp_path / "stage" / "best.pt")
    assert not is_done(tmp_path / "stage")
    assert run_stage(tmp_path / "stage", {"a": 1}, work) and len(calls) == 2
    (tmp_path / "stage" / "metrics.csv").write_text("round,value\n")  # truncated
    assert not is_done(tmp_path / "stage")
    (tmp_path / "stage" / MARKER).write_text(json.dumps({"params": {"a": 1}}))  # an old-format marker
    assert not is_done(tmp_path / "stage")


def test_a_checkpoint_s_bytes_depend_on_its_content_only(tmp_path):
    """Issue 19 item 13: torch.save named the archive after the random temp file, so equal states gave other bytes."""
    import zipfile

    import torch

    from utils.run_dir import atomic_torch_save

    state = {"model": {"weight": torch.arange(6.0).reshape(2, 3), "steps": torch.tensor(4)}, "epoch": 3}
    atomic_torch_save(state, tmp_path / "a" / "best.pt")
    atomic_torch_save({"model": {key: value.clone() for key, value in state["model"].items()}, "epoch": 3},
                      tmp_path / "b" / "other_name.pt")
    assert (tmp_path / "a" / "best.pt").read_bytes() == (tmp_path / "b" / "other_name.pt").read_bytes()
    assert {name.split("/")[0] for name in zipfile.ZipFile(tmp_path / "a" / "best.pt").namelist()} == {"archive"}
    loaded = torch.load(tmp_path / "b" / "other_name.pt", weights_only=True)
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"]) and loaded["epoch"] == 3
