"""The type of every experiment-file key: checked before step 0, errors name the YAML key.

:data:`SHARED_TYPES` maps each dotted key of the shared sections (pipeline/sections.py) to a check (a
type, a range, a list of items, or None allowed); each study kind (pipeline/studies/) adds its own keys'
checks, and a test keeps every kind's schema and types in step. A check returns the value to use (a float
given as the string ``"1e-3"``, as a quoted value is, becomes 1e-3) or raises a :class:`TaskHetError`
naming the file and the key. Names the registries know (tasks, encoders, algorithms, schemes) are checked
afterwards by the kind's validation.

Why this is not pydantic v2 (measured on 2026-11-24, pydantic 2.14.4): a trial moved the
experiment schema to pydantic models (``extra="forbid"``, strict typed fields with their defaults, a
BeforeValidator for YAML 1.1's ``1e-3`` strings, the first ``ValidationError`` turned into one line
naming the file and the dotted key, and today's ``unknown key 'federated.n_round'; allowed here: ...``
kept through a lookup of the model's fields). It took 174 lines for what is now this file's 228 plus
the experiment schema (63 lines) and its merge (13): shorter. But of 12 bad inputs tried, 5
messages were as clear as today's (the unknown key, ``n_rounds: 0``, ``true`` for an integer, a
negative alpha, an unknown optimizer), 4 differed by pydantic's ``Value error, `` prefix (strippable),
and 3 were less clear: a range names only the bound that failed (``data.test_fraction: Input should be
less than 1`` against ``must be a finite number > 0 and < 1``; ``'abc'`` for ``init_lr`` loses the
``> 0``), an empty ``federated.algorithms`` loses its example (``Dictionary should have at least 1 item
after validation, not 0``) and a scalar section names pydantic's class (``Input should be a valid
dictionary or instance of Data``). Keeping today's wording needs a layer that rebuilds it from
pydantic's error types and the fields' constraints, and the study kinds build their schemas
from the shared sections, their merge and the checks below, so it would have to move as well. That was not done:
the checks stay hand-written, and a move to pydantic should bring that wording layer with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from steps.render import MAX_BUILDINGS, MAX_RENDER_SIZE, MAX_VIEWS
from steps.train_centralized import MAX_EMBEDDING_GRID
from utils.cli import (MAX_BATCH_SIZE, MAX_DECODER_WIDTH, MAX_EPOCHS, MAX_IMAGE_SIZE, MAX_LEARNING_RATE, MAX_SAMPLES,
                       MAX_SEED)
from utils.errors import TaskHetError
from utils.loaders import PLAIN_NAME

Check = Callable[[Any, str], Any]


def _fail(key: str, expected: str, value: Any) -> TaskHetError:
    return TaskHetError(f"{key} must be {expected}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Int:
    """An integer (not a bool, not a float) in ``[low, high]``."""

    low: int | None = None
    high: int | None = None

    def __call__(self, value: Any, key: str) -> int:
        expected = "an integer" + (f" >= {self.low}" if self.low is not None else "") + (
            f" <= {self.high}" if self.high is not None else "")
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(key, expected, value)
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise _fail(key, expected, value)
        return value


@dataclass(frozen=True)
class Float:
    """A finite number in the interval given (``low_open``/``high_open``: the bound itself excluded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, value: Any, key: str) -> float | int:
        lower = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
        upper = "" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:g}"
        expected = "a finite number" + (f" {lower}" if lower else "") + (" and" if lower and upper else "") + (
            f" {upper}" if upper else "")
        number = value
        if isinstance(value, str):  # a quoted "1e-3" (a file's plain 1e-3 is a number already: utils/plain_yaml.py)
            try:
                number = float(value)
            except ValueError:
                raise _fail(key, expected, value) from None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise _fail(key, expected, value)
        if self.low is not None and (number < self.low or (self.low_open and number == self.low)):
            raise _fail(key, expected, value)
        if self.high is not None and (number > self.high or (self.high_open and number == self.high)):
            raise _fail(key, expected, value)
        return number


