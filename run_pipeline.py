"""The main job: steps 1–4 for every combination of one experiment file, then the gap report.

Input: a YAML experiment file (experiments/demo.yaml, experiments/paper.yaml; keys
and defaults in pipeline/studies/main_job/config.py), or a study file with a ``study:``
key naming its kind (experiments/digits_fedavg.yaml, experiments/digits_heterogeneity.yaml;
kinds in pipeline/studies/): centralized → federated grid → the kind's report. Output:
results/<name>/ with every step's folder, report.md, report.csv and plots.
Rerunning skips finished steps and resumes an interrupted federated run from its
checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.argv import command_line
from pipeline.experiment import load_experiment, run_experiment
from pipeline.studies import get_study
from utils import cli
from utils.cli import run_main
from utils.locks import folder_lock


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", type=Path, help="YAML experiment file")
    parser.add_argument("--results", type=Path, default=Path("results"), help="parent folder of the experiment's outputs")
    cli.add_runtime_flags(parser)  # --threads reaches every step; the steps draw no bars, the pipeline draws one
    parser.add_argument("--jobs", type=cli.ints(1, cli.MAX_WORKERS), default=1,
                        help="federated runs at once, each in its own process (default: 1, in this process), for "
                             "experiment and study files alike; with --jobs 2 on 2 cores pass --threads 1")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cli.refuse_several_processes("run_pipeline.py")
    config = load_experiment(args.experiment)
    show_progress = cli.apply_runtime_flags(args).progress
    out_dir = args.results / config["name"]
    with folder_lock(out_dir, f"experiment {config['name']!r} in --results"):  # a second run of it is refused
        table = run_experiment(config, out_dir, command_line([str(args.experiment)]), jobs=args.jobs,
                               threads=args.threads, show_progress=show_progress)
    print(f"report: {out_dir / 'report.md'} ({len(table)} {get_study(config['study']).report_unit} in report.csv)")


if __name__ == "__main__":
    run_main(main)
