"""The synthetic buildings' geometry and ray caster: what a building is (textured box room with
primitive objects), where a camera stands, and how one view is rendered into every Taskonomy
domain's raw values (depth, normals, semantics, curvature, keypoints, edges). Drawing buildings
and cameras, encoding views in Taskonomy's file formats and writing the data set are
:mod:`datasets.synthetic`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KEYPOINT_SIGMA_M = 0.12
EDGE_TEXTURE_SCALE = 0.3
# 2D keypoints as Taskonomy's (SURF's detector response, before non-maximum suppression): the magnitude of the
# scale-normalised determinant of the Hessian, sigma^4 |Lxx Lyy - Lxy^2|, of the grey image at sigma = 1/32 of its
# width (2 px at 64 px: a blob is still a pixel wide for a 32-px model), / 0.004, which saturates 1.3% of the demo's
# pixels (0 on 0.8%). Both signs (blobs and saddles): the positive part alone is 0 on half the pixels, and local SGD (the
# federated optimiser) then never beat the all-zero map, as Harris' response / 5e-5 before (0 on 68% of the pixels)
# never did for any optimiser. The choice, measured: docs/BENCHMARKS.md, "The 2D keypoint target".
KEYPOINT2D_SIGMA_FRACTION = 1 / 32
KEYPOINT2D_SCALE = 0.004
OCCLUSION_JUMP = 0.04


@dataclass(frozen=True)
class Texture:
    """A procedural surface pattern mixing two colours; frequency in cycles per metre."""

    colour_a: tuple[float, float, float]
    colour_b: tuple[float, float, float]
    frequency: float
    pattern: int


@dataclass(frozen=True)
class Primitive:
    """An object: ``half_size`` is (hx, hy, hz) for boxes, (r, r, r) for spheres, (r, r, half height) for cylinders."""

    shape: str
    class_id: int
    centre: tuple[float, float, float]
    half_size: tuple[float, float, float]
    yaw: float
    texture: Texture

    @property
    def footprint_radius(self) -> float:
        """Radius of a circle around the object's floor footprint (any yaw), for placement."""
        return math.hypot(self.half_size[0], self.half_size[1]) if self.shape == "box" else self.half_size[0]


@dataclass(frozen=True)
class Building:
    """One room with its objects, textures and light."""

    name: str
    scene_type: int
    places_index: int
    size: tuple[float, float, float]
    wall: Texture
    floor: Texture
    ceiling: Texture
    texture_frequency: float
    light_direction: tuple[float, float, float]
    light_intensity: float
    ambient: float
    openings: tuple[tuple[int, float, float, float, float], ...]
    objects: tuple[Primitive, ...]


@dataclass(frozen=True)
class Camera:
    """A view: pose (orthonormal right/up/forward, world z up) and horizontal field of view in radians."""

    point: int
    view: int
    position: tuple[float, float, float]
    forward: tuple[float, float, float]
    right: tuple[float, float, float]
    up: tuple[float, float, float]
    fov: float


@dataclass
class ViewRender:
    """The float ground truth of one view (H x W): what the files encode.

    ``depth_*`` are metres (inf where no surface); ``normal`` is camera-frame unit
    vectors in real Taskonomy's frame (x right, y down, z away from the camera);
    ``semantic`` is the class id (0 background, 1..16 objects; 0 also where ``hit``
    is False); ``surface`` is -1 for no surface, 0..5 for room faces (2*axis + side:
    4 floor, 5 ceiling), 6+k for object k.
    """

    rgb: np.ndarray
    depth_euclidean: np.ndarray
    depth_zbuffer: np.ndarray
    normal: np.ndarray
    reshading: np.ndarray
    semantic: np.ndarray
    hit: np.ndarray
    curvature: np.ndarray
    keypoints3d: np.ndarray
    surface: np.ndarray


def _pattern(u: np.ndarray, v: np.ndarray, texture: Texture) -> np.ndarray:
    """A pattern value in [0, 1] at surface coordinates (metres)."""
    f = texture.frequency
    if texture.pattern == 0:
        return 0.5 + 0.5 * np.sin(2 * np.pi * f * u)
    if texture.pattern == 1:
        return (np.floor(f * u) + np.floor(f * v)) % 2
    if texture.pattern == 2:
        return 0.5 + 0.5 * np.sin(2 * np.pi * f * (u + 0.3 * np.sin(2 * np.pi * f * v) / f))
    return ((f * u) % 1.0 < 0.1) | ((f * v) % 1.0 < 0.1)


def _albedo(u: np.ndarray, v: np.ndarray, texture: Texture) -> np.ndarray:
    mix = _pattern(u, v, texture).astype(np.float64)[:, None]
    return np.array(texture.colour_a) * (1 - mix) + np.array(texture.colour_b) * mix


