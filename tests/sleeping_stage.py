"""A pool stage for tests/test_interrupts.py: writes its worker's pid to ``argv[0]`` and sleeps (a run in progress)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    Path(argv[0]).write_text(str(os.getpid()))
    time.sleep(600)
