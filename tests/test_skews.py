"""Per-client skews (issue 22): feature skew and concept shift drawn by step 3b, applied by step 4.

Every test reads real step-3b output (a small digits manifest) and real step-4 loaders
(``network.client_data.make_clients``), and compares against values computed by hand here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from datasets.digits import DigitsDataset, select_digits
from network.client_data import global_test_loader, make_clients
from partitioning.skew_record import draw_skews
from partitioning.skews import SKEWS, SkewContext, check_pairs, list_skews, swap_mapping
from steps import assign, federated
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.cli import run_main
from utils.errors import TaskHetError
from utils.seeding import torch_generator

N_CLIENTS = 4
IMAGE_SIZE = 16


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("digits") / "manifest.csv"
    select_digits(0.2, seed=0, n_samples=240).to_csv(path, index=False)
    return path


def step3b(manifest: Path, out: Path, *flags: str) -> Path:
    assign.main(["--manifest", str(manifest), "--n_clients", str(N_CLIENTS), "--out", str(out), "--seed", "3", "--no-plots",
                 *flags])
    return out / "assignments.csv"


def clients_of(manifest: Path, assignments: Path, **changes):
    manifest_table = pd.read_csv(manifest)
    table = pd.read_csv(assignments)
    args = SimpleNamespace(data_path=manifest.parent, image_size=IMAGE_SIZE, cache_dir=None, batch_size=1000,
                           num_workers=0, rand_seed=0, assignments=assignments, local_test="assigned", cache_features=False)
    for key, value in changes.items():
        setattr(args, key, value)
    task = SimpleNamespace(kind="classification", name="digit_class", domain="digit_class")
    return manifest_table, make_clients(args, manifest_table, table, task, changes.get("feature_model")), args, task


def one_batch(loader) -> dict:
    batches = list(loader)
    assert len(batches) == 1
    return batches[0]


def plain(manifest_table: pd.DataFrame, sample_ids) -> DigitsDataset:
    rows = manifest_table.set_index("sample_id").loc[list(sample_ids)].reset_index()
    return DigitsDataset(rows, IMAGE_SIZE)


def plain_images(manifest_table, sample_ids) -> torch.Tensor:
    dataset = plain(manifest_table, sample_ids)
    return torch.stack([dataset[i]["image"] for i in range(len(dataset))])


# ----- feature_noise -----
def test_noise_levels_are_niid_bench_form_and_client_0_is_bit_identical(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3")
    record = json.loads(path.with_suffix(".json").read_text())["skews"]["feature_noise"]
    sigmas = [record["clients"][str(i)]["sigma"] for i in range(N_CLIENTS)]
    assert sigmas == pytest.approx([0.0, 0.1, 0.2, 0.3], abs=1e-12)  # σ·i/(N−1), N = 4
    manifest, clients, _, _ = clients_of(manifest_path, path)
    for client, sigma in zip(clients, sigmas):
        batch = one_batch(client.train_loader(0))
        clean = plain_images(manifest, batch["sample_id"])
        if sigma == 0:
            assert torch.equal(batch["image"], clean)  # bit-identical
            continue
        seed = record["clients"][client.client_id]["seed"]
        noise = torch.stack([torch.randn(clean.shape[1:], generator=torch_generator(seed, sid)) for sid in batch["sample_id"]])
        torch.testing.assert_close(batch["image"], clean + sigma * noise, rtol=0, atol=1e-6)
        assert (batch["image"] - clean).std().item() == pytest.approx(sigma, rel=0.1)


def test_client_test_rows_are_skewed_like_train_rows(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3")
    manifest, clients, _, _ = clients_of(manifest_path, path)
    last = clients[-1]
    batch = one_batch(last.test_loader)
    assert (batch["image"] - plain_images(manifest, batch["sample_id"])).abs().max() > 0.1


# ----- feature_shift -----
def test_shift_parameters_are_seeded_per_client_and_applied_as_recorded(manifest_path, tmp_path):
    import torchvision.transforms.v2.functional as TF

    flags = ("--feature_shift", "brightness=0.4,contrast=0.3,blur=1.5,rotation=20")
    first, second = step3b(manifest_path, tmp_path / "a", *flags), step3b(manifest_path, tmp_path / "b", *flags)
    record = json.loads(first.with_suffix(".json").read_text())["skews"]["feature_shift"]
    assert record == json.loads(second.with_suffix(".json").read_text())["skews"]["feature_shift"]
    other = json.loads(step3b(manifest_path, tmp_path / "c", *flags[:1], flags[1]).with_suffix(".json").read_text())
    assert other["skews"]["feature_shift"] == record  # the same flags and seed: the same draws
    params = [record["clients"][str(i)] for i in range(N_CLIENTS)]
    assert len({p["rotation"] for p in params}) == N_CLIENTS  # drawn per client
    assert all(0.6 <= p["brightness"] <= 1.4 and 0 <= p["blur"] <= 1.5 and abs(p["rotation"]) <= 20 for p in params)
    manifest, clients, _, _ = clients_of(manifest_path, first)
    client = clients[1]
    p = record["clients"]["1"]
    batch = one_batch(client.train_loader(0))
    expected = plain_images(manifest, batch["sample_id"])
    expected = TF.adjust_contrast(TF.adjust_brightness(expected, p["brightness"]), p["contrast"])
    size = 2 * int(np.ceil(3 * p["blur"])) + 1
    expected = TF.rotate(TF.gaussian_blur(expected, [size, size], [p["blur"]] * 2), p["rotation"],
                         interpolation=TF.InterpolationMode.BILINEAR)
    assert torch.equal(batch["image"], expected)


def test_an_edited_record_is_what_step_4_applies(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3")
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["skews"]["feature_noise"]["clients"]["0"]["sigma"] = 0.5  # the user makes client 0 the noisiest
    meta["skews"]["feature_noise"]["clients"]["3"]["sigma"] = 0.0
    sidecar.write_text(json.dumps(meta))
    manifest, clients, _, _ = clients_of(manifest_path, path)
    first, last = one_batch(clients[0].train_loader(0)), one_batch(clients[3].train_loader(0))
    assert torch.equal(last["image"], plain_images(manifest, last["sample_id"]))
    assert (first["image"] - plain_images(manifest, first["sample_id"])).std().item() == pytest.approx(0.5, rel=0.1)


# ----- label_swap -----
def test_swapped_pairs_are_exactly_those_recorded_and_other_clients_keep_their_labels(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--label_swap", "2", "--concept_fraction", "0.5")
    record = json.loads(path.with_suffix(".json").read_text())["skews"]["label_swap"]["clients"]
    assert len(record) == 2  # round(0.5 · 4)
    manifest, clients, _, _ = clients_of(manifest_path, path)
    truth = manifest.set_index("sample_id")["label"]
    for client in clients:
        for loader in (client.train_loader(0), client.test_loader):
            batch = one_batch(loader)
            true = truth.loc[list(batch["sample_id"])].to_numpy()
            seen = batch["digit_class"].numpy()
            assert np.array_equal(batch["label"].numpy(), seen)
            if client.client_id not in record:
                assert np.array_equal(seen, true)
                continue
            pairs = record[client.client_id]["pairs"]
            assert len(pairs) == 2 and len({c for pair in pairs for c in pair}) == 4
            mapping = {c: c for c in range(10)}
            for a, b in pairs:
                mapping[a], mapping[b] = b, a
            assert np.array_equal(seen, [mapping[c] for c in true])
            changed = {(int(t), int(s)) for t, s in zip(true, seen) if t != s}
            assert changed <= {(a, b) for a, b in pairs} | {(b, a) for a, b in pairs}


def test_given_pairs_apply_to_the_chosen_fraction_and_swap_the_class_counts(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--label_swap", "1-7", "--concept_fraction", "0.25")
    record = json.loads(path.with_suffix(".json").read_text())["skews"]["label_swap"]["clients"]
    assert list(record.values()) == [{"pairs": [[1, 7]]}]
    manifest, clients, _, _ = clients_of(manifest_path, path)
    table = pd.read_csv(path)
    (swapped,) = record
    client = next(c for c in clients if c.client_id == swapped)
    train_ids = table[(table["client_id"] == int(swapped)) & (table["subset"] == "train")]["sample_id"]
    counts = np.bincount(manifest.set_index("sample_id").loc[train_ids, "label"], minlength=10)
    counts[[1, 7]] = counts[[7, 1]]
    assert client.class_counts == tuple(counts.tolist())


def test_global_test_set_is_never_transformed(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.5", "--feature_shift", "brightness=0.5,rotation=30",
                  "--label_swap", "3", "--concept_fraction", "1")
    manifest, clients, args, task = clients_of(manifest_path, path)
    assert all(one_batch(c.train_loader(0))["image"].shape[0] for c in clients)
    loader = global_test_loader(args, manifest, task)
    images = torch.cat([batch["image"] for batch in loader])
    labels = torch.cat([batch["digit_class"] for batch in loader])
    test = manifest[manifest["split"] == "test"]
    assert torch.equal(images, plain_images(manifest, test["sample_id"]))
    assert np.array_equal(labels.numpy(), test["label"].to_numpy())


# ----- pure functions -----
def test_swap_mapping_and_pair_checks():
    assert swap_mapping([[1, 7], [2, 3]], 10) == [0, 7, 3, 2, 4, 5, 6, 1, 8, 9]
    assert check_pairs([[7, 1]], 10, "x") == [[1, 7]]
    for pairs, message in (([[2, 2]], "onto itself"), ([[1, 10]], r"\[0, 9\]"), ([[1, 2], [2, 3]], "two pairs"),
                           ([[1]], "not a pair"), ([[1.5, 2]], "integer")):
        with pytest.raises(TaskHetError, match=message):
            check_pairs(pairs, 10, "x")


@pytest.mark.parametrize("name", list_skews())
def test_every_skew_is_seeded_and_its_record_reads_back(name):
    """Generic over the registry: the same seed draws the same record, and each client's recorded
    parameters pass the entry's own check unchanged."""
    context = SkewContext("taskonomy", 10, ("depth_euclidean", "depth_zbuffer", "class_scene"), 5)
    settings = {"feature_noise": {"sigma": 0.2}, "feature_shift": {"limits": {"hue": 0.1, "blur": 1.0}},
                "label_swap": {"pairs": 2, "fraction": 0.6},
                "target_variant": {"task": "depth_euclidean", "variant": "depth_zbuffer", "fraction": 0.4}}[name]
    record = draw_skews({name: settings}, context, seed=7)
    assert record == draw_skews({name: settings}, context, seed=7)
    skew = SKEWS.get(name)
    for key, params in record[name]["clients"].items():
        assert skew.check_client(json.loads(json.dumps(params)), context, key) == params


