"""The synthetic buildings' content: object and scene classes, rooms, cameras and scene scores.

Drawn from seeded streams (utils.seeding.numpy_rng) only; :mod:`datasets.synthetic` renders
and writes what this module draws. Room size, texture frequency and lighting come from
streams that never see the scene class (see datasets/synthetic.py's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from datasets.synthetic_raycast import Building, Camera, Primitive, Texture
from datasets.taskonomy import read_scene_names
from datasets.taskonomy_domains import NUM_SCENE_SCORES
from utils.errors import TaskHetError
from utils.seeding import numpy_rng
PLACES365_SOURCE = Path(__file__).with_name("places365_categories.txt")


def places365_names() -> list[str]:
    """The 365 Places365 class names in label order (``bedroom``, ``bakery/shop``, ...)."""
    return read_scene_names(PLACES365_SOURCE)


@dataclass(frozen=True)
class ObjectClass:
    """A semantic class: its primitive, size range (x, y, z extents in m), lift off the floor and colour."""

    class_id: int
    name: str
    shape: str
    size_min: tuple[float, float, float]
    size_max: tuple[float, float, float]
    lift: tuple[float, float]
    colour: tuple[float, float, float]


# Class ids 1..16 are Taskonomy's indoor COCO classes (datasets.taskonomy.SEMANTIC_CLASS_NAMES); walls, floor and
# ceiling are class 0 (background). Files store raw = class + 1, and raw 0 where no surface was hit (unlabelled).
OBJECT_CLASSES = (
    ObjectClass(1, "bottle", "cylinder", (0.15, 0.15, 0.35), (0.25, 0.25, 0.6), (0.6, 1.0), (0.15, 0.55, 0.30)),
    ObjectClass(2, "chair", "box", (0.45, 0.45, 0.8), (0.6, 0.6, 1.0), (0.0, 0.0), (0.55, 0.35, 0.20)),
    ObjectClass(3, "couch", "box", (1.6, 0.8, 0.7), (2.2, 1.0, 0.9), (0.0, 0.0), (0.60, 0.20, 0.25)),
    ObjectClass(4, "potted_plant", "sphere", (0.5, 0.5, 0.5), (0.8, 0.8, 0.8), (0.0, 0.3), (0.20, 0.70, 0.20)),
    ObjectClass(5, "bed", "box", (1.4, 1.9, 0.5), (2.0, 2.2, 0.7), (0.0, 0.0), (0.85, 0.85, 0.95)),
    ObjectClass(6, "dining_table", "box", (1.2, 0.8, 0.72), (2.0, 1.2, 0.78), (0.0, 0.0), (0.45, 0.30, 0.15)),
    ObjectClass(7, "toilet", "cylinder", (0.4, 0.4, 0.4), (0.5, 0.5, 0.5), (0.0, 0.0), (0.95, 0.95, 0.95)),
    ObjectClass(8, "tv", "box", (0.9, 0.08, 0.55), (1.4, 0.12, 0.8), (0.6, 1.0), (0.05, 0.05, 0.08)),
    ObjectClass(9, "microwave", "box", (0.45, 0.35, 0.28), (0.55, 0.45, 0.35), (0.8, 1.0), (0.70, 0.70, 0.72)),
    ObjectClass(10, "oven", "box", (0.6, 0.6, 0.85), (0.75, 0.7, 0.95), (0.0, 0.0), (0.30, 0.30, 0.32)),
    ObjectClass(11, "toaster", "box", (0.25, 0.18, 0.2), (0.35, 0.25, 0.25), (0.8, 1.0), (0.85, 0.20, 0.15)),
    ObjectClass(12, "sink", "box", (0.5, 0.45, 0.85), (0.8, 0.55, 0.95), (0.0, 0.0), (0.75, 0.85, 0.90)),
    ObjectClass(13, "refrigerator", "box", (0.7, 0.7, 1.7), (0.9, 0.8, 2.0), (0.0, 0.0), (0.90, 0.90, 0.88)),
    ObjectClass(14, "book", "box", (0.2, 0.15, 0.3), (0.3, 0.2, 0.45), (0.5, 1.2), (0.20, 0.30, 0.75)),
    ObjectClass(15, "clock", "sphere", (0.3, 0.3, 0.3), (0.4, 0.4, 0.4), (1.5, 1.9), (0.95, 0.80, 0.20)),
    ObjectClass(16, "vase", "cylinder", (0.2, 0.2, 0.4), (0.3, 0.3, 0.6), (0.0, 0.8), (0.60, 0.30, 0.70)),
)
CLASS_BY_NAME = MappingProxyType({object_class.name: object_class for object_class in OBJECT_CLASSES})


@dataclass(frozen=True)
class SceneType:
    """A Places365 scene: objects it always holds, and objects it holds with probability 1/2 each."""

    places_name: str
    core: tuple[str, ...]
    optional: tuple[str, ...]


SCENE_TYPES = (
    SceneType("bedroom", ("bed",), ("clock", "book", "vase", "chair", "tv")),
    SceneType("kitchen", ("refrigerator", "oven"), ("microwave", "toaster", "sink", "bottle", "dining_table")),
    SceneType("office", ("chair", "dining_table"), ("tv", "book", "clock", "potted_plant")),
    SceneType("living_room", ("couch", "tv"), ("potted_plant", "vase", "chair", "clock", "book")),
    SceneType("bathroom", ("toilet", "sink"), ("bottle", "vase")),
    SceneType("dining_room", ("dining_table", "chair", "chair"), ("vase", "bottle", "clock", "potted_plant")),
    SceneType("classroom", ("dining_table", "chair", "chair", "chair"), ("clock", "book", "tv")),
    SceneType("conference_room", ("dining_table", "chair", "chair", "tv"), ("clock", "bottle", "potted_plant")),
    SceneType("corridor", ("potted_plant",), ("clock", "vase")),
    SceneType("home_office", ("chair", "book", "tv"), ("potted_plant", "clock", "bottle")),
    SceneType("waiting_room", ("couch", "chair"), ("potted_plant", "clock", "book", "tv")),
    SceneType("storage_room", ("book", "bottle"), ("refrigerator", "vase", "microwave")),
)


@dataclass(frozen=True)
class RenderConfig:
    """What to render. Files depend only on these values."""

    num_buildings: int = 24
    views_per_building: int = 50
    views_per_point: int = 5
    image_size: int = 64
    seed: int = 0

    def validate(self) -> None:
        """Raise :class:`TaskHetError` naming the first bad value."""
        for name in ("num_buildings", "views_per_building", "views_per_point", "image_size"):
            if getattr(self, name) < 1:
                raise TaskHetError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size < 8:
            raise TaskHetError(f"image_size must be >= 8 pixels, got {self.image_size}")


def _texture(rng: np.random.Generator, frequency: float) -> Texture:
    base = rng.uniform(0.25, 0.9, size=3)
    contrast = rng.uniform(0.1, 0.45)
    other = np.clip(base + rng.choice([-1.0, 1.0]) * contrast * rng.uniform(0.5, 1.0, size=3), 0.05, 1.0)
    return Texture(tuple(base.round(4)), tuple(other.round(4)), float(frequency), int(rng.integers(0, 4)))


def assign_scene_types(config: RenderConfig) -> list[int]:
    """Scene type per building: a seeded permutation, repeated, so every type appears before any repeats."""
    order = numpy_rng(config.seed, "scene_types").permutation(len(SCENE_TYPES))
    return [int(order[index % len(order)]) for index in range(config.num_buildings)]


def building_name(index: int) -> str:
    """Names are lower-case words like Taskonomy's (no underscores: they appear inside sample ids)."""
    return f"synth{index:03d}"


