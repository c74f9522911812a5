"""Checkpoints without a frozen pretrained encoder (models/frozen_encoder.py): what they hold, resume, refusals, readers.

The small_cnn encoder with a saved weights file stands in for a pretrained one (a path is a source, as
``imagenet`` is); EfficientNet-Lite0's ImageNet weights (the demo's) check the BatchNorm statistics.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pandas as pd
import pytest
import torch

import network.engine_sequential
import test_fed
import training.fit
from datasets.taskonomy import read_manifest
from models import build_task_model, load_task_model
from models.encoders import build_encoder
from models.frozen_encoder import (FROZEN_ENCODER, FrozenEncoder, load_full_checkpoint, strip_frozen_encoder,
                                   write_unfrozen_copy)
from network.checkpoints import load_resumable
from network.client_store import ClientStore
from sparse.from_run import read_run
from partitioning.assignments import write_assignments
from steps import embed, meter
from steps import train_centralized as step2
from steps.merge import load_model_weights
from steps.merge import main as merge_main
from tests.fixtures import Killed, die_after_saving, tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.hashing import tensors_sha256
from utils.run_dir import atomic_torch_save, load_checkpoint

TASK = "depth_euclidean"
N_CLIENTS = 3



def save_encoder_weights(path, seed):
    """A small_cnn encoder's state, drawn from ``seed``: the stand-in for a published weights file."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.save(build_encoder("small_cnn").state_dict(), path)
    return path


def keys_anywhere(node, found=None):
    """Every dict key at any depth of a loaded checkpoint."""
    found = set() if found is None else found
    if isinstance(node, dict):
        for key, value in node.items():
            found.add(key)
            keys_anywhere(value, found)
    elif isinstance(node, (list, tuple)):
        for value in node:
            keys_anywhere(value, found)
    return found


def encoder_keys(checkpoint):
    return sorted(key for key in keys_anywhere(checkpoint) if isinstance(key, str) and "encoder." in key)


def assert_same(expected, got, where="checkpoint"):
    """Equal nested dicts: the same keys in the same order, tensors equal to the bit."""
    if isinstance(expected, dict):
        assert list(expected) == list(got), where
        for key in expected:
            assert_same(expected[key], got[key], f"{where}/{key}")
    elif torch.is_tensor(expected):
        assert expected.dtype == got.dtype and torch.equal(expected, got), where
    else:
        assert expected == got, where


def step2_argv(data_root, manifest, out, weights, *extra):
    return ["--task", TASK, "--encoder", "small_cnn", "--weights", str(weights), "--freeze_encoder",
            "--data_path", str(data_root), "--manifest", str(manifest), "--image_size", "32", "--batch_size", "6",
            "--optimizer", "adamw", "--init_lr", "0.003", "--scheduler", "cosine", "--no-use_accelerator", "--no-plots",
            "--n_epochs", "2", "--deterministic", "--seed", "7", "--out", str(out), *extra]


def step4_argv(data_root, manifest, assignments, out, weights, *extra):
    return ["--task", TASK, "--data_path", str(data_root), "--manifest", str(manifest), "--assignments", str(assignments),
            "--out", str(out), "--encoder", "small_cnn", "--weights", str(weights), "--freeze_encoder", "--image_size",
            "32", "--n_rounds", "2", "--local_steps", "2", "--batch_size", "4", "--no-use_accelerator", "--no-progress", "--no-plots",
            "--rand_seed", "1", "--deterministic", *extra]