def _yaw_matrix(yaw: float) -> np.ndarray:
    """World -> object-local rotation (inverse of a rotation by ``yaw`` about z)."""
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])


def _safe(directions: np.ndarray) -> np.ndarray:
    # Rays parallel to a slab would divide by zero; a tiny component gives the same (infinite) answer.
    return np.where(np.abs(directions) < 1e-12, 1e-12, directions)


def _intersect_room(origin: np.ndarray, directions: np.ndarray, building: Building) -> tuple[np.ndarray, np.ndarray]:
    """Exit distance from inside the room, and the face id (2*axis + side); windows give inf."""
    size = np.array(building.size)
    d = _safe(directions)
    t_axes = (np.where(d > 0, size, 0.0) - origin) / d
    axis = np.argmin(t_axes, axis=1)
    rows = np.arange(len(d))
    t = t_axes[rows, axis]
    face = 2 * axis + (d[rows, axis] > 0)
    points = origin + t[:, None] * directions
    for wall, start, end, bottom, top in building.openings:
        along = points[:, 1] if wall < 2 else points[:, 0]
        hole = (face == wall) & (along > start) & (along < end) & (points[:, 2] > bottom) & (points[:, 2] < top)
        t = np.where(hole, np.inf, t)
    return t, face


def _intersect(origin: np.ndarray, directions: np.ndarray, primitive: Primitive) -> np.ndarray:
    """Distance to the first hit of each ray with one object (inf for a miss); rays are unit length."""
    centre, half = np.array(primitive.centre), np.array(primitive.half_size)
    if primitive.shape == "box":
        rotation = _yaw_matrix(primitive.yaw)
        local_origin, local_dirs = rotation @ (origin - centre), _safe(directions @ rotation.T)
        t1, t2 = (-half - local_origin) / local_dirs, (half - local_origin) / local_dirs
        near, far = np.minimum(t1, t2).max(axis=1), np.maximum(t1, t2).min(axis=1)
        return np.where((near <= far) & (near > 1e-6), near, np.inf)
    offset = origin - centre
    if primitive.shape == "sphere":
        b = directions @ offset
        discriminant = b * b - (offset @ offset - half[0] ** 2)
        t = -b - np.sqrt(np.maximum(discriminant, 0.0))
        return np.where((discriminant >= 0) & (t > 1e-6), t, np.inf)
    dx, dy, dz = directions[:, 0], directions[:, 1], directions[:, 2]
    a = np.maximum(dx * dx + dy * dy, 1e-12)
    b = offset[0] * dx + offset[1] * dy
    discriminant = b * b - a * (offset[0] ** 2 + offset[1] ** 2 - half[0] ** 2)
    t_side = (-b - np.sqrt(np.maximum(discriminant, 0.0))) / a
    z_side = offset[2] + t_side * dz
    t_side = np.where((discriminant >= 0) & (t_side > 1e-6) & (np.abs(z_side) <= half[2]), t_side, np.inf)
    best = t_side
    for cap in (half[2], -half[2]):
        t_cap = (cap - offset[2]) / _safe(dz)
        radial = (offset[0] + t_cap * dx) ** 2 + (offset[1] + t_cap * dy) ** 2
        best = np.minimum(best, np.where((t_cap > 1e-6) & (radial <= half[0] ** 2), t_cap, np.inf))
    return best


def _box_keypoints(distances: np.ndarray) -> np.ndarray:
    """3D keypoint strength from the distances (m) to a face's two pairs of edges: 0.5 on an edge, 1 at a corner."""
    near = np.min(distances, axis=1)
    sigma2 = 2 * KEYPOINT_SIGMA_M**2
    return 0.5 * np.exp(-(near**2) / sigma2) + 0.5 * np.exp(-np.sum(distances**2, axis=1) / sigma2)


def _room_surface(points: np.ndarray, face: np.ndarray, building: Building) -> dict[str, np.ndarray]:
    size = np.array(building.size)
    axis = face // 2
    normal = np.zeros_like(points)
    normal[np.arange(len(points)), axis] = np.where(face % 2 == 1, -1.0, 1.0)
    albedo = np.empty_like(points)
    tangent_distances = np.empty((len(points), 2))
    for axis_value, texture in ((0, building.wall), (1, building.wall), (2, None)):
        rows = axis == axis_value
        u_axis, v_axis = [k for k in range(3) if k != axis_value]
        u, v = points[rows, u_axis], points[rows, v_axis]
        if texture is None:
            floor = face[rows] == 4
            albedo[rows] = np.where(floor[:, None], _albedo(u, v, building.floor), _albedo(u, v, building.ceiling))
        else:
            albedo[rows] = _albedo(u, v, texture)
        tangent_distances[rows, 0] = np.minimum(u, size[u_axis] - u)
        tangent_distances[rows, 1] = np.minimum(v, size[v_axis] - v)
    return {"normal": normal, "albedo": albedo, "curvature": np.zeros((len(points), 2)), "keypoints3d": _box_keypoints(tangent_distances)}


