"""Benchmark: `make setup` plus the docs requirements (what `make test` installs on a fresh machine), with uv and
with pip alone, each into a new venv with empty download caches.

`make setup` installs uv, torch and torchvision with pip, then every other requirement file with uv; where uv fails,
pip installs them (the Makefile says why). ``UV=/bin/false`` makes uv fail at once, so the second side is the pip-only
install. The two sides run one after the other (``--repeats`` pairs, alternating which goes first) and the script
prints each side's median seconds, their ratio, and whether the two venvs hold the same packages (``pip freeze``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from utils.cli import ints, run_main  # noqa: E402
from utils.errors import TaskHetError  # noqa: E402

SIDES = {"uv": [], "pip only": ["UV=/bin/false"]}  # make variables of each side
TARGETS = ["setup", "{venv}/.docs_installed"]  # what `make test` installs before the tests


def make_command(venv: Path, variables: list[str]) -> list[str]:
    """The `make` call that sets up ``venv`` from nothing (``VENV`` moves the venv and its stamps)."""
    return ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", *variables,
            *(target.format(venv=venv) for target in TARGETS)]


def packages(venv: Path) -> list[str]:
    """``pip freeze`` of ``venv`` (both sides install uv: pip installs it before uv is tried)."""
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True,
                          check=True)
    return sorted(line for line in done.stdout.splitlines() if line)


def differences(first: list[str], second: list[str]) -> list[str]:
    """The lines of one freeze that the other lacks, each marked with the side it is in (``-``: first)."""
    return [f"-{line}" for line in first if line not in second] + [f"+{line}" for line in second if line not in first]


def time_setup(variables: list[str], scratch: Path) -> tuple[float, list[str]]:
    """Seconds to set up a new venv under ``scratch`` with empty pip and uv caches, and the packages it holds."""
    venv = scratch / "venv"
    environment = {**os.environ, "PIP_CACHE_DIR": str(scratch / "pip-cache"), "UV_CACHE_DIR": str(scratch / "uv-cache")}
    start = time.perf_counter()
    done = subprocess.run(make_command(venv, variables), env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise TaskHetError(f"make setup ({' '.join(variables) or 'uv'}) failed with exit code {done.returncode}: {last}")
    return seconds, packages(venv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=ints(1, 10), default=1, help="pairs of setups, the first side alternating")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    frozen: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        order = list(SIDES) if repeat % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            with tempfile.TemporaryDirectory(prefix="bench-setup-") as scratch:
                took, frozen[side] = time_setup(SIDES[side], Path(scratch))
            seconds[side].append(took)
            print(f"{side}: {took:.1f} s")
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    print(f"make setup and the docs requirements, median of {args.repeats}: uv {medians['uv']:.1f} s, "
          f"pip only {medians['pip only']:.1f} s; pip only / uv = {medians['pip only'] / medians['uv']:.2f}")
    changed = differences(frozen["pip only"], frozen["uv"])
    print("the same packages in both venvs" if not changed else f"packages that differ: {', '.join(changed)}")


if __name__ == "__main__":
    run_main(main)
