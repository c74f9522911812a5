"""A grid's disk use, projected before step 0, and the check that refuses a grid its results folder cannot hold.

A study kind lists what its grid will write (:class:`DiskPlan`: its stages with the bytes each keeps, and the caches),
sized by pipeline/disk_sizes.py from the code itself. :func:`project` leaves out the stages already finished in the
results folder (a done ``stage.json`` with the same parameters), adds the runs in flight at the peak (``jobs`` of
them, each holding its last checkpoint, the temporary file that replaces it, and the client states spilled to disk),
and compares what is still to be written, plus a margin, with the free space of the folder's file system.

A stage's parameters name the folders of earlier stages (the manifest, the assignments, a step-2 checkpoint), whose
names carry hashes of files not yet written before step 0; a finished stage is matched on every other parameter
(:data:`STAGE_PATHS` are left out). A rerun after a change to the data only (its runs' parameters unchanged) is
therefore taken as done and not counted again: the projection is then low by those runs.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from utils.errors import TaskHetError
from utils.stages import MARKER, is_done

GIB = 2**30
MIB = 2**20
# The margin kept free beyond the projection: 10% of it, at least 64 MiB. Why: the projection leaves out files of a
# few kilobytes each (logs, reports, pictures; 1 MiB is charged per run for them), the sample count may be an upper
# bound of step 1's, and another process may write to the same disk meanwhile; a disk filled to its last byte also
# fails writes the projection never sees (a lock file, a log line).
MARGIN_SHARE = 0.10
MARGIN_FLOOR = 64 * MIB
# Parameters that name an earlier stage's folder or file, whose stage key is known only once that stage has run.
STAGE_PATHS = frozenset({"data_path", "manifest", "assignments", "centralized_checkpoint", "checkpoint", "groups"})


@dataclass(frozen=True)
class Bytes:
    """A size of ``fixed`` bytes plus ``per_sample`` bytes for each sample of the manifest (step 3's embeddings)."""

    fixed: int = 0
    per_sample: int = 0

    def at(self, samples: int | None) -> int:
        """The size for ``samples`` samples (None, unknown before step 1: the fixed part only)."""
        return self.fixed + (self.per_sample * samples if samples is not None else 0)


@dataclass(frozen=True)
class PlannedStage:
    """One stage of the grid as the projection counts it.

    Attributes:
        part: the projection's line it adds to (``step 4``, ``step 2``, ...).
        folder: a glob, relative to the experiment's folder, matching its stage folder whatever its stage key
            (``federated/normal/label_based/a0.1/fedavg/s0-*``): a finished stage there with the same parameters
            is taken as done.
        params: its stage parameters (:data:`STAGE_PATHS` are ignored).
        kept: what it leaves on disk once done.
        peak: bytes beyond ``kept`` while it runs (a checkpoint's temporary copy, spilled client states); the
            runs in flight at once each add the largest peak of those still to run.
    """

    part: str
    folder: str
    params: dict[str, Any]
    kept: Bytes
    peak: int = 0


@dataclass(frozen=True)
class PlannedCache:
    """A cache folder under the experiment's ``cache/`` (``prefix``: ``decoded_`` or ``encoded_``) of ``size``;
    what such folders already hold is subtracted (a rerun reuses them)."""

    part: str
    prefix: str
    size: Bytes


@dataclass
class DiskPlan:
    """What a grid will write, from its kind (``StudyKind.disk_plan``).

    Attributes:
        stages: every stage the projection counts.
        caches: the caches the stages fill.
        samples: the manifest's sample count where known before step 1 (None: the per-sample parts are left out).
        samples_from: where ``samples`` comes from, for the log line.
        notes: what is assumed or left out (a failed probe, a family whose cache is not projected).
    """

    stages: list[PlannedStage]
    caches: list[PlannedCache] = field(default_factory=list)
    samples: int | None = None
    samples_from: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Projection:
    """What the grid still has to write, against the free space of the results folder's file system.

    Attributes:
        parts: line -> bytes still to be written once every stage is done (``step 4``, ``step 2``, ...).
        in_flight: bytes more at the peak, while ``runs_in_flight`` pooled stages write at once.
        runs_in_flight: how many pooled stages the peak counts.
        pending, finished: stages still to run and stages already done in the folder (not counted).
        unknown_per_sample: bytes per sample left out because the sample count is unknown before step 1.
        free: free bytes where the results go; ``where``: the existing folder they were measured at.
        notes: the plan's notes.
    """

    parts: dict[str, int]
    in_flight: int
    runs_in_flight: int
    pending: int
    finished: int
    unknown_per_sample: int
    free: int
    where: Path
    samples: int | None
    samples_from: str
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.parts.values()) + self.in_flight

    @property
    def margin(self) -> int:
        return max(math.ceil(MARGIN_SHARE * self.total), MARGIN_FLOOR)

    @property
    def fits(self) -> bool:
        return self.total + self.margin <= self.free

    def line(self) -> str:
        """``disk: the grid will write about X GiB (...); Y GiB free in FOLDER``: the run's first log line."""
        shown = ", ".join(f"{part} {size_text(size)}" for part, size in self.parts.items() if size)
        flight = (f", plus {size_text(self.in_flight)} at the peak with {self.runs_in_flight} at once"
                  if self.in_flight else "")
        unknown = (f"; not counted: {size_text(self.unknown_per_sample)} per sample of step 3 and the caches (the "
                   "sample count is known after step 1)" if self.unknown_per_sample else "")
        samples = f", {self.samples:,} samples ({self.samples_from})" if self.samples is not None else ""
        notes = "".join(f"; {note}" for note in self.notes)  # a failed probe's assumption, a cache not projected
        return (f"disk: the grid will write about {size_text(self.total)} ({shown or 'nothing'}{flight}; "
                f"{self.pending} stages to run, {self.finished} done{samples}{unknown}{notes}); "
                f"{size_text(self.free)} free in {self.where}")

    def record(self) -> dict[str, Any]:
        """The projection for config.json (bytes)."""
        return {"line": self.line(), "to_write": self.total, "parts": dict(self.parts), "in_flight": self.in_flight,
                "runs_in_flight": self.runs_in_flight, "margin": self.margin, "free": self.free,
                "where": str(self.where), "samples": self.samples, "unknown_per_sample": self.unknown_per_sample,
                "notes": list(self.notes)}

    def check(self, out_dir: Path) -> None:
        """Refuse, in one line naming the figures and the folder, a grid that does not fit with the margin."""
        if not self.fits:
            raise TaskHetError(
                f"--results: the grid needs about {size_text(self.total)} more in {out_dir} (with a margin of "
                f"{size_text(self.margin)}: {size_text(self.total + self.margin)}) but {self.where} has "
                f"{size_text(self.free)} free; free space, point --results elsewhere, or pass --no-disk_check")


