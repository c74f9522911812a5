"""The main job, or any study file: every step of one experiment file, then its report.

`python run_pipeline.py experiments/demo.yaml [KEY=VALUE ...] --jobs 2 --threads 1`; what it does and its
flags: pipeline/command.py (``--help``).
"""

from pipeline.command import main, parse_args  # noqa: F401  (parse_args: the flags, for callers of this script)
from utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