# ----- bad input: one error line each -----
def error_line(capsys, main, argv) -> str:
    capsys.readouterr()  # what earlier steps logged
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


@pytest.mark.parametrize("flags, expected", [
    (("--feature_noise", "-0.1"), "--feature_noise"),
    (("--feature_noise", "nan"), "--feature_noise"),
    (("--label_swap", "4-4"), "onto itself"),
    (("--label_swap", "3-10"), r"--label_swap"),
    (("--feature_shift", "sharpen=0.5"), "unknown transform 'sharpen'"),
    (("--feature_shift", "rotation=nan"), "rotation"),
    (("--target_variant", "digit_class:depth_zbuffer"), "has no target variant"),
    (("--target_variant", "depth_euclidean:depth_zbuffer"), "not a task of data family 'digits'"),
    (("--concept_fraction", "1.5", "--label_swap", "1"), "--concept_fraction"),
])
def test_bad_step3b_flags_are_one_error_line(manifest_path, tmp_path, capsys, flags, expected):
    out = tmp_path / "a"
    line = error_line(capsys, assign.main, ["--manifest", str(manifest_path), "--n_clients", "4", "--out", str(out), *flags])
    assert re.search(expected, line), line
    assert not (out / "assignments.csv").exists()


def edit(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta["skews"])
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("change, expected", [
    (lambda s: s["feature_noise"]["clients"]["1"].update(sigma=float("nan")), r"skews\.feature_noise\.clients\.1\.sigma"),
    (lambda s: s["feature_noise"]["clients"]["1"].update(sigma=-1), r"skews\.feature_noise\.clients\.1\.sigma"),
    (lambda s: s.update(feature_blur=s.pop("feature_noise")), "unknown skew 'feature_blur'"),
    (lambda s: s["label_swap"]["clients"].update({"9": {"pairs": [[1, 2]]}}), r"clients\.9: '9' is not a client id"),
    (lambda s: s["label_swap"]["clients"].update({"0": {"pairs": [[5, 5]]}}), "onto itself"),
    (lambda s: s["label_swap"]["clients"].update({"0": {"pairs": [[5, 11]]}}), r"clients\.0\.pairs"),
    (lambda s: s["label_swap"]["clients"].update({"00": {"pairs": [[1, 2]]}, "0": {"pairs": [[1, 2]]}}), "appears twice"),
])
def test_a_bad_recorded_skew_is_one_error_line_naming_file_and_key(manifest_path, tmp_path, capsys, change, expected):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.2", "--label_swap", "1", "--concept_fraction", "0.5")
    edit(path.with_suffix(".json"), change)
    line = error_line(capsys, federated.main, step4_argv(manifest_path, path, tmp_path / "run"))
    assert "assignments.json" in line and pytest.importorskip("re").search(expected, line), line
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_without_n_clients_in_the_sidecar_the_client_ids_are_those_of_the_table(manifest_path, tmp_path, capsys):
    """A sidecar without ``n_clients`` (hand-made): the clients are 0..max(client_id) of assignments.csv, so a record
    naming the next id (no such client) is refused, and one naming the last client is applied."""
    path = step3b(manifest_path, tmp_path / "a", "--label_swap", "1", "--concept_fraction", "0.5")
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    del meta["n_clients"]
    assert pd.read_csv(path)["client_id"].max() == N_CLIENTS - 1
    meta["skews"]["label_swap"]["clients"][str(N_CLIENTS - 1)] = {"pairs": [[1, 2]]}
    sidecar.write_text(json.dumps(meta))
    manifest, clients, _, _ = clients_of(manifest_path, path)
    batch = one_batch(clients[N_CLIENTS - 1].train_loader(0))
    labels = torch.tensor(manifest.set_index("sample_id").loc[list(batch["sample_id"]), "label"].to_numpy())
    assert torch.equal(batch["digit_class"], torch.tensor(swap_mapping([[1, 2]], 10))[labels])
    meta["skews"]["label_swap"]["clients"][str(N_CLIENTS)] = {"pairs": [[1, 2]]}
    sidecar.write_text(json.dumps(meta))
    line = error_line(capsys, federated.main, step4_argv(manifest_path, path, tmp_path / "run"))
    assert "assignments.json" in line and f"clients.{N_CLIENTS}: '{N_CLIENTS}' is not a client id in 0..{N_CLIENTS - 1}" \
        in line, line