def _object_surface(points: np.ndarray, primitive: Primitive) -> dict[str, np.ndarray]:
    centre, half = np.array(primitive.centre), np.array(primitive.half_size)
    count = len(points)
    if primitive.shape == "box":
        rotation = _yaw_matrix(primitive.yaw)
        local = (points - centre) @ rotation.T
        axis = np.argmax(np.abs(local) / half, axis=1)
        local_normal = np.zeros_like(local)
        local_normal[np.arange(count), axis] = np.sign(local[np.arange(count), axis])
        normal = local_normal @ rotation
        tangent = np.array([[k for k in range(3) if k != a] for a in range(3)])[axis]
        distances = half[tangent] - np.abs(np.take_along_axis(local, tangent, axis=1))
        uv = np.take_along_axis(local, tangent, axis=1)
        albedo = _albedo(uv[:, 0], uv[:, 1], primitive.texture)
        return {"normal": normal, "albedo": albedo, "curvature": np.zeros((count, 2)), "keypoints3d": _box_keypoints(distances)}
    offset = points - centre
    if primitive.shape == "sphere":
        normal = offset / half[0]
        u, v = np.arctan2(offset[:, 1], offset[:, 0]) * half[0], offset[:, 2]
        curvature = np.full((count, 2), 1.0 / half[0])
        return {"normal": normal, "albedo": _albedo(u, v, primitive.texture), "curvature": curvature, "keypoints3d": np.zeros(count)}
    radial = np.hypot(offset[:, 0], offset[:, 1])
    on_cap = np.abs(np.abs(offset[:, 2]) - half[2]) < np.abs(radial - half[0])
    side_normal = np.stack([offset[:, 0], offset[:, 1], np.zeros(count)], axis=1) / np.maximum(radial, 1e-9)[:, None]
    cap_normal = np.stack([np.zeros(count), np.zeros(count), np.sign(offset[:, 2])], axis=1)
    normal = np.where(on_cap[:, None], cap_normal, side_normal)
    rim_distance = np.where(on_cap, half[0] - radial, half[2] - np.abs(offset[:, 2]))
    curvature = np.stack([np.where(on_cap, 0.0, 1.0 / half[0]), np.zeros(count)], axis=1)
    u = np.arctan2(offset[:, 1], offset[:, 0]) * half[0]
    keypoints = 0.5 * np.exp(-(rim_distance**2) / (2 * KEYPOINT_SIGMA_M**2))
    return {"normal": normal, "albedo": _albedo(u, offset[:, 2], primitive.texture), "curvature": curvature, "keypoints3d": keypoints}


def camera_rays(camera: Camera, image_size: int) -> np.ndarray:
    """Unit ray directions [H*W, 3], row-major from the top-left pixel centre."""
    tan_half = math.tan(camera.fov / 2)
    centres = (np.arange(image_size) + 0.5) / image_size * 2 - 1
    xs, ys = centres * tan_half, -centres * tan_half
    directions = np.array(camera.forward) + xs[None, :, None] * np.array(camera.right) + ys[:, None, None] * np.array(camera.up)
    directions = directions.reshape(-1, 3)
    return directions / np.linalg.norm(directions, axis=1, keepdims=True)


