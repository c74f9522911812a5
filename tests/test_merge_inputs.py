"""merge_task_vectors.py's inputs (issue 19 item 8, issue 24): finite λ, one name per model, matching checkpoints,
INCOMPLETE while it works, each entry in its own dtype, and --run on a digits sparse_ft run by default."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

import test_fed
from sparse.merge import choose_lambda, merge, task_vector
from steps import assign as step3b
from steps import select as step1
from steps.merge import main, run_merge
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.loaders import INCOMPLETE


def two_models(tmp_path):
    base = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    tuned = {"w": torch.tensor([2.0, 2.0]), "b": torch.tensor([0.0])}
    torch.save(base, tmp_path / "base.pt")
    torch.save(tuned, tmp_path / "tuned.pt")
    return tmp_path / "base.pt", tmp_path / "tuned.pt"


@pytest.mark.parametrize("flags, message", [
    (["--lam", "nan"], r"--lam: must be a number in \[-100, 100\], got 'nan'"),
    (["--lam", "inf"], r"--lam: must be a number in \[-100, 100\], got 'inf'"),
    (["--lam=-inf"], r"--lam: must be a number in \[-100, 100\], got '-inf'"),
    (["--lam", "1e200"], r"--lam: must be a number in \[-100, 100\], got '1e200'"),
])
def test_a_non_finite_lam_is_refused_and_nothing_is_written(tmp_path, flags, message):
    base, tuned = two_models(tmp_path)
    with pytest.raises(TaskHetError, match=message):
        main(["--base", str(base), "--finetuned", f"a={tuned}", *flags, "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("text, bad", [("0,nan,1", "nan"), ("0,inf", "inf"), ("-inf,0.5", "-inf"), ("0,1e200", "1e200"),
                                       ("0,٣", "٣")])
def test_a_non_finite_lambdas_item_is_refused_naming_it(tmp_path, text, bad):
    with pytest.raises(TaskHetError, match=rf"--lambdas must hold numbers in \[-100, 100\], got {bad} in"):
        main(["--run", str(tmp_path / "no_run"), f"--lambdas={text}", "--out", str(tmp_path / "m")])
    with pytest.raises(TaskHetError, match="--lambdas repeats a value"):
        main(["--run", str(tmp_path / "no_run"), "--lambdas", "0,0.5,0.50", "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


def test_the_library_refuses_a_non_finite_lambda():
    base = {"w": torch.zeros(2)}
    vectors = [{"w": torch.ones(2)}]
    for lam in (math.nan, math.inf, -math.inf):
        with pytest.raises(TaskHetError, match="must be a finite number"):
            merge(base, vectors, lam)
        with pytest.raises(TaskHetError, match="must be a finite number"):
            choose_lambda(base, vectors, lambda weights: 0.0, [0.0, lam])
        with pytest.raises(TaskHetError, match="must be a finite number"):
            run_merge(base, {"a": {"w": torch.ones(2)}}, "unused", [lam])


def test_the_search_never_picks_a_nan_or_infinite_loss_over_a_finite_one():
    base = {"w": torch.zeros(1)}
    vectors = [{"w": torch.ones(1)}]
    # loss by λ (read off the merged weight): NaN at 0, +inf at 0.5, 3 at 1, 2 at 2 -> λ = 2
    table = {0.0: math.nan, 0.5: math.inf, 1.0: 3.0, 2.0: 2.0, 3.0: -math.inf}
    lam, losses = choose_lambda(base, vectors, lambda weights: table[float(weights["w"][0])], [0.0, 0.5, 1.0, 2.0, 3.0])
    assert lam == 2.0 and math.isnan(losses[0.0])
    with pytest.raises(TaskHetError, match="no λ of the grid gives a finite validation loss"):
        choose_lambda(base, vectors, lambda weights: math.nan, [0.0, 1.0])


def test_a_name_given_twice_in_finetuned_is_refused_naming_it(tmp_path):
    base, tuned = two_models(tmp_path)
    with pytest.raises(TaskHetError, match=r"--finetuned names a more than once"):
        main(["--base", str(base), "--finetuned", f"a={tuned}", f"b={tuned}", f"a={base}", "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


def test_checkpoints_of_other_shapes_or_keys_name_both_files_and_the_entry(tmp_path):
    base, _ = two_models(tmp_path)
    torch.save({"w": torch.zeros(3), "b": torch.zeros(1)}, tmp_path / "wide.pt")
    torch.save({"w": torch.zeros(2)}, tmp_path / "short.pt")
    with pytest.raises(TaskHetError, match=r"entry 'w' has shape \[2\] in --base .*base.pt but \[3\] in "
                                           r"--finetuned x=.*wide.pt"):
        main(["--base", str(base), "--finetuned", f"x={tmp_path / 'wide.pt'}", "--out", str(tmp_path / "m")])
    with pytest.raises(TaskHetError, match=r"--base .*base.pt has entry 'b' and --finetuned y=.*short.pt has not"):
        main(["--base", str(base), "--finetuned", f"y={tmp_path / 'short.pt'}", "--out", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


def test_the_folder_says_incomplete_while_the_merge_works_and_not_after(tmp_path):
    base = {"w": torch.zeros(2)}
    seen = []

    def client_loss(name, weights):  # runs in the middle of the merge, after config.json and metrics.csv
        seen.append(sorted(path.name for path in (tmp_path / "m").iterdir()))
        return 0.0

    run_merge(base, {"a": {"w": torch.ones(2)}}, tmp_path / "m", [1.0], client_loss=client_loss)
    assert INCOMPLETE in seen[0] and "config.json" in seen[0] and "merged.pt" not in seen[0]
    assert not (tmp_path / "m" / INCOMPLETE).exists() and (tmp_path / "m" / "merged.pt").is_file()

    def killed(name, weights):
        raise KeyboardInterrupt  # a kill half-way
    with pytest.raises(KeyboardInterrupt):
        run_merge(base, {"a": {"w": torch.ones(2)}}, tmp_path / "k", [1.0], client_loss=killed)
    assert (tmp_path / "k" / INCOMPLETE).is_file() and not (tmp_path / "k" / "merged.pt").exists()
    with pytest.raises(KeyboardInterrupt):  # a rerun into a finished folder removes the old merged.pt first
        run_merge(base, {"a": {"w": torch.ones(2)}}, tmp_path / "m", [1.0], client_loss=killed)
    assert (tmp_path / "m" / INCOMPLETE).is_file() and not (tmp_path / "m" / "merged.pt").exists()


def test_float64_entries_are_merged_in_float64():
    third = torch.tensor([1 / 3, 1e-12 + 1.0], dtype=torch.float64)  # not representable in float32
    base = {"w64": third, "w32": torch.tensor([0.1, 0.2]), "h16": torch.tensor([0.1], dtype=torch.float16),
            "count": torch.tensor(7)}
    tuned = {"w64": third + 1e-9, "w32": torch.tensor([0.3, 0.2]), "h16": torch.tensor([0.2], dtype=torch.float16),
             "count": torch.tensor(9)}
    vector = task_vector(base, tuned)
    assert vector["w64"].dtype == torch.float64 and vector["h16"].dtype == torch.float32 and "count" not in vector
    at_zero = merge(base, [vector], 0.0)
    for key, value in base.items():
        assert at_zero[key].dtype == value.dtype and torch.equal(at_zero[key], value), key
    at_one = merge(base, [vector], 1.0)
    assert torch.equal(at_one["w64"], third + ((third + 1e-9) - third))  # float64 arithmetic, by hand
    assert abs(float(at_one["w64"][0] - third[0]) - 1e-9) < 1e-15  # float32 would lose the 1e-9 entirely
    at_half = merge(base, [vector], 0.5)
    assert torch.equal(at_half["w64"], third + 0.5 * ((third + 1e-9) - third))


# ----- --run on a digits sparse_ft run with keep_local_models: the default validation split is the manifest's val rows
@pytest.fixture(scope="module")
def digits_sparse_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits_merge")
    manifest = step1.main(["--family", "digits", "--n_samples", "120", "--test_fraction", "0.2", "--val_fraction", "0.2",
                           "--seed", "0", "--out", str(root / "step1")])
    step3b.main(["--manifest", str(manifest), "--scheme", "iid", "--n_clients", "2", "--client_test_fraction", "0.25",
                 "--seed", "0", "--out", str(root / "assign")])
    run = root / "run"
    # No --input_key: sparse_ft takes the digits family's input key ("image"), item 13 of issue 19.
    test_fed.main(["--task", "digit_class", "--manifest", str(manifest), "--assignments",
                   str(root / "assign" / "assignments.csv"), "--out", str(run), "--encoder", "small_cnn",
                   "--image_size", "8", "--n_rounds", "1", "--local_steps", "2", "--batch_size", "8",
                   "--no-use_accelerator", "--no-progress", "--method", "sparse_ft", "--density", "0.5",
                   "--calibration_rounds", "1", "--calibration_batches", "1", "--keep_local_models", "true"])
    return root, manifest, run


def test_merge_run_uses_the_manifests_val_rows_by_default(digits_sparse_run, tmp_path):
    root, manifest, run = digits_sparse_run
    main(["--run", str(run), "--lambdas", "0,1", "--out", str(tmp_path / "m")])
    record = json.loads((tmp_path / "m" / "config.json").read_text())["args"]
    assert record["val_split"] == "manifest_val"
    searched = pd.read_csv(tmp_path / "m" / "metrics.csv").query("split == 'val'")
    assert list(searched.other) == ["lambda=0.0", "lambda=1.0"]
    # λ = 0 is θ_0: its validation loss is the start model's loss on the 24 val rows, which step 4 logged at round 0
    step4 = pd.read_csv(run / "metrics.csv", dtype={"client": str})
    start = step4.query("round == 0 and split == 'val' and client == 'global' and metric == 'loss'").value
    assert len(start) == 1 and searched.value.iloc[0] == pytest.approx(float(start.iloc[0]), rel=1e-6)
    assert not (tmp_path / "m" / INCOMPLETE).exists() and (tmp_path / "m" / "merged.pt").is_file()
    with pytest.raises(TaskHetError, match="--val_split held_out: --val_fraction 0.1 needs .* or pass --val_split "
                                           "client_test"):
        main(["--run", str(run), "--val_split", "held_out", "--out", str(tmp_path / "h")])


def test_a_held_out_split_of_zero_rows_is_one_error_line_and_nothing_is_merged(digits_sparse_run, tmp_path, capsys):
    """--val_fraction 0 draws no rows (network.calibration_split.calibration_ids returns []): a λ search over no
    data is refused with one line naming both flags, before anything is written."""
    _, _, run = digits_sparse_run
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, ["--run", str(run), "--val_split", "held_out", "--val_fraction", "0", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == ["error: --val_split held_out needs --val_fraction > 0"], err
    assert not (tmp_path / "m" / "merged.pt").exists() and not (tmp_path / "m" / "merge.csv").exists()


@pytest.mark.parametrize("family_key", ["image", "rgb", "encoded"])
def test_sparse_ft_calibrates_on_the_run_input_key_by_default(family_key):
    from network.algorithms import build_algorithm
    from tests.tiny_models import TinyNet

    algorithm, _ = build_algorithm("sparse_ft", TinyNet(), {"0": 4}, {}, input_key=family_key)
    batch = {family_key: torch.zeros(1), "x": torch.zeros(1), "label": torch.zeros(1)}
    assert algorithm.calibration_input(batch) == family_key  # not the first of a fixed list ("rgb,x" picked x)
    named, _ = build_algorithm("sparse_ft", TinyNet(), {"0": 4}, {"input_key": "x"}, input_key=family_key)
    assert named.calibration_input(batch) == "x"  # an explicit setting still wins


@pytest.mark.parametrize("setting, batch_keys, chosen", [
    ("rgb,x", ("x", "label"), "x"),  # the first listed key the batch has, not the first listed
    ("rgb,x", ("rgb", "x"), "rgb"),  # both present: the listed order decides
    (" x , rgb ", ("rgb",), "rgb"),  # spaces around a key are not part of it
    ("rgb,,x", ("x",), "x"),  # an empty item is skipped
    ("rgb,x", ("label",), "rgb"),  # none present: the first listed (the model then names the missing key)
])
def test_sparse_ft_input_key_is_the_first_comma_separated_key_the_batch_has(setting, batch_keys, chosen):
    from network.algorithms import build_algorithm
    from tests.tiny_models import TinyNet

    algorithm, _ = build_algorithm("sparse_ft", TinyNet(), {"0": 4}, {"input_key": setting}, input_key="image")
    assert algorithm.calibration_input({key: torch.zeros(1) for key in batch_keys}) == chosen
