"""Synthetic buildings, ray-cast with numpy and written in the Taskonomy/omnidata layout.

Real Taskonomy cannot be downloaded everywhere, so the embedded default data is
rendered here and read by :mod:`datasets.taskonomy` unchanged. A building is one
room: its size, its wall/floor/ceiling textures (pattern, frequency, palette),
one directional light (direction, intensity, ambient) and a few windows (holes
where rays find no surface). It holds objects (boxes, spheres, cylinders) of
semantic classes 1..16, and its scene class (a real Places365 index) is set by
which objects it holds. Room size, texture frequency and lighting are drawn from
random streams that never see the scene class, so the variation that dense tasks
care about (depth range, edge density, shading) is not explained by the label.

Every view is a camera looking at a "point" of the room; all pixels' rays are
cast at once. Ground truth comes from the geometry (depth, normals, reshading,
semantics, occlusion edges, 3D keypoints, curvature, validity), except texture
edges and 2D keypoints, which are computed on the rendered image as in
Taskonomy. Encodings follow ``docs/DATA.md``. Everything derives from one seed:
the same seed and sizes give byte-identical files. The geometry and the ray caster are
:mod:`datasets.synthetic_raycast`'s, the buildings and cameras are drawn by
:mod:`datasets.synthetic_scenes`; this module encodes views and writes the data set.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image
from tqdm import tqdm

from datasets.synthetic_raycast import ViewRender, image_features, occlusion_edges, render_view
from datasets.synthetic_scenes import (SCENE_TYPES, RenderConfig, assign_scene_types, make_building, make_cameras,
                                       places365_names, scene_places_indices, scene_scores)
from datasets.taskonomy import domain_dir
from datasets.taskonomy_domains import DEPTH_INVALID, DEPTH_UNITS_PER_METRE, DOMAINS, NORMAL_INVALID, get_domain
from utils.errors import TaskHetError
from utils.interrupts import quiet_worker
from utils.locks import folder_entries
from utils.run_dir import atomic_write_text
from utils.seeding import numpy_rng

META_FILE = "synthetic_meta.json"
# 2: segment_semantic written as raw = class + 1 (0 unlabelled), normals with y down and z away from the camera.
# 3: keypoints2d as the determinant of the Hessian (SURF), not Harris' corner response.
FORMAT_VERSION = 3
SPLIT_FILE = "train_val_test_synthetic.csv"
PLACES_FILE = "places_class_names.txt"
BUILDINGS_FILE = "synthetic_buildings.csv"
CURVATURE_SCALE = 4.0


def write_places_file(out_dir: Path) -> None:
    """``places_class_names.txt``: the Places365 names, one per line (line = label index)."""
    atomic_write_text(Path(out_dir) / PLACES_FILE, "\n".join(places365_names()) + "\n")


def encode_view(render: ViewRender, scores: np.ndarray) -> dict[str, np.ndarray]:
    """File contents per domain (uint8/uint16 images, the float32 score vector), per docs/DATA.md."""
    hit = render.hit

    def depth_png(depth: np.ndarray) -> np.ndarray:
        units = np.clip(np.round(np.where(hit, depth, 0.0) * DEPTH_UNITS_PER_METRE), 0, DEPTH_INVALID - 1)
        return np.where(hit, units, DEPTH_INVALID).astype(np.uint16)

    def unit16(values: np.ndarray) -> np.ndarray:
        return np.round(np.clip(values, 0, 1) * 65535).astype(np.uint16)

    rgb = np.round(render.rgb * 255).astype(np.uint8)
    edges, keypoints2d = image_features(rgb)
    normal = np.where(hit[..., None], np.round((render.normal + 1) / 2 * 255), NORMAL_INVALID).astype(np.uint8)
    curvature = np.zeros((*hit.shape, 3), dtype=np.uint8)
    curvature[..., :2] = np.where(hit[..., None], 128 + np.round(127 * np.tanh(render.curvature / CURVATURE_SCALE)), 0)
    return {
        "rgb": rgb,
        "depth_euclidean": depth_png(render.depth_euclidean),
        "depth_zbuffer": depth_png(render.depth_zbuffer),
        "normal": normal,
        "reshading": np.round(render.reshading * 255).astype(np.uint8),
        "segment_semantic": np.where(hit, render.semantic + 1, 0).astype(np.uint8),
        "edge_texture": unit16(edges),
        "edge_occlusion": unit16(occlusion_edges(render.depth_euclidean, render.surface).astype(np.float64)),
        "keypoints2d": unit16(keypoints2d),
        "keypoints3d": unit16(render.keypoints3d),
        "principal_curvature": curvature,
        "mask_valid": np.where(hit, 255, 0).astype(np.uint8),
        "class_scene": scores,
    }


def _write(path: Path, content: np.ndarray) -> None:
    if path.suffix == ".npy":
        np.save(path, content)
    else:
        Image.fromarray(content).save(path)


def render_building(config: RenderConfig, index: int, scene_type: int, out_dir: Path) -> dict:
    """Render and write every view of one building.

    Returns:
        Its row of ``synthetic_buildings.csv``: building, scene_name, places_index,
        room_x_m/room_y_m/room_z_m, texture_frequency, light_intensity, ambient,
        num_objects, num_openings.
    """
    places_indices = scene_places_indices()
    places_index = places_indices[scene_type]
    building = make_building(config, index, scene_type, places_index)
    for domain in DOMAINS:
        domain_dir(out_dir, domain, building.name).mkdir(parents=True, exist_ok=True)
    scores_rng = numpy_rng(config.seed, "scene_scores", index)
    for camera in make_cameras(config, building, index):
        render = render_view(building, camera, config.image_size)
        for domain, content in encode_view(render, scene_scores(scores_rng, building, render.semantic, places_indices)).items():
            _write(domain_dir(out_dir, domain, building.name) / get_domain(domain).file_name(camera.point, camera.view), content)
    return {
        "building": building.name, "scene_name": SCENE_TYPES[scene_type].places_name, "places_index": places_index,
        "room_x_m": round(building.size[0], 3), "room_y_m": round(building.size[1], 3), "room_z_m": round(building.size[2], 3),
        "texture_frequency": round(building.texture_frequency, 4), "light_intensity": round(building.light_intensity, 4),
        "ambient": round(building.ambient, 4), "num_objects": len(building.objects), "num_openings": len(building.openings),
    }


def _render_job(job: tuple[RenderConfig, int, int, Path]) -> dict:
    return render_building(*job)


def _prepare_out_dir(out_dir: Path, config: RenderConfig) -> bool:
    """True if ``out_dir`` already holds this exact render; clears an older render of ours otherwise."""
    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("complete") and meta.get("config") == asdict(config) and meta.get("format_version") == FORMAT_VERSION:
            return True
        for domain in DOMAINS:
            shutil.rmtree(out_dir / domain, ignore_errors=True)
    elif out_dir.exists() and folder_entries(out_dir):  # a folder holding only its lock is empty
        raise TaskHetError(f"{out_dir} is not empty and holds no {META_FILE}: refusing to render into it; choose another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_meta(out_dir, config, complete=False)
    return False


def _write_meta(out_dir: Path, config: RenderConfig, complete: bool) -> None:
    """The render's marker: written incomplete before the first file, complete after the last."""
    meta = {"format_version": FORMAT_VERSION, "config": asdict(config), "complete": complete}
    atomic_write_text(out_dir / META_FILE, json.dumps(meta, indent=2))


