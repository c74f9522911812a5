"""Per-client skews: feature skew (P(X|Y) varies) and concept shift (P(Y|X) varies) on top of any partition.

A partition scheme (``partitioning.partition``) decides *which* rows a client holds; a skew
changes *what a client sees* in them. Every skew is an entry of the one registry
:data:`SKEWS`:

* ``feature_noise`` (feature skew, NIID-Bench's noise form): client i's images get additive
  Gaussian noise of standard deviation σ_i = σ·i/(N−1), so client 0 is clean and client N−1
  has σ. Values are in the images' [0, 1] units, before the model's normalisation, and are not
  clipped (NIID-Bench does not clip either). Unlike NIID-Bench, which redraws the noise at each
  access from the global RNG, a sample's noise here is fixed: drawn from a generator seeded by
  (the client's recorded seed, the sample id), so a resumed or re-run step 4 sees exactly the
  same pixels, and cached encoder maps can hold them.
* ``feature_shift`` (feature skew): per-client image shifts, each client's parameters drawn
  from its own seeded generator: brightness, contrast and saturation factors in [1−m, 1+m], a
  hue shift in [−m, m], a Gaussian blur σ in [0, m] and a rotation in [−m, m] degrees (only the
  transforms named in the flag). Applied with ``torchvision.transforms.v2.functional``.
* ``label_swap`` (concept shift, classification): a chosen fraction of clients relabel k
  disjoint class pairs (a ↔ b), drawn per client or given; the pairs are recorded.
* ``target_variant`` (concept shift, dense tasks): a chosen fraction of clients get the targets
  of another target domain the data really has for the same images (``depth_euclidean`` ↔
  ``depth_zbuffer``: distance to the camera centre vs. distance to the image plane). The
  global test set keeps the run's task's own targets, so the global test measures how well the
  one global model predicts the majority concept after training among clients that disagree;
  each client's client-test rows carry its own concept.

Step 3b draws every client's parameters (:func:`partitioning.skew_record.draw_skews`) and records them in the
assignments.json sidecar under ``"skews"``: ``{name: {"settings": {...}, "clients":
{"<client id>": {...}}}}``. The record is the source of truth: step 4 reads it back
(:func:`partitioning.skew_record.read_skews`), validates it as a user file (a user may edit it) and applies exactly
those parameters (:func:`partitioning.skew_record.client_skews`) to a client's train and client-test batches, never to
the global test or validation sets.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from partitioning.skew_transforms import AddNoise, ShiftImages, SwapLabels, UseVariant, swap_mapping
from utils.cli import INTEGER_PATTERN, MAX_SEED, floats, ints
from utils.errors import TaskHetError
from utils.registry import Registry
from utils.seeding import derive_seed, numpy_rng

SKEWS_KEY = "skews"  # the sidecar key of the record
FEATURE, CONCEPT = "feature", "concept"
# Targets the data really has twice, for the same images (datasets/taskonomy_domains.py, datasets/synthetic.py).
TARGET_VARIANTS = {"depth_euclidean": ("depth_zbuffer",), "depth_zbuffer": ("depth_euclidean",)}
# feature_shift's transforms: name -> (largest magnitude a flag may ask, what the magnitude means).
SHIFT_LIMITS = {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0, "hue": 0.5, "blur": 10.0, "rotation": 180.0}
SHIFT_ORDER = tuple(SHIFT_LIMITS)  # the order the transforms apply in
# feature_noise's largest σ: ten times the images' whole [0, 1] range is pure noise already, and stays finite in float32.
MAX_NOISE_SIGMA = 10.0
# The most classes a classification task may have here (class ids 0..MAX_CLASSES-1): what --label_swap is checked
# against before the data (and its real number of classes) is read.
MAX_CLASSES = 100_000
NOISE_SIGMAS = floats(0.0, MAX_NOISE_SIGMA)
CONCEPT_FRACTIONS = floats(0.0, 1.0)
LABEL_SWAP_HELP = (f"K (pairs drawn per affected client, an integer in [1, {MAX_CLASSES // 2}] and at most half the "
                   f"classes) or A-B,C-D (class ids, integers in [0, {MAX_CLASSES - 1}] below the number of classes)")


@dataclass(frozen=True)
class SkewContext:
    """What a skew is checked against.

    Attributes:
        family: the data family's name.
        num_classes: K of the family's classification task (classes are 0..K-1); None: not known yet (the flags
            alone are checked, against :data:`MAX_CLASSES`).
        tasks: the family's tasks; None: not known yet (target variants are checked against
            :data:`TARGET_VARIANTS` only).
        n_clients: clients of the partition (ids 0..n_clients-1).
    """

    family: str | None
    num_classes: int | None
    tasks: tuple[str, ...] | None
    n_clients: int

    @property
    def class_count(self) -> int:
        """K, or :data:`MAX_CLASSES` while the data is unknown."""
        return MAX_CLASSES if self.num_classes is None else self.num_classes


def flag_context(n_clients: int) -> SkewContext:
    """The context of a check from the flags alone (no data read yet): classes up to :data:`MAX_CLASSES`, any task."""
    return SkewContext(None, None, None, n_clients)


# ----- the registry -----
class Skew(ABC):
    """One kind of per-client skew: how step 3b draws it, how a record is checked, how step 4 applies it."""

    name: str
    kind: str  # FEATURE or CONCEPT
    order: int  # application order: feature shifts, then noise, then the concept

    @abstractmethod
    def check_settings(self, settings: dict, context: SkewContext) -> dict:
        """The step-3b settings, validated; a :class:`TaskHetError` naming the flag otherwise."""

    @abstractmethod
    def draw(self, settings: dict, context: SkewContext, seed: int) -> dict[int, dict]:
        """Client id -> the client's parameters (clients left out are unaffected)."""

    @abstractmethod
    def check_client(self, params: Any, context: SkewContext, where: str) -> dict:
        """A recorded client's parameters, validated; ``where`` names the file and key in messages."""

    @abstractmethod
    def transform(self, params: dict, keys: "BatchKeys") -> Callable[[dict], dict] | None:
        """The client's batch transform (None: identity)."""

    @abstractmethod
    def columns(self, params: dict | None) -> dict[str, Any]:
        """client_stats.csv columns of one client (``params`` None: unaffected)."""