def render_view(building: Building, camera: Camera, image_size: int) -> ViewRender:
    """Ray-cast every pixel of one view at once and shade it.

    Each primitive is intersected with all rays in one vectorised call; the nearest
    hit per pixel then selects whose surface attributes (normal, albedo, curvature,
    3D keypoints) fill that pixel.

    Returns:
        The float ground truth at ``image_size`` x ``image_size``.
    """
    origin = np.array(camera.position)
    directions = camera_rays(camera, image_size)
    room_t, room_face = _intersect_room(origin, directions, building)
    distances = np.stack([room_t, *(_intersect(origin, directions, obj) for obj in building.objects)])
    nearest = np.argmin(distances, axis=0)
    t = distances[nearest, np.arange(len(directions))]
    hit = np.isfinite(t)
    points = origin + np.where(hit, t, 0.0)[:, None] * directions
    count = len(directions)
    normal, albedo = np.zeros((count, 3)), np.zeros((count, 3))
    curvature, keypoints3d = np.zeros((count, 2)), np.zeros(count)
    semantic = np.zeros(count, dtype=np.uint8)
    surface = np.full(count, -1, dtype=np.int64)
    room_rows = hit & (nearest == 0)
    parts = [(room_rows, _room_surface(points[room_rows], room_face[room_rows], building))]
    surface[room_rows] = room_face[room_rows]
    for k, obj in enumerate(building.objects):
        rows = hit & (nearest == k + 1)
        parts.append((rows, _object_surface(points[rows], obj)))
        semantic[rows] = obj.class_id
        surface[rows] = 6 + k
    for rows, attributes in parts:
        normal[rows], albedo[rows] = attributes["normal"], attributes["albedo"]
        curvature[rows], keypoints3d[rows] = attributes["curvature"], attributes["keypoints3d"]
    shading = building.ambient + building.light_intensity * np.clip(normal @ np.array(building.light_direction), 0.0, None)
    sky = np.array([0.55, 0.75, 0.95]) + 0.3 * np.clip(directions[:, 2:3], 0, 1)
    rgb = np.where(hit[:, None], np.clip(albedo * shading[:, None], 0, 1), np.clip(sky, 0, 1))
    forward = np.array(camera.forward)
    # Real Taskonomy's camera frame (measured on omnidata's files): x right, y down, z away from the camera.
    camera_normal = normal @ np.stack([np.array(camera.right), -np.array(camera.up), forward], axis=1)
    shape = (image_size, image_size)
    return ViewRender(
        rgb=rgb.reshape(*shape, 3),
        depth_euclidean=t.reshape(shape),
        depth_zbuffer=(t * (directions @ forward)).reshape(shape),
        normal=camera_normal.reshape(*shape, 3),
        reshading=np.where(hit, np.clip(shading, 0, 1), 0.0).reshape(shape),
        semantic=semantic.reshape(shape),
        hit=hit.reshape(shape),
        curvature=curvature.reshape(*shape, 2),
        keypoints3d=np.where(hit, keypoints3d, 0.0).reshape(shape),
        surface=surface.reshape(shape),
    )


def occlusion_edges(depth: np.ndarray, surface: np.ndarray) -> np.ndarray:
    """Occluding-side pixels of depth discontinuities between different surfaces (bool [H, W])."""
    edges = np.zeros(depth.shape, dtype=bool)
    padded_depth = np.pad(depth, 1, mode="edge")
    padded_surface = np.pad(surface, 1, mode="edge")
    height, width = depth.shape
    for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        neighbour = padded_depth[1 + dy : 1 + dy + height, 1 + dx : 1 + dx + width]
        neighbour_surface = padded_surface[1 + dy : 1 + dy + height, 1 + dx : 1 + dx + width]
        with np.errstate(invalid="ignore"):
            jump = np.abs(neighbour - depth) > OCCLUSION_JUMP * np.minimum(neighbour, depth)
        # Room faces never occlude each other (the room is convex seen from inside), so their creases are not edges.
        both_room = (surface < 6) & (neighbour_surface >= 0) & (neighbour_surface < 6)
        edges |= (neighbour_surface != surface) & ~both_room & np.isfinite(depth) & (neighbour > depth) & (jump | ~np.isfinite(neighbour))
    return edges


def image_features(rgb_uint8: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Texture edges (Sobel magnitude) and 2D keypoints (SURF's determinant of the Hessian) of the written image, in [0, 1]."""
    from scipy import ndimage  # here: only rendering needs scipy, not reading the rendered data

    grey = rgb_uint8.astype(np.float64) @ np.array([0.299, 0.587, 0.114]) / 255.0
    blurred = ndimage.gaussian_filter(grey, 0.7)
    gx, gy = ndimage.sobel(blurred, axis=1) / 8.0, ndimage.sobel(blurred, axis=0) / 8.0
    edges = np.clip(np.hypot(gx, gy) / EDGE_TEXTURE_SCALE, 0, 1)
    return edges, keypoints2d_response(grey)


def keypoints2d_response(grey: np.ndarray) -> np.ndarray:
    """sigma^4 |Lxx Lyy - Lxy^2| of the Gaussian-smoothed ``grey`` [H, W] / KEYPOINT2D_SCALE, clipped to [0, 1]."""
    from scipy import ndimage

    sigma = KEYPOINT2D_SIGMA_FRACTION * grey.shape[1]
    smoothed = ndimage.gaussian_filter(grey, sigma)
    # Second differences of the smoothed image, not scipy's Gaussian-derivative kernels: those do not sum to exactly 0,
    # so a flat grey of 0.5 read as a curvature of -4e-5; these are exact on a parabola and 0 on a flat image.
    lxx = ndimage.correlate1d(smoothed, [1.0, -2.0, 1.0], axis=1)
    lyy = ndimage.correlate1d(smoothed, [1.0, -2.0, 1.0], axis=0)
    lxy = ndimage.correlate1d(ndimage.correlate1d(smoothed, [-0.5, 0.0, 0.5], axis=1), [-0.5, 0.0, 0.5], axis=0)
    determinant = (lxx * lyy - lxy * lxy) * sigma**4
    return np.clip(np.abs(determinant) / KEYPOINT2D_SCALE, 0, 1)
