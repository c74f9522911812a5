"""The pool's one-line summary of what it is about to run (printed and logged before the grid starts)."""

from pathlib import Path

import pytest

import steps.train_centralized
from pipeline.pool import STEP2, PoolStage, stage_counts
from steps import federated, meter


def stages(models: int, readings: int, runs: int) -> list[PoolStage]:
    scripts = [STEP2] * models + [meter.__name__] * readings + [federated.__name__] * runs
    return [PoolStage(f"s{index}", Path(f"s{index}"), {}, [], script=script) for index, script in enumerate(scripts)]


@pytest.mark.parametrize("models, readings, runs, text", [
    (0, 0, 216, "step 4: 216 runs"),
    (0, 48, 216, "step 3c: 48 readings; step 4: 216 runs"),
    (4, 0, 0, "step 2: 4 models"),
    (1, 1, 1, "step 2: 1 model; step 3c: 1 reading; step 4: 1 run"),
    (0, 0, 0, "step 4: 0 runs"),
])
def test_each_kind_is_counted_apart(models, readings, runs, text):
    assert stage_counts(stages(models, readings, runs)) == text


def test_step_2_is_named_as_its_module_is():
    # The pool names step 2 by its module (importing it would load accelerate into every pool's fork server).
    assert STEP2 == steps.train_centralized.__name__
