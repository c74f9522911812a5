"""Every plot a researcher reads, rendered from a small run's files and checked through matplotlib's objects:
its title, its axes' units, its legend off the data (judged by the artists' bounding boxes) and its bands inside
the metric's range.

Every plot goes through ``utils.plots.save_figure``, which closes the figure; the fixture keeps the
figures instead (``figures`` in tests/conftest.py) so that the test can look inside them after the PNG is
written.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from network.algorithms.base import TRAIN_LOSS


def _inside(artist, figure) -> bool:
    """Whether ``artist`` is drawn wholly inside the figure (not cut off at its edges)."""
    figure.canvas.draw()
    box = artist.get_window_extent(figure.canvas.get_renderer())
    return box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= figure.bbox.width + 0.5 and box.y1 <= figure.bbox.height + 0.5


def _overlaps_an_axis(legend, figure) -> bool:
    """Whether the legend's box overlaps any visible axis (so possibly a line, band or bar) or any title."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    axes = [axis for axis in figure.axes if axis.get_visible()]
    titles = [axis.title for axis in axes if axis.get_title()] + ([figure._suptitle] if figure._suptitle else [])
    return any(box.overlaps(artist.get_window_extent(renderer)) for artist in [*axes, *titles])


def _one_legend_off_the_data(figure):
    """The figure's one legend: beside or below the panels (its box overlaps no axis, so no line, band or bar under
    it, and no title), and whole inside the figure; no axis has a legend of its own."""
    assert len(figure.legends) == 1 and not any(axis.get_legend() for axis in figure.axes)
    legend = figure.legends[0]
    assert not _overlaps_an_axis(legend, figure) and _inside(legend, figure)
    return legend


def _labels(legend) -> list[str]:
    return [text.get_text() for text in legend.get_texts()]


def _bands(axis) -> list:
    return [collection for collection in axis.collections if len(collection.get_paths())]


def _band_range(band) -> tuple[float, float]:
    vertices = np.concatenate([path.vertices for path in band.get_paths()])
    return float(vertices[:, 1].min()), float(vertices[:, 1].max())


# ----- a step-4 run's curves.png -----
def _run_folder(tmp_path, scheme: str = "dirichlet_mixture", alpha: float | None = 0.1):
    """A run folder as step 4 leaves it: config.json naming the assignments, whose sidecar names the scheme."""
    run_dir = tmp_path / "label_based" / "fedavg" / "s3-abc123"
    run_dir.mkdir(parents=True)
    sidecar = tmp_path / "assignments.json"
    sidecar.write_text(json.dumps({"scheme": scheme, "alpha": alpha, "n_clients": 5}))
    args = {"task": "normal", "type": "label_based", "alpha": alpha, "method": "fedavg", "rand_seed": 3,
            "assignments": str(tmp_path / "assignments.csv")}
    (run_dir / "config.json").write_text(json.dumps({"args": args, "step": "step 4"}))
    return run_dir


# Five clients' client-test losses per evaluated round: the global model's, and their own models'.
GLOBAL_MODEL = {0: [2.0, 2.2, 2.4, 2.6, 2.8], 10: [1.0, 1.1, 1.2, 1.3, 1.4], 20: [0.1, 0.2, 0.3, 0.9, 1.5]}
PERSONAL = {0: [1.0, 2.0, 3.0, 4.0, 5.0], 10: [0.5, 0.6, 0.7, 0.8, 0.9], 20: [0.0, 0.01, 0.02, 0.03, 2.0]}


def _run_metrics() -> pd.DataFrame:
    """metrics.csv of a run evaluated at rounds 0, 10, 20 whose clients' test rows are the test split: the mean of
    the clients' losses under the global model equals the global test loss."""
    rows = []
    for round_index in GLOBAL_MODEL:
        mean = float(np.mean(GLOBAL_MODEL[round_index]))
        rows.append(dict(round=round_index, split="test", client="global", metric="loss", value=mean))
        for split, losses in (("client_test", GLOBAL_MODEL[round_index]), ("client_test_personal", PERSONAL[round_index])):
            rows += [dict(round=round_index, split=split, client=str(client), metric="loss", value=value)
                     for client, value in enumerate(losses)]
            spread = float(np.std(losses))
            rows += [dict(round=round_index, split=split, client="mean", metric="loss", value=float(np.mean(losses))),
                     dict(round=round_index, split=split, client="std", metric="loss", value=spread)]
    rows += [dict(round=r, split="train", client="mean", metric=TRAIN_LOSS, value=2.0 / r) for r in range(1, 21)]
    return pd.DataFrame(rows)


