"""Step 2 (steps/train_centralized.py, train_centralized_task_model.py) end to end on tiny synthetic data, on the CPU."""

import math
import shutil

import pandas as pd
import pytest
import torch

import training.fit
from datasets.cifar import select_cifar
from datasets.digits import select_digits
from datasets.family import get_family, list_families
from losses import classification_loss, segmentation_loss
from models import get_task, load_task_model
from pipeline.run_results import trivial_losses
from steps import train_centralized as step2
from tests.fixtures import Killed, die_after_saving, script_evaluation, write_tiny_cifar
from training.schedules import ScheduleConfig, learning_rates, list_schedulers
from training.selection import selected_test_metrics
from tests.fixtures import make_tiny_manifest, render_tiny_dataset, tiny_data_root, tiny_manifest  # noqa: F401
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint

# class_scene (4 buildings = 4 classes, trained from scratch) overfits at the dense tasks' step size
LEARNING_RATE = {"class_scene": "0.001"}
EPOCHS = {"class_scene": 6}


def argv(data_root, manifest, out, task="normal", *extra):
    return ["--task", task, "--encoder", "small_cnn", "--weights", "none", "--data_path", str(data_root),
            "--manifest", str(manifest), "--image_size", "32", "--batch_size", "6", "--optimizer", "adamw",
            "--init_lr", LEARNING_RATE.get(task, "0.003"), "--scheduler", "cosine", "--no-use_accelerator",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def views96(tmp_path_factory):
    """4 buildings x 24 views (72 train / 24 test): enough test samples for a stable validation loss."""
    root = render_tiny_dataset(tmp_path_factory.mktemp("views96"), n_views=24)
    return root, make_tiny_manifest(root, tmp_path_factory.mktemp("views96_step1"))


def val_losses(run_dir, split="test") -> pd.Series:
    metrics = pd.read_csv(run_dir / "metrics.csv")
    return metrics[(metrics.split == split) & (metrics.metric == "loss")].set_index("epoch").value


@pytest.fixture(scope="module")
def digits96(views96, tmp_path_factory):
    """96 digits (72 train / 24 test), the same sizes as views96; the data root is unused."""
    manifest = tmp_path_factory.mktemp("digits96_step1") / "manifest.csv"
    select_digits(0.25, seed=0, n_samples=96).to_csv(manifest, index=False)
    return views96[0], manifest


@pytest.fixture(scope="module")
def cifar96(tmp_path_factory):
    """Tiny CIFAR-10 files whose classes differ in brightness (270 train + 30 val / 20 test images), and their manifest.

    30 a class: 9 training images a class left too few for small_cnn to lower the loss in 2 epochs."""
    root = write_tiny_cifar(tmp_path_factory.mktemp("cifar96"), "cifar10", [30] * 10, test_per_class=2, learnable=True)
    manifest = tmp_path_factory.mktemp("cifar96_step1") / "manifest.csv"
    select_cifar(root, "cifar10", 1.0, 0.1, seed=0, verify_checksums=False).to_csv(manifest, index=False)
    return root, manifest


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Step-1 manifests of the folder families at a tiny size: 4 classes × 12 images, and 48 paired images."""
    from steps import select
    from tests.folder_fixtures import write_imagefolder, write_paired_folders

    made = {}
    for family, root in (("imagefolder", write_imagefolder(tmp_path_factory.mktemp("photos"), per_class=12,
                                                            classes=("owl", "cat", "dog", "eel"))),
                         ("paired_folders", write_paired_folders(tmp_path_factory.mktemp("paired"), n_images=48))):
        out = tmp_path_factory.mktemp(f"{family}_step1")
        made[family] = (root, select.main(["--family", family, "--data_path", str(root), "--out", str(out),
                                           "--test_fraction", "0.25", "--val_fraction", "0.25", "--no-progress"]))
    return made


def first_task_of_each_metric() -> set[str]:
    """One task per primary metric draws its pictures (curves.png, loss.png, <metric>.png); the rest run --no-plots."""
    firsts = {}
    for name in list_families():
        for task in get_family(name).tasks:
            firsts.setdefault(get_task(task).primary_metric, task)
    return set(firsts.values())


@pytest.mark.parametrize("family, task", [(name, task) for name in list_families() for task in get_family(name).tasks])
def test_short_run_lowers_validation_loss(family, task, views96, digits96, cifar96, folders, tmp_path):
    out = tmp_path / task
    epochs = EPOCHS.get(task, 2)
    data = {"taskonomy": views96, "digits": digits96, "cifar": cifar96, **folders}[family]
    plots = task in first_task_of_each_metric()
    summary = step2.main(argv(*data, out, task, "--n_epochs", str(epochs), *([] if plots else ["--no-plots"])))
    # every family's step 1 writes a validation part by default, and it selects
    selected_on = "val"
    losses = val_losses(out, selected_on)
    assert summary["selected_on"] == selected_on
    assert list(losses.index) == list(range(epochs + 1)) and list(val_losses(out, "test").index) == list(range(epochs + 1))
    assert losses[epochs] < losses[0], f"{task}: {selected_on} loss {losses[0]:.4f} -> {losses[epochs]:.4f}"
    metric = get_task(task).primary_metric
    for name in ("config.json", "run.log", "metrics.csv", "best.pt", "last.pt"):
        assert (out / name).is_file(), name
    pictures = {"curves.png", "loss.png", f"{metric}.png"}
    assert {path.name for path in out.glob("*.png")} == (pictures if plots else set())
    assert summary["best_val_loss"] == pytest.approx(losses.min())
    # the trivial predictors' test losses: all zeros, and the training median (L1 losses) or class prior (cross-entropy)
    trivial = trivial_losses(out / "metrics.csv")
    constant = "prior" if get_task(task).loss_fn in (segmentation_loss, classification_loss) else "median"
    assert set(trivial) == {"zero", constant} and all(math.isfinite(value) and value > 0 for value in trivial.values())
    assert load_checkpoint(out / "best.pt")["epoch"] == losses.idxmin() == summary["best_epoch"]
    model = load_task_model(out / "best.pt")
    assert model.config["task"] == task
    prediction, embedding = model.eval()(torch.rand(2, 3, 32, 32))
    assert prediction.shape[0] == 2 and embedding.shape[0] == 2



@pytest.mark.kernels
def test_killed_and_resumed_run_is_bit_identical(tiny_data_root, tiny_manifest, tmp_path, monkeypatch):
    extra = ("--n_epochs", "3", "--deterministic", "--seed", "7")
    uninterrupted = tmp_path / "uninterrupted"
    step2.main(argv(tiny_data_root, tiny_manifest, uninterrupted, "segment_semantic", *extra, "--no-plots"))

    interrupted = tmp_path / "interrupted"
    real_save = training.fit.atomic_torch_save
    die_after_saving(monkeypatch, training.fit)
    with pytest.raises(Killed):
        step2.main(argv(tiny_data_root, tiny_manifest, interrupted, "segment_semantic", *extra))
    monkeypatch.setattr(training.fit, "atomic_torch_save", real_save)
    assert load_checkpoint(interrupted / "last.pt")["state"]["epoch"] == 1
    step2.main(argv(tiny_data_root, tiny_manifest, interrupted, "segment_semantic", *extra, "--resume"))

    expected, resumed = load_checkpoint(uninterrupted / "last.pt"), load_checkpoint(interrupted / "last.pt")
    assert resumed["state"] == expected["state"]
    assert expected["model"].keys() == resumed["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, state in expected["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], resumed["optimizer"]["state"][index]["exp_avg"])
    # --no-plots changes no number (and a resumed run may turn the pictures back on: not in the signature)
    assert (uninterrupted / "metrics.csv").read_bytes() == (interrupted / "metrics.csv").read_bytes()
    assert not list(uninterrupted.glob("*.png")) and (interrupted / "curves.png").stat().st_size > 0
    assert torch.equal(load_checkpoint(uninterrupted / "best.pt")["model"]["head.weight"],
                       load_checkpoint(interrupted / "best.pt")["model"]["head.weight"])


def test_finished_run_is_skipped_and_changed_arguments_are_refused(tiny_data_root, tiny_manifest, tmp_path):
    out = tmp_path / "run"
    step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1", "--no-plots"))
    before = (out / "metrics.csv").read_bytes()
    summary = step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1", "--no-plots"))
    assert summary["epochs_done"] == 1 and (out / "metrics.csv").read_bytes() == before
    with pytest.raises(TaskHetError, match=r"other arguments \(init_lr: '0.003' -> '0.01'\).*--no-resume"):
        step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1", "--init_lr", "0.01", "--no-plots"))
    step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1", "--no-resume", "--init_lr", "0.01", "--no-plots"))
    assert (out / "metrics.csv").read_bytes() != before


def test_bad_input_is_one_clear_error(tiny_data_root, tiny_manifest, tmp_path, capsys):
    with pytest.raises(TaskHetError, match="unknown task 'depth'; choose one of: .*depth_euclidean"):
        step2.main(argv(tiny_data_root, tiny_manifest, tmp_path / "a", "depth"))
    with pytest.raises(TaskHetError, match="unknown encoder 'resnet5'"):
        step2.main(argv(tiny_data_root, tiny_manifest, tmp_path / "b") + ["--encoder", "resnet5"])
    with pytest.raises(TaskHetError, match="--use_adam contradicts --optimizer sgd"):
        step2.main(argv(tiny_data_root, tiny_manifest, tmp_path / "c") + ["--optimizer", "sgd", "--use_adam"])

    weights = tmp_path / "resnet18.pth"
    torch.save(step2.build_task_model("normal", "resnet18").encoder.state_dict(), weights)
    with pytest.raises(TaskHetError, match="resnet18.pth does not match encoder small_cnn"):
        step2.main(argv(tiny_data_root, tiny_manifest, tmp_path / "d") + ["--weights", str(weights)])

    no_reshading = tmp_path / "data"
    shutil.copytree(tiny_data_root, no_reshading)
    shutil.rmtree(no_reshading / "reshading")
    with pytest.raises(TaskHetError, match="reshading"):
        step2.main(argv(no_reshading, tiny_manifest, tmp_path / "e", "reshading"))

    # as a script: one line on stderr, exit code 2, no traceback
    with pytest.raises(SystemExit) as exit_info:
        run_main(step2.main, argv(no_reshading, tiny_manifest, tmp_path / "f", "reshading"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: ") and "reshading" in message and "\n" not in message
    assert not (tmp_path / "a").exists() and not (tmp_path / "e").exists()


def test_plot_curves_reads_any_long_format_csv(tmp_path):
    from utils.plots import plot_curves

    csv = tmp_path / "federated.csv"
    pd.DataFrame({
        "round": [1, 1, 2, 2, 2],
        "split": ["test", "test", "test", "test", "train"],
        "client": ["global", "3", "global", "3", "global"],
        "metric": ["loss", "loss", "loss", "loss", "loss"],
        "value": [1.0, 2.0, 0.5, 1.5, 0.7],
    }).to_csv(csv, index=False)
    assert plot_curves(csv, tmp_path / "curves.png", x="round", where={"client": "global"}) == tmp_path / "curves.png"
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert plot_curves(csv, tmp_path / "none.png", x="round", where={"client": "99"}) is None
    assert not (tmp_path / "none.png").exists()
    with pytest.raises(TaskHetError, match="missing column.*epoch"):
        plot_curves(csv, tmp_path / "bad.png", x="epoch")


# Hand-computed rates per epoch (initial rate 1, 6 epochs, step_size 2, gamma 0.5, decay rate 0.5):
# warmup W=2 gives e / (W + 1) = 1/3, 2/3, then the schedule starts from 1 at epoch 3;
# cosine over T = 6 - W epochs: (1 + cos(pi * k / T)) / 2.
HAND_RATES = {
    ("none", 0): [1, 1, 1, 1, 1, 1],
    ("none", 2): [1 / 3, 2 / 3, 1, 1, 1, 1],
    ("cosine", 0): [1, (1 + 3 ** 0.5 / 2) / 2, 0.75, 0.5, 0.25, (1 - 3 ** 0.5 / 2) / 2],
    ("cosine", 2): [1 / 3, 2 / 3, 1, (1 + 2 ** -0.5) / 2, 0.5, (1 - 2 ** -0.5) / 2],
    ("step", 0): [1, 1, 0.5, 0.5, 0.25, 0.25],
    ("step", 2): [1 / 3, 2 / 3, 1, 1, 0.5, 0.5],
    ("exponential", 0): [1, 0.5, 0.25, 0.125, 0.0625, 0.03125],
    ("exponential", 2): [1 / 3, 2 / 3, 1, 0.5, 0.25, 0.125],
}


@pytest.mark.parametrize("scheduler, warmup", sorted(HAND_RATES))
def test_schedule_rates_match_hand_computed_values(scheduler, warmup):
    config = ScheduleConfig(n_epochs=6, warmup_epochs=warmup, step_size=2, gamma=0.5, decay_rate=0.5)
    assert learning_rates(scheduler, config) == pytest.approx(HAND_RATES[scheduler, warmup], rel=1e-12)
    assert sorted(list_schedulers()) == sorted({name for name, _ in HAND_RATES})


def test_step2_trains_each_epoch_at_the_scheduled_rate(digits96, tmp_path):
    out = tmp_path / "run"
    step2.main(argv(*digits96, out, "digit_class", "--n_epochs", "4", "--init_lr", "0.01", "--optimizer", "sgd",
                    "--scheduler", "step", "--step_size", "1", "--gamma", "0.5", "--warmup_epochs", "1", "--no-plots"))
    metrics = pd.read_csv(out / "metrics.csv")
    rates = metrics[(metrics.split == "train") & (metrics.metric == "lr")].set_index("epoch").value
    # warmup epoch 1: 0.01 * 1/2; then 0.01 halved every epoch
    assert rates.to_dict() == pytest.approx({1: 0.005, 2: 0.01, 3: 0.005, 4: 0.0025})


# Scripted losses per split and epoch 0..4: validation is lowest at epoch 1, test keeps falling to epoch 4.
SCRIPTED = {"val": [2.0, 1.0, 1.5, 1.8, 1.9], "test": [2.0, 1.9, 1.5, 1.2, 1.1]}


def scripted_evaluation(monkeypatch, scripted: dict[str, list[float]] = SCRIPTED):
    """Replace fit's evaluation by ``scripted`` (training itself still runs), so val and test disagree on the best epoch."""
    script_evaluation(monkeypatch, scripted)


def test_validation_not_test_picks_best_pt_and_stops_early(digits96, tmp_path, monkeypatch):
    scripted_evaluation(monkeypatch)
    out = tmp_path / "run"
    summary = step2.main(argv(*digits96, out, "digit_class", "--n_epochs", "4", "--early_stopping_patience", "2",
                                   "--no-plots"))
    assert summary["selected_on"] == "val" and summary["best_epoch"] == 1 and summary["best_val_loss"] == 1.0
    assert load_checkpoint(out / "best.pt")["epoch"] == 1
    # patience 2: epochs 2 and 3 do not beat epoch 1's val loss, so epoch 4 never runs though test still falls
    assert summary["epochs_done"] == 3 and summary["stopped_early"]
    assert selected_test_metrics(out / "metrics.csv") == {"epoch": 1, "selected_on": "val", "loss": 1.9, "top1": 0.5}


def test_without_a_validation_part_nothing_is_selected_and_the_last_epoch_only_when_asked_for(
        digits96, tmp_path, monkeypatch, capsys):
    """The test split never selects: without validation rows step 2 is refused in one line, unless --last_epoch asks
    to keep the last epoch; best.pt is then epoch 4 though the test loss was lowest at epoch 1."""
    scripted_evaluation(monkeypatch, {"test": [2.0, 1.2, 1.5, 1.8, 1.9]})
    manifest = tmp_path / "manifest.csv"
    pd.read_csv(digits96[1]).drop(columns="val").to_csv(manifest, index=False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run_main(step2.main, argv(digits96[0], manifest, out, "digit_class", "--n_epochs", "4"))
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in error
    assert error.startswith(f"error: manifest {manifest} has no validation rows (column val) to choose best.pt on (the "
                            "test split never chooses)") and "--last_epoch" in error
    assert not out.exists()  # refused before the folder is claimed
    with pytest.raises(TaskHetError, match="^--early_stopping_patience 2: manifest .* has no validation rows to stop on"):
        step2.main(argv(digits96[0], manifest, out, "digit_class", "--n_epochs", "4", "--last_epoch",
                        "--early_stopping_patience", "2"))
    assert not out.exists()
    summary = step2.main(argv(digits96[0], manifest, out, "digit_class", "--n_epochs", "4", "--last_epoch", "--no-plots"))
    assert summary["selected_on"] == "last" and summary["best_epoch"] == 4 and summary["epochs_done"] == 4
    assert load_checkpoint(out / "best.pt")["epoch"] == 4
    assert set(pd.read_csv(out / "metrics.csv").split) == {"train", "test", "trivial_test"}  # no val, no trivial_val
    # what a report reads: the last epoch's test metrics, and that no split chose them
    assert selected_test_metrics(out / "metrics.csv") == {"epoch": 4, "selected_on": "last", "loss": 1.9, "top1": 0.5}


@pytest.mark.parametrize("flags, message", [
    (("--scheduler", "cosinus"), "--scheduler: invalid choice: 'cosinus'"),
    (("--warmup_epochs", "2", "--n_epochs", "2"), "--warmup_epochs 2 must be below --n_epochs 2"),
    (("--step_size", "0"), "--step_size"),
    (("--gamma", "-1"), "--gamma"),
])
def test_bad_schedule_flag_is_one_error_line(digits96, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        run_main(step2.main, argv(*digits96, tmp_path / "out", "digit_class", *flags))
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.startswith("error: ") and message in error and "\n" not in error
    assert not (tmp_path / "out").exists()
