"""Skip-if-done bookkeeping for the pipeline's steps.

A stage's folder is named after a hash of everything that determines its output:
its parameters and the content hashes of its input files. The stage writes
``stage.json`` last, after all its outputs, listing every file of the folder with
its size; a folder without it, or whose files no longer match it (one deleted,
truncated or replaced), is unfinished and is run again (steps that checkpoint, like
step 4, then resume from their checkpoint). A changed parameter or input gives a new
folder, so no run ever overwrites the outputs of a different configuration.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from utils.hashing import file_sha256
from utils.locks import LOCK_FILE, STAGE_LOCK, waiting_lock
from utils.run_dir import atomic_write_text

MARKER = "stage.json"


def stage_key(params: dict[str, Any], inputs: list[Path], root: Path | None = None) -> str:
    """A short hash of the parameters and the contents of the input files.

    Paths inside ``root`` (the experiment's results folder) enter the hash relative to it,
    and input files by position and content, so a moved or renamed results folder keeps
    its stage names and nothing is redone.
    """
    portable = {key: _relative(value, root) for key, value in params.items()}
    record = {"params": portable, "inputs": [file_sha256(path) for path in inputs]}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _relative(value: Any, root: Path | None) -> Any:
    if root is None or not isinstance(value, (str, Path)):
        return value
    try:
        return Path(value).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:  # not a path inside the results folder: it stays as given
        return value


def output_sizes(stage_dir: Path) -> dict[str, int]:
    """Every file under ``stage_dir`` except the marker and the lock files: relative path -> size in bytes."""
    stage_dir = Path(stage_dir)
    return {path.relative_to(stage_dir).as_posix(): path.stat().st_size
            for path in sorted(stage_dir.rglob("*")) if path.is_file() and path.name not in (MARKER, LOCK_FILE, STAGE_LOCK)}


def is_done(stage_dir: Path) -> bool:
    """True if the stage finished and every output its marker lists is still there with the recorded size."""
    marker = Path(stage_dir) / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())["outputs"]
    except (ValueError, KeyError, TypeError):
        return False  # a marker of an older format or a damaged one: redo (or resume) the stage
    return all((Path(stage_dir) / name).is_file() and (Path(stage_dir) / name).stat().st_size == size
               for name, size in recorded.items())


def run_stage(stage_dir: Path, params: dict[str, Any], work: Callable[[], None]) -> bool:
    """Run ``work`` unless ``stage_dir`` holds a finished stage; returns True if it ran.

    Several processes may reach one stage (the shards of a grid, ``run_pipeline.py --shard``, each run the stages
    their runs share): the stage lock lets one run it while the others wait, then find it done and skip it.
    """
    if is_done(stage_dir):
        return False
    Path(stage_dir).mkdir(parents=True, exist_ok=True)
    with waiting_lock(Path(stage_dir) / STAGE_LOCK,
                      lambda: print(f"waiting for another process to finish {stage_dir}", flush=True)):
        if is_done(stage_dir):  # the process we waited for finished it
            return False
        (Path(stage_dir) / MARKER).unlink(missing_ok=True)  # a stale marker must never outlive a rerun
        work()
        record = {"params": params, "outputs": output_sizes(stage_dir)}
        atomic_write_text(Path(stage_dir) / MARKER, json.dumps(record, indent=2, sort_keys=True, default=str))
    return True