def test_a_run_curves_plot_names_what_the_study_compares_and_keeps_bands_and_legend_off_limits(tmp_path, figures):
    from network.run_outputs import plot_curves, run_title

    run_dir = _run_folder(tmp_path)
    _run_metrics().to_csv(run_dir / "metrics.csv", index=False)
    plot_curves(run_dir / "metrics.csv", run_dir / "curves.png", run_title("fedavg", run_dir))
    figure = figures[-1]
    (axis,) = figure.axes
    assert axis.get_title() == "normal · label-based dirichlet_mixture, α=0.1 · fedavg · seed 3"
    assert axis.get_xlabel() == "round (evaluated at 0, 10, 20)" and axis.get_ylabel() == "loss (task loss, no unit)"
    band = "; band: clients' 10–90% range"
    # The global test and the client mean under the global model are the same numbers: one line with both names.
    assert _labels(_one_legend_off_the_data(figure)) == [
        f"global test = client test (global model){band}", f"client test (personal models){band}",
        "local train loss (mean)"]
    lines = {line.get_label(): line for line in axis.get_lines()}
    assert len(lines) == 3
    bands = _bands(axis)
    assert len(bands) == 2
    # numpy's linear quantiles of five values: 10% = v1 + 0.4·(v2 − v1), 90% = v4 + 0.6·(v5 − v4)
    personal_band = next(b for b in bands if np.allclose(b.get_facecolor()[0][:3], _rgb(
        lines["client test (personal models)"])))
    assert _band_range(personal_band) == pytest.approx((0.004, 4.6))  # round 20's 10%, round 0's 90%
    global_band = next(b for b in bands if b is not personal_band)
    assert _band_range(global_band) == pytest.approx((0.14, 2.72))  # round 20's 10%, round 0's 90%
    assert all(_band_range(b)[0] >= 0 for b in bands)  # mean − std went to −0.38 at round 20 (personal)
    assert list(lines["local train loss (mean)"].get_xdata()) == list(range(1, 21))


def test_a_curve_within_half_a_percent_of_another_is_drawn_once_with_both_names(figures):
    from utils.plots import CurvesOnce, plt

    figure, axis = plt.subplots()
    curves = CurvesOnce(axis)
    first = curves.plot([0, 10], [1.0, 0.5], "global test")
    assert curves.plot([0, 10], [1.0, 0.5], "client mean") is first
    assert curves.plot([0, 10], [1.004, 0.502], "other mean") is first  # 0.4% off: the eye cannot tell
    assert first.get_label() == "global test = client mean ≈ other mean"
    assert curves.plot([0, 10], [1.01, 0.5], "apart") is not first  # 1% off: a line of its own
    assert curves.plot([0, 5], [1.0, 0.5], "other rounds") is not first
    assert len(axis.get_lines()) == 3


def _rgb(line) -> tuple:
    from matplotlib.colors import to_rgb

    return to_rgb(line.get_color())


def test_an_iid_run_is_titled_iid_and_a_folder_without_config_by_its_names(tmp_path):
    from network.run_outputs import run_title

    assert run_title("fedavg", _run_folder(tmp_path, "iid", None)) == "normal · iid · fedavg · seed 3"
    bare = tmp_path / "a" / "b" / "c"
    bare.mkdir(parents=True)
    assert run_title("scaffold", bare) == "scaffold: a/b/c"


# ----- step 2's curves, and the search's -----
def test_step2_plots_have_units_and_one_legend_beside_the_panels(tmp_path, figures):
    from utils.plots import plot_curves

    rows = [dict(epoch=epoch, split=split, metric=metric, value=value)
            for epoch in range(3) for split in ("val", "test")
            for metric, value in (("loss", 1.0 / (epoch + 1)), ("mean_angle", 40.0 - epoch), ("within_11_25", 0.1 * epoch))]
    rows += [dict(epoch=epoch, split="train", metric="lr", value=0.01) for epoch in (1, 2)]
    pd.DataFrame(rows).to_csv(tmp_path / "metrics.csv", index=False)
    plot_curves(tmp_path / "metrics.csv", tmp_path / "curves.png", title="normal: step2-run")
    figure = figures[-1]
    visible = [axis for axis in figure.axes if axis.get_visible()]
    assert [(axis.get_title(), axis.get_ylabel()) for axis in visible] == [
        ("loss", "task loss, no unit"), ("mean_angle", "degrees"), ("within_11_25", "share of pixels, 0–1"),
        ("lr", "learning rate")]
    assert all(axis.get_xlabel() == "epoch" for axis in visible)
    assert figure.get_suptitle() == "normal: step2-run" and _inside(figure._suptitle, figure)
    assert _labels(_one_legend_off_the_data(figure)) == ["test", "val", "train"]


