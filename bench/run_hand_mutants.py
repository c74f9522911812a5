"""Hand-written mutants: each one a small change a careless edit could make, and the tests that must catch it.

The mutants live in ``bench/hand_mutants/*.toml``, one file per area (one ``[[mutant]]`` table each: ``id``, ``file``, ``find`` — text that
occurs exactly once in that file —, ``replace``, ``tests`` — pytest node ids or files — and ``why``). This script copies
the tracked files of the repository into a temporary folder once, then for each mutant patches the copy, runs the named
tests there with this Python, and restores the file. A mutant is *killed* when the tests fail, *survived* when they
pass; a ``find`` that no longer occurs exactly once is reported as *stale* (the code moved: rewrite the mutant), and a
mutant whose tests fail on the unmutated tree as *baseline fails* (it proves nothing).

Usage: ``.venv/bin/python bench/run_hand_mutants.py [--only ID ...] [--files mocha ...] [--out results/hand_mutants.csv]``
It never touches the working tree. Scores are recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "bench" / "hand_mutants"
FIELDS = ("id", "file", "find", "replace", "tests", "why")


def load_mutants(path: Path) -> list[dict]:
    """The ``[[mutant]]`` tables of ``path``, each with every field of ``FIELDS`` and a unique id."""
    mutants = tomllib.loads(path.read_text(encoding="utf-8")).get("mutant", [])
    seen = set()
    for number, mutant in enumerate(mutants, start=1):
        missing = [field for field in FIELDS if field not in mutant]
        if missing:
            raise SystemExit(f"error: {path}: mutant {number} lacks {', '.join(missing)}")
        if mutant["id"] in seen:
            raise SystemExit(f"error: {path}: mutant id {mutant['id']!r} appears twice")
        seen.add(mutant["id"])
    return mutants


def copy_tracked(destination: Path) -> None:
    """The files git tracks (committed or staged), plus untracked ones not ignored: the tree as a fresh clone sees it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / name.decode()
        if source.is_file():
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def export_commit(reference: str, destination: Path) -> None:
    """The tree of commit ``reference`` (``git archive``): a score recorded for a commit, whatever the working tree."""
    archive = subprocess.run(["git", "archive", "--format=tar", reference], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=True)


def tests_pass(copy: Path, tests: list[str], timeout: int) -> bool | None:
    """Whether ``tests`` pass in ``copy`` (None: they ran past ``timeout``)."""
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0",
                                 *tests], cwd=copy, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return result.returncode == 0


def run_mutant(copy: Path, mutant: dict, timeout: int, baselines: dict[tuple, bool | None]) -> tuple[str, float]:
    """('killed' | 'survived' | 'stale' | 'timeout' | 'baseline fails', seconds) for one mutant applied to ``copy``.

    The mutant's tests first run on the unmutated copy (once per set of tests): a failure there would count every
    mutant as killed."""
    path = copy / mutant["file"]
    original = path.read_text(encoding="utf-8")
    if original.count(mutant["find"]) != 1:
        return "stale", 0.0
    tests = tuple(mutant["tests"])
    if tests not in baselines:
        baselines[tests] = tests_pass(copy, list(tests), timeout)
    if not baselines[tests]:
        return "baseline fails", 0.0
    path.write_text(original.replace(mutant["find"], mutant["replace"]), encoding="utf-8")
    start = time.monotonic()
    try:
        passed = tests_pass(copy, list(tests), timeout)
    finally:
        path.write_text(original, encoding="utf-8")
    outcome = "timeout" if passed is None else "survived" if passed else "killed"
    return outcome, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run only these mutant ids")
    parser.add_argument("--files", nargs="*", default=None, help="run only the mutants of these files (stems)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "hand_mutants.csv", help="a CSV of outcomes")
    parser.add_argument("--ref", default=None, help="mutate this commit's tree (e.g. HEAD) instead of the working tree")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per mutant")
    args = parser.parse_args(argv)
    paths = sorted(MUTANTS.glob("*.toml"))
    if args.files:
        paths = [path for path in paths if path.stem in args.files]
    mutants = [mutant for path in paths for mutant in load_mutants(path)]
    ids = [mutant["id"] for mutant in mutants]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"error: {MUTANTS}: a mutant id appears in two files")
    if args.only:
        unknown = sorted(set(args.only) - {mutant["id"] for mutant in mutants})
        if unknown:
            raise SystemExit(f"error: --only: no mutant {', '.join(unknown)} in {MUTANTS}")
        mutants = [mutant for mutant in mutants if mutant["id"] in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hand_mutants_") as folder:
        copy = Path(folder)
        if args.ref:
            export_commit(args.ref, copy)
        else:
            copy_tracked(copy)
        baselines: dict[tuple, bool | None] = {}
        for mutant in mutants:
            outcome, seconds = run_mutant(copy, mutant, args.timeout, baselines)
            print(f"{outcome:8s} {mutant['id']} ({seconds:.0f} s)", flush=True)
            rows.append({"id": mutant["id"], "file": mutant["file"], "outcome": outcome, "seconds": round(seconds, 1)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["id", "file", "outcome", "seconds"])
        writer.writeheader()
        writer.writerows(rows)
    killed = sum(row["outcome"] in ("killed", "timeout") for row in rows)
    live = sum(row["outcome"] not in ("stale", "baseline fails") for row in rows)
    print(f"killed {killed} of {live} mutants ({len(rows) - live} stale or with failing tests unmutated); {args.out}")
    return 0 if killed == live and live == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
