"""``python -m pipeline.fingerprint_cli EXPERIMENT``: the fingerprint line a report of EXPERIMENT would carry now
(pipeline/fingerprint.py), to compare with a pasted one. Apart from pipeline/fingerprint.py, which the report's
writer imports, so that reading an experiment file does not make an import circle."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.experiment import load_experiment
from pipeline.fingerprint import fingerprint_line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the fingerprint line a report of EXPERIMENT would carry now.")
    parser.add_argument("experiment", type=Path, help="an experiment file (experiments/*.yaml)")
    args = parser.parse_args(argv)
    print(fingerprint_line(load_experiment(args.experiment)))


if __name__ == "__main__":
    from utils.cli import run_main

    run_main(main)