def test_a_duplicated_key_in_the_record_is_refused(manifest_path, tmp_path, capsys):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.2")
    sidecar = path.with_suffix(".json")
    text = sidecar.read_text().replace('"sigma": 0.0', '"sigma": 0.0, "sigma": 0.9', 1)
    sidecar.write_text(text)
    line = error_line(capsys, federated.main, step4_argv(manifest_path, path, tmp_path / "run"))
    assert "assignments.json" in line and "'sigma' appears twice" in line


# ----- end to end: step 3b -> step 4 on digits -----
def step4_argv(manifest: Path, assignments: Path, out: Path, *extra: str) -> list[str]:
    return ["--task", "digit_class", "--manifest", str(manifest), "--assignments", str(assignments), "--encoder", "small_cnn",
            "--image_size", str(IMAGE_SIZE), "--n_rounds", "1", "--local_steps", "2", "--batch_size", "8",
            "--no-use_accelerator", "--no-progress", "--no-plots", "--rand_seed", "1", "--out", str(out), *extra]


@pytest.mark.parametrize("flags", [("--feature_noise", "0.3"), ("--feature_shift", "brightness=0.3,contrast=0.3,blur=1,rotation=15"),
                                   ("--label_swap", "2", "--concept_fraction", "0.5")])
def test_end_to_end_digits_run_with_each_skew(manifest_path, tmp_path, flags):
    path = step3b(manifest_path, tmp_path / "a", *flags)
    stats = pd.read_csv(tmp_path / "a" / "client_stats.csv", keep_default_na=False)
    column = {"--feature_noise": "noise_sigma", "--feature_shift": "shift_rotation", "--label_swap": "swapped_pairs"}[flags[0]]
    assert list(stats.columns[:5]) == ["client_id", "size", "n_groups", "effective_groups", "js_divergence"]
    recorded = json.loads(path.with_suffix(".json").read_text())["skews"]
    if column == "noise_sigma":
        assert stats[column].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])
    elif column == "shift_rotation":
        assert stats[column].tolist() == [recorded["feature_shift"]["clients"][str(i)]["rotation"] for i in range(N_CLIENTS)]
    else:
        assert stats[column].tolist() == ["-".join(map(str, recorded["label_swap"]["clients"][str(i)]["pairs"][0])) + ";"
                                          + "-".join(map(str, recorded["label_swap"]["clients"][str(i)]["pairs"][1]))
                                          if str(i) in recorded["label_swap"]["clients"] else "" for i in range(N_CLIENTS)]
    result = federated.main(step4_argv(manifest_path, path, tmp_path / "run"))
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert np.isfinite(result["best_test_loss"]) and not metrics.empty