def size_text(size: int) -> str:
    """Bytes as GiB, MiB below one GiB, KiB below one MiB; 1 decimal."""
    if size >= GIB:
        return f"{size / GIB:,.1f} GiB"
    return f"{size / MIB:,.1f} MiB" if size >= MIB else f"{size / 1024:,.1f} KiB"


def project(plan: DiskPlan, out_dir: Path, runs_in_flight: int | None) -> Projection:
    """What ``plan`` still writes into ``out_dir`` (stages done there left out), with ``runs_in_flight`` pooled
    stages at once (None: every one still to run, as a Ray cluster without ``--jobs`` may)."""
    done = finished_stages(out_dir, {stage.folder for stage in plan.stages})
    pending = [stage for stage in plan.stages if stage_identity(stage.params) not in done.get(stage.folder, set())]
    parts: dict[str, int] = {}
    for stage in pending:
        parts[stage.part] = parts.get(stage.part, 0) + stage.kept.at(plan.samples)
    for cache in plan.caches if pending else []:  # a grid with every stage done fills no cache
        on_disk = folder_bytes(out_dir / "cache", cache.prefix)
        parts[cache.part] = parts.get(cache.part, 0) + max(0, cache.size.at(plan.samples) - on_disk)
    peaks = sorted((stage.peak for stage in pending if stage.peak), reverse=True)
    at_once = len(peaks) if runs_in_flight is None else min(runs_in_flight, len(peaks))
    unknown = 0 if plan.samples is not None or not pending else (sum(stage.kept.per_sample for stage in pending)
                                                                 + sum(cache.size.per_sample for cache in plan.caches))
    where = existing_parent(out_dir)
    return Projection(parts, at_once * (peaks[0] if peaks else 0), at_once, len(pending),
                      len(plan.stages) - len(pending), unknown, shutil.disk_usage(where).free, where, plan.samples,
                      plan.samples_from, tuple(plan.notes))


def stage_identity(params: dict[str, Any]) -> str:
    """A stage's parameters as compared with a finished stage.json's: every key but :data:`STAGE_PATHS`, as JSON
    writes them (stage.json is written with ``default=str``)."""
    written = json.loads(json.dumps(params, default=str))
    return json.dumps({key: value for key, value in written.items() if key not in STAGE_PATHS}, sort_keys=True)


def finished_stages(out_dir: Path, folders: set[str]) -> dict[str, set[str]]:
    """Each folder glob -> the identities of the finished stages it matches (a done stage.json, utils/stages.py)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        identities = set()
        for marker in sorted(Path(out_dir).glob(f"{folder}/{MARKER}")) if Path(out_dir).is_dir() else []:
            if is_done(marker.parent):
                try:
                    identities.add(stage_identity(json.loads(marker.read_text())["params"]))
                except (ValueError, KeyError, TypeError):  # a damaged marker: its stage is redone, so counted
                    continue
        found[folder] = identities
    return found


def folder_bytes(cache_dir: Path, prefix: str) -> int:
    """Bytes of the files in ``cache_dir``'s folders named ``prefix*`` (0 when there is none)."""
    if not cache_dir.is_dir():
        return 0
    return sum(path.stat().st_size for folder in cache_dir.glob(f"{prefix}*") for path in folder.rglob("*")
               if path.is_file())


def existing_parent(folder: Path) -> Path:
    """``folder``, or its nearest parent that exists (a results folder not made yet is measured where it will be)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder
