"""The plots a researcher reads, checked through matplotlib's objects: titles, axis labels, legend entries, bounds.

Every plot goes through ``utils.plots.save_figure``, which closes the figure; the fixture keeps the
figures instead (``figures`` in tests/conftest.py) so that the test can look inside them after the PNG is
written.
"""

from __future__ import annotations

import numpy as np
import pandas as pd




def _inside(artist, figure) -> bool:
    """Whether ``artist`` is drawn wholly inside the figure (not cut off at its edges)."""
    figure.canvas.draw()
    box = artist.get_window_extent(figure.canvas.get_renderer())
    return box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= figure.bbox.width + 0.5 and box.y1 <= figure.bbox.height + 0.5


def _overlaps_an_axis(legend, figure) -> bool:
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    return any(box.overlaps(axis.get_window_extent(renderer)) for axis in figure.axes)


def test_the_search_title_is_not_cut_off(tmp_path, figures):
    from training.search import plot_validation_accuracy

    rows = [{"config": config, "epoch": epoch, "split": "val", "metric": "top1", "value": 0.1 * epoch}
            for config in ("lr0.1-wd0-cosine", "lr0.01-wd0.0005-step") for epoch in (1, 2, 3)]
    pd.DataFrame(rows).to_csv(tmp_path / "val_top1.csv", index=False)
    plot_validation_accuracy(tmp_path / "val_top1.csv", tmp_path / "val_top1.png")
    figure = figures[-1]
    title = figure.get_suptitle()
    assert title == "validation top-1 accuracy per config (mean over seeds)"
    assert _inside(figure._suptitle, figure)
    axis = figure.axes[0]
    assert axis.get_xlabel() == "epoch" and axis.get_title() == "top1"
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["lr0.01-wd0.0005-step", "lr0.1-wd0-cosine"]


def _finals() -> pd.DataFrame:
    rows = []
    for algorithm in ("fedavg", "fedprox"):
        for alpha in (0.1, 1.0):
            for seed, losses in enumerate(((0.05, 0.06), (0.4, 0.5), (0.1, 0.12))):  # spread: a plain t band goes below 0
                for grouping, loss in zip(("label_based", "embedding_based"), losses):
                    rows.append(dict(task="normal", grouping=grouping, alpha=alpha, algorithm=algorithm, seed=seed,
                                     loss=loss, metric="mean_angle", metric_value=30.0))
        rows += [dict(task="normal", grouping="iid", alpha=float("inf"), algorithm=algorithm, seed=seed, loss=0.04,
                      metric="mean_angle", metric_value=30.0) for seed in range(3)]
    return pd.DataFrame(rows)


def test_loss_vs_alpha_has_one_panel_per_algorithm_bounded_bands_and_the_legend_off_the_data(tmp_path, figures):
    from pipeline.studies.main_job.plots import plot_loss_vs_alpha

    plot_loss_vs_alpha(_finals(), tmp_path / "loss_vs_alpha.png")
    figure = figures[-1]
    assert [axis.get_title() for axis in figure.axes] == ["normal · fedavg", "normal · fedprox"]
    for axis in figure.axes:
        assert axis.get_xlabel() == "Dirichlet α" and axis.get_ylabel() == "final global test loss"
        bands = [collection for collection in axis.collections if len(collection.get_paths())]
        assert len(bands) == 2  # label- and embedding-based, not eight overlapping ones
        for band in bands:
            assert min(path.vertices[:, 1].min() for path in band.get_paths()) >= 0
    legend = figure.legends[0]
    assert [text.get_text() for text in legend.get_texts()] == [
        "embedding-based (dashed)", "iid reference (dotted)", "label-based (solid)", "95% interval (log scale)"]
    assert not _overlaps_an_axis(legend, figure) and _inside(legend, figure)


def test_round_curves_say_which_style_is_which_grouping(tmp_path, figures):
    from pipeline.studies.main_job.plots import plot_round_curves

    curves = pd.concat([_finals().assign(round=r) for r in (1, 2)])
    plot_round_curves(curves, tmp_path / "round_curves.png")
    figure = figures[-1]
    entries = {text.get_text(): handle for text, handle in zip(figure.legends[0].get_texts(), figure.legends[0].legend_handles)}
    assert set(entries) == {"fedavg", "fedprox", "label-based (solid)", "embedding-based (dashed)", "iid reference (dotted)"}
    assert entries["label-based (solid)"].get_linestyle() == "-" and entries["embedding-based (dashed)"].get_linestyle() == "--"
    axis = figure.axes[0]
    assert axis.get_xlabel() == "round" and axis.get_ylabel() == "global test loss" and axis.get_title() == "normal, α=0.1"
    label_lines = [line for line in axis.get_lines() if line.get_linestyle() == "-"]
    assert len(label_lines) == 2  # one solid line per algorithm: the label-based runs
    assert not _overlaps_an_axis(figure.legends[0], figure)