@dataclass(frozen=True)
class Bool:
    """true or false (an unquoted yes/no/on/off is refused when the file is read, utils/plain_yaml.py; a quoted 'no'
    is a string and refused here)."""

    def __call__(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise _fail(key, "true or false", value)
        return value


@dataclass(frozen=True)
class Str:
    """A non-empty string, one of ``choices`` when given, a plain name when ``plain``."""

    choices: tuple[str, ...] = ()
    plain: bool = False

    def __call__(self, value: Any, key: str) -> str:
        if self.choices:
            expected = "one of " + ", ".join(self.choices)
        elif self.plain:
            expected = "a plain name (letters, digits, '.', '_', '-'; no '/' or '..')"
        else:
            expected = "a non-empty string"
        if not isinstance(value, str) or not value.strip():
            raise _fail(key, expected, value)
        if (self.choices and value not in self.choices) or (self.plain and not PLAIN_NAME.fullmatch(value)):
            raise _fail(key, expected, value)
        return value


@dataclass(frozen=True)
class ListOf:
    """A YAML list (``[a, b]``, never a bare scalar) of at least ``min_len`` items, each checked."""

    item: Check
    min_len: int = 1
    unique: bool = True

    def __call__(self, value: Any, key: str) -> list:
        if not isinstance(value, list):
            raise _fail(key, f"a list (e.g. [{value!r}])" if isinstance(value, (str, int, float)) else "a list", value)
        if len(value) < self.min_len:
            raise TaskHetError(f"{key} must list at least {self.min_len} item(s), got {value!r}")
        checked = [self.item(item, f"{key}[{index}]") for index, item in enumerate(value)]
        if self.unique and len(set(map(repr, checked))) != len(checked):
            raise TaskHetError(f"{key} lists an item twice: {value!r}")
        return checked


@dataclass(frozen=True)
class Optional:
    """None (YAML ``null`` or the key left out) or a value ``check`` accepts."""

    check: Check

    def __call__(self, value: Any, key: str) -> Any:
        return None if value is None else self.check(value, key)


@dataclass(frozen=True)
class Mapping:
    """A mapping whose values are checked elsewhere (``federated.algorithms``: each algorithm's Settings).

    ``what`` and ``example`` make the error; ``allow_empty`` accepts ``{}`` (or an empty YAML value).
    """

    what: str = "map algorithm names to their settings"
    example: str = "{fedavg: {}, fedprox: {mu: 0.01}}"
    allow_empty: bool = False

    def __call__(self, value: Any, key: str) -> dict:
        if self.allow_empty and value is None:
            return {}
        if not isinstance(value, dict) or not (value or self.allow_empty):
            raise TaskHetError(f"{key} must {self.what}, e.g. {self.example}, got {value!r}")
        return value


POSITIVE, FRACTION = Float(0, low_open=True), Float(0, 1, low_open=True, high_open=True)
# The ranges of the flags the keys become (utils/cli.py and the steps name them), so a file's number is bounded as a
# typed one is, and refused before step 0.
LEARNING_RATE = Float(0, MAX_LEARNING_RATE, low_open=True)
MOMENTUM = Float(0, 1, high_open=True)  # 1 or more never forgets a gradient

# The types of the sections every kind shares (pipeline/sections.py); each kind adds its own keys' types.
SHARED_TYPES: dict[str, Check] = {
    "name": Str(plain=True),
    "data.source": Str(),
    "data.root": Str(),
    "data.synthetic.n_buildings": Int(1, MAX_BUILDINGS),
    "data.synthetic.n_views": Int(1, MAX_VIEWS),
    "data.synthetic.image_size": Int(8, MAX_RENDER_SIZE),
    "data.synthetic.seed": Int(0, MAX_SEED),
    "data.buildings": Optional(ListOf(Str(plain=True))),
    "data.top_k_classes": Int(1, 365),  # Places365 has 365 scene classes
    "data.test_fraction": FRACTION,
    "data.split_by": Str(("building", "csv", "sample")),
    "data.n_samples": Optional(Int(1, MAX_SAMPLES)),
    "data.split_csv": Optional(Str()),
    "data.imbalance_factor": Optional(Float(0, 1, low_open=True)),
    "data.val_fraction": Optional(Float(0, 1, high_open=True)),
    "data.verify_checksums": Optional(Bool()),
    "model.encoder": Str(),
    "model.weights": Str(),
    "model.image_size": Int(1, MAX_IMAGE_SIZE),
    "model.embedding_grid": Int(0, MAX_EMBEDDING_GRID),
    "model.freeze_encoder": Bool(),
    "model.cache_features": Bool(),
    "model.decoder_width": Optional(Int(2, MAX_DECODER_WIDTH)),
    "centralized.n_epochs": Int(1, MAX_EPOCHS),
    "centralized.batch_size": Int(1, MAX_BATCH_SIZE),
    "centralized.init_lr": LEARNING_RATE,
    "centralized.optimizer": Str(("sgd", "adamw")),
    "centralized.scheduler": Str(("cosine", "exponential", "none", "step")),
    "centralized.warmup_epochs": Int(0, MAX_EPOCHS),
    "centralized.step_size": Int(1, MAX_EPOCHS),
    "centralized.gamma": Float(0, 1, low_open=True),
    "centralized.momentum": MOMENTUM,
    "centralized.lr_decay_rate": Float(0, 1, low_open=True),
    "centralized.weight_decay": Float(0, 1),
    "centralized.early_stopping_patience": Int(0, MAX_EPOCHS),
    "seeds": ListOf(Int(0, MAX_SEED)),
    "use_accelerator": Bool(),
}


def check_types(config: dict[str, Any], source: Path, types: dict[str, Check]) -> None:
    """Check every key of a merged config against ``types`` (dotted key -> check), in place (values may be normalised)."""
    for dotted, check in types.items():
        *sections, leaf = dotted.split(".")
        parent = config
        for section in sections:
            parent = parent[section]
        try:
            parent[leaf] = check(parent[leaf], dotted)
        except TaskHetError as error:
            raise TaskHetError(f"{source}: {error}") from None
