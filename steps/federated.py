"""Step 4: federated training of a task model over the clients of an assignment file (``test_fed.py``).

The command line is parsed in two stages: the run's own flags first, then exactly the
settings of the chosen ``--method`` (each algorithm declares them in its own file), so a
setting of another algorithm (``--mu`` for fedavg) is an error that lists the right ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from network.algorithms import describe_algorithms, list_algorithms
from network.algorithms.base import get_settings_class
from network.client_data import LOCAL_TESTS
from network.run import ENGINES, RunConfig, prepare
from partitioning.groupings import GROUPINGS, canonical_grouping
from network.settings import add_settings_arguments, describe
from utils import cli
from utils.cli import positive_float, positive_int
from utils.errors import TaskHetError
from utils.locks import folder_lock

DESCRIPTION = """Step 4 of TaskHet: federated training of one task's model (--list_methods shows the algorithms).
Inputs: the step-1 manifest (--manifest), the data under --data_path and a step-3b assignments.csv (--assignments;
default <assignment_files_path>/<type>/<task|labels>[/k<n_clusters>]/a<alpha>/assignments.csv), checked against
the manifest. Clients train on their 'train' rows; their 'test' rows and the manifest's test split evaluate.
Outputs in --out: config.json, run.log, metrics.csv (round, split, client, metric, value), checkpoint.pt (every
round; --resume continues from it), best.pt (lowest global test loss) and curves.png.
Each algorithm's own settings follow --method X: `test_fed.py --method X --help` lists them."""