def test_a_resumed_run_applies_the_same_transforms(manifest_path, tmp_path):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3", "--feature_shift", "contrast=0.3,rotation=15",
                  "--label_swap", "1", "--concept_fraction", "0.5")
    federated.main(step4_argv(manifest_path, path, tmp_path / "whole", "--n_rounds", "2"))
    federated.main(step4_argv(manifest_path, path, tmp_path / "split"))
    federated.main(step4_argv(manifest_path, path, tmp_path / "split", "--n_rounds", "2"))  # resumes at round 2
    whole = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)["model"]
    split = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)["model"]
    assert whole.keys() == split.keys() and all(torch.equal(whole[key], split[key]) for key in whole)
    rows = [pd.read_csv(folder / "metrics.csv").query("round == 2") for folder in (tmp_path / "whole", tmp_path / "split")]
    pd.testing.assert_frame_equal(rows[0].reset_index(drop=True), rows[1].reset_index(drop=True))


def test_an_edited_record_refuses_to_resume(manifest_path, tmp_path, capsys):
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3")
    federated.main(step4_argv(manifest_path, path, tmp_path / "run"))
    edit(path.with_suffix(".json"), lambda s: s["feature_noise"]["clients"]["1"].update(sigma=0.25))
    line = error_line(capsys, federated.main, step4_argv(manifest_path, path, tmp_path / "run", "--n_rounds", "2"))
    assert "different run" in line