def test_the_search_title_is_not_cut_off(tmp_path, figures):
    from training.search import plot_validation_curves

    rows = [{"config": config, "epoch": epoch, "split": "val", "metric": "top1", "value": 0.1 * epoch}
            for config in ("lr0.1-wd0-cosine", "lr0.01-wd0.0005-step") for epoch in (1, 2, 3)]
    pd.DataFrame(rows).to_csv(tmp_path / "val_top1.csv", index=False)
    plot_validation_curves(tmp_path / "val_top1.csv", tmp_path / "val_top1.png")
    figure = figures[-1]
    assert figure.get_suptitle() == "validation top-1 per config (mean over seeds)"
    assert _inside(figure._suptitle, figure)
    axis = figure.axes[0]
    assert axis.get_xlabel() == "epoch" and axis.get_title() == "top1" and axis.get_ylabel() == "share of samples, 0–1"
    assert _labels(_one_legend_off_the_data(figure)) == ["lr0.01-wd0.0005-step", "lr0.1-wd0-cosine"]


# ----- the main job's report -----
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


def test_loss_vs_alpha_shows_each_band_with_its_own_swatch_and_the_legend_off_the_data(tmp_path, figures):
    from pipeline.studies.main_job.plots import plot_loss_vs_alpha

    plot_loss_vs_alpha(_finals(), tmp_path / "loss_vs_alpha.png")
    figure = figures[-1]
    assert [axis.get_title() for axis in figure.axes] == ["normal · fedavg", "normal · fedprox"]
    for axis in figure.axes:
        assert axis.get_xlabel() == "Dirichlet α (log scale)"
        assert axis.get_ylabel() == "final global test loss\n(task loss, no unit)"
        bands = _bands(axis)
        assert len(bands) == 2  # label- and embedding-based, not eight overlapping ones
        assert all(_band_range(band)[0] >= 0 for band in bands)
    legend = _one_legend_off_the_data(figure)
    note = "; band: 95% interval of the mean (log scale)"
    assert _labels(legend) == [f"embedding-based (dashed){note}", "iid reference (dotted)", f"label-based (solid){note}"]
    from matplotlib.colors import to_rgb

    # One swatch per band, in its band's colour (a single blue swatch named both bands before).
    swatch_colours = [to_rgb(handle.get_facecolor()) for handle in legend.legend_handles
                      if hasattr(handle, "get_facecolor") and handle.get_fill()]
    assert swatch_colours == [to_rgb("C1"), to_rgb("C0")]


def test_round_curves_say_which_style_is_which_grouping(tmp_path, figures):
    from pipeline.studies.main_job.plots import plot_round_curves

    curves = pd.concat([_finals().assign(round=r) for r in (1, 2)])
    plot_round_curves(curves, tmp_path / "round_curves.png")
    figure = figures[-1]
    legend = _one_legend_off_the_data(figure)
    entries = {text.get_text(): handle for text, handle in zip(legend.get_texts(), legend.legend_handles)}
    assert set(entries) == {"fedavg", "fedprox", "label-based (solid)", "embedding-based (dashed)", "iid reference (dotted)"}
    assert entries["label-based (solid)"].get_linestyle() == "-" and entries["embedding-based (dashed)"].get_linestyle() == "--"
    axis = figure.axes[0]
    assert axis.get_xlabel() == "round" and axis.get_ylabel() == "global test loss\n(task loss, no unit)"
    assert axis.get_title() == "normal, α=0.1"
    label_lines = [line for line in axis.get_lines() if line.get_linestyle() == "-"]
    assert len(label_lines) == 2  # one solid line per algorithm: the label-based runs


def test_partition_heatmaps_have_one_title_per_panel_and_the_clients_shares(tmp_path, figures):
    """Drawn from step 3b's client_stats.csv, not by pasting its PNG (whose own title doubled the panel's)."""
    from pipeline.studies.main_job.plots import plot_heatmaps

    heatmaps = {}
    for grouping, counts in (("label_based", [[3, 1], [0, 4]]), ("embedding_based", [[2, 2], [1, 0]])):
        folder = tmp_path / grouping
        folder.mkdir()
        pd.DataFrame({"client_id": [0, 1], "size": [4, 4], "count_0": [row[0] for row in counts],
                      "count_1": [row[1] for row in counts], "js_divergence": [0.1, 0.2]}).to_csv(
            folder / "client_stats.csv", index=False)
        heatmaps[("normal", grouping, 0.1)] = folder / "client_group_heatmap.png"  # never read: it need not exist
    plot_heatmaps(heatmaps, tmp_path / "partition_heatmaps.png")
    figure = figures[-1]
    panels = [axis for axis in figure.axes if axis.get_images()]
    assert [axis.get_title() for axis in panels] == ["normal · label-based · α=0.1", "normal · embedding-based · α=0.1"]
    assert np.allclose(panels[0].get_images()[0].get_array(), [[0.75, 0.25], [0.0, 1.0]])
    assert np.allclose(panels[1].get_images()[0].get_array(), [[0.5, 0.5], [1.0, 0.0]])
    assert all(axis.get_ylabel() == "client" for axis in panels)
    colourbar = next(axis for axis in figure.axes if not axis.get_images())
    assert colourbar.get_ylabel() == "share of the client's samples (0–1)"


