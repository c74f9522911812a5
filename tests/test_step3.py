"""Step 3 and 3b on tiny rendered data: batch-independent embeddings, then the two CLIs end to end."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from datasets.family import validation_mask
from datasets.taskonomy import TaskonomyDataset, read_manifest
from models import build_task_model
from partitioning.assignments import load_assignments
from partitioning.clustering import embed_samples
from steps import assign, embed
from tests.fixtures import make_tiny_manifest, render_tiny_dataset
from training.loop import make_loader
from utils.errors import TaskHetError

IMAGE_SIZE = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Rendered buildings, their manifest and an untrained small_cnn depth checkpoint."""
    base = tmp_path_factory.mktemp("step3")
    root = render_tiny_dataset(base / "data", n_buildings=4, n_views=6, image_size=IMAGE_SIZE, seed=0)
    manifest = make_tiny_manifest(root, base / "step1", top_k=4)
    model = build_task_model("depth_euclidean", encoder="small_cnn", seed=0)
    checkpoint = base / "step2" / "best.pt"
    checkpoint.parent.mkdir()
    torch.save({"model": model.state_dict(), "model_config": model.config}, checkpoint)
    (checkpoint.parent / "config.json").write_text(json.dumps({"args": {"image_size": IMAGE_SIZE}}))
    return {"root": root, "manifest": manifest, "checkpoint": checkpoint, "model": model, "base": base}


