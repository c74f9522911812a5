"""Step 4: federated training of a task model over the clients of an assignment file (``test_fed.py``).

The command line is parsed in two stages: the run's own flags first, then exactly the
settings of the chosen ``--method`` (each algorithm declares them in its own file), so a
setting of another algorithm (``--mu`` for fedavg) is an error that lists the right ones.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from network.algorithms import describe_algorithms, list_algorithms
from network.algorithms.base import ALGORITHMS, get_settings_class
from network.client_data import LOCAL_TESTS
from network.privacy import DEFAULT_CLIP_LR, MAX_CLIP, MAX_EPSILON, MAX_NOISE_MULTIPLIER
from network.lr_schedule import LR_SCHEDULE_HELP, make_lr_schedule
from network.run import prepare
from network.run_config import ENGINES, RunConfig, check_flower_counts, resolve
from network.run_inputs import default_assignments
from partitioning.groupings import GROUPINGS, canonical_grouping
from partitioning.temporal import ROUNDS
from network.settings import add_settings_arguments, build_settings, describe
from steps.assign import ALPHAS, CLIENTS
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock

DESCRIPTION = """Step 4 of TaskHet: federated training of one task's model (--list_methods shows the algorithms).
Inputs: the step-1 manifest (--manifest), the data under --data_path and a step-3b assignments.csv (--assignments;
default <assignment_files_path>/<type>/<task|labels>[/k<n_clusters>]/a<alpha>/assignments.csv), checked against
the manifest. Clients train on their 'train' rows; their 'test' rows and the manifest's test split evaluate.
Outputs in --out: config.json, run.log, metrics.csv (round, split, client, metric, value), checkpoint.pt (every
round; --resume continues from it), best.pt (lowest global validation loss; none without validation rows) and curves.png.
Each algorithm's own settings follow --method X: `test_fed.py --method X --help` lists them."""
# Step 4's own limits (the shared ones are utils.cli's; rounds and clients are partitioning's).
MAX_LOCAL_STEPS = 10_000  # J per round, and --finetune_steps
MAX_LOCAL_EPOCHS = 1_000  # E per round
MAX_GPUS_PER_CLIENT = 64.0
MAX_STATE_MEMORY_MB = float(2**20)  # 1 TiB
CLIENT_FRACTIONS = cli.floats(0.0, 1.0, low_open=True)
CALIBRATION_FRACTIONS = cli.floats(0.0, 1.0, high_open=True)  # the clients keep some train rows