@dataclass(frozen=True)
class BatchKeys:
    """The batch keys a transform touches: the model input, the task's target, the family's label column."""

    input_key: str
    task: str
    domain: str
    task_kind: str
    label_column: str
    num_classes: int


SKEWS: Registry[Skew] = Registry("client skew")


def _register(cls: type[Skew]) -> type[Skew]:
    """Class decorator: one instance of the skew in :data:`SKEWS` under its ``name`` (a duplicate raises)."""
    SKEWS.register(cls.name)(cls())
    return cls


def list_skews() -> list[str]:
    """Registered skew names, sorted."""
    return SKEWS.names()


def get_skew(name: str) -> Skew:
    """The skew called ``name``; a :class:`TaskHetError` listing the skews otherwise."""
    return SKEWS.get(name)


def _number(value: Any, where: str, low: float, high: float, integer: bool = False) -> float:
    """``value`` as a finite number in [low, high] (an int when ``integer``); NaN, inf, bools and text refused."""
    kind = (int,) if integer else (int, float)
    # An int is compared as it is (math.isfinite of a 400-digit int overflows); a float must be finite.
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not isinstance(value, kind) or not finite or not low <= value <= high:
        what = "an integer" if integer else "a finite number"
        raise TaskHetError(f"{where} must be {what} in [{low:g}, {high:g}], got {value!r}")
    return value


def json_object(value: Any, where: str, keys: Sequence[str]) -> dict:
    """``value`` as a JSON object with exactly ``keys``."""
    if not isinstance(value, dict):
        raise TaskHetError(f"{where} must be a JSON object, got {value!r}")
    unknown, missing = sorted(set(value) - set(keys)), sorted(set(keys) - set(value))
    if unknown or missing:
        raise TaskHetError(f"{where}: " + "; ".join(
            part for part in (f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                              f"missing key(s) {', '.join(missing)}" if missing else "") if part)
                           + f" (expected {', '.join(keys)})")
    return value


