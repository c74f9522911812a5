"""Tiny data built on the fly for tests: synthetic buildings and their step-1 manifest.

Other test files import the helpers (``from tests.fixtures import render_tiny_dataset``)
or the session fixtures ``tiny_data_root`` / ``tiny_manifest`` (import them by name
into the test module), which render once per test session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from datasets.selection import SelectionConfig, select_datapoints, write_selection
from datasets.synthetic import RenderConfig, render_dataset

VIEWS_PER_POINT = 3


def tiny_render_config(n_buildings: int = 4, n_views: int = 6, image_size: int = 32, seed: int = 0) -> RenderConfig:
    """The render config :func:`render_tiny_dataset` uses."""
    return RenderConfig(num_buildings=n_buildings, views_per_building=n_views, views_per_point=VIEWS_PER_POINT, image_size=image_size, seed=seed)


def render_tiny_dataset(root: Path, n_buildings: int = 4, n_views: int = 6, image_size: int = 32, seed: int = 0) -> Path:
    """Render synthetic buildings into ``root`` (one process, no progress bar); returns the data root.

    4 buildings x 6 views at 32x32 take about a tenth of a second. Every building
    gets a different scene class while ``n_buildings`` <= 12.
    """
    return render_dataset(Path(root), tiny_render_config(n_buildings, n_views, image_size, seed), workers=1, progress=False)


def make_tiny_manifest(root: Path, out_dir: Path, top_k: int = 4) -> Path:
    """Run step 1's library code on ``root`` (split by sample, 25% test, seed 0); returns ``manifest.csv``."""
    config = SelectionConfig(data_path=Path(root), top_k_classes=top_k, test_fraction=0.25, split_by="sample", seed=0)
    selection = select_datapoints(config, progress=False)
    return write_selection(selection, Path(out_dir))["manifest"]


@pytest.fixture(scope="session")
def tiny_data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic data root rendered once per session (treat as read-only)."""
    return render_tiny_dataset(tmp_path_factory.mktemp("tiny_synthetic"))


@pytest.fixture(scope="session")
def tiny_manifest(tiny_data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-1 manifest of :func:`tiny_data_root` (treat as read-only)."""
    return make_tiny_manifest(tiny_data_root, tmp_path_factory.mktemp("tiny_step1"))
