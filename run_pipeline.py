"""The main job: steps 1–4 for every combination of one experiment file, then the gap report.

Input: a YAML experiment file (experiments/demo.yaml, experiments/paper.yaml; keys
and defaults in pipeline/studies/main_job/config.py), or a study file with a ``study:``
key naming its kind (experiments/digits_fedavg.yaml, experiments/digits_heterogeneity.yaml;
kinds in pipeline/studies/): centralized → federated grid → the kind's report. Output:
results/<name>/ with every step's folder, report.md, report.csv and plots.
Rerunning skips finished steps and resumes an interrupted federated run from its
checkpoint. The federated runs go --jobs at a time in local worker processes (one GPU
each), or as Ray tasks on a cluster (--executor ray; docs/howto/ray-cluster.md).
Flags: pipeline/command.py (``--help``).
"""
from pipeline.command import main, parse_args  # noqa: F401  (parse_args: the flags, for callers of this script)
from utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