def test_cached_features_get_the_noise_before_encoding(manifest_path, tmp_path):
    from models import build_task_model

    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3")
    model = build_task_model("digit_class", "small_cnn", "none", num_classes=10, seed=0, freeze_encoder=True)
    manifest, clients, _, _ = clients_of(manifest_path, path, feature_model=model, cache_features=True)
    record = json.loads(path.with_suffix(".json").read_text())["skews"]["feature_noise"]["clients"]
    for client in (clients[0], clients[3]):
        batch = one_batch(client.train_loader(0))
        images = plain_images(manifest, batch["sample_id"])
        params = record[client.client_id]
        if params["sigma"]:
            noise = torch.stack([torch.randn(images.shape[1:], generator=torch_generator(params["seed"], sid))
                                 for sid in batch["sample_id"]])
            images = images + params["sigma"] * noise
        with torch.inference_mode():
            expected = model.encoder.eval()(model.normalise(images))
        for got, want in zip(batch["encoded"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    run = federated.main(step4_argv(manifest_path, path, tmp_path / "run", "--freeze_encoder", "--cache_features"))
    assert np.isfinite(run["best_test_loss"])


def test_cached_features_refuse_proportional_client_tests_under_a_feature_skew(manifest_path, tmp_path, capsys):
    """--local_test proportional draws client tests from the global test split, whose maps are the untransformed
    images': a feature-skewed client's test would skip its skew. Refused before training; a concept shift is fine."""
    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3")
    cached = ("--freeze_encoder", "--cache_features", "--local_test", "proportional")
    line = error_line(capsys, federated.main, step4_argv(manifest_path, path, tmp_path / "run", *cached))
    assert line.startswith(f"error: {path.with_suffix('.json')}: feature skews with --cache_features") \
        and "--local_test assigned, or --no-cache_features" in line, line
    assert not (tmp_path / "run" / "metrics.csv").exists()
    concept = step3b(manifest_path, tmp_path / "b", "--label_swap", "1", "--concept_fraction", "0.5")
    run = federated.main(step4_argv(manifest_path, concept, tmp_path / "run_concept", *cached))
    assert np.isfinite(run["best_test_loss"])


# ----- target_variant: dense concept shift on the synthetic Taskonomy family -----


def test_variant_clients_train_on_the_variant_targets_and_the_global_test_keeps_the_task(tiny_data_root, tiny_manifest,  # noqa: F811
                                                                                        tmp_path):
    from datasets.taskonomy import TaskonomyDataset
    from models import get_task

    out = tmp_path / "a"
    assign.main(["--manifest", str(tiny_manifest), "--n_clients", "2", "--out", str(out), "--scheme", "iid",
                 "--target_variant", "depth_euclidean:depth_zbuffer", "--concept_fraction", "0.5"])
    record = json.loads((out / "assignments.json").read_text())["skews"]["target_variant"]["clients"]
    assert list(record.values()) == [{"task": "depth_euclidean", "variant": "depth_zbuffer"}]
    stats = pd.read_csv(out / "client_stats.csv", keep_default_na=False)
    assert stats["target_variant"].tolist() == ["depth_zbuffer" if str(i) in record else "" for i in range(2)]
    manifest = pd.read_csv(tiny_manifest)
    task = get_task("depth_euclidean")
    args = SimpleNamespace(data_path=tiny_data_root, image_size=16, cache_dir=None, batch_size=1000, num_workers=0,
                           rand_seed=0, assignments=out / "assignments.csv", local_test="assigned", cache_features=False)
    clients = make_clients(args, manifest, pd.read_csv(out / "assignments.csv"), task)
    by_id = manifest.set_index("sample_id")

    def truth(domain: str, ids) -> torch.Tensor:
        dataset = TaskonomyDataset(tiny_data_root, by_id.loc[list(ids)].reset_index(), [domain], 16, None)
        return torch.stack([dataset[i][domain] for i in range(len(dataset))])

    for client in clients:
        batch = one_batch(client.train_loader(0))
        domain = "depth_zbuffer" if client.client_id in record else "depth_euclidean"
        assert torch.equal(batch["depth_euclidean"], truth(domain, batch["sample_id"]))
        assert "depth_zbuffer" not in batch
    zbuffer = truth("depth_zbuffer", manifest["sample_id"][:4])
    assert not torch.equal(zbuffer, truth("depth_euclidean", manifest["sample_id"][:4]))  # really two concepts
    test = torch.cat([b["depth_euclidean"] for b in global_test_loader(args, manifest, task)])
    assert torch.equal(test, truth("depth_euclidean", manifest.loc[manifest["split"] == "test", "sample_id"]))


def test_a_variant_recorded_for_another_task_is_refused(tiny_data_root, tiny_manifest, tmp_path):  # noqa: F811
    from models import get_task

    out = tmp_path / "a"
    assign.main(["--manifest", str(tiny_manifest), "--n_clients", "2", "--out", str(out), "--scheme", "iid",
                 "--target_variant", "depth_euclidean:depth_zbuffer", "--concept_fraction", "1"])
    args = SimpleNamespace(data_path=tiny_data_root, image_size=16, cache_dir=None, batch_size=1000, num_workers=0,
                           rand_seed=0, assignments=out / "assignments.csv", local_test="assigned", cache_features=False)
    with pytest.raises(TaskHetError, match="--task normal has no recorded variant"):
        make_clients(args, pd.read_csv(tiny_manifest), pd.read_csv(out / "assignments.csv"), get_task("normal"))


# ----- step 3c: the meter measures the clients as step 4 trains them -----
def test_the_meter_takes_each_clients_gradient_on_its_skewed_rows(manifest_path, tmp_path):
    from models import load_task_model
    from network.heterogeneity import full_gradient
    from steps import meter, train_centralized
    from training.loop import make_loader

    train_centralized.main(["--task", "digit_class", "--encoder", "small_cnn", "--weights", "none", "--manifest",
                            str(manifest_path), "--image_size", str(IMAGE_SIZE), "--batch_size", "16", "--n_epochs", "1",
                            "--optimizer", "adamw", "--no-use_accelerator", "--no-plots", "--out", str(tmp_path / "step2")])
    path = step3b(manifest_path, tmp_path / "a", "--label_swap", "1-7,2-3", "--concept_fraction", "0.5")
    meter.main(["--checkpoint", str(tmp_path / "step2" / "best.pt"), "--manifest", str(manifest_path), "--assignments",
                str(path), "--data_path", str(manifest_path.parent), "--no-use_accelerator", "--out", str(tmp_path / "m")])
    measured = pd.read_csv(tmp_path / "m" / "metrics.csv").query("metric == 'grad_norm2' and client != 'all'")
    swapped = json.loads(path.with_suffix(".json").read_text())["skews"]["label_swap"]["clients"]
    model = load_task_model(tmp_path / "step2" / "best.pt")
    manifest, table = pd.read_csv(manifest_path), pd.read_csv(path)
    mapping = torch.tensor(swap_mapping([[1, 7], [2, 3]], 10))

    def loss_fn(net, batch, reduction="mean"):
        return torch.nn.functional.cross_entropy(net(batch["image"])[0].float(), batch["digit_class"], reduction=reduction)

    for client, norm in zip(measured["client"].astype(str), measured["value"]):
        ids = table.query(f"client_id == {client} and subset == 'train'")["sample_id"]
        dataset = plain(manifest, ids)
        items = [dataset[i] for i in range(len(dataset))]
        if client in swapped:
            items = [{**item, "digit_class": mapping[item["digit_class"]]} for item in items]
        gradient = full_gradient(model, make_loader(items, 16, False, 0), loss_fn, torch.device("cpu"))
        assert float(gradient @ gradient) == pytest.approx(norm, rel=1e-5)


def meter_clients(manifest: Path, assignments: Path, task_name: str, feature_model, data_path: Path | None = None):
    """Each client's ``(id, batch)`` as step 3c builds them (network.client_skews.client_rows_dataset): its train rows,
    with ``--cache_features`` when ``feature_model`` is given; one batch per client."""
    from datasets.family import load_manifest
    from models import get_task
    from network.client_skews import client_rows_dataset, run_skews
    from training.loop import make_loader

    family, manifest_table = load_manifest(manifest)
    table, task = pd.read_csv(assignments), get_task(task_name)
    args = SimpleNamespace(data_path=data_path or manifest.parent, image_size=IMAGE_SIZE, cache_dir=None,
                           assignments=assignments, cache_features=feature_model is not None, local_test="assigned")
    skews = run_skews(args, manifest_table, table, task, family)
    by_id = manifest_table.set_index("sample_id")
    for client_id, rows in table[table["subset"] == "train"].groupby("client_id", sort=True):
        dataset, collate = client_rows_dataset(args, manifest_table, by_id.loc[list(rows["sample_id"])].reset_index(),
                                               task, family, skews.get(int(client_id)), feature_model)
        yield str(client_id), one_batch(make_loader(dataset, 1000, False, 0, collate_fn=collate))


@pytest.mark.parametrize("flags", [("--label_swap", "1-7,2-3", "--concept_fraction", "0.5"),
                                   ("--feature_noise", "0.3", "--label_swap", "1-7,2-3", "--concept_fraction", "0.5")],
                         ids=["concept_only", "noise_and_concept"])
def test_the_meters_cached_features_are_the_skewed_images_maps_with_the_swapped_labels(manifest_path, tmp_path, flags):
    """Step 3c with --cache_features: a client's maps are the frozen encoder's maps of its noised images (the noise
    applied once, before encoding), and a concept shift still swaps its labels (the collate keeps the concept)."""
    from models import build_task_model

    path = step3b(manifest_path, tmp_path / "a", *flags)
    record = json.loads(path.with_suffix(".json").read_text())["skews"]
    swapped, noise = record["label_swap"]["clients"], record.get("feature_noise", {}).get("clients", {})
    assert swapped and (noise or "--feature_noise" not in flags)
    mapping = torch.tensor(swap_mapping([[1, 7], [2, 3]], 10))
    model = build_task_model("digit_class", "small_cnn", "none", num_classes=10, seed=0, freeze_encoder=True)
    manifest = pd.read_csv(manifest_path)
    seen = []
    for client_id, batch in meter_clients(manifest_path, path, "digit_class", model):
        images = plain_images(manifest, batch["sample_id"])
        if noise.get(client_id, {}).get("sigma"):
            params = noise[client_id]
            images = images + params["sigma"] * torch.stack(
                [torch.randn(images.shape[1:], generator=torch_generator(params["seed"], sid)) for sid in batch["sample_id"]])
        with torch.inference_mode():
            expected = model.encoder.eval()(model.normalise(images))
        for got, want in zip(batch["encoded"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        labels = torch.tensor(manifest.set_index("sample_id").loc[list(batch["sample_id"]), "label"].to_numpy())
        assert torch.equal(batch["digit_class"], mapping[labels] if client_id in swapped else labels), client_id
        seen.append(client_id)
    assert seen == [str(client) for client in range(N_CLIENTS)]


@pytest.mark.parametrize("cached", [False, True], ids=["images", "cached_features"])
def test_the_meter_reads_a_variant_clients_rows_for_the_variant(tiny_data_root, tiny_manifest, tmp_path, cached):  # noqa: F811
    """Step 3c under target_variant: a variant client's depth targets are the variant's (depth_zbuffer), under the
    task's key, with or without --cache_features; the other client keeps the task's."""
    from datasets.taskonomy import TaskonomyDataset
    from models import build_task_model

    out = tmp_path / "a"
    assign.main(["--manifest", str(tiny_manifest), "--n_clients", "2", "--out", str(out), "--scheme", "iid",
                 "--target_variant", "depth_euclidean:depth_zbuffer", "--concept_fraction", "0.5"])
    record = json.loads((out / "assignments.json").read_text())["skews"]["target_variant"]["clients"]
    model = build_task_model("depth_euclidean", "small_cnn", "none", seed=0, freeze_encoder=True) if cached else None
    by_id = pd.read_csv(tiny_manifest).set_index("sample_id")
    seen = []
    for client_id, batch in meter_clients(tiny_manifest, out / "assignments.csv", "depth_euclidean", model,
                                          tiny_data_root):
        domain = "depth_zbuffer" if client_id in record else "depth_euclidean"
        truth = TaskonomyDataset(tiny_data_root, by_id.loc[list(batch["sample_id"])].reset_index(), [domain], IMAGE_SIZE,
                                 None)
        assert torch.equal(batch["depth_euclidean"], torch.stack([truth[i][domain] for i in range(len(truth))]))
        assert "depth_zbuffer" not in batch and ("encoded" in batch) == cached
        seen.append(client_id)
    assert len(seen) == 2 and sum(client_id in record for client_id in seen) == 1


# ----- experiment files: partition.skews passes step 3b's skew flags -----
@pytest.mark.slow
def test_an_experiment_file_partitions_with_skews(tmp_path):
    import yaml

    import run_pipeline
    from tests.test_digits import tiny_digits_experiment

    config = tiny_digits_experiment(tmp_path)
    config["partition"]["skews"] = {"feature_noise": 0.2, "label_swap": "1-7", "concept_fraction": 0.34}
    config["heterogeneity_meter"] = False
    experiment = tmp_path / "skews.yaml"
    experiment.write_text(yaml.safe_dump(config))
    run_pipeline.main([str(experiment), "--results", str(tmp_path / "results"), "--no-run_plots"])
    sidecars = sorted((tmp_path / "results").rglob("assignments/**/assignments.json"))
    assert len(sidecars) == 2  # label-based and embedding-based
    for sidecar in sidecars:
        record = json.loads(sidecar.read_text())["skews"]
        assert [record["feature_noise"]["clients"][str(i)]["sigma"] for i in range(3)] == pytest.approx([0.0, 0.1, 0.2])
        assert list(record["label_swap"]["clients"].values()) == [{"pairs": [[1, 7]]}]  # round(0.34 · 3) = 1 client


def test_an_unknown_skew_key_in_an_experiment_file_is_refused(tmp_path):
    import yaml

    from pipeline.experiment import load_experiment
    from tests.test_digits import tiny_digits_experiment

    config = tiny_digits_experiment(tmp_path)
    config["partition"]["skews"] = {"feature_blur": 1.0}
    experiment = tmp_path / "bad.yaml"
    experiment.write_text(yaml.safe_dump(config))
    with pytest.raises(TaskHetError, match=r"bad.yaml: partition.skews 'feature_blur' is unknown; choose from: feature_noise"):
        load_experiment(experiment)


def test_dense_tasks_refuse_rotation_and_label_swap_but_take_photometric_shifts():
    from partitioning.skew_record import client_skews
    from partitioning.skews import BatchKeys

    dense = BatchKeys("rgb", "depth_euclidean", "depth_euclidean", "dense", "scene_class", 4)
    with pytest.raises(TaskHetError, match="rotates client images by 5°, but --task depth_euclidean is dense"):
        client_skews({"feature_shift": {0: {"rotation": 5.0}}}, dense)
    with pytest.raises(TaskHetError, match="label_swap is a classification concept shift; --task depth_euclidean"):
        client_skews({"label_swap": {0: {"pairs": [[0, 1]]}}}, dense)
    skew = client_skews({"feature_shift": {0: {"brightness": 0.5}}}, dense)[0]
    batch = skew.apply({"rgb": torch.full((2, 3, 4, 4), 0.8), "sample_id": ["a", "b"], "depth_euclidean": torch.ones(2, 1, 4, 4)})
    assert torch.allclose(batch["rgb"], torch.full((2, 3, 4, 4), 0.4)) and torch.equal(batch["depth_euclidean"], torch.ones(2, 1, 4, 4))


def test_the_heatmap_rows_say_what_each_client_gets():
    from partitioning.skew_record import skew_summary

    record = {"feature_noise": {"clients": {"0": {"sigma": 0.0, "seed": 1}, "1": {"sigma": 0.1, "seed": 2}}},
              "label_swap": {"clients": {"1": {"pairs": [[1, 7], [2, 3]]}}},
              "feature_shift": {"clients": {"0": {"blur": 0.5}}}}
    assert skew_summary(record, 0) == "shift blu=0.5"
    assert skew_summary(record, 1) == "σ=0.1; swap 1↔7,2↔3"
    assert skew_summary(record, 2) == ""


@pytest.mark.slow
def test_the_flower_engine_applies_the_same_skews(manifest_path, tmp_path):
    """test_fed.py --engine flower (Flower's simulation runtime: the project's one Ray simulation in the suite)
    equals the sequential engine under every skew at once. FedRep over 2 rounds on 2 simulated nodes for the 4
    clients: each node hosts two clients and keeps their personal heads between rounds, and the clients' own test
    rows are evaluated on the nodes with those heads, and before and after fine-tuning. (Every algorithm over
    Flower's messages, SCAFFOLD's control variates among them: tests/test_engine_flower.py, in this process.)"""
    from network.client import CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, PERSONAL_TEST_SPLIT
    from utils.loaders import load_checkpoint

    path = step3b(manifest_path, tmp_path / "a", "--feature_noise", "0.3", "--feature_shift", "contrast=0.3",
                  "--label_swap", "1", "--concept_fraction", "0.5", "--client_test_fraction", "0.25")
    fedrep = ("--method", "fedrep", "--n_rounds", "2", "--finetune_steps", "1")
    federated.main(step4_argv(manifest_path, path, tmp_path / "sequential", *fedrep))
    # Flower's simulation (Ray) in a process of its own: it is the subject here, and a Ray instance's end must not
    # take down a pytest-xdist worker that other tests still use. Every core per client: one Ray actor runs the
    # clients of both nodes, one after another (each actor is a process that imports torch, torchvision and Flower,
    # about 25 s of CPU on the 2-core machine; a node's state lives in its folder, not in an actor).
    flower = subprocess.run([sys.executable, "test_fed.py", *step4_argv(manifest_path, path, tmp_path / "flower",
                                                                        *fedrep, "--engine", "flower",
                                                                        "--flower_num_nodes", "2",
                                                                        "--flower_num_cpus", str(os.cpu_count()))],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600)
    assert flower.returncode == 0, flower.stderr
    runs = [pd.read_csv(tmp_path / name / "metrics.csv", dtype={"client": str}) for name in ("sequential", "flower")]
    pd.testing.assert_frame_equal(runs[0][["round", "split", "client", "metric"]], runs[1][["round", "split", "client", "metric"]])
    assert (runs[0].value - runs[1].value).abs().max() < 1e-5
    assert set(runs[1].split) >= {"train", "test", CLIENT_TEST_SPLIT, FINETUNED_TEST_SPLIT, PERSONAL_TEST_SPLIT}
    weights = [load_checkpoint(tmp_path / name / "checkpoint.pt")["model"] for name in ("sequential", "flower")]
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, rtol=1e-5, atol=1e-6)
    # The personal heads stayed on the two nodes: a state per client, each holding only the head.
    assert f"{N_CLIENTS} clients on 2 Flower nodes" in (tmp_path / "flower" / "run.log").read_text()
    heads = sorted((tmp_path / "flower" / "node_states").glob("*/client_*/round_2.pt"))
    assert len(heads) == N_CLIENTS
    assert all(set(load_checkpoint(path)) == {"head.weight", "head.bias"} for path in heads)


@pytest.mark.kernels
def test_a_batch_transformed_in_one_call_equals_each_image_alone_bit_for_bit():
    """ClientSkew transforms a batch's unseen images in one call; the pixels must not depend on the batch an image
    first came in (resume and the cached-feature path see one image at a time). Every shift, the noise and a
    swap, on a batch that is partly in the memo already."""
    from partitioning.skew_record import client_skews
    from partitioning.skews import BatchKeys

    record = {"feature_shift": {1: {"brightness": 1.2, "contrast": 0.8, "saturation": 1.1, "hue": 0.05, "blur": 1.0,
                                    "rotation": 12.0}},
              "feature_noise": {1: {"sigma": 0.2, "seed": 123}},
              "label_swap": {1: {"pairs": [[1, 7], [3, 8]]}}}
    keys = BatchKeys("image", "digit_class", "digit_class", "classification", "label", 10)
    images = torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = [f"s{index}" for index in range(16)]
    alone = client_skews(record, keys)[1]
    one_at_a_time = torch.stack([alone.image(image, sample_id) for image, sample_id in zip(images, ids)])
    batched = client_skews(record, keys)[1]
    batched.images(images[3:9], ids[3:9])  # some seen before, in another batch
    together = batched.apply({"image": images, "sample_id": ids, "label": torch.arange(16) % 10,
                              "digit_class": torch.arange(16) % 10})
    assert torch.equal(together["image"], one_at_a_time)
    assert not torch.equal(together["image"], images)  # the skew did something
    assert together["digit_class"].tolist()[:10] == [0, 7, 2, 8, 4, 5, 6, 1, 3, 9]  # the swap, 1↔7 and 3↔8
    assert sorted(batched.memo) == sorted(ids)
