"""The Ray task of the results-folder check (pipeline/ray_checks.check_shared_storage), alone in a module that
imports only the standard library.

Ray imports a task's module in the worker that runs it: from pipeline/ray_executor.py, whose imports reach torch,
pandas and the steps, the check cost every node about 5 s of CPU before any run, on a worker that a GPU run never
reuses (each takes a fresh one). From here it costs the node a Python start.
"""

from __future__ import annotations

from pathlib import Path


def probe_storage(cwd: str, marker: str, token: str, node_id: str) -> str | None:
    """On one node: None when it sees the driver's working directory and ``marker`` holding ``token`` and can write
    beside it (``<marker>.<node_id>``, which the driver then reads); else what it cannot do."""
    if not Path(cwd).is_dir():
        return f"has no folder {cwd} (the driver's working directory, where every relative path starts)"
    try:
        seen = Path(marker).read_text()
    except OSError as error:
        return f"cannot read {marker}, which this machine wrote ({error.strerror or type(error).__name__})"
    if seen != token:
        return f"reads another file at {marker} than the one this machine wrote"
    try:
        # Not atomic: the driver reads the reply only after this task has returned.
        Path(f"{marker}.{node_id}").write_text(token)
    except OSError as error:
        return f"cannot write in {Path(marker).parent} ({error.strerror or type(error).__name__})"
    return None
