"""A pool stage for tests/test_interrupts.py and tests/test_executors.py: like every step, it holds its folder's lock
(``argv[1]``) and makes a tqdm bar (tqdm's default lock is a named semaphore); it writes its process's pid to
``argv[0]`` and sleeps ``argv[2]`` seconds (default 600: a run in progress). Later arguments (the pipeline's shared
flags) are ignored."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tqdm import tqdm

from utils.locks import folder_lock


def main(argv: list[str]) -> None:
    seconds = float(argv[2]) if len(argv) > 2 and not argv[2].startswith("--") else 600.0
    with folder_lock(argv[1]):
        for _ in tqdm(range(1), disable=True):
            pass
        Path(argv[0]).write_text(str(os.getpid()))
        time.sleep(seconds)