def test_the_agreement_plot_legend_is_beside_the_bars(tmp_path, figures):
    from pipeline.studies.main_job.plots import plot_agreement

    plot_agreement({"normal": {"nmi": 0.4, "ari": 0.2}, "class_scene": {"nmi": 0.9, "ari": 0.8}},
                   tmp_path / "agreement.png")
    figure = figures[-1]
    assert _labels(_one_legend_off_the_data(figure)) == ["NMI", "ARI"]
    assert figure.axes[0].get_ylim() == (0, 1)


def test_the_meter_band_is_labelled(tmp_path, figures):
    from pipeline.studies.main_job.meter import plot_meter

    meters = pd.DataFrame([dict(task="normal", grouping=grouping, alpha=alpha, seed=seed, g2=1.0 + seed, b2=1.5)
                           for grouping in ("label_based", "embedding_based") for alpha in (0.1, 1.0) for seed in (0, 1)])
    plot_meter(meters, tmp_path / "meter.png")
    figure = figures[-1]
    labels = _labels(_one_legend_off_the_data(figure))
    assert "label_based min–max over seeds" in labels and "embedding_based min–max over seeds" in labels
    axis = figure.axes[0]
    assert axis.get_xlabel() == "Dirichlet α" and axis.get_ylabel() == "gradient dissimilarity G²"


# ----- the Fed-LT study's report -----
def _fed_lt_table() -> pd.DataFrame:
    rows = []
    for partition in ("dirichlet_per_class-a0.5", "dirichlet_per_class-a1"):
        for method, mean in (("fedavg", 0.6), ("fedloge", 0.7)):
            row = {"partition": partition, "method": method, "seeds": 3}
            for column, shift in (("global", 0.0), ("global_head", 0.1), ("global_middle", 0.0), ("global_tail", -0.3)):
                row.update({f"{column}_mean": mean + shift, f"{column}_low": mean + shift - 0.05,
                            f"{column}_high": mean + shift + 0.02})
            rows.append(row)
    return pd.DataFrame(rows)


def test_fed_lt_accuracy_by_class_group_has_one_bar_group_per_class_group_and_intervals(tmp_path, figures):
    from pipeline.studies.fed_lt import plot_class_groups

    plot_class_groups(_fed_lt_table(), "digits_lt", tmp_path / "groups.png")
    figure = figures[-1]
    assert figure.get_suptitle() == "digits_lt: global top-1 by class group, mean over seeds"
    assert [axis.get_title() for axis in figure.axes] == ["dirichlet_per_class-a0.5", "dirichlet_per_class-a1"]
    axis = figure.axes[0]
    assert [tick.get_text() for tick in axis.get_xticklabels()] == ["overall", "head", "middle", "tail"]
    assert figure.get_supxlabel().startswith("test classes (head, middle, tail: ")
    assert axis.get_ylabel() == "global top1 (share of samples, 0–1)" and axis.get_ylim() == (0, 1)
    heights = [patch.get_height() for patch in axis.patches]
    assert heights == pytest.approx([0.6, 0.7, 0.6, 0.3] + [0.7, 0.8, 0.7, 0.4])  # fedavg's four bars, then fedloge's
    assert _labels(_one_legend_off_the_data(figure)) == ["fedavg", "fedloge"]


def test_fed_lt_accuracy_per_round_bands_span_the_seeds(tmp_path, figures):
    from pipeline.studies.fed_lt import plot_accuracy_vs_round

    curves = pd.DataFrame([dict(partition="p", method=method, seed=seed, round=r, top1=value)
                           for method, base in (("fedavg", 0.5), ("fedloge", 0.6)) for seed, offset in enumerate((0.0, 0.2, 0.1))
                           for r, value in ((0, 0.1), (10, base + offset))])
    plot_accuracy_vs_round(curves, "digits_lt", tmp_path / "rounds.png")
    figure = figures[-1]
    (axis,) = figure.axes
    assert figure.get_suptitle() == "digits_lt: global top-1 per round, mean over seeds"
    assert axis.get_xlabel() == "round" and axis.get_ylabel() == "global test top1 (share of samples, 0–1)"
    assert [_band_range(band) for band in _bands(axis)] == [pytest.approx((0.1, 0.7)), pytest.approx((0.1, 0.8))]
    assert [list(line.get_ydata()) for line in axis.get_lines()] == [pytest.approx([0.1, 0.6]), pytest.approx([0.1, 0.7])]
    assert _labels(_one_legend_off_the_data(figure)) == ["fedavg", "fedloge"]