def make_building(config: RenderConfig, index: int, scene_type: int, places_index: int) -> Building:
    """Draw one building. Room, textures and light use streams independent of the scene type.

    Args:
        config: the render's config (its seed).
        index: building number (names the building and its random streams).
        scene_type: index into :data:`SCENE_TYPES`; decides the objects only.
        places_index: the scene's Places365 label (stored for the class_scene scores).
    """
    room_rng = numpy_rng(config.seed, "room", index)
    size = (room_rng.uniform(3.5, 9.0), room_rng.uniform(3.5, 9.0), room_rng.uniform(2.5, 3.6))
    texture_frequency = float(np.exp(room_rng.uniform(np.log(0.5), np.log(4.0))))
    wall, floor, ceiling = (_texture(room_rng, texture_frequency * room_rng.uniform(0.7, 1.4)) for _ in range(3))
    elevation, azimuth = room_rng.uniform(np.radians(30), np.radians(80)), room_rng.uniform(0, 2 * np.pi)
    light = (np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth), np.sin(elevation))
    openings = []
    for _ in range(int(room_rng.integers(0, 3))):
        face = int(room_rng.integers(0, 4))
        wall_length = size[1] if face < 2 else size[0]
        width = room_rng.uniform(0.8, min(2.0, wall_length - 0.5))
        start = room_rng.uniform(0.2, wall_length - width - 0.2)
        bottom = room_rng.uniform(0.7, 1.2)
        openings.append((face, start, start + width, bottom, min(bottom + room_rng.uniform(0.8, 1.5), size[2] - 0.2)))
    objects = _place_objects(numpy_rng(config.seed, "objects", index), SCENE_TYPES[scene_type], size)
    return Building(
        name=building_name(index), scene_type=scene_type, places_index=places_index, size=size,
        wall=wall, floor=floor, ceiling=ceiling, texture_frequency=texture_frequency,
        light_direction=light, light_intensity=float(room_rng.uniform(0.4, 1.0)), ambient=float(room_rng.uniform(0.15, 0.45)),
        openings=tuple(openings), objects=objects,
    )


