"""Skip-if-done bookkeeping for the pipeline's steps.

A stage's folder is named after a hash of everything that determines its output:
its parameters and the content hashes of its input files. The stage writes
``stage.json`` last, after all its outputs; a folder without it is unfinished and
is run again (steps that checkpoint, like step 4, then resume from their
checkpoint). A changed parameter or input gives a new folder, so no run ever
overwrites the outputs of a different configuration.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from utils.run_dir import atomic_write_text

MARKER = "stage.json"


def file_sha256(path: Path) -> str:
    """Content hash of one file."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stage_key(params: dict[str, Any], inputs: list[Path]) -> str:
    """A short hash of the parameters and the contents of the input files."""
    record = {"params": params, "inputs": {str(path): file_sha256(path) for path in inputs}}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:12]


def is_done(stage_dir: Path) -> bool:
    """True if the stage finished (its marker exists)."""
    return (Path(stage_dir) / MARKER).is_file()


def run_stage(stage_dir: Path, params: dict[str, Any], work: Callable[[], None]) -> bool:
    """Run ``work`` unless ``stage_dir`` holds a finished stage; returns True if it ran."""
    if is_done(stage_dir):
        return False
    Path(stage_dir).mkdir(parents=True, exist_ok=True)
    work()
    atomic_write_text(Path(stage_dir) / MARKER, json.dumps({"params": params}, indent=2, sort_keys=True, default=str))
    return True
