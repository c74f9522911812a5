"""Fingerprints of what produced a report's numbers: the code that computes them, and the resolved experiment.

A result pasted into the README or a results page is only true of the code that made it. The main job's report
states both fingerprints in its opening lines (so a paste carries them), and `tests/test_pasted_results.py` fails
when the code or the experiment file changed after the paste and nothing was re-pasted.

The code fingerprint covers the files that can change a number of the report: the data, models, losses, partitions,
training, federated engines and algorithms, the steps, and the main job's report (:data:`NUMERIC_CODE`). The rest
(command-line plumbing, executors, progress lines, docs, tests, benchmarks) is left out, so a change there does not
ask for an hour of reruns. The experiment fingerprint is taken over the validated configuration (every key resolved,
comments and key order ignored), not the file's bytes.

``python -m pipeline.fingerprint_cli experiments/demo.yaml`` prints the line the report would carry now.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NUMERIC_CODE = ("datasets/**/*.py", "models/**/*.py", "network/**/*.py", "partitioning/**/*.py", "steps/**/*.py",
                "training/**/*.py", "losses.py", "utils/statistics.py", "utils/seeding.py", "utils/loaders.py",
                "pipeline/run_results.py", "pipeline/studies/main_job/*.py")
LINE_START = "*Fingerprints*: code `"  # how the report's line begins (tests find it by this)
DIGITS = 16  # hex digits kept: enough that a change is never mistaken for no change


def code_fingerprint(root: Path = ROOT) -> str:
    """SHA-256 over the path and bytes of every file of :data:`NUMERIC_CODE` under ``root``, in path order."""
    digest = hashlib.sha256()
    files = sorted({path for pattern in NUMERIC_CODE for path in root.glob(pattern) if "__pycache__" not in path.parts})
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:DIGITS]


def config_fingerprint(config: dict[str, Any]) -> str:
    """SHA-256 of the validated configuration as sorted JSON (comments, key order and spacing do not count)."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGITS]


def fingerprint_line(config: dict[str, Any], root: Path = ROOT) -> str:
    """The report's line: both fingerprints and how to check them."""
    return (f"{LINE_START}{code_fingerprint(root)}`, experiment `{config_fingerprint(config)}` "
            "(`python -m pipeline.fingerprint_cli <experiment file>` prints today's; a paste whose fingerprints differ "
            "from today's is out of date).")


def pasted_fingerprints(text: str) -> tuple[str, str] | None:
    """(code, experiment) from the report line in a pasted page, or None when the page has none."""
    start = text.find(LINE_START)
    if start < 0:
        return None
    code = text[start + len(LINE_START):].split("`", 1)[0]
    rest = text[start:].split("experiment `", 1)
    return (code, rest[1].split("`", 1)[0]) if len(rest) == 2 else None