def _concept_fraction(settings: dict) -> float:
    """The share of clients a concept shift affects (``--concept_fraction``), in [0, 1]."""
    return float(_number(settings.get("fraction"), "--concept_fraction", CONCEPT_FRACTIONS.low, CONCEPT_FRACTIONS.high))


def affected_clients(fraction: float, n_clients: int, rng: np.random.Generator) -> list[int]:
    """round_half_up(fraction · n_clients) distinct clients, drawn with ``rng``, sorted."""
    count = int(math.floor(fraction * n_clients + 0.5))
    return sorted(rng.choice(n_clients, size=count, replace=False).tolist())


@_register
class FeatureNoise(Skew):
    """NIID-Bench's noise-based feature skew: σ_i = σ·i/(N−1); client 0 is clean."""

    name, kind, order = "feature_noise", FEATURE, 1
    flag = "--feature_noise"

    def check_settings(self, settings: dict, context: SkewContext) -> dict:
        return {"sigma": float(_number(settings.get("sigma"), f"{self.flag} (σ)", 0.0, MAX_NOISE_SIGMA))}

    def draw(self, settings: dict, context: SkewContext, seed: int) -> dict[int, dict]:
        steps = max(context.n_clients - 1, 1)
        return {client: {"sigma": settings["sigma"] * client / steps, "seed": derive_seed(seed, "skew", self.name, client)}
                for client in range(context.n_clients)}

    def check_client(self, params: Any, context: SkewContext, where: str) -> dict:
        params = json_object(params, where, ("seed", "sigma"))
        return {"sigma": float(_number(params["sigma"], f"{where}.sigma", 0.0, MAX_NOISE_SIGMA)),
                "seed": int(_number(params["seed"], f"{where}.seed", 0, MAX_SEED, integer=True))}

    def transform(self, params: dict, keys: BatchKeys) -> Callable[[dict], dict] | None:
        # σ = 0 leaves the batch object alone: client 0's inputs stay bit-identical.
        return AddNoise(keys.input_key, params["sigma"], params["seed"]) if params["sigma"] > 0 else None

    def columns(self, params: dict | None) -> dict[str, Any]:
        return {"noise_sigma": params["sigma"] if params else 0.0}


@_register
class FeatureShift(Skew):
    """Per-client colour/brightness/contrast, blur and rotation, parameters drawn per client."""

    name, kind, order = "feature_shift", FEATURE, 0
    flag = "--feature_shift"

    def check_settings(self, settings: dict, context: SkewContext) -> dict:
        limits = settings.get("limits")
        if not isinstance(limits, dict) or not limits:
            raise TaskHetError(f"{self.flag} must name at least one transform as NAME=MAX ({', '.join(SHIFT_ORDER)})")
        checked = {}
        for name, value in limits.items():
            if name not in SHIFT_LIMITS:
                raise TaskHetError(f"{self.flag}: unknown transform {name!r}; choose from {', '.join(SHIFT_ORDER)}")
            checked[name] = float(_number(value, f"{self.flag} {name}", 0.0, SHIFT_LIMITS[name]))
        return {"limits": {name: checked[name] for name in SHIFT_ORDER if name in checked}}

    def draw(self, settings: dict, context: SkewContext, seed: int) -> dict[int, dict]:
        drawn = {}
        for client in range(context.n_clients):
            rng = numpy_rng(seed, "skew", self.name, client)
            params = {}
            for name, limit in settings["limits"].items():  # one draw per name, in SHIFT_ORDER, from the client's rng
                low, high = _shift_range(name, limit)
                params[name] = float(rng.uniform(low, high))
            drawn[client] = params
        return drawn

    def check_client(self, params: Any, context: SkewContext, where: str) -> dict:
        if not isinstance(params, dict) or not params:
            raise TaskHetError(f"{where} must be a JSON object of transforms ({', '.join(SHIFT_ORDER)}), got {params!r}")
        for name, value in params.items():
            if name not in SHIFT_LIMITS:
                raise TaskHetError(f"{where}: unknown transform {name!r}; choose from {', '.join(SHIFT_ORDER)}")
            _number(value, f"{where}.{name}", *_shift_range(name, SHIFT_LIMITS[name]))
        return {name: float(params[name]) for name in SHIFT_ORDER if name in params}

    def transform(self, params: dict, keys: BatchKeys) -> Callable[[dict], dict] | None:
        if keys.task_kind != "classification" and params.get("rotation", 0.0) != 0.0:
            raise TaskHetError(f"feature_shift rotates client images by {params['rotation']:g}°, but --task {keys.task} "
                               "is dense: its per-pixel targets would no longer line up; make the partition without "
                               "rotation in --feature_shift")
        return ShiftImages(keys.input_key, tuple(params.items()))

    def columns(self, params: dict | None) -> dict[str, Any]:
        identity = {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0, "hue": 0.0, "blur": 0.0, "rotation": 0.0}
        return {f"shift_{name}": (params or {}).get(name, identity[name]) for name in SHIFT_ORDER}


