"""The main job: steps 1–4 for every combination of one experiment file, then the gap report.

Input: a YAML experiment file (experiments/demo.yaml, experiments/paper.yaml; keys
and defaults in pipeline/studies/main_job/config.py), or a study file with a ``study:``
key naming its kind (experiments/digits_fedavg.yaml, experiments/digits_heterogeneity.yaml;
kinds in pipeline/studies/): centralized → federated grid → the kind's report. Output:
results/<name>/ with every step's folder, report.md, report.csv and plots.
Rerunning skips finished steps and resumes an interrupted federated run from its
checkpoint. The federated runs go --jobs at a time in local worker processes (one GPU
each), or as Ray tasks on a cluster (--executor ray; docs/howto/ray-cluster.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.argv import command_line
from pipeline.checks import check_input_files
from pipeline.disk_projection import Projection, project
from pipeline.executors import (CPUS_PER_RUN, DEFAULT_MAX_RETRIES, EXECUTORS, GPU_FRACTIONS, RETRIES, ExecutorSettings,
                                 open_executor)
from pipeline.experiment import load_experiment, run_experiment
from pipeline.shards import Shard
from pipeline.studies import get_study
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock


def build_parser() -> argparse.ArgumentParser:
    """run_pipeline.py's flags (the documentation's flag reference prints them too)."""
    parser = cli.ArgumentParser(prog="run_pipeline.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", type=Path, help="YAML experiment file")
    # default given: an absent list is optional to parse_intermixed_args too (else it names KEY=VALUE as missing)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", default=[],
                        help="change a key of the file for this run, with the file's own checks: federated.n_rounds=10 "
                             "seeds=[0] grid[0].local_steps=[2] (a value is YAML, its numbers plain decimals such "
                             "as 10 or 1e-3; before or after the flags); recorded in <results>/<name>/config.json")
    parser.add_argument("--results", type=Path, default=Path("results"), help="parent folder of the experiment's outputs")
    # the steps draw no bars, the pipeline draws one
    cli.add_runtime_flags(parser, threads_help=(
        f"torch CPU threads of the steps whose outputs are the same at any count: rendering, step 1 and step 3's "
        f"embeddings and clusters (default: {cli.DEFAULT_THREADS}). Steps 2, 3c and 4 sum gradients, which another "
        "count rounds otherwise, so they run one thread each whatever this says, and the answer is the same at any "
        "--threads; their parallelism is --jobs"))
    parser.add_argument("--jobs", type=cli.ints(1, cli.MAX_WORKERS), default=None,
                        help="federated runs (and step-3c readings) at once, for experiment and study files alike. "
                             "local: each in its own worker process, worker i seeing only GPU i mod G of G visible GPUs "
                             "(default: 1, in this process; with --jobs 2 on 2 cores pass --threads 1); ray: at most "
                             "this many in flight (default: as many as the cluster's resources allow)")
    parser.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                        help="TensorBoard logs of every step-2 and step-4 run, each in its own run folder, so "
                             "`tensorboard --logdir results/<name>` shows the whole grid live; runs already finished "
                             "are not redone for it (default: the experiment file's tensorboard key, which is off)")
    parser.add_argument("--run_plots", action=argparse.BooleanOptionalAction, default=None,
                        help="each step-2, step-3b and step-4 stage's own pictures (curves.png, the partition's "
                             "heatmap: up to a second of CPU each); --no-run_plots leaves them out, every other file "
                             "the same, for a grid whose runs nobody opens one by one. The report's pictures are "
                             "always drawn (default: the experiment file's run_plots key, which is on)")
    parser.add_argument("--disk_check", action=argparse.BooleanOptionalAction, default=True,
                        help="before step 0, project the bytes the grid will still write (its runs' checkpoints, "
                             "the --jobs runs in flight with their temporary copies, the models, embeddings and "
                             "caches; stages already finished are not counted) and refuse, in one line, a grid "
                             "that does not fit the --results folder's free space with a 10%% margin. The "
                             "projection is printed and kept in config.json and run.log; --no-disk_check skips it")
    parser.add_argument("--shard", type=shard_type, default=None, metavar="i/n",
                        help="run only shard i of n (counted from 0) of the federated runs, for a Slurm array or "
                             "n processes on shared storage with no Ray: every stage the runs share runs once (the "
                             "others wait for it), the runs are split i, i+n, i+2n, ..., and no report is written; "
                             "then run the same command without --shard to finish what is left and write the report "
                             "(docs/howto/slurm.md)")
    executors = parser.add_argument_group("where the runs go (results do not depend on these; docs/howto/ray-cluster.md)")
    executors.add_argument("--executor", choices=EXECUTORS.names(), default="local",
                           help="local: worker processes on this machine; ray: Ray tasks on a Ray cluster")
    executors.add_argument("--ray_address", default=None,
                           help="the Ray cluster to run on: the address `ray start --head` prints (HOST:PORT), auto (the "
                                "cluster started on this machine) or ray://HOST:PORT; default: start Ray on this machine. "
                                "The --results folder must be on storage every node sees (checked)")
    executors.add_argument("--gpus_per_run", type=GPU_FRACTIONS, default=None,
                           help="the share of one GPU each run takes (0.25: four runs per GPU); default: 1 where there "
                                "are GPUs and the experiment uses them, else 0. local: checked against --jobs and the "
                                "visible GPUs")
    executors.add_argument("--cpus_per_run", type=CPUS_PER_RUN, default=None,
                           help="CPUs each Ray task takes (its training runs one torch thread, as locally); default: 1")
    executors.add_argument("--max_retries", type=RETRIES, default=None,
                           help=f"times Ray reruns a run whose worker or node died (it resumes from its checkpoint); "
                                f"default: {DEFAULT_MAX_RETRIES}")
    return parser


def shard_type(text: str) -> Shard:
    """argparse type of ``--shard``: ``i/n`` (its message becomes the parser's one error line)."""
    try:
        return Shard.parse(text)
    except TaskHetError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--shard ")) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # intermixed: KEY=VALUE overrides may follow a flag (FILE --threads 1 federated.n_rounds=2), not only the file
    return build_parser().parse_intermixed_args(argv)


def executor_settings(args: argparse.Namespace) -> ExecutorSettings:
    """The flags that say where the pooled stages run, checked (one line naming the flag)."""
    settings = ExecutorSettings(args.executor, args.jobs, args.threads, args.ray_address, args.gpus_per_run,
                                args.cpus_per_run, args.max_retries)
    settings.check()
    return settings


def disk_check(args: argparse.Namespace, settings: ExecutorSettings, config: dict, out_dir: Path) -> dict:
    """The grid's disk projection (pipeline/disk_projection.py), printed, and refused when it does not fit; its
    record for config.json (``line``: what run.log keeps)."""
    if not args.disk_check:
        return {"line": "disk: not checked (--no-disk_check)"}
    if get_study(config["study"]).disk_plan is None:  # a kind without a plan (mechanism) has no data section either
        line = f"disk: not projected for study kind {config['study']!r}"
        print(line, flush=True)
        return {"line": line}
    check_input_files(config)  # a missing input is its own line, before a projection that would read around it
    # Runs in flight at once: --jobs local workers in each shard process (every shard may run at once); a Ray
    # cluster without --jobs may start every run still to do.
    jobs = settings.jobs if settings.executor != "local" else (settings.jobs or 1)
    in_flight = None if jobs is None else jobs * (args.shard.count if args.shard is not None else 1)
    projection = experiment_projection(config, out_dir, in_flight)
    print(projection.line(), flush=True)
    projection.check(out_dir)
    return projection.record()


def experiment_projection(config: dict, out_dir: Path, runs_in_flight: int | None) -> Projection:
    """The disk projection of a validated experiment (``load_experiment``) whose study kind has a disk plan, into
    ``out_dir`` (pipeline/disk_projection.py); here, above both the projection and the study kinds that use it."""
    plan = get_study(config["study"]).disk_plan
    return project(plan(config, Path(out_dir)), Path(out_dir), runs_in_flight)


def main(argv: list[str] | None = None) -> None:
    """Run (or resume) the experiment ``argv`` names (None reads sys.argv), then print where its report is."""
    args = parse_args(argv)
    cli.refuse_several_processes("run_pipeline.py")
    settings = executor_settings(args)
    config = load_experiment(args.experiment, args.overrides)
    for key in ("tensorboard", "run_plots"):  # the flag wins over the file's key (every study kind takes the flag)
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    show_progress = cli.apply_runtime_flags(args).progress
    out_dir = args.results / config["name"]
    if args.shard is not None and settings.executor != "local":
        raise TaskHetError("--shard splits a grid over processes without a cluster: use it with --executor local "
                           "(a Ray cluster spreads the runs itself)")
    disk = disk_check(args, settings, config, out_dir)  # before anything is written: a refusal leaves nothing
    # A second run of the experiment is refused; shards lock their own folder, so n of them (and the final call)
    # share the experiment, each stage guarded by its stage lock and each run by its own folder lock.
    lock_dir = out_dir if args.shard is None else out_dir / "shards" / args.shard.folder_name
    with folder_lock(lock_dir, f"experiment {config['name']!r} in --results"):
        # The executor starts (a Ray cluster joined, its resources and storage checked) before anything is written.
        with open_executor(settings, out_dir, config["use_accelerator"]) as executor:
            # what was run: the file, its overrides and every key as checked (every run folder has its own config.json too)
            record = {"experiment": str(args.experiment), "overrides": args.overrides, "resolved": config,
                      **{key: value for key, value in vars(args).items() if key not in ("experiment", "overrides")},
                      "disk": disk}
            shard_flags = [] if args.shard is None else ["--shard", args.shard.label]
            table = run_experiment(config, out_dir, command_line([str(args.experiment), *args.overrides, *shard_flags]),
                                   jobs=settings.jobs or 1, threads=args.threads, show_progress=show_progress,
                                   executor=executor, record=record, shard=args.shard)
    if args.shard is not None:
        print(f"shard {args.shard.label}: its runs are done; when every shard has finished, run the same command "
              f"without --shard to finish what is left and write {out_dir / 'report.md'}")
        return
    print(f"report: {out_dir / 'report.md'} ({len(table)} {get_study(config['study']).report_unit} in report.csv)")