def build_parser(method: str | None = None, prog: str = "test_fed.py", description: str = DESCRIPTION
                 ) -> argparse.ArgumentParser:
    """The run's flags, plus the settings of ``method`` when given; ``prog`` and ``description`` head ``--help`` (the
    Flower app reads the same flags under its own name)."""
    defaults = RunConfig(task="")
    parser = cli.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--list_methods", action="store_true", help="print every algorithm with its settings and exit")
    add("--task", required=method is not None, help="task to train (depth_euclidean, normal, segment_semantic, class_scene, ...)")
    add("--method", default="fedavg", choices=list_algorithms(), help="federated algorithm (default: fedavg)")
    add("--engine", default="sequential", choices=ENGINES, help="round loop (default: sequential)")
    add("--vectorize_clients", action=argparse.BooleanOptionalAction, default=False,
        help="train a round's sampled clients in lock-step (torch.func vmap; same results as one after another, "
             "up to float rounding); algorithms that declare support only (default: no)")
    add("--vectorize_chunk", type=positive_int, default=defaults.vectorize_chunk,
        help="--vectorize_clients: clients per lock-step chunk; memory grows with it (default: 32)")
    add("--flower_mode", choices=("simulation",), default="simulation",
        help="--engine flower: Flower's simulation runtime on this machine (a real deployment: docs/FLOWER.md)")
    add("--flower_num_cpus", type=positive_float, default=1.0, help="--engine flower: CPU cores per client (default: 1)")
    add("--flower_num_gpus", type=cli.nonnegative_float, default=0.0, help="--engine flower: share of a GPU per client, e.g. 0.25 (default: 0)")
    add("--min_available_clients", type=positive_int, default=None,
        help="--engine flower: results a round needs; failed clients beyond that are logged by id (default: all sampled)")
    add("--manifest", type=Path, default=defaults.manifest, help="step-1 manifest.csv")
    add("--data_path", type=Path, default=defaults.data_path, help="data root (default: data/synthetic)")
    add("--assignments", type=Path, default=None, help="assignments.csv of step 3b (default: see above)")
    add("--assignment_files_path", type=Path, default=defaults.assignment_files_path, help="folder of assignment files")
    add("--type", type=canonical_grouping, choices=GROUPINGS, default=None,
        help="partition kind, checked against the file (class_based: the old name of label_based)")
    add("--alpha", type=positive_float, default=None, help="Dirichlet α of the partition (checked against the file)")
    add("--n_clients", type=positive_int, default=None, help="number of clients (checked against the file)")
    add("--n_clusters", type=positive_int, default=10, help="KMeans clusters of an embedding-based partition (default path)")
    add("--encoder", default=defaults.encoder, help="encoder of a model built from scratch (default: resnet50)")
    add("--weights", default="none",
        help="encoder weights from scratch: none | imagenet | clip | dino | PATH; which names an encoder offers: "
             "README 'Models and training' (default: none)")
    add("--freeze_encoder", action=argparse.BooleanOptionalAction, default=False,
        help="keep the encoder fixed: clients train only the decoder and head (a centralized init keeps its own choice "
             "unless this is set)")
    add("--decoder_width", type=positive_int, default=None,
        help="channels of a dense task's decoder from scratch (default: the encoder's)")
    add("--cache_features", action=argparse.BooleanOptionalAction, default=False,
        help="with a frozen encoder: compute its feature maps once per sample (in --cache_dir, shared by later runs) "
             "and train the decoder and head on them (default: no)")
    add("--init_from", choices=("scratch", "centralized"), default="scratch", help="initial global model (default: scratch)")
    add("--centralized_checkpoint", type=Path, default=None, help="step-2 best.pt for --init_from centralized")
    add("--image_size", type=positive_int, default=defaults.image_size, help="image side length (default: 224)")
    add("--n_rounds", type=positive_int, default=defaults.n_rounds, help="federated rounds (default: 100)")
    add("--local_steps", "--sgd_per_epoch", type=positive_int, default=None, help="J local SGD steps per round (default: 50)")
    add("--local_epochs", type=positive_int, default=None, help="E local epochs per round instead of --local_steps")
    add("--batch_size", type=positive_int, default=defaults.batch_size, help="local batch size (default: 16)")
    add("--init_lr", type=positive_float, default=defaults.init_lr, help="local learning rate of round 1 (default: 0.01)")
    add("--lr_schedule", default="constant", help="constant | cosine | exponential:RATE | step:EVERY:GAMMA (per round)")
    add("--momentum", type=cli.nonnegative_float, default=0.0, help="local SGD momentum (default: 0)")
    add("--weight_decay", type=cli.nonnegative_float, default=0.0, help="local SGD weight decay (default: 0)")
    add("--client_fraction", type=positive_float, default=1.0, help="share of clients per round (default: 1)")
    add("--calibration_fraction", type=cli.nonnegative_float, default=0.0,
        help="hold out this share of the manifest's train rows no client holds as the server's calibration split "
             "(sparse_ft --mask_source server; default: 0, none)")
    add("--finetune_steps", type=cli.nonnegative_int, default=0,
        help="also evaluate each client's model after this many local SGD steps on its train rows (default: 0, off)")
    add("--local_test", choices=LOCAL_TESTS, default="assigned",
        help="client test sets: assigned (each client's test rows of assignments.csv) or proportional (the Fed-LT "
             "protocol: drawn from the manifest's test split in the client's training class proportions, "
             "⌊n_c/N·|test|⌋ images of class c; clients may overlap) (default: assigned)")
    add("--diagnostics", action=argparse.BooleanOptionalAction, default=False,
        help="per round: client drift ‖y_k − x‖, mean/max update norm (metrics.csv) and the update-cosine matrix "
             "(diagnostics/round_<r>_cosine.npy, heatmap on evaluation rounds); every --diagnostics_every rounds, G², "
             "B² and each client's ‖∇F_k‖² at the global model over all clients (metrics.csv split diagnostics); "
             "plot diagnostics.png")
    add("--diagnostics_every", type=positive_int, default=defaults.diagnostics_every,
        help="--diagnostics: take every client's gradient at the global model every this many rounds, round 0 "
             "included (default: 1)")
    add("--diagnostics_max_samples", type=positive_int, default=None,
        help="--diagnostics: each client's gradient over at most this many of its train rows, a sample fixed by "
             "the seed and the client (the same every round) (default: all of them)")
    add("--eval_every", type=positive_int, default=1, help="evaluate every this many rounds (default: 1)")
    add("--checkpoint_every", type=positive_int, default=1,
        help="write checkpoint.pt every this many rounds, and at round 0 and the last round; --resume redoes the "
             "rounds after the last one, bit for bit (default: 1)")
    add("--rand_seed", "--seed", type=int, default=defaults.rand_seed, help="root seed of init, sampling and training (default: 42)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False, help="deterministic kernels")
    add("--use_accelerator", action=argparse.BooleanOptionalAction, default=True, help="CUDA/MPS when present")
    add("--num_workers", type=cli.nonnegative_int, default=0, help="DataLoader worker processes (default: 0)")
    add("--cache_dir", type=Path, default=None, help="decoded-sample cache folder (default: none)")
    add("--client_state_memory_mb", type=cli.nonnegative_float, default=2048, help="client state kept in memory, MB; more spills to disk")
    cli.add_runtime_flags(parser)
    add("--tensorboard", action=argparse.BooleanOptionalAction, default=False,
        help="also write metrics.csv's rows as TensorBoard scalars under <out>/tensorboard (needs the tensorboard "
             "package; metrics.csv stays the source of truth)")
    add("--round_lines", action=argparse.BooleanOptionalAction, default=True,
        help="one console line per round; --no-round_lines keeps them in run.log and prints one line at the end")
    add("--resume", action=argparse.BooleanOptionalAction, default=True, help="continue from <out>/checkpoint.pt")
    add("--out", type=Path, default=None, help="run folder (default: results/test_federated/<task>/<type>/<method>/...)")
    if method is not None:
        add_settings_arguments(parser, get_settings_class(method), method)
    return parser


def parse_run_config(argv: list[str] | None, prog: str = "test_fed.py", description: str = DESCRIPTION
                     ) -> RunConfig | None:
    """The run config of a command line (None after --list_methods); ``prog``/``description``: see :func:`build_parser`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    first = cli.ArgumentParser(add_help=False)
    first.add_argument("--method", default="fedavg")
    first.add_argument("--list_methods", action="store_true")
    known, _ = first.parse_known_args(argv)
    if known.list_methods:
        print(describe_algorithms())
        return None
    settings_class = get_settings_class(known.method)
    args, unknown = build_parser(known.method, prog, description).parse_known_args(argv)
    cli.apply_runtime_flags(args)
    if unknown:
        listing = ", ".join(f"--{info.name}" for info in describe(settings_class)) or "none"
        flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")] or unknown
        raise TaskHetError(f"{known.method} has no setting {', '.join(flags)}; its settings: {listing} "
                           "(test_fed.py --list_methods shows every algorithm's)")
    values = vars(args)
    names = {info.name for info in describe(settings_class)}
    settings = {name: values.pop(name) for name in list(values) if name in names}
    values.pop("list_methods")
    return RunConfig(settings=settings, **values)


def main(argv: list[str] | None = None) -> dict | None:
    config = parse_run_config(argv)
    if config is None:
        return None
    from network.run import run  # the heavy part: models, data, engines

    with folder_lock(config.out):  # one run at a time writes the folder
        return run(prepare(config))