def _shift_range(name: str, limit: float) -> tuple[float, float]:
    """The interval a client's value of transform ``name`` is drawn from, given the flag's magnitude ``limit``."""
    if name in ("brightness", "contrast", "saturation"):
        return 1.0 - limit, 1.0 + limit  # multiplicative factors around 1 (identity)
    if name == "blur":
        return 0.0, limit  # a Gaussian σ in pixels
    return -limit, limit  # hue shift (fraction of the hue circle), rotation (degrees)


@_register
class LabelSwap(Skew):
    """Classification concept shift: a fraction of clients relabel k disjoint class pairs."""

    name, kind, order = "label_swap", CONCEPT, 2
    flag = "--label_swap"

    def check_settings(self, settings: dict, context: SkewContext) -> dict:
        fraction = _concept_fraction(settings)
        pairs = settings.get("pairs")
        if isinstance(pairs, int) and not isinstance(pairs, bool):
            _number(pairs, f"{self.flag} (pairs per client)", 1, context.class_count // 2, integer=True)
            return {"pairs": pairs, "fraction": fraction}
        return {"pairs": check_pairs(pairs, context.class_count, self.flag), "fraction": fraction}

    def draw(self, settings: dict, context: SkewContext, seed: int) -> dict[int, dict]:
        clients = affected_clients(settings["fraction"], context.n_clients, numpy_rng(seed, "skew", self.name, "clients"))
        drawn = {}
        for client in clients:
            pairs = settings["pairs"]
            if isinstance(pairs, int):  # k disjoint pairs of the client's own
                classes = numpy_rng(seed, "skew", self.name, client).permutation(context.num_classes)[: 2 * pairs]
                pairs = sorted(sorted(map(int, classes[i: i + 2])) for i in range(0, 2 * settings["pairs"], 2))
            drawn[client] = {"pairs": [list(pair) for pair in pairs]}
        return drawn

    def check_client(self, params: Any, context: SkewContext, where: str) -> dict:
        params = json_object(params, where, ("pairs",))
        return {"pairs": check_pairs(params["pairs"], context.class_count, f"{where}.pairs")}

    def transform(self, params: dict, keys: BatchKeys) -> Callable[[dict], dict] | None:
        if keys.task_kind != "classification":
            raise TaskHetError(f"label_swap is a classification concept shift; --task {keys.task} is not a "
                               "classification task")
        return SwapLabels(tuple(dict.fromkeys((keys.domain, keys.label_column))), tuple(swap_mapping(params["pairs"], keys.num_classes)))

    def columns(self, params: dict | None) -> dict[str, Any]:
        return {"swapped_pairs": ";".join(f"{a}-{b}" for a, b in params["pairs"]) if params else ""}


def check_pairs(pairs: Any, num_classes: int, where: str) -> list[list[int]]:
    """Disjoint class pairs ``[[a, b], ...]`` with a != b, both in 0..num_classes-1, sorted; else one error naming ``where``."""
    if not isinstance(pairs, list) or not pairs:
        raise TaskHetError(f"{where} must list class pairs [[a, b], ...], got {pairs!r}")
    seen: set[int] = set()
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TaskHetError(f"{where}: {pair!r} is not a pair of classes")
        a, b = (int(_number(value, where, 0, num_classes - 1, integer=True)) for value in pair)
        if a == b:
            raise TaskHetError(f"{where}: swaps class {a} onto itself")
        for value in (a, b):
            if value in seen:
                raise TaskHetError(f"{where}: class {value} is in two pairs (pairs must be disjoint)")
            seen.add(value)
    return sorted(sorted(int(value) for value in pair) for pair in pairs)


def parse_pairs(text: str) -> int | list[list[int]]:
    """``--label_swap`` (:data:`LABEL_SWAP_HELP`): ``K`` (K pairs drawn per client) or ``A-B,C-D`` (the same pairs
    for every affected client), every number ASCII digits in its range. Pairs are checked (distinct, disjoint, below
    the number of classes) by :func:`check_pairs`."""
    text = text.strip()
    if INTEGER_PATTERN.fullmatch(text):
        return ints(1, MAX_CLASSES // 2).read(text, f"--label_swap {text!r}: K (pairs per client)")
    pairs = []
    for part in text.split(","):
        ends = part.split("-")
        if len(ends) != 2:
            raise TaskHetError(f"--label_swap {text!r}: expected {LABEL_SWAP_HELP}; got {part.strip()!r}")
        pairs.append([ints(0, MAX_CLASSES - 1).read(end, f"--label_swap {text!r}: class id") for end in ends])
    return pairs


@_register
class TargetVariant(Skew):
    """Dense concept shift: a fraction of clients' targets come from the task's variant domain."""

    name, kind, order = "target_variant", CONCEPT, 3
    flag = "--target_variant"

    def check_settings(self, settings: dict, context: SkewContext) -> dict:
        fraction = _concept_fraction(settings)
        task, variant = settings.get("task"), settings.get("variant")
        self._check_pair(task, variant, context, self.flag)
        return {"task": task, "variant": variant, "fraction": fraction}

    @staticmethod
    def _check_pair(task: Any, variant: Any, context: SkewContext, where: str) -> None:
        known = context.tasks is not None  # else: the flags alone, before the data family is known
        if known and task not in context.tasks:
            raise TaskHetError(f"{where}: {task!r} is not a task of data family {context.family!r}")
        if task not in TARGET_VARIANTS:
            raise TaskHetError(f"{where}: task {task!r} has no target variant (tasks with one: "
                               f"{', '.join(sorted(TARGET_VARIANTS))})")
        if variant not in TARGET_VARIANTS[task] or (known and variant not in context.tasks):
            raise TaskHetError(f"{where}: {variant!r} is not a target variant of {task!r} in data family "
                               f"{context.family!r} (its variants: {', '.join(TARGET_VARIANTS[task])})")

    def draw(self, settings: dict, context: SkewContext, seed: int) -> dict[int, dict]:
        clients = affected_clients(settings["fraction"], context.n_clients, numpy_rng(seed, "skew", self.name, "clients"))
        return {client: {"task": settings["task"], "variant": settings["variant"]} for client in clients}

    def check_client(self, params: Any, context: SkewContext, where: str) -> dict:
        params = json_object(params, where, ("task", "variant"))
        self._check_pair(params["task"], params["variant"], context, where)
        return dict(params)

    def transform(self, params: dict, keys: BatchKeys) -> Callable[[dict], dict] | None:
        if keys.task != params["task"]:
            raise TaskHetError(f"target_variant was drawn for task {params['task']!r}; --task {keys.task} has no "
                               "recorded variant (make the partition for this task, or run that task)")
        return UseVariant(keys.domain, params["variant"])

    def columns(self, params: dict | None) -> dict[str, Any]:
        return {"target_variant": params["variant"] if params else ""}
