"""The synthetic renderer: renderer -> loader round trip, determinism, layout and the side files."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from datasets.selection import read_scene_names, read_split_csv
from datasets.synthetic import BUILDINGS_FILE, PLACES_FILE, SPLIT_FILE, encode_view, render_dataset
from datasets.synthetic_raycast import KEYPOINT2D_SCALE, Camera, keypoints2d_response, render_view
from datasets.synthetic_scenes import OBJECT_CLASSES, SCENE_TYPES, assign_scene_types, make_building, make_cameras, scene_places_indices
from datasets.taskonomy import TaskonomyDataset, domain_dir, read_manifest
from datasets.taskonomy_domains import (DEPTH_UNITS_PER_METRE, DOMAIN_SPECS, DOMAINS, NUM_SEMANTIC_CLASSES,
                                        SEGMENT_IGNORE_INDEX, SEMANTIC_CLASS_NAMES)
from steps import render
from tests.fixtures import render_tiny_dataset, tiny_data_root, tiny_manifest, tiny_render_config  # noqa: F401
from utils.errors import TaskHetError


def rendered_views(config):
    """Float ground truth of every view, keyed by sample id, recomputed from the config."""
    scene_types = assign_scene_types(config)
    views = {}
    for index in range(config.num_buildings):
        building = make_building(config, index, scene_types[index], scene_places_indices()[scene_types[index]])
        for camera in make_cameras(config, building, index):
            views[f"{building.name}_point_{camera.point}_view_{camera.view}"] = render_view(building, camera, config.image_size)
    return views


def test_round_trip_matches_renderer_ground_truth(tiny_data_root, tiny_manifest):
    config = tiny_render_config()
    views = rendered_views(config)
    domains = ["depth_euclidean", "depth_zbuffer", "normal", "segment_semantic", "mask_valid", "reshading"]
    dataset = TaskonomyDataset(tiny_data_root, read_manifest(tiny_manifest), domains, config.image_size)
    assert len(dataset) == config.num_buildings * config.views_per_building
    no_surface_pixels = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        truth = views[sample["sample_id"]]
        hit = truth.hit
        no_surface_pixels += int((~hit).sum())
        for name in ("depth_euclidean", "depth_zbuffer"):
            decoded = sample[name][0].numpy()
            expected = getattr(truth, name)
            assert np.all(np.abs(decoded[hit] - expected[hit]) <= 0.5 / DEPTH_UNITS_PER_METRE + 1e-6)
            assert np.all(decoded[~hit] == 0)
        normal = sample["normal"].numpy()
        lengths = np.linalg.norm(normal, axis=0)
        assert np.all(np.abs(lengths[hit] - 1.0) < 0.02)
        np.testing.assert_allclose(normal[:, hit], truth.normal[hit].T, atol=1.0 / 255 + 1e-6)
        semantic = sample["segment_semantic"].numpy()
        assert semantic[hit].min() >= 0 and semantic[hit].max() < NUM_SEMANTIC_CLASSES
        np.testing.assert_array_equal(semantic[hit], truth.semantic[hit])  # room = 0 (background), objects 1..16
        assert np.all(semantic[~hit] == SEGMENT_IGNORE_INDEX)
        np.testing.assert_array_equal(sample["mask"][0].numpy(), hit)
        np.testing.assert_array_equal(sample["mask_valid"][0].numpy(), hit)
        assert np.all(sample["reshading"][0].numpy()[~hit] == 0)
    assert no_surface_pixels > 0, "the tiny render should include windows, or the mask check tests nothing"


def test_same_seed_gives_byte_identical_files(tmp_path):
    first = render_tiny_dataset(tmp_path / "a", n_buildings=2, n_views=3)
    second = render_tiny_dataset(tmp_path / "b", n_buildings=2, n_views=3)
    other_seed = render_tiny_dataset(tmp_path / "c", n_buildings=2, n_views=3, seed=1)
    files = sorted(path.relative_to(first) for path in first.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(second) for path in second.rglob("*") if path.is_file())
    assert len(files) == 2 * 3 * len(DOMAINS) + 4
    for relative in files:
        assert (first / relative).read_bytes() == (second / relative).read_bytes(), relative
    rgb = Path("rgb/taskonomy/synth000/point_0_view_0_domain_rgb.png")
    assert (first / rgb).read_bytes() != (other_seed / rgb).read_bytes()


def test_parallel_render_equals_serial(tmp_path):
    config = tiny_render_config(n_buildings=3, n_views=2)
    serial = render_dataset(tmp_path / "serial", config, workers=1, progress=False)
    parallel = render_dataset(tmp_path / "parallel", config, workers=2, progress=False)
    for path in serial.rglob("*.png"):
        assert path.read_bytes() == (parallel / path.relative_to(serial)).read_bytes()


def test_layout_and_encodings_follow_taskonomy(tiny_data_root):
    folder = domain_dir(tiny_data_root, "segment_semantic", "synth000")
    assert (folder / "point_0_view_0_domain_segmentsemantic.png").is_file()
    assert (domain_dir(tiny_data_root, "class_scene", "synth000") / "point_0_view_0_domain_class_places.npy").is_file()
    modes = {"rgb": "RGB", "normal": "RGB", "depth_euclidean": "I;16", "edge_texture": "I;16", "segment_semantic": "L", "mask_valid": "L"}
    for domain, mode in modes.items():
        name = DOMAIN_SPECS[domain].file_name(0, 0)
        with Image.open(domain_dir(tiny_data_root, domain, "synth000") / name) as image:
            assert image.mode == mode and image.size == (32, 32)
    depth = np.array(Image.open(domain_dir(tiny_data_root, "depth_euclidean", "synth000") / "point_0_view_0_domain_depth_euclidean.png"))
    assert depth.dtype == np.uint16


def test_scene_scores_peak_at_the_building_class(tiny_data_root):
    buildings = pd.read_csv(tiny_data_root / BUILDINGS_FILE)
    names = read_scene_names(tiny_data_root / PLACES_FILE)
    for row in buildings.itertuples():
        assert names[row.places_index] == row.scene_name
        for path in domain_dir(tiny_data_root, "class_scene", row.building).glob("*.npy"):
            scores = np.load(path)
            assert scores.shape == (365,) and scores.dtype == np.float32
            assert abs(float(scores.sum()) - 1.0) < 1e-4
            assert int(np.argmax(scores)) == row.places_index
    assert buildings["scene_name"].nunique() == len(buildings)


def test_places_names_use_real_places365_indices(tiny_data_root):
    names = read_scene_names(tiny_data_root / PLACES_FILE)
    assert (names[45], names[52], names[203], names[215], names[244]) == ("bathroom", "bedroom", "kitchen", "living_room", "office")
    assert {SCENE_TYPES[i].places_name for i in range(len(SCENE_TYPES))} <= set(names)


def test_split_csv_has_taskonomy_format(tiny_data_root):
    table = pd.read_csv(tiny_data_root / SPLIT_FILE)
    assert list(table.columns) == ["id", "train", "val", "test"]
    assert (table[["train", "val", "test"]].sum(axis=1) == 1).all()
    assert read_split_csv(tiny_data_root / SPLIT_FILE) == sorted(p.name for p in domain_dir(tiny_data_root, "rgb").iterdir())


def test_room_and_light_do_not_depend_on_scene_class():
    config = tiny_render_config(n_buildings=6)
    for index in range(6):
        first, second = (make_building(config, index, scene_type, 0) for scene_type in (0, 5))
        assert first.objects != second.objects
        assert (first.size, first.wall, first.floor, first.ceiling, first.light_direction, first.light_intensity, first.ambient) == (
            second.size, second.wall, second.floor, second.ceiling, second.light_direction, second.light_intensity, second.ambient)


def test_ground_truth_ranges(tiny_data_root, tiny_manifest):
    domains = ["edge_texture", "edge_occlusion", "keypoints2d", "keypoints3d", "principal_curvature"]
    dataset = TaskonomyDataset(tiny_data_root, read_manifest(tiny_manifest), domains, 32)
    maxima = {name: 0.0 for name in dataset.output_domains}
    for index in range(len(dataset)):
        sample = dataset[index]
        for name in maxima:
            values = sample[name]
            assert values.min() >= 0 and values.max() <= 1
            maxima[name] = max(maxima[name], float(values.max()))
        assert not sample["edge_occlusion"][~sample["mask"]].any()
    assert all(value > 0.2 for value in maxima.values()), maxima


def quadratic_image(width: int, a: float, b: float, stretch: float = 1.0) -> np.ndarray:
    """0.5 + a x^2 + b y^2 in pixels from the centre, x and y divided by ``stretch``."""
    y, x = (np.mgrid[0:width, 0:width] - width // 2) / stretch
    return 0.5 + a * x**2 + b * y**2


def test_keypoints2d_is_the_scale_normalised_hessian_determinant_both_signs():
    # By hand, at sigma = 64 / 32 = 2 px: Lxx = 2a, Lyy = 2b, Lxy = 0, so sigma^4 |Lxx Lyy - Lxy^2| / 0.004
    # = 16 * 4 * 0.001 * 0.0005 / 0.004 = 0.008: exact up to rounding, since smoothing a parabola with a normalised
    # symmetric kernel only adds a constant and a second difference of a parabola is exact. A response without
    # sigma^4, or with sigma fixed in pixels, is off 16-fold.
    expected = 16 * 4 * 0.001 * 0.0005 / KEYPOINT2D_SCALE
    bowl = keypoints2d_response(quadratic_image(64, 0.001, 0.0005))[32, 32]
    saddle = keypoints2d_response(quadratic_image(64, 0.001, -0.0005))[32, 32]
    assert bowl == pytest.approx(expected, rel=1e-9) and saddle == pytest.approx(expected, rel=1e-9)  # blobs and saddles
    # A ridge (b = 0) has a zero determinant; a flat image has none.
    assert keypoints2d_response(quadratic_image(64, 0.001, 0.0))[32, 32] < 0.05 * expected
    assert keypoints2d_response(np.full((64, 64), 0.3)).max() == 0.0
    # Scale-normalised, with sigma a fixed share of the width: the same picture at twice the pixels answers the same.
    double = keypoints2d_response(quadratic_image(128, 0.001, 0.0005, stretch=2.0))[64, 64]
    assert double == pytest.approx(expected, rel=1e-9)
    # Clipped to [0, 1].
    steep = keypoints2d_response(quadratic_image(64, 0.1, 0.1))
    assert steep.max() == 1.0 and steep.min() >= 0.0


def test_rerender_with_same_config_is_skipped_and_foreign_folder_refused(tmp_path):
    root = render_tiny_dataset(tmp_path / "data", n_buildings=1, n_views=2)
    rgb = root / "rgb/taskonomy/synth000/point_0_view_0_domain_rgb.png"
    os.utime(rgb, (0, 0))
    render_tiny_dataset(tmp_path / "data", n_buildings=1, n_views=2)
    assert rgb.stat().st_mtime == 0
    render_tiny_dataset(tmp_path / "data", n_buildings=1, n_views=3)
    assert rgb.stat().st_mtime != 0
    assert (root / "rgb/taskonomy/synth000/point_0_view_2_domain_rgb.png").is_file()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(TaskHetError, match="not empty"):
        render_tiny_dataset(foreign)


def test_bad_render_config_is_refused(tmp_path):
    with pytest.raises(TaskHetError, match="image_size"):
        render_dataset(tmp_path, replace(tiny_render_config(), image_size=4), progress=False)


def test_cli_renders_requested_sizes(tmp_path, capsys):
    argv = ["--out", str(tmp_path / "cli"), "--n_buildings", "2", "--n_views", "2", "--image_size", "16", "--no-progress"]
    out = render.main(argv)
    assert "2 buildings x 2 views at 16px" in capsys.readouterr().out
    assert len(list((out / "rgb/taskonomy").iterdir())) == 2
    with Image.open(out / "normal/taskonomy/synth001/point_0_view_1_domain_normal.png") as image:
        assert image.size == (16, 16)


def test_renderer_writes_real_segmentation_ids(tiny_data_root):
    # The renderer writes what real Taskonomy stores: raw = class + 1, raw 0 where no surface was hit.
    assert [object_class.name for object_class in OBJECT_CLASSES] == list(SEMANTIC_CLASS_NAMES[1:])
    assert [object_class.class_id for object_class in OBJECT_CLASSES] == list(range(1, NUM_SEMANTIC_CLASSES))
    config = tiny_render_config()
    raw_values = set()
    for sample_id, truth in rendered_views(config).items():
        building, rest = sample_id.split("_", 1)
        name = f"{rest}_domain_segmentsemantic.png"
        with Image.open(domain_dir(tiny_data_root, "segment_semantic", building) / name) as image:
            raw = np.array(image)
        np.testing.assert_array_equal(raw[truth.hit], truth.semantic[truth.hit].astype(np.int64) + 1)
        assert np.all(raw[~truth.hit] == 0)
        raw_values |= set(np.unique(raw).tolist())
    assert {0, 1} <= raw_values and max(raw_values) <= NUM_SEMANTIC_CLASSES  # unlabelled windows and background walls


def test_normals_follow_real_taskonomy_orientation(tiny_data_root):
    # Measured on omnidata's own sample files (shared/TASKONOMY_FORMAT.md): floors G≈48, ceilings G≈255,
    # visible surfaces B<128, i.e. x right, y down, z away from the camera. The renderer must agree.
    config = tiny_render_config()
    floor = ceiling = facing = 0
    for sample_id, truth in rendered_views(config).items():
        building, rest = sample_id.split("_", 1)
        with Image.open(domain_dir(tiny_data_root, "normal", building) / f"{rest}_domain_normal.png") as image:
            pixels = np.array(image).astype(int)
        on_floor, on_ceiling = truth.surface == 4, truth.surface == 5  # room faces are 2*axis + side
        assert np.all(pixels[on_floor][:, 1] < 128) and np.all(pixels[on_ceiling][:, 1] > 128)
        # A surface facing the camera has its normal against the optical axis: z away from the camera is negative.
        facing_camera = truth.hit & (truth.normal[..., 2] < -0.05)
        assert np.all(pixels[facing_camera][:, 2] < 128)
        floor, ceiling, facing = floor + on_floor.sum(), ceiling + on_ceiling.sum(), facing + facing_camera.sum()
    assert floor > 0 and ceiling > 0 and facing > 0


def test_level_camera_sees_floor_below_128_ceiling_above_and_walls_facing_it():
    config = tiny_render_config(n_buildings=1)
    building = make_building(config, 0, 0, scene_places_indices()[0])
    size = np.array(building.size)
    # Level, at the room's centre, looking along +x at the far wall: no object can hide the room's faces.
    camera = Camera(0, 0, (0.3, size[1] / 2, size[2] / 2), (1.0, 0.0, 0.0), (0.0, -1.0, 0.0), (0.0, 0.0, 1.0), np.radians(90.0))
    render = render_view(replace(building, objects=()), camera, 32)
    normal = encode_view(render, np.zeros(365, np.float32))["normal"].astype(int)
    on_floor, on_ceiling, far_wall = render.surface == 4, render.surface == 5, render.surface == 1
    assert on_floor.sum() > 0 and on_ceiling.sum() > 0 and far_wall.sum() > 0
    assert np.all(normal[on_floor][:, 1] < 128) and np.all(normal[on_ceiling][:, 1] > 128)
    # Seen head-on, the far wall's normal points straight back at the camera: (128, 128, 0).
    np.testing.assert_array_equal(normal[far_wall], np.broadcast_to([128, 128, 0], normal[far_wall].shape))
    assert np.all(normal[render.hit][:, 2] <= 128)


RENDER_UNDER_THE_PIPELINES_HANDLER = """
import sys
sys.path.insert(0, ".")
import utils.tv_compat
from datasets.synthetic import render_dataset
from datasets.synthetic_scenes import RenderConfig
from utils.interrupts import raise_on_sigterm

raise_on_sigterm()  # as run_main sets it: the pool's workers inherit it by fork
for attempt in range(3):
    render_dataset(sys.argv[1] + str(attempt), RenderConfig(num_buildings=4, views_per_building=2, image_size=32),
                   workers=2, progress=False)
"""


def test_the_render_pool_ends_without_a_worker_traceback(tmp_path):
    """The pool's exit sends its workers SIGTERM; the handler a pipeline installs made that a traceback in most
    renders (2 of 3 before the workers reset it)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", RENDER_UNDER_THE_PIPELINES_HANDLER, str(tmp_path / "r")],
                            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