def test_embeddings_do_not_depend_on_batch_size(tiny):
    dataset = TaskonomyDataset(tiny["root"], read_manifest(tiny["manifest"]), [], IMAGE_SIZE)
    model = tiny["model"]
    # A model with non-trivial batch-norm running statistics, as after training.
    model.train()
    with torch.no_grad():
        model(torch.rand(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    one, ids_one = embed_samples(model, make_loader(dataset, 1, shuffle=False, seed=0), torch.device("cpu"), "rgb")
    many, ids_many = embed_samples(model, make_loader(dataset, 64, shuffle=False, seed=0), torch.device("cpu"), "rgb")
    assert not model.training
    assert ids_one == ids_many == dataset.manifest["sample_id"].tolist()
    assert one.dtype == np.float32 and one.shape[0] == len(dataset)
    np.testing.assert_allclose(one, many, rtol=1e-5, atol=1e-6)


def test_extract_embeddings_then_assignments_end_to_end(tiny):
    out = tiny["base"] / "step3"
    argv = ["--checkpoint", str(tiny["checkpoint"]), "--manifest", str(tiny["manifest"]), "--data_path", str(tiny["root"]),
            "--out", str(out), "--n_clusters", "3", "--batch_size", "5", "--no-use_accelerator"]
    embed.main(argv)
    manifest = read_manifest(tiny["manifest"])
    embeddings = np.load(out / "embeddings.npy")
    assert embeddings.dtype == np.float32 and embeddings.shape[0] == len(manifest)
    assert pd.read_csv(out / "sample_ids.csv")["sample_id"].tolist() == manifest["sample_id"].tolist()
    clusters = pd.read_csv(out / "clusters.csv")
    assert clusters["sample_id"].tolist() == manifest["sample_id"].tolist() and set(clusters["cluster"]) == {0, 1, 2}
    assert np.load(out / "centers.npy").shape == (3, embeddings.shape[1])
    agreement = json.loads((out / "agreement.json").read_text())
    assert 0 <= agreement["nmi"] <= 1 and -1 <= agreement["ari"] <= 1
    for name in ("scatter_clusters.png", "scatter_scene_class.png", "contingency.png", "config.json", "metrics.csv", "run.log"):
        assert (out / name).stat().st_size > 0, name

    # A rerun with other clustering settings reuses the embeddings (and gets the same ones).
    before = (out / "embeddings.npy").stat().st_mtime_ns
    embed.main([*argv[:-5], "--n_clusters", "2", "--no-use_accelerator"])
    assert (out / "embeddings.npy").stat().st_mtime_ns == before
    assert set(pd.read_csv(out / "clusters.csv")["cluster"]) == {0, 1}

    outputs = {}
    for name, groups in (("label", "scene_class"), ("embedding", str(out / "clusters.csv")), ("again", str(out / "clusters.csv"))):
        outputs[name] = tiny["base"] / f"step3b-{name}"
        assign.main(["--manifest", str(tiny["manifest"]), "--groups", groups, "--scheme", "dirichlet_mixture",
                                      "--alpha", "0.5", "--n_clients", "3", "--client_test_fraction", "0.25", "--seed", "1",
                                      "--out", str(outputs[name]), *(["--no-plots"] if name == "again" else [])])
    table, meta = load_assignments(outputs["embedding"] / "assignments.csv", manifest)
    train_ids = set(manifest.loc[(manifest.split == "train") & ~validation_mask(manifest), "sample_id"])
    assert manifest["val"].sum() > 0  # the validation rows exist, and no client holds them
    assert set(table["sample_id"]) == train_ids  # dirichlet_mixture uses every train sample, no test or val sample
    assert meta["scheme"] == "dirichlet_mixture" and meta["alpha"] == 0.5 and meta["n_clients"] == 3
    assert set(meta["sources"]) == {"manifest", "groups"} and meta["n_unused"] == 0
    # --no-plots draws no heatmap and changes no file the step writes besides it
    assert (outputs["embedding"] / "assignments.csv").read_bytes() == (outputs["again"] / "assignments.csv").read_bytes()
    assert (outputs["embedding"] / "client_stats.csv").read_bytes() == (outputs["again"] / "client_stats.csv").read_bytes()
    assert (outputs["embedding"] / "client_group_heatmap.png").is_file()
    assert not list(outputs["again"].glob("*.png"))
    label_table, _ = load_assignments(outputs["label"] / "assignments.csv", manifest)
    scene_of = manifest.set_index("sample_id")["scene_class"]
    assert (label_table["group"].astype(int) == label_table["sample_id"].map(scene_of)).all()
    stats = pd.read_csv(outputs["label"] / "client_stats.csv")
    assert stats["size"].sum() == len(train_ids) and {"js_divergence", "effective_groups"} <= set(stats.columns)
    assert (outputs["label"] / "client_group_heatmap.png").stat().st_size > 0


def test_step3_errors_name_the_problem(tiny, capsys):
    out = tiny["base"] / "errors"
    with pytest.raises(TaskHetError, match="--checkpoint"):
        embed.main(["--checkpoint", str(out / "none.pt"), "--manifest", str(tiny["manifest"]),
                                 "--data_path", str(tiny["root"]), "--out", str(out)])
    with pytest.raises(TaskHetError, match="neither a manifest column"):
        assign.main(["--manifest", str(tiny["manifest"]), "--groups", "nothing", "--out", str(out)])
    assign.main(["--manifest", str(tiny["manifest"]), "--scheme", "iid", "--alpha", "1", "--n_clients", "2",
                                  "--out", str(out)])
    assert "--alpha is not used by scheme 'iid'" in (out / "run.log").read_text()


def test_an_untrained_best_pt_is_refused_in_one_line_unless_allowed(tiny, tmp_path, capsys):
    """A step-2 best.pt of epoch 0 is the untrained network: step 3 refuses it before writing anything, naming the
    checkpoint and --allow_untrained; with the flag it embeds it; epoch 1 passes without it."""
    from utils.cli import run_main

    saved = torch.load(tiny["checkpoint"], weights_only=True)
    for epoch in (0, 1):
        folder = tmp_path / f"epoch{epoch}"
        folder.mkdir()
        torch.save({**saved, "epoch": epoch}, folder / "best.pt")
        (folder / "config.json").write_text(json.dumps({"args": {"image_size": IMAGE_SIZE}}))

    def argv(epoch, out, *extra):
        return ["--checkpoint", str(tmp_path / f"epoch{epoch}" / "best.pt"), "--manifest", str(tiny["manifest"]),
                "--data_path", str(tiny["root"]), "--out", str(out), "--n_clusters", "2", "--n_init", "1",
                "--no-use_accelerator", *extra]

    with pytest.raises(SystemExit) as exit_info:
        run_main(embed.main, argv(0, tmp_path / "refused"))
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in error
    assert error.startswith(f"error: --checkpoint {tmp_path / 'epoch0' / 'best.pt'} is epoch 0, the untrained model")
    assert "--allow_untrained" in error
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    allowed = embed.main(argv(0, tmp_path / "allowed", "--allow_untrained"))
    trained = embed.main(argv(1, tmp_path / "trained"))
    assert allowed.is_file() and trained.is_file()