def test_the_meter_band_is_labelled(tmp_path, figures):
    from pipeline.studies.main_job.meter import plot_meter

    meters = pd.DataFrame([dict(task="normal", grouping=grouping, alpha=alpha, seed=seed, g2=1.0 + seed, b2=1.5)
                           for grouping in ("label_based", "embedding_based") for alpha in (0.1, 1.0) for seed in (0, 1)])
    plot_meter(meters, tmp_path / "meter.png")
    axis = figures[-1].axes[0]
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "label_based min–max over seeds" in labels and "embedding_based min–max over seeds" in labels
    assert axis.get_xlabel() == "Dirichlet α" and axis.get_ylabel() == "gradient dissimilarity G²"


def test_a_run_curves_plot_is_titled_with_the_run(tmp_path, figures):
    from network.run_outputs import plot_curves, run_title

    run_dir = tmp_path / "label_based" / "fedavg" / "s0-abc123"
    run_dir.mkdir(parents=True)
    rows = [dict(round=r, split="test", client="global", metric="loss", value=1.0 / (r + 1)) for r in range(3)]
    pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
    plot_curves(run_dir / "metrics.csv", run_dir / "curves.png", run_title("fedavg", run_dir))
    axis = figures[-1].axes[0]
    assert axis.get_title() == "fedavg: label_based/fedavg/s0-abc123"
    assert axis.get_xlabel() == "round" and axis.get_ylabel() == "loss"
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["global test"]
    assert np.isclose(axis.get_lines()[0].get_ydata()[0], 1.0)


def test_a_run_curves_plot_shows_the_client_spread_and_the_train_loss(tmp_path, figures):
    """curves.png: the client-test mean with a mean ± std band that does not hide the curves under it, and the mean
    local train loss as its own dashed line."""
    from network.algorithms.base import TRAIN_LOSS
    from network.client import CLIENT_TEST_SPLIT
    from network.run_outputs import plot_curves
    from matplotlib.colors import to_rgb

    mean, std, train = [2.0, 1.5, 1.2], [0.5, 0.4, 0.1], [1.8, 1.1]
    rows = [dict(round=r, split="test", client="global", metric="loss", value=1.0 / (r + 1)) for r in range(3)]
    rows += [dict(round=r, split=CLIENT_TEST_SPLIT, client=client, metric="loss", value=values[r])
             for r in range(3) for client, values in (("mean", mean), ("std", std), ("0", [9.0] * 3))]
    rows += [dict(round=r + 1, split="train", client=client, metric=TRAIN_LOSS, value=value)
             for r, value in enumerate(train) for client in ("mean", "0")]
    pd.DataFrame(rows).to_csv(tmp_path / "metrics.csv", index=False)
    plot_curves(tmp_path / "metrics.csv", tmp_path / "curves.png")
    axis = figures[-1].axes[0]
    assert [text.get_text() for text in axis.get_legend().get_texts()] == [
        "global test", "client test (global model)", "local train loss (mean)"]
    lines = {line.get_label(): line for line in axis.get_lines()}
    assert list(lines["local train loss (mean)"].get_xdata()) == [1, 2]
    assert list(lines["local train loss (mean)"].get_ydata()) == train
    assert lines["local train loss (mean)"].get_linestyle() == "--"
    bands = [collection for collection in axis.collections if len(collection.get_paths())]
    assert len(bands) == 1  # the client test's band; the global test has no spread
    corners = bands[0].get_paths()[0].vertices
    assert np.isclose(corners[:, 1].min(), min(m - s for m, s in zip(mean, std)))  # 1.1 at round 2
    assert np.isclose(corners[:, 1].max(), max(m + s for m, s in zip(mean, std)))  # 2.5 at round 0
    assert bands[0].get_alpha() is not None and bands[0].get_alpha() < 1  # see-through: the curves stay visible
    assert np.allclose(bands[0].get_facecolor()[0][:3], to_rgb(lines["client test (global model)"].get_color()))
