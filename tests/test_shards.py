"""A grid split over processes without a cluster (pipeline/shards.py, ``run_pipeline.py --shard i/n``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import run_pipeline
from pipeline.pool import PoolStage
from pipeline.shards import Shard
from steps import federated as step4
from steps import meter as step3c
from tests.test_study import tiny_study
from utils.errors import TaskHetError
from utils.locks import STAGE_LOCK
from utils.stages import is_done, run_stage

ROOT = Path(__file__).resolve().parent.parent


def stages(scripts: str) -> list[PoolStage]:
    """One stage per letter: r a step-4 run, m a step-3c reading (named by their position)."""
    scripts_of = {"r": step4.__name__, "m": step3c.__name__}
    return [PoolStage(str(index), Path(str(index)), {}, [], scripts_of[letter]) for index, letter in enumerate(scripts)]


def names(selected: list[PoolStage]) -> list[str]:
    return [stage.name for stage in selected]


def test_a_shard_takes_every_nth_run_and_every_other_stage():
    grid = stages("mrrmrrrr")  # runs at positions 1, 2, 4, 5, 6, 7; readings at 0 and 3
    assert names(Shard(0, 3).share(grid)) == ["0", "1", "3", "5"]  # runs 0 and 3 of the six, and both readings
    assert names(Shard(1, 3).share(grid)) == ["0", "2", "3", "6"]
    assert names(Shard(2, 3).share(grid)) == ["0", "3", "4", "7"]
    assert names(Shard(0, 1).share(grid)) == names(grid)  # one shard: everything
    assert names(Shard(5, 8).share(grid)) == ["0", "3", "7"]  # more shards than runs: shard 5 gets the sixth run
    assert names(Shard(6, 8).share(grid)) == ["0", "3"]  # and shard 6 none
    runs = [stage for stage in grid if stage.script == step4.__name__]
    shares = [[stage for stage in Shard(i, 4).share(grid) if stage.script == step4.__name__] for i in range(4)]
    assert sorted(map(id, sum(shares, []))) == sorted(map(id, runs))  # every run in exactly one shard


@pytest.mark.parametrize("text, message", [("3/2", "0 <= i < n, got 3/2"), ("0/0", "1 <= n"), ("-1/2", "i/n"),
                                           ("1/2/3", "i/n"), ("1", "i/n"), ("١/٢", "i/n"), ("", "i/n")])
def test_a_bad_shard_is_one_line_naming_the_flag(text, message):
    with pytest.raises(TaskHetError, match=message):
        Shard.parse(text)


def test_a_second_process_at_a_running_stage_waits_for_it_then_skips_it(tmp_path):
    """Two callers of one stage: the second waits on the stage lock while the first runs, then finds it done."""
    stage_dir, started, release, calls, results = tmp_path / "stage", threading.Event(), threading.Event(), [], {}

    def work():
        calls.append(1)
        started.set()
        release.wait(10)
        (stage_dir / "out.txt").write_text("done")

    first = threading.Thread(target=lambda: results.setdefault("first", run_stage(stage_dir, {}, work)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: results.setdefault("second", run_stage(stage_dir, {}, work)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and "second" not in results  # it waits: the first holds the stage
    release.set()
    first.join(10)
    second.join(10)
    assert results == {"first": True, "second": False} and calls == [1] and is_done(stage_dir)
    assert (stage_dir / STAGE_LOCK).exists() and "stage-lock" not in (stage_dir / "stage.json").read_text()


@pytest.mark.slow
def test_shards_at_once_on_one_folder_equal_one_process_byte_for_byte(tmp_path):
    config = tiny_study(tmp_path)
    config["seeds"] = [0]
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(config))
    flags = ["--no-run_plots", "--threads", "1", "--no-progress"]
    run_pipeline.main([str(study), "--results", str(tmp_path / "one"), *flags])
    shards = [subprocess.Popen([sys.executable, "run_pipeline.py", str(study), "--results", str(tmp_path / "split"),
                                *flags, "--shard", f"{index}/2"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for index in range(2)]
    outputs = [shard.communicate(timeout=300)[0] for shard in shards]
    assert [shard.returncode for shard in shards] == [0, 0], outputs
    split = tmp_path / "split" / "tinystudy"
    assert not (split / "report.csv").exists()  # a shard writes no report
    assert all("its runs are done" in output for output in outputs)
    runs = [int(line.split(" of ")[1].split(" ")[0]) for output in outputs for line in output.splitlines()
            if line.startswith("run 1 of ")]
    assert sorted(runs) == [2, 3]  # the 5 runs split 3 + 2
    run_pipeline.main([str(study), "--results", str(tmp_path / "split"), *flags])  # the final call: the report
    one = tmp_path / "one" / "tinystudy"
    files = sorted(path.relative_to(one) for pattern in ("**/metrics.csv", "**/clients.csv", "**/assignments.csv",
                                                         "report.csv", "**/best.pt") for path in one.glob(pattern))
    assert len(files) > 10
    for name in files:
        assert (split / name).read_bytes() == (one / name).read_bytes(), name
    assert sorted(path.name for path in split.rglob("stage.json")) == sorted(path.name for path in one.rglob("stage.json"))