MAX_CHECKPOINT_MINUTES = 10_000.0  # about a week
CLIP_NORMS = cli.floats(0.0, MAX_CLIP, low_open=True)


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
    add("--vectorize_chunk", type=CLIENTS, default=defaults.vectorize_chunk,
        help="--vectorize_clients: clients per lock-step chunk; memory grows with it (default: 32)")
    add("--flower_mode", choices=("simulation",), default="simulation",
        help="--engine flower: Flower's simulation runtime on this machine (a real deployment: docs/FLOWER.md)")
    add("--flower_num_cpus", type=cli.floats(0.0, cli.MAX_THREADS, low_open=True), default=1.0, help="--engine flower: CPU cores per client (default: 1)")
    add("--flower_num_gpus", type=cli.floats(0.0, MAX_GPUS_PER_CLIENT), default=0.0, help="--engine flower: share of a GPU per client, e.g. 0.25 (default: 0)")
    add("--flower_num_nodes", type=CLIENTS, default=None,
        help="--engine flower: simulated SuperNodes, at most the clients; node p of K hosts clients p, p+K, p+2K, ... "
             "and keeps their state (default: one node per client)")
    add("--min_available_clients", type=CLIENTS, default=None,
        help="--engine flower: results a round needs; failed clients beyond that are logged by id (default: all sampled)")
    add("--manifest", type=Path, default=defaults.manifest, help="step-1 manifest.csv")
    add("--data_path", type=Path, default=defaults.data_path, help="data root (default: data/synthetic)")
    add("--assignments", type=Path, default=None, help="assignments.csv of step 3b (default: see above)")
    add("--assignment_files_path", type=Path, default=defaults.assignment_files_path, help="folder of assignment files")
    add("--type", type=canonical_grouping, choices=GROUPINGS, default=None,
        help="partition kind, checked against the file (class_based: the old name of label_based)")
    add("--alpha", type=ALPHAS, default=None, help="Dirichlet α of the partition (checked against the file)")
    add("--n_clients", type=CLIENTS, default=None, help="number of clients (checked against the file)")
    add("--n_clusters", type=cli.ints(1, cli.MAX_CLUSTERS), default=10, help="KMeans clusters of an embedding-based partition (default path)")
    add("--encoder", default=defaults.encoder, help="encoder of a model built from scratch (default: resnet50)")
    add("--weights", default="none",
        help="encoder weights from scratch: none | imagenet | clip | dino | PATH; which names an encoder offers: "
             "README 'Models and training' (default: none)")
    add("--freeze_encoder", action=argparse.BooleanOptionalAction, default=False,
        help="keep the encoder fixed: clients train only the decoder and head (a centralized init keeps its own choice "
             "unless this is set)")
    add("--decoder_width", type=cli.ints(1, cli.MAX_DECODER_WIDTH), default=None,
        help="channels of a dense task's decoder from scratch (default: the encoder's)")
    add("--cache_features", action=argparse.BooleanOptionalAction, default=False,
        help="with a frozen encoder: compute its feature maps once per sample (in --cache_dir, shared by later runs) "
             "and train the decoder and head on them (default: no)")
    add("--init_from", choices=("scratch", "centralized"), default="scratch", help="initial global model (default: scratch)")
    add("--centralized_checkpoint", type=Path, default=None, help="step-2 best.pt for --init_from centralized")
    add("--image_size", type=cli.IMAGE_SIZES, default=defaults.image_size, help="image side length (default: 224)")
    add("--n_rounds", type=ROUNDS, default=defaults.n_rounds, help="federated rounds (default: 100)")
    add("--local_steps", "--sgd_per_epoch", type=cli.ints(1, MAX_LOCAL_STEPS), default=None, help="J local SGD steps per round (default: 50)")
    add("--local_epochs", type=cli.ints(1, MAX_LOCAL_EPOCHS), default=None, help="E local epochs per round instead of --local_steps")
    add("--batch_size", type=cli.BATCH_SIZES, default=defaults.batch_size, help="local batch size (default: 16)")
    add("--init_lr", type=cli.LEARNING_RATES, default=defaults.init_lr, help="local learning rate of round 1 (default: 0.01)")
    add("--lr_schedule", default="constant", help=f"{LR_SCHEDULE_HELP} (default: constant)")
    add("--momentum", type=cli.MOMENTA, default=0.0, help="local SGD momentum (default: 0)")
    add("--weight_decay", type=cli.WEIGHT_DECAYS, default=0.0, help="local SGD weight decay (default: 0)")
    add("--client_fraction", type=CLIENT_FRACTIONS, default=1.0, help="share of clients per round (default: 1)")
    add_privacy_flags(parser)
    add("--straggler_fraction", type=cli.floats(0.0, 1.0), default=0.0,
        help="unequal local work: this share of the clients, drawn once from the seed, are stragglers taking "
             "max(1, floor(S·J)) local steps, S = --straggler_share (clients.csv: local_step_budget; default: 0, none)")
    add("--straggler_share", type=cli.floats(0.0, 1.0, low_open=True), default=0.5,
        help="--straggler_fraction: the share S of --local_steps a straggler takes (default: 0.5)")
    add("--local_steps_range", default=None, metavar="LOW:HIGH",
        help="unequal local work: each client's local steps drawn once from the seed, uniformly from LOW..HIGH "
             "(clients.csv: local_step_budget; default: every client takes --local_steps)")
    add("--calibration_fraction", type=CALIBRATION_FRACTIONS, default=0.0,
        help="hold out this share of the manifest's train rows no client holds as the server's calibration split "
             "(sparse_ft --mask_source server; default: 0, none)")
    add("--finetune_steps", type=cli.ints(0, MAX_LOCAL_STEPS), default=0,
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
    add("--diagnostics_every", type=ROUNDS, default=defaults.diagnostics_every,
        help="--diagnostics: take every client's gradient at the global model every this many rounds, round 0 "
             "included (default: 1)")
    add("--diagnostics_max_samples", type=cli.ints(1, cli.MAX_SAMPLES), default=None,
        help="--diagnostics: each client's gradient over at most this many of its train rows, a sample fixed by "
             "the seed and the client (the same every round) (default: all of them)")
    add("--eval_every", type=ROUNDS, default=1, help="evaluate every this many rounds (default: 1)")
    add("--checkpoint_every", type=ROUNDS, default=1,
        help="write checkpoint.pt every this many rounds, and at round 0 and the last round; --resume redoes the "
             "rounds after the last one, bit for bit (default: 1)")
    add("--checkpoint_minutes", type=cli.floats(0.0, MAX_CHECKPOINT_MINUTES, low_open=True), default=None,
        help="write checkpoint.pt whenever this many minutes have passed since the last one (and at round 0 and the "
             "last round) instead of every --checkpoint_every rounds: the time a kill can cost, whatever a round "
             "costs (default: by rounds)")
    add("--keep_client_state", action=argparse.BooleanOptionalAction, default=False,
        help="keep the clients' states (SCAFFOLD's c_i, personal models) in the final checkpoint.pt and client_states/; "
             "by default a finished run drops them (its evaluation is in metrics.csv), and resuming it to train more "
             "rounds is then refused (default: no)")
    add("--rand_seed", "--seed", type=cli.SEEDS, default=defaults.rand_seed, help="root seed of init, sampling and training (default: 42)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False, help="deterministic kernels")
    add("--use_accelerator", action=argparse.BooleanOptionalAction, default=True, help="CUDA/MPS when present")
    add("--num_workers", type=cli.WORKERS, default=0, help="DataLoader worker processes (default: 0)")
    add("--cache_dir", type=Path, default=None, help="decoded-sample cache folder (default: none)")
    add("--client_state_memory_mb", type=cli.floats(0.0, MAX_STATE_MEMORY_MB), default=2048, help="client state kept in memory, MB; more spills to disk")
    cli.add_runtime_flags(parser)
    add("--tensorboard", action=argparse.BooleanOptionalAction, default=False,
        help="also write metrics.csv's rows as TensorBoard scalars under <out>/tensorboard (needs the tensorboard "
             "package; metrics.csv stays the source of truth)")
    cli.add_plots_flag(parser, "curves.png (and with --diagnostics, diagnostics.png and the drift pictures)")
    add("--round_lines", action=argparse.BooleanOptionalAction, default=True,
        help="one console line per evaluated round (round, losses, ETA; run.log has every round); --no-round_lines "
             "keeps them in run.log and prints one line at the end")
    add("--resume", action=argparse.BooleanOptionalAction, default=True,
        help="continue from <out>/checkpoint.pt if present (default: yes: rerunning the same command after Ctrl-C or a "
             "kill resumes, redoing only the rounds after the last checkpoint); --no-resume starts over")
    add("--out", type=Path, default=None, help="run folder (default: results/test_federated/<task>/<type>/<method>/...)")
    if method is not None:
        add_settings_arguments(parser, get_settings_class(method), method)
    return parser


def add_privacy_flags(parser: argparse.ArgumentParser) -> None:
    """Client-level differential privacy (network/privacy.py): on when --dp_clip is given."""
    add = parser.add_argument
    add("--dp_clip", type=clip_norm, default=None,
        help="client-level DP (DP-FedAvg): clip each client's upload to this L2 norm C, in (0, 1e6], or inf (no "
             "clipping, with --dp_noise_multiplier 0); needs --weighting uniform (default: no DP)")
    add("--dp_noise_multiplier", type=cli.floats(0.0, MAX_NOISE_MULTIPLIER), default=None,
        help="--dp_clip: the server adds Gaussian noise of std z·C to the round's sum of clipped uploads (0: none, ε = ∞)")
    add("--dp_target_epsilon", type=cli.floats(0.0, MAX_EPSILON, low_open=True), default=None,
        help="--dp_clip: the privacy budget ε at --dp_delta; without --dp_noise_multiplier, z is calibrated so that "
             "--n_rounds spend it; with it, the run stops before the round that would exceed it")
    add("--dp_delta", type=cli.floats(0.0, 1.0, low_open=True, high_open=True), default=1e-5,
        help="--dp_clip: the δ of every reported ε; a δ of 1/N or more gets a warning (default: 1e-05)")
    add("--dp_adaptive_quantile", type=cli.floats(0.0, 1.0), default=None,
        help="--dp_clip: adaptive clipping (Andrew et al. 2021): C follows this quantile of the update norms, "
             "estimated from the clients' privatised bits; --dp_clip is then the initial C (default: fixed C)")
    add("--dp_clip_lr", type=cli.floats(0.0, 10.0, low_open=True), default=DEFAULT_CLIP_LR,
        help="--dp_adaptive_quantile: the geometric step η_C of C (default: 0.2)")
    add("--dp_count_noise", type=cli.floats(0.0, 1e6, low_open=True), default=None,
        help="--dp_adaptive_quantile: the std σ_b of the noise on the count of unclipped uploads; it must exceed "
             "z/2 (default: m/20, m the clients per round)")


def clip_norm(text: str) -> float:
    """argparse type of --dp_clip: a number in (0, 1e6] or ``inf``."""
    if isinstance(text, str) and text.strip().lower() == "inf":
        return math.inf
    try:
        return CLIP_NORMS.parse(text)
    except ValueError as error:  # argparse would print only "invalid clip_norm value"
        raise argparse.ArgumentTypeError(f"{error} (or inf: no clipping)") from None


def check_arguments(argv: list[str], *, n_clients: int | None = None,
                    parsers: dict[str, argparse.ArgumentParser] | None = None) -> argparse.Namespace:
    """Parse step 4's command line and make every check the step makes from its arguments alone.

    No file is read (neither the manifest nor assignments.csv), nothing is written, no model is built and no thread
    count is set: :func:`main` calls this first, and a caller such as the pipeline may call it to refuse a bad run
    before any step runs. Checked: every number's range and its ASCII digits (each flag's ``--help`` names its
    range); that ``--method`` has every setting given (an unknown one lists its settings) and each setting's type,
    range and ``Settings`` checks (e.g. fedem ``--n_components`` at most 64, sparse_ft ``--density`` in (0, 1]);
    ``--task``; the run config's own checks (``RunConfig``: the diagnostics options, the Flower engine's
    checkpointing); ``--assignments`` or ``--type``/``--alpha`` to find it; ``--local_steps`` against
    ``--local_epochs``, ``--init_from centralized`` needing ``--centralized_checkpoint``, ``--calibration_fraction``
    and ``--vectorize_clients`` against the engine, ``--local_test``; ``--lr_schedule`` (its form and ranges);
    sparse_ft's server masks needing ``--calibration_fraction``. With the number of clients N (``n_clients``, or
    the ``--n_clients`` flag): the method against N (IFCA: ``--n_cluster_models`` <= N), a ``capped`` weighting's
    ``--cap`` >= 1/N, and the Flower engine's ``--min_available_clients`` against the clients sampled per round
    and its ``--flower_num_nodes`` against N.
    What needs the files stays with :func:`main`: the task against the manifest's family, the assignments against
    the manifest, a temporal schedule against ``--n_rounds``.

    Args:
        argv: the command line, as ``test_fed.py`` takes it.
        n_clients: the number of clients of the assignments the run will read, when the caller knows it (the
            pipeline knows it from the partition it asks step 3b for); None: the ``--n_clients`` flag, if given.
        parsers: method -> its parser, filled as methods are met, for a caller that checks many runs (a grid of
            10,000 runs builds each method's parser once instead of once a run); None: a new parser.

    Returns:
        The parsed arguments, algorithm settings included (as given, strings on a command line). With
        ``--list_methods`` only ``list_methods`` and ``method`` are set and nothing else is checked.

    Raises:
        TaskHetError: one line naming the flag (``--n_components``, ``--lr_schedule``, ...) and what it allows.
    """
    return _checked(argv, n_clients, parsers=parsers)[0]


def _checked(argv: list[str], n_clients: int | None = None, prog: str = "test_fed.py", description: str = DESCRIPTION,
             parsers: dict[str, argparse.ArgumentParser] | None = None) -> tuple[argparse.Namespace, RunConfig | None]:
    """:func:`check_arguments`, also returning the run config it checked (None after --list_methods)."""
    argv = list(argv)
    first = cli.ArgumentParser(prog=prog, add_help=False)
    first.add_argument("--method", default="fedavg")
    first.add_argument("--list_methods", action="store_true")
    known, _ = first.parse_known_args(argv)
    if known.list_methods:
        return argparse.Namespace(list_methods=True, method=known.method), None
    settings_class = get_settings_class(known.method)
    parsers = {} if parsers is None else parsers
    if known.method not in parsers:
        parsers[known.method] = build_parser(known.method, prog, description)
    args, unknown = parsers[known.method].parse_known_args(argv)
    if unknown:
        listing = ", ".join(f"--{info.name}" for info in describe(settings_class)) or "none"
        flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")] or unknown
        raise TaskHetError(f"{known.method} has no setting {', '.join(flags)}; its settings: {listing} "
                           f"({prog} --list_methods shows every algorithm's)")
    config = run_config(args)
    check_run(config, n_clients if n_clients is not None else config.n_clients)
    return args, config


def run_config(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` of parsed arguments (its own checks run as it is made)."""
    values = dict(vars(args))
    names = {info.name for info in describe(get_settings_class(args.method))}
    settings = {name: values.pop(name) for name in list(values) if name in names}
    values.pop("list_methods")
    return RunConfig(settings=settings, **values)


def check_run(config: RunConfig, n_clients: int | None) -> None:
    """The checks of :func:`network.run.prepare` that need no file, and those of the algorithm against ``n_clients``
    (None: unknown, skipped)."""
    from models import get_task
    from network.aggregation import client_weights

    get_task(config.task)
    resolve(config.replace(assignments=config.assignments or default_assignments(config)), {})
    make_lr_schedule(config.lr_schedule, config.init_lr, config.n_rounds)
    algorithm = ALGORITHMS.get(config.method)
    settings = build_settings(algorithm.Settings, config.settings, config.method)
    if getattr(settings, "mask_source", None) == "server" and not config.calibration_fraction:
        raise TaskHetError(f"{config.method} --mask_source server needs a held-out calibration split: pass "
                           "--calibration_fraction F (train rows of the manifest that no client holds)")
    if n_clients is None:
        return
    algorithm.check_num_clients(settings, n_clients)
    if getattr(settings, "weighting", None) == "capped":  # the cap must leave shares that sum to 1
        client_weights({str(client): 1 for client in range(n_clients)}, "capped", settings.cap)
    check_flower_counts(config, n_clients)


def check_run_config(config: RunConfig, n_clients: int | None = None) -> RunConfig:
    """:func:`check_arguments` for a run config that came from no command line (a Flower deployment's JSON, which a
    user may edit): every field the range of its flag, then the same checks. Returns ``config``."""
    for action in build_parser(config.method)._actions:
        value = getattr(config, action.dest, None)
        if isinstance(action.type, cli.Range) and value is not None:
            try:
                action.type.check(value)
            except ValueError as error:
                raise TaskHetError(f"--{action.dest} {error}") from None
    check_run(config, n_clients if n_clients is not None else config.n_clients)
    return config


def parse_run_config(argv: list[str] | None, prog: str = "test_fed.py", description: str = DESCRIPTION
                     ) -> RunConfig | None:
    """The checked run config of a command line (None after --list_methods, which prints the algorithms);
    ``prog``/``description``: see :func:`build_parser`. Runtime flags are applied (progress bars, threads)."""
    args, _ = _checked(sys.argv[1:] if argv is None else argv, prog=prog, description=description)
    if args.list_methods:
        print(describe_algorithms())
        return None
    return run_config(cli.apply_runtime_flags(args))


def main(argv: list[str] | None = None) -> dict | None:
    """Run step 4 as ``argv`` asks (None reads sys.argv): every argument is checked first (:func:`check_arguments`),
    before a folder, a lock or a thread count is touched; returns the run folder and its best global test loss."""
    args = check_arguments(sys.argv[1:] if argv is None else argv)
    if args.list_methods:
        print(describe_algorithms())
        return None
    config = run_config(cli.apply_runtime_flags(args))
    from network.run import run  # the heavy part: models, data, engines

    setup = prepare(config)  # reads the inputs only; it also fills in the default --out, which the lock needs
    with folder_lock(setup.config.out):  # one run at a time writes the folder
        return run(setup)
