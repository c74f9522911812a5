"""Benchmark: the test suite as `make test` runs it, with the host's speed measured before and after.

On the 2-core development machine the same commit's suite has taken up to nearly twice as long in one hour as in
another, and the spread followed the host, not the code: a fresh ``python -c "import run_pipeline"`` took nearly
twice as long in the slow hours too (docs/BENCHMARKS.md, "The test suite"). So the suite's time alone does not say
whether a change made it faster. This script
runs the host probe (that import, in a new interpreter, the median of ``--probes``), then the suite, then the probe
again, and prints:

- the suite's wall time and pytest's own count and time;
- the machine's busy and idle CPU seconds over the suite (``/proc/stat``: every process the tests start, Ray's
  daemons included; other load too): idle near zero means the suite is CPU-bound and only less work is faster;
- the probe before and after, and the suite's time in probes (wall / mean probe), which moves much less with the
  host than the wall time does.

Arguments after ``--`` replace the suite's (``tests``), e.g. ``-- tests/test_engine.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

# `make bench` runs this file as a script, so the repository root is not on sys.path by itself.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import machine_cpu_seconds, used_between  # noqa: E402
from utils.cli import ints, run_main  # noqa: E402
from utils.errors import TaskHetError  # noqa: E402

PROBE = "import run_pipeline"  # torch, pandas, matplotlib and the project: what every process of the suite pays
SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ passed.*?) in (?P<seconds>[0-9.]+)s")


def suite_environment() -> dict[str, str]:
    """`make test`'s environment: bytecode cached (this machine sets PYTHONDONTWRITEBYTECODE)."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def probe_seconds(times: int) -> float:
    """The median wall time of ``times`` fresh interpreters that run :data:`PROBE` in the repository."""
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=suite_environment(), check=True)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


class SuiteRun(NamedTuple):
    wall: float  # seconds
    last_line: str  # pytest's summary line (or the end of its stderr when it printed nothing)
    code: int  # pytest's exit code
    failed: list[str]  # the node ids of pytest's FAILED and ERROR lines


def failed_tests(output: str) -> list[str]:
    """The node ids that pytest's short summary lists as FAILED or ERROR (``FAILED tests/a.py::t - message``)."""
    return [line.split(" ", 2)[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]


def run_suite(pytest_args: list[str]) -> SuiteRun:
    """``python -m pytest -q -n auto <pytest_args>``, timed."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "auto", *pytest_args], cwd=ROOT,
                          env=suite_environment(), capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return SuiteRun(time.perf_counter() - start, lines[-1] if lines else done.stderr.strip()[-300:], done.returncode,
                    failed_tests(done.stdout))


def failure_message(run: SuiteRun, most: int = 5) -> str:
    """One line: pytest's exit code and summary, and the first ``most`` failed tests by name (a rare failure in a
    6-minute run must be found again without running it twice)."""
    message = f"the suite did not pass (pytest exit code {run.code}): {run.last_line}"
    if run.failed:
        more = f" and {len(run.failed) - most} more" if len(run.failed) > most else ""
        message += f"; failed: {', '.join(run.failed[:most])}{more}"
    return message


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--probes", type=ints(1, 50), default=3,
                        help="fresh interpreters timed for the host probe, before and after the suite")
    parser.add_argument("pytest_args", nargs="*", default=["tests"],
                        help="what pytest runs instead of `tests`, after -- (e.g. -- tests/test_engine.py -k resume)")
    args = parser.parse_args(argv)
    before = probe_seconds(args.probes)
    cpu = machine_cpu_seconds()
    run = run_suite(args.pytest_args)
    used = used_between(cpu, machine_cpu_seconds())
    after = probe_seconds(args.probes)
    summary = SUMMARY.match(run.last_line)
    if run.code != 0 or summary is None:
        raise TaskHetError(failure_message(run))
    minutes, seconds = divmod(round(run.wall), 60)
    print(f"suite: {summary['counts']}, {run.wall:.0f} s of wall time ({minutes} min {seconds:02d} s; "
          f"pytest's own {float(summary['seconds']):.0f} s)")
    if used is not None:
        print(f"machine CPU over it: {used.busy:.0f} s busy, {used.idle:.0f} s idle ({os.cpu_count()} cores)")
    print(f"host probe (`{PROBE}` in a new interpreter, median of {args.probes}): {before:.2f} s before, "
          f"{after:.2f} s after")
    print(f"ratio suite / probe: {run.wall / ((before + after) / 2):.0f}")


if __name__ == "__main__":
    run_main(main)