def _place_objects(rng: np.random.Generator, scene: SceneType, room: tuple[float, float, float]) -> tuple[Primitive, ...]:
    names = list(scene.core) + [name for name in scene.optional if rng.random() < 0.5]
    placed: list[Primitive] = []
    for name in names:
        object_class = CLASS_BY_NAME[name]
        extent = rng.uniform(object_class.size_min, object_class.size_max)
        if object_class.shape == "sphere":
            extent[:] = extent[0]
        elif object_class.shape == "cylinder":
            extent[1] = extent[0]
        half = tuple(float(value) for value in extent / 2)
        lift = rng.uniform(*object_class.lift)
        yaw = float(rng.uniform(0, np.pi)) if object_class.shape == "box" else 0.0
        colour = np.clip(np.array(object_class.colour) * rng.uniform(0.85, 1.15, size=3), 0.02, 1.0)
        texture = Texture(tuple(colour.round(4)), tuple((colour * 0.7).round(4)), float(rng.uniform(2.0, 8.0)), int(rng.integers(0, 4)))
        candidate = Primitive(object_class.shape, object_class.class_id, (0.0, 0.0, lift + half[2]), half, yaw, texture)
        radius = candidate.footprint_radius
        for _ in range(50):
            # Bounded retries: a crowded room drops the object rather than looping forever.
            x, y = rng.uniform(radius + 0.1, room[0] - radius - 0.1), rng.uniform(radius + 0.1, room[1] - radius - 0.1)
            if all(math.hypot(x - other.centre[0], y - other.centre[1]) > radius + other.footprint_radius + 0.1 for other in placed):
                placed.append(Primitive(candidate.shape, candidate.class_id, (float(x), float(y), candidate.centre[2]), half, yaw, texture))
                break
    return tuple(placed)


def make_cameras(config: RenderConfig, building: Building, index: int) -> list[Camera]:
    """Cameras of one building: ``views_per_building`` views, ``views_per_point`` per target point.

    Args:
        config: the render's config.
        building: from :func:`make_building`.
        index: the building's number (its random stream).
    """
    rng = numpy_rng(config.seed, "views", index)
    size = np.array(building.size)
    cameras: list[Camera] = []
    for point in range(math.ceil(config.views_per_building / config.views_per_point)):
        if building.objects and rng.random() < 0.6:
            target = np.array(building.objects[int(rng.integers(len(building.objects)))].centre)
        else:
            target = rng.uniform([0.3, 0.3, 0.3], size - 0.3)
        target = target + rng.normal(0.0, 0.15, size=3)
        num_views = min(config.views_per_point, config.views_per_building - point * config.views_per_point)
        for view in range(num_views):
            position = _free_position(rng, building, target)
            forward = (target - position) / np.linalg.norm(target - position)
            right = np.cross(forward, [0.0, 0.0, 1.0])
            right /= np.linalg.norm(right)
            up = np.cross(right, forward)
            fov = float(np.radians(rng.uniform(50.0, 75.0)))
            cameras.append(Camera(point, view, tuple(position), tuple(forward), tuple(right), tuple(up), fov))
    return cameras


def _free_position(rng: np.random.Generator, building: Building, target: np.ndarray) -> np.ndarray:
    size = np.array(building.size)
    for _ in range(500):
        position = np.array([rng.uniform(0.3, size[0] - 0.3), rng.uniform(0.3, size[1] - 0.3), rng.uniform(1.1, min(1.8, size[2] - 0.3))])
        clear = all(math.hypot(position[0] - obj.centre[0], position[1] - obj.centre[1]) > obj.footprint_radius + 0.25 for obj in building.objects)
        if clear and np.linalg.norm(target - position) > 0.8 and np.linalg.norm((target - position)[:2]) > 0.6:
            return position
    raise RuntimeError(f"no free camera position in {building.name}; object placement leaves too little room")


def scene_places_indices() -> tuple[int, ...]:
    """The Places365 label index of each of :data:`SCENE_TYPES`."""
    names = places365_names()
    return tuple(names.index(scene.places_name) for scene in SCENE_TYPES)


def scene_scores(rng: np.random.Generator, building: Building, semantic: np.ndarray, places_indices: tuple[int, ...]) -> np.ndarray:
    """365 Places365 scores summing to 1, peaked (> 0.5) at the building's class.

    The remaining mass goes to the scene types whose objects the view shows, so
    views differ the way a classifier's outputs would.

    Args:
        rng: the building's score stream.
        building: the building (its ``places_index`` gets the peak).
        semantic: the view's class-id image.
        places_indices: from :func:`scene_places_indices`.
    """
    peak = rng.uniform(0.55, 0.9)
    visible = np.bincount(semantic.ravel(), minlength=len(OBJECT_CLASSES) + 1)[1:] / semantic.size
    others = rng.random(NUM_SCENE_SCORES) * 0.02
    for scene, places_index in zip(SCENE_TYPES, places_indices):
        held = {CLASS_BY_NAME[name].class_id for name in scene.core + scene.optional}
        others[places_index] += sum(visible[class_id - 1] for class_id in held)
    others[building.places_index] = 0.0
    scores = others / others.sum() * (1 - peak)
    scores[building.places_index] = peak
    return scores.astype(np.float32)
