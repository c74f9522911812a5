"""Step 2 (steps/train_centralized.py, train_centralized_task_model.py) end to end on tiny synthetic data, on the CPU."""

import shutil

import pandas as pd
import pytest
import torch

import training.loop
from datasets.cifar import select_cifar
from datasets.digits import select_digits
from datasets.family import get_family, list_families
from models import get_task, load_task_model
from steps import train_centralized as step2
from tests.fixtures import write_tiny_cifar
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


@pytest.mark.parametrize("family, task", [(name, task) for name in list_families() for task in get_family(name).tasks])
def test_short_run_lowers_validation_loss(family, task, views96, digits96, cifar96, tmp_path):
    out = tmp_path / task
    epochs = EPOCHS.get(task, 2)
    data = {"taskonomy": views96, "digits": digits96, "cifar": cifar96}[family]
    summary = step2.main(argv(*data, out, task, "--n_epochs", str(epochs)))
    # cifar and digits manifests have a validation part: it selects; taskonomy selects on test as before
    selected_on = "test" if family == "taskonomy" else "val"
    losses = val_losses(out, selected_on)
    assert summary["selected_on"] == selected_on
    assert list(losses.index) == list(range(epochs + 1)) and list(val_losses(out, "test").index) == list(range(epochs + 1))
    assert losses[epochs] < losses[0], f"{task}: {selected_on} loss {losses[0]:.4f} -> {losses[epochs]:.4f}"
    metric = get_task(task).primary_metric
    for name in ("config.json", "run.log", "metrics.csv", "best.pt", "last.pt", "curves.png", "loss.png", f"{metric}.png"):
        assert (out / name).is_file(), name
    assert summary["best_val_loss"] == pytest.approx(losses.min())
    assert load_checkpoint(out / "best.pt")["epoch"] == losses.idxmin() == summary["best_epoch"]
    model = load_task_model(out / "best.pt")
    assert model.config["task"] == task
    prediction, embedding = model.eval()(torch.rand(2, 3, 32, 32))
    assert prediction.shape[0] == 2 and embedding.shape[0] == 2


class Killed(Exception):
    """Stands in for the process being killed."""


def test_killed_and_resumed_run_is_bit_identical(tiny_data_root, tiny_manifest, tmp_path, monkeypatch):
    extra = ("--n_epochs", "3", "--deterministic", "--seed", "7")
    uninterrupted = tmp_path / "uninterrupted"
    step2.main(argv(tiny_data_root, tiny_manifest, uninterrupted, "segment_semantic", *extra))

    interrupted = tmp_path / "interrupted"
    real_save = training.loop.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        if path.name == "last.pt" and obj["state"]["epoch"] == 1:
            raise Killed

    monkeypatch.setattr(training.loop, "atomic_torch_save", save_then_die)
    with pytest.raises(Killed):
        step2.main(argv(tiny_data_root, tiny_manifest, interrupted, "segment_semantic", *extra))
    monkeypatch.setattr(training.loop, "atomic_torch_save", real_save)
    assert load_checkpoint(interrupted / "last.pt")["state"]["epoch"] == 1
    step2.main(argv(tiny_data_root, tiny_manifest, interrupted, "segment_semantic", *extra, "--resume"))

    expected, resumed = load_checkpoint(uninterrupted / "last.pt"), load_checkpoint(interrupted / "last.pt")
    assert resumed["state"] == expected["state"]
    assert expected["model"].keys() == resumed["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, state in expected["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg"], resumed["optimizer"]["state"][index]["exp_avg"])
    assert (uninterrupted / "metrics.csv").read_bytes() == (interrupted / "metrics.csv").read_bytes()
    assert torch.equal(load_checkpoint(uninterrupted / "best.pt")["model"]["head.weight"],
                       load_checkpoint(interrupted / "best.pt")["model"]["head.weight"])


def test_finished_run_is_skipped_and_changed_arguments_are_refused(tiny_data_root, tiny_manifest, tmp_path):
    out = tmp_path / "run"
    step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1"))
    before = (out / "metrics.csv").read_bytes()
    summary = step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1"))
    assert summary["epochs_done"] == 1 and (out / "metrics.csv").read_bytes() == before
    with pytest.raises(TaskHetError, match=r"other arguments \(init_lr: '0.003' -> '0.01'\).*--no-resume"):
        step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1", "--init_lr", "0.01"))
    step2.main(argv(tiny_data_root, tiny_manifest, out, "reshading", "--n_epochs", "1", "--no-resume", "--init_lr", "0.01"))
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