def write_split_csv(path: Path, buildings: list[str], seed: int) -> None:
    """Taskonomy's split format: ``id,train,val,test``, one building per row (70/15/15, seeded)."""
    order = numpy_rng(seed, "split_csv").permutation(len(buildings))
    num_test = len(buildings) * 15 // 100
    num_val = len(buildings) * 15 // 100
    rows = []
    for rank, position in enumerate(order):
        split = "test" if rank < num_test else "val" if rank < num_test + num_val else "train"
        rows.append({"id": buildings[position], "train": int(split == "train"), "val": int(split == "val"), "test": int(split == "test")})
    pd.DataFrame(rows).sort_values("id").to_csv(path, index=False)


def render_dataset(out_dir: Path, config: RenderConfig, workers: int = 2, progress: bool = True) -> Path:
    """Render ``config.num_buildings`` buildings into ``out_dir`` in the Taskonomy layout.

    Also writes ``train_val_test_synthetic.csv`` (``id,train,val,test``),
    ``places_class_names.txt`` (365 names, one per line, line = label index) and
    ``synthetic_buildings.csv`` (per-building room size, texture frequency, light).
    An existing complete render with the same config is kept as is.

    Returns:
        ``out_dir``.
    """
    config.validate()
    out_dir = Path(out_dir)
    if _prepare_out_dir(out_dir, config):
        return out_dir
    scene_types = assign_scene_types(config)
    jobs = [(config, index, scene_types[index], out_dir) for index in range(config.num_buildings)]
    parallel = workers > 1 and len(jobs) > 1
    # quiet_worker: the pool's exit sends its workers SIGTERM, which the handler they inherit would make a traceback
    pool_context = (multiprocessing.get_context().Pool(min(workers, len(jobs)), initializer=quiet_worker) if parallel
                    else contextlib.nullcontext())
    with pool_context as pool:
        results = pool.imap(_render_job, jobs) if parallel else map(_render_job, jobs)  # both keep the job order
        rows = list(tqdm(results, total=len(jobs), desc="rendering buildings", unit="building", disable=not progress))
    pd.DataFrame(rows).to_csv(out_dir / BUILDINGS_FILE, index=False)
    write_split_csv(out_dir / SPLIT_FILE, [row["building"] for row in rows], config.seed)
    write_places_file(out_dir)
    _write_meta(out_dir, config, complete=True)
    return out_dir