@pytest.fixture(scope="module")
def frozen_runs(tiny_data_root, tiny_manifest, tmp_path_factory):  # noqa: F811
    """A frozen-encoder step 2 and a Ditto step 4 on it (Ditto's client states are whole models), uninterrupted."""
    base = tmp_path_factory.mktemp("frozen")
    weights = save_encoder_weights(base / "pretrained.pt", seed=0)
    step2.main(step2_argv(tiny_data_root, tiny_manifest, base / "step2", weights))
    train = read_manifest(tiny_manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % N_CLIENTS,
                          "group": train["scene_class"],
                          "subset": ["test" if (index // N_CLIENTS) % 3 == 2 else "train" for index in train.index]})
    assignments = base / "assignments" / "assignments.csv"
    write_assignments(assignments, table, {"scheme": "round_robin", "alpha": 1.0, "n_clients": N_CLIENTS,
                                           "groups": "scene_class"})
    # --keep_client_state: the clients' states stay in the final checkpoint, so the tests below see them too
    test_fed.main(step4_argv(tiny_data_root, tiny_manifest, assignments, base / "step4", weights, "--method", "ditto",
                             "--keep_client_state"))
    return {"base": base, "weights": weights, "step2": base / "step2", "step4": base / "step4",
            "assignments": assignments, "data": (tiny_data_root, tiny_manifest)}


# ----- the hash -----
def test_the_encoder_hash_is_sha256_over_sorted_names_dtypes_shapes_and_bytes():
    tensors = {"b": torch.tensor([1.5], dtype=torch.float32), "a": torch.tensor([[2], [3]], dtype=torch.int64)}
    by_hand = hashlib.sha256()
    by_hand.update(b"a\0torch.int64\0(2, 1)\x0016\n" + (2).to_bytes(8, "little") + (3).to_bytes(8, "little"))
    by_hand.update(b"b\0torch.float32\0(1,)\x004\n" + bytes.fromhex("0000c03f"))  # 1.5 as a little-endian float32
    assert tensors_sha256(tensors) == by_hand.hexdigest()
    assert tensors_sha256(dict(reversed(tensors.items()))) == by_hand.hexdigest()  # the mapping's order is not hashed
    assert tensors_sha256({**tensors, "b": tensors["b"].double()}) != by_hand.hexdigest()  # the dtype is


# ----- what the files hold -----
@pytest.mark.parametrize("step, name", [("step2", "best.pt"), ("step2", "last.pt"), ("step4", "best.pt"),
                                        ("step4", "checkpoint.pt")])
def test_a_frozen_runs_checkpoints_hold_no_encoder_tensor_and_name_it_instead(frozen_runs, step, name):
    path = frozen_runs[step] / name
    raw = load_checkpoint(path)
    assert encoder_keys(raw) == []
    source = FrozenEncoder.rebuild("small_cnn", str(frozen_runs["weights"]))
    record = raw[FROZEN_ENCODER]
    assert {key: record[key] for key in ("name", "weights", "sha256")} == source.record()
    full = load_full_checkpoint(path)
    assert FROZEN_ENCODER not in full
    for key, value in source.tensors.items():  # every copy of the encoder is back, equal to the source's
        assert torch.equal(full["model"][key], value), key
    # Written whole (the places that held the encoder sharing one copy, as torch.save shares a tensor), the same
    # checkpoint is bigger by at least the encoder's bytes, less the record's few kB.
    atomic_torch_save(full, frozen_runs["base"] / f"whole-{step}-{name}")
    whole = (frozen_runs["base"] / f"whole-{step}-{name}").stat().st_size
    encoder_bytes = sum(value.numel() * value.element_size() for value in source.tensors.values())
    assert whole - path.stat().st_size > encoder_bytes - 8192
    places = {tuple(entry["path"]): len(entry["keys"]) for entry in record["omitted"]}
    expected = {("step2", "best.pt"): [("model",)], ("step2", "last.pt"): [("model",)],
                ("step4", "best.pt"): [("model",), ("models", "global")],
                ("step4", "checkpoint.pt"): [("model",), ("server", "models", "global"),  # and Ditto's personal models
                                             *[("client_states", str(client)) for client in range(N_CLIENTS)]]}[step, name]
    assert places == {place: len(source.tensors) for place in expected}


def test_the_demos_encoder_keeps_its_batchnorm_statistics_and_a_changed_entry_stays_in_the_file(tmp_path):
    model = build_task_model("class_scene", "efficientnet_lite0", "imagenet", num_classes=4, seed=0,
                             freeze_encoder=True, decoder_width=32)
    frozen = model.frozen_encoder
    statistics = [key for key in frozen.tensors if key.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert len(statistics) > 100
    head = model.head.weight.detach().clone()
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=0.1)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(2):
        logits, _ = model(torch.rand(4, 3, 32, 32, generator=generator))
        torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    for key, value in frozen.tensors.items():  # weights and BatchNorm statistics as loaded
        assert torch.equal(state[key], value), key
    assert not torch.equal(state["head.weight"], head)  # the head did train
    stripped = strip_frozen_encoder({"model": state}, frozen)
    assert encoder_keys(stripped) == [] and len(stripped["model"]) == len(state) - len(frozen.tensors)

    model.encoder.train()  # as if something had trained it: its statistics move, and the file must keep them
    with torch.no_grad():
        model(torch.rand(4, 3, 32, 32, generator=generator))
    moved = model.state_dict()
    stripped = strip_frozen_encoder({"model": moved}, frozen)
    changed = sorted(key for key in frozen.tensors if not torch.equal(moved[key], frozen.tensors[key]))
    assert changed and set(changed) <= set(statistics)
    assert encoder_keys(stripped) == changed
    atomic_torch_save(stripped, tmp_path / "moved.pt")
    assert_same(moved, load_full_checkpoint(tmp_path / "moved.pt")["model"])


def test_a_model_without_a_pretrained_source_keeps_whole_checkpoints():
    model = build_task_model(TASK, "small_cnn", "none", seed=0, freeze_encoder=True)
    assert model.frozen_encoder is None
    checkpoint = {"model": model.state_dict()}
    assert strip_frozen_encoder(checkpoint, model.frozen_encoder) is checkpoint


def test_a_spilled_client_state_leaves_the_encoder_out_and_reads_back_whole(tmp_path):
    weights = save_encoder_weights(tmp_path / "pretrained.pt", seed=0)
    model = build_task_model(TASK, "small_cnn", str(weights), seed=0, freeze_encoder=True)
    store = ClientStore(tmp_path / "spill", 0, model.frozen_encoder)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    store.put("7", state)
    assert encoder_keys(load_checkpoint(tmp_path / "spill" / "client_7.pt")) == []
    assert_same(state, store.get("7"))


# ----- resume -----
@pytest.mark.kernels
def test_a_killed_and_resumed_frozen_step2_run_is_bit_identical(frozen_runs, tmp_path, monkeypatch):
    data_root, manifest = frozen_runs["data"]
    interrupted = tmp_path / "interrupted"
    real_save = training.fit.atomic_torch_save
    die_after_saving(monkeypatch, training.fit)
    with pytest.raises(Killed):
        step2.main(step2_argv(data_root, manifest, interrupted, frozen_runs["weights"]))
    monkeypatch.setattr(training.fit, "atomic_torch_save", real_save)
    assert encoder_keys(load_checkpoint(interrupted / "last.pt")) == []
    step2.main(step2_argv(data_root, manifest, interrupted, frozen_runs["weights"], "--resume"))

    for name in ("last.pt", "best.pt"):
        expected, resumed = (load_full_checkpoint(run / name) for run in (frozen_runs["step2"], interrupted))
        for key in ("model", "optimizer", "state", "rng", "epoch"):
            if key in expected:
                assert_same(expected[key], resumed[key], f"{name}/{key}")
    assert (frozen_runs["step2"] / "metrics.csv").read_bytes() == (interrupted / "metrics.csv").read_bytes()


def test_a_killed_and_resumed_frozen_step4_run_is_bit_identical(frozen_runs, tmp_path, monkeypatch):
    data_root, manifest = frozen_runs["data"]
    argv = step4_argv(data_root, manifest, frozen_runs["assignments"], tmp_path / "run", frozen_runs["weights"],
                      "--method", "ditto", "--keep_client_state")
    real_save = network.engine_sequential.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        if path.name == "checkpoint.pt" and obj["round"] == 1:
            raise Killed

    monkeypatch.setattr(network.engine_sequential, "atomic_torch_save", save_then_die)
    with pytest.raises(Killed):
        test_fed.main(argv)
    monkeypatch.setattr(network.engine_sequential, "atomic_torch_save", real_save)
    test_fed.main(argv)

    for name in ("checkpoint.pt", "best.pt"):
        expected, resumed = (load_full_checkpoint(run / name) for run in (frozen_runs["step4"], tmp_path / "run"))
        for key in ("model", "models", "server", "client_states", "round", "best_loss"):
            if key in expected:
                assert_same(expected[key], resumed[key], f"{name}/{key}")
    assert (frozen_runs["step4"] / "metrics.csv").read_bytes() == (tmp_path / "run" / "metrics.csv").read_bytes()


# ----- every reader refuses another encoder, in one line -----
def universal_checkpoint(tmp_path):
    """A frozen model's checkpoint with every reader's entries, stripped; and the weights file it names."""
    weights = save_encoder_weights(tmp_path / "pretrained.pt", seed=0)
    model = build_task_model(TASK, "small_cnn", str(weights), seed=0, freeze_encoder=True)
    state = model.state_dict()
    checkpoint = {"model": state, "model_config": model.config, "optimizer": {}, "scheduler": None, "state": {},
                  "rng": {}, "run_signature": {}, "run": {}, "round": 1, "best_loss": 1.0,
                  "server": {"models": {"global": state}, "tensors": {}}, "client_states": {"0": state}}
    return strip_frozen_encoder(checkpoint, model.frozen_encoder), weights


def sparse_run_folder(path):
    (path.parent / "config.json").write_text(json.dumps({"step": "step 4", "args": {"method": "sparse_ft"}}))
    return path.parent


READERS = {
    "load_task_model (steps 3, 3c, 4's --init_from centralized)": ("best.pt", lambda path: load_task_model(path)),
    "step-2 resume": ("last.pt", lambda path: training.fit.check_resumable(path.parent, {}, True)),
    "step-4 resume": ("checkpoint.pt", lambda path: load_resumable(path, {})),
    "merge": ("best.pt", load_model_weights),
    "merge --run": ("checkpoint.pt", lambda path: read_run(sparse_run_folder(path))),
    "the unfrozen copy of a study": ("best.pt", lambda path: write_unfrozen_copy(path, path.parent / "copy.pt")),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("how", ["another weights file", "a tampered hash"])
def test_every_reader_refuses_another_encoder_in_one_line(tmp_path, reader, how):
    checkpoint, weights = universal_checkpoint(tmp_path)
    expected = checkpoint[FROZEN_ENCODER]["sha256"]
    if how == "another weights file":
        save_encoder_weights(weights, seed=1)
        found = FrozenEncoder.rebuild("small_cnn", str(weights)).sha256
    else:
        checkpoint[FROZEN_ENCODER]["sha256"] = expected = "0" * 64
        found = FrozenEncoder.rebuild("small_cnn", str(weights)).sha256
    name, read = READERS[reader]
    path = tmp_path / "run" / name
    atomic_torch_save(checkpoint, path)
    with pytest.raises(TaskHetError) as error:
        read(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    assert f"SHA-256 {expected[:16]}" in message and f"SHA-256 {found[:16]}" in message and f"--weights {weights}" in message
    assert not (tmp_path / "run" / "copy.pt").exists()


def test_weights_from_a_frozen_checkpoint_are_refused_naming_the_source_it_names(tmp_path):
    checkpoint, weights = universal_checkpoint(tmp_path)
    atomic_torch_save(checkpoint, tmp_path / "best.pt")
    with pytest.raises(TaskHetError) as error:
        build_encoder("small_cnn", str(tmp_path / "best.pt"))
    assert str(error.value) == (f"--weights {tmp_path / 'best.pt'} holds no encoder: it names its frozen encoder small_cnn "
                                f"(SHA-256 {checkpoint[FROZEN_ENCODER]['sha256'][:16]}…) by its source; pass --weights "
                                f"{weights}, which is that encoder")
    assert build_encoder("small_cnn", str(weights)).state_dict().keys()  # which loads


def test_a_spilled_state_of_another_encoder_is_refused(tmp_path):
    weights = save_encoder_weights(tmp_path / "pretrained.pt", seed=0)
    model = build_task_model(TASK, "small_cnn", str(weights), seed=0, freeze_encoder=True)
    store = ClientStore(tmp_path / "spill", 0, model.frozen_encoder)
    store.put("0", model.state_dict())
    spilled = load_checkpoint(tmp_path / "spill" / "client_0.pt")
    spilled[FROZEN_ENCODER]["sha256"] = "f" * 64
    torch.save(spilled, tmp_path / "spill" / "client_0.pt")
    with pytest.raises(TaskHetError, match=r"client_0.pt was written with the frozen encoder small_cnn .*SHA-256 ffff"):
        store.get("0")


def test_a_step_refuses_a_missing_source_in_one_error_line(frozen_runs, tmp_path, capsys):
    """Step 3 on a best.pt whose weights file is gone: one line naming the checkpoint, the file and the hash."""
    shutil.copytree(frozen_runs["step2"], tmp_path / "step2")
    checkpoint = load_checkpoint(tmp_path / "step2" / "best.pt")
    checkpoint[FROZEN_ENCODER]["weights"] = str(tmp_path / "gone.pt")
    atomic_torch_save(checkpoint, tmp_path / "step2" / "best.pt")
    data_root, manifest = frozen_runs["data"]
    with pytest.raises(SystemExit):
        run_main(embed.main, ["--checkpoint", str(tmp_path / "step2" / "best.pt"), "--manifest", str(manifest),
                              "--data_path", str(data_root), "--out", str(tmp_path / "step3"), "--no-use_accelerator"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and str(tmp_path / "step2" / "best.pt") in err[0]
    assert "gone.pt" in err[0] and checkpoint[FROZEN_ENCODER]["sha256"][:16] in err[0]
    assert not (tmp_path / "step3" / "embeddings.npy").exists()


def test_an_old_whole_checkpoint_of_a_frozen_model_still_loads(tmp_path):
    weights = save_encoder_weights(tmp_path / "pretrained.pt", seed=0)
    model = build_task_model(TASK, "small_cnn", str(weights), seed=0, freeze_encoder=True)
    atomic_torch_save({"model": model.state_dict(), "model_config": model.config}, tmp_path / "best.pt")
    weights.unlink()  # a whole checkpoint needs no source
    again = load_task_model(tmp_path / "best.pt")
    assert_same(model.state_dict(), again.state_dict())
    assert again.frozen_encoder is None  # nothing names the source: its checkpoints stay whole


# ----- the steps read the new checkpoints -----
def test_steps_3_3c_and_4_read_a_frozen_step2_checkpoint(frozen_runs, tmp_path):
    data_root, manifest = frozen_runs["data"]
    best = frozen_runs["step2"] / "best.pt"
    embed.main(["--checkpoint", str(best), "--manifest", str(manifest), "--data_path", str(data_root),
                "--out", str(tmp_path / "step3"), "--n_clusters", "2", "--no-use_accelerator"])
    assert (tmp_path / "step3" / "embeddings.npy").is_file()
    meter.main(["--checkpoint", str(best), "--manifest", str(manifest), "--assignments", str(frozen_runs["assignments"]),
                "--data_path", str(data_root), "--no-use_accelerator", "--out", str(tmp_path / "step3c")])
    assert (tmp_path / "step3c" / "meter.json").is_file()
    test_fed.main(step4_argv(data_root, manifest, frozen_runs["assignments"], tmp_path / "step4", frozen_runs["weights"],
                             "--method", "fedavg", "--n_rounds", "1", "--init_from", "centralized",
                             "--centralized_checkpoint", str(best)))
    started = load_full_checkpoint(tmp_path / "step4" / "checkpoint.pt")
    trained = load_full_checkpoint(best)["model"]
    assert encoder_keys(load_checkpoint(tmp_path / "step4" / "checkpoint.pt")) == []  # the started run names it too
    for key, value in trained.items():
        if key.startswith("encoder."):
            assert torch.equal(started["model"][key], value), key


def test_merge_reads_frozen_checkpoints_and_writes_a_whole_model(frozen_runs, tmp_path):
    base, tuned = frozen_runs["step4"] / "best.pt", frozen_runs["step2"] / "best.pt"
    merge_main(["--base", str(base), "--finetuned", f"a={tuned}", "--lam", "0.5", "--out", str(tmp_path / "merge")])
    merged = load_checkpoint(tmp_path / "merge" / "merged.pt")
    merged = merged.get("model", merged)
    source = FrozenEncoder.rebuild("small_cnn", str(frozen_runs["weights"]))
    for key, value in source.tensors.items():  # τ is zero on the encoder: θ_0's copy of it, whole
        assert torch.equal(merged[key], value), key
    head = load_full_checkpoint(base)["model"]["head.weight"]
    torch.testing.assert_close(merged["head.weight"], head + 0.5 * (load_full_checkpoint(tuned)["model"]["head.weight"] - head))


def test_a_studys_unfrozen_copy_is_a_whole_checkpoint_that_trains_its_encoder(frozen_runs, tmp_path):
    write_unfrozen_copy(frozen_runs["step2"] / "best.pt", tmp_path / "head" / "best.pt")
    copy = load_checkpoint(tmp_path / "head" / "best.pt")
    assert FROZEN_ENCODER not in copy and copy["model_config"]["freeze_encoder"] is False
    assert_same(load_full_checkpoint(frozen_runs["step2"] / "best.pt")["model"], copy["model"])
    model = load_task_model(tmp_path / "head" / "best.pt")
    assert model.frozen_encoder is None and all(param.requires_grad for param in model.encoder.parameters())
