"""Step 3b: assign the manifest's train samples to federated clients.

Inputs: manifest.csv (step 1) and the groups to skew: a manifest column (by
default the data family's label column, e.g. ``scene_class``: label-based) or a
clusters.csv (step 3: embedding-based).
Outputs in --out: assignments.csv (sample_id, client_id, group, subset; with
--temporal also from_round, to_round) with its assignments.json sidecar,
client_stats.csv, client_group_heatmap.png (and client_schedule_heatmap.png with
--temporal), unused_samples.csv, metrics.csv, config.json, run.log.
Every client's Jensen–Shannon and Hellinger distances to the pooled mixture are
reported over the labels and, given the clusters (--groups or --distance_groups a
clusters.csv), over the embedding clusters: client_stats.csv's label_* and
cluster_* columns, assignments.json's "distances".
--unseen_fraction F holds out round(F x n_clients) of the clients from all training: assignments.csv is the same
as without it, and assignments.json lists them ("unseen_clients"); step 4 evaluates them after their own adaptation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from datasets.family import load_manifest, validation_mask
from partitioning.allocation import SIZE_SKEW_HELP, parse_size_skew
from partitioning.assignments import (ALPHAS, MAX_CLIENTS, UNSEEN_FRACTION_KEY, UNSEEN_FRACTIONS, UNSEEN_KEY,
                                     assignments_table, draw_unseen_clients, resolve_groups, source_record,
                                     unseen_count, write_assignments)
from partitioning.client_tests import (CLIENT_TESTS, DEFAULT_TEST_FRACTION, HELD_OUT, TEST_SPLIT, client_test_mask,
                                       deal_test_split)
from partitioning.partition import get_partitioner, list_schemes, scheme_parameters
from partitioning.partition_stats import (DISTANCES, client_stats, mean_distances, partition_distances, phase_stats,
                                         plot_heatmap, plot_schedule)
from partitioning.skew_record import check_skew_settings, draw_skews, skew_columns, skew_summary
from partitioning.skews import SKEWS_KEY, SkewContext
from partitioning.temporal import (FROM_ROUND, NO_END, ROUNDS, TEMPORAL_HELP, TO_ROUND, TemporalSpec, check_schedule_size,
                                   parse_temporal, phase_windows, schedule_table)
from steps.skew_flags import add_skew_flags, skew_settings
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.run_dir import claim_folder, run_log, unfinished, write_config

from utils.seeding import numpy_rng

STEP = "step 3b"
CLIENTS = cli.ints(1, MAX_CLIENTS)
# Groups per client (shards): a client × group slot table is drawn, so both factors are bounded.
MAX_GROUPS_PER_CLIENT = 1_000
TEST_FRACTIONS = cli.floats(0.0, 1.0, high_open=True)  # a client keeps some rows to train on


def build_parser() -> argparse.ArgumentParser:
    """The step-3b command line (make_client_assignments.py --help)."""
    parser = cli.ArgumentParser(description=__doc__, formatter_class=cli.DefaultsHelpFormatter)
    parser.add_argument("--manifest", type=Path, required=True,
                        help="step-1 manifest.csv; only its train split is partitioned, without its validation rows (val = 1)")
    parser.add_argument("--groups", default=None, help="a manifest column or a step-3 clusters.csv (default: the data family's label column)")
    parser.add_argument("--distance_groups", default=None,
                        help="a step-3 clusters.csv (or a manifest column) to measure every client's embedding-space "
                             "distances over (client_stats.csv's cluster_* columns); default: --groups when it is a "
                             "clusters file, else none. Label-space distances (label_*) are always measured")
    parser.add_argument("--scheme", default="dirichlet_mixture", choices=list_schemes())
    parser.add_argument("--alpha", type=ALPHAS, default=None, help="Dirichlet concentration (Dirichlet schemes; scheme default 1.0)")
    parser.add_argument("--n_clients", type=CLIENTS, default=10, help="clients of the partition")
    parser.add_argument("--size_skew", default=None, help=f"quantity skew: {SIZE_SKEW_HELP} (default: equal sizes)")
    parser.add_argument("--groups_per_client", type=cli.ints(1, MAX_GROUPS_PER_CLIENT), default=None,
                        help="shards: groups per client (scheme default 2)")
    parser.add_argument("--client_tests", choices=CLIENT_TESTS, default=HELD_OUT,
                        help="where each client's test rows come from: held_out (a share of its own train rows, "
                             "--client_test_fraction) or test_split (the manifest's test rows, dealt to the clients in "
                             "proportion to their train rows of each group; every client trains on all of its rows)")
    parser.add_argument("--client_test_fraction", type=TEST_FRACTIONS, default=None,
                        help=f"--client_tests held_out: share of each client's samples held out as client-test "
                             f"(default {DEFAULT_TEST_FRACTION})")
    parser.add_argument("--min_client_size", type=cli.ints(1, cli.MAX_SAMPLES), default=1,
                        help="fewest samples a client may hold")
    parser.add_argument("--temporal", default=None,
                        help=f"temporal skew (a schedule in assignments.csv): {TEMPORAL_HELP} "
                             "(default: none, every row held every round)")
    parser.add_argument("--n_rounds", type=ROUNDS, default=None,
                        help="with --temporal: the step-4 run's rounds; rotate repeats its phases up to it (default: "
                             "each phase once, the last one to the end)")
    parser.add_argument("--unseen_fraction", type=UNSEEN_FRACTIONS, default=0.0, metavar="F",
                        help="hold out round(F x n_clients) clients, drawn from the seed, from all training: step 4 never "
                             "samples, trains or aggregates them and evaluates them after their own adaptation (splits "
                             "unseen_test*); assignments.csv is unchanged, assignments.json lists them as "
                             "unseen_clients (default: 0, none)")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="root seed of the partition, the client tests, the "
                                                                  "schedule, the skews and the unseen clients")
    add_skew_flags(parser)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    cli.add_runtime_flags(parser)
    cli.add_plots_flag(parser, "client_group_heatmap.png (with --temporal also client_schedule_heatmap.png)",
                       "client_stats.csv and assignments.csv")
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Partition the manifest's train samples over clients and write assignments.csv with its statistics.

    Args:
        argv: command-line arguments; None reads sys.argv.

    Returns:
        The path of the assignments.csv written.
    """
    args = cli.apply_runtime_flags(check_arguments(sys.argv[1:] if argv is None else list(argv)))
    with folder_lock(args.out):  # one run at a time writes the folder
        return assign_clients(args)


def check_arguments(argv: list[str]) -> argparse.Namespace:
    """Parse step 3b's command line and make every check the step makes from its arguments alone.

    No file is read (neither the manifest nor a clusters file), nothing is written and no thread count is set:
    :func:`main` calls this first, and a caller such as the pipeline may call it to refuse a bad partition before
    any step runs. Checked: every number's range and its ASCII digits (each flag's ``--help`` names its range);
    ``--client_tests`` against ``--client_test_fraction``; the scheme's parameters (``--alpha``,
    ``--groups_per_client``, ``--min_client_size``, ``--size_skew``; ``Partitioner.check_parameters``); ``--temporal``
    and its phases against ``--n_rounds``, and the size of its schedule; every skew flag (``--feature_noise`` σ,
    ``--feature_shift`` names and magnitudes such as ``blur=99``, ``--label_swap`` pairs such as ``0-0``,
    ``--target_variant`` names against the tasks that have a variant, ``--concept_fraction``); ``--unseen_fraction``
    against ``--n_clients`` (at least one client held out, at least one left to train).
    What needs the data stays with :func:`main`: the manifest's classes and tasks, enough samples for the clients.

    Args:
        argv: the command line, as ``make_client_assignments.py`` takes it.

    Returns:
        The parsed arguments (``client_test_fraction`` filled in from its default).

    Raises:
        TaskHetError: one line naming the flag (``--feature_noise``, ``--temporal``, ...) and what it allows.
    """
    args = build_parser().parse_args(argv)
    resolve_client_tests(args)
    parse_size_skew(args.size_skew)  # a scheme that ignores it still refuses a malformed value
    given = scheme_arguments(args)
    accepted = scheme_parameters(args.scheme)
    get_partitioner(args.scheme, args.n_clients, **{k: v for k, v in given.items() if k in accepted}).check_parameters()
    spec = parse_temporal(args.temporal)
    if spec is not None:
        phase_windows(spec, args.n_rounds)
        check_schedule_size(spec, args.n_clients, args.n_rounds)
    check_skew_settings(skew_settings(args), args.n_clients)
    unseen_count(args.unseen_fraction, args.n_clients)  # rounds to at least one client held out and one kept
    return args


def scheme_arguments(args: argparse.Namespace) -> dict:
    """The flags a scheme may take, those given (None: not given)."""
    given = {"alpha": args.alpha, "size_skew": args.size_skew, "groups_per_client": args.groups_per_client,
             "min_client_size": args.min_client_size, "seed": args.seed}
    return {name: value for name, value in given.items() if value is not None}


def resolve_client_tests(args: argparse.Namespace) -> None:
    """Fill in --client_test_fraction's default; a fraction beside --client_tests test_split is one error."""
    if args.client_tests == TEST_SPLIT and args.client_test_fraction is not None:
        raise TaskHetError("--client_test_fraction holds out train rows, which --client_tests test_split never does: "
                           "give one of the two")
    if args.client_tests == HELD_OUT and args.client_test_fraction is None:
        args.client_test_fraction = DEFAULT_TEST_FRACTION


def assign_clients(args: argparse.Namespace) -> Path:
    """Partition and write, holding the lock of ``args.out`` (see :func:`main`)."""
    claim_folder(args.out, STEP)
    family, manifest = load_manifest(args.manifest)
    # Validation rows (cifar's val = 1) select models: no client trains on them.
    train = manifest[(manifest["split"] == "train") & ~validation_mask(manifest)].reset_index(drop=True)
    if train.empty:
        raise TaskHetError(f"{args.manifest}: has no train rows to partition")
    args.groups = args.groups or family.label_column
    # A folder family's manifest may hold no labels or sources (no groups.csv): one line, not a silent one-group split.
    if args.groups == family.label_column and args.scheme not in ("iid", "natural"):
        family.require_values(manifest, args.groups, f"--groups {args.groups} (manifest {args.manifest})")
    if args.scheme == "natural" and family.source_column:
        family.require_values(manifest, family.source_column, f"--scheme natural (manifest {args.manifest})")
    # --client_tests test_split deals the test rows to the clients: their groups are resolved with the train rows'
    # (one call, so both come back as the same type). A clusters file covers every sample step 3 embedded.
    test = (manifest[(manifest["split"] == "test") & ~validation_mask(manifest)].reset_index(drop=True)
            if args.client_tests == TEST_SPLIT else None)
    grouped = train if test is None else pd.concat([train, test], ignore_index=True)
    other_ids = manifest.loc[~manifest["sample_id"].isin(grouped["sample_id"]), "sample_id"]
    all_groups, groups_file = resolve_groups(grouped, args.groups, extra_ids=other_ids)
    groups = all_groups.iloc[:len(train)].reset_index(drop=True)
    if test is not None:
        test = test.assign(group=all_groups.iloc[len(train):].to_numpy())
    skews = draw_skews(skew_settings(args), SkewContext(family.name, family.num_classes(manifest), tuple(family.tasks),
                                                        args.n_clients), args.seed)
    spaces = distance_spaces(args, train, family.label_column, groups, groups_file, manifest["sample_id"])
    args.out.mkdir(parents=True, exist_ok=True)
    write_config(args.out, vars(args), step=STEP)
    with run_log(args.out) as logger:
        with unfinished(args.out, STEP):  # step 4 refuses an assignments.csv of a run that did not finish
            return write_partition(args, family, train, groups, groups_file, logger, skews, test, spaces)


def write_partition(args: argparse.Namespace, family, train: pd.DataFrame, groups: pd.Series, groups_file: Path | None,
              logger, skews: dict | None = None, test: pd.DataFrame | None = None,
              spaces: dict[str, tuple[str, pd.Series]] | None = None) -> Path:
    """Split ``train`` over clients and write every output of the step; returns assignments.csv.

    ``skews``: the per-client skews drawn by :func:`partitioning.skew_record.draw_skews`, recorded in the sidecar.
    ``test``: with ``--client_tests test_split``, the manifest's test rows with their ``group``: dealt to the clients
    as their test rows (:func:`partitioning.client_tests.deal_test_split`).
    ``spaces``: what the distances are measured over (:func:`distance_spaces`); None: none."""
    given = scheme_arguments(args)
    accepted = scheme_parameters(args.scheme)
    for name in sorted(k for k in given if k not in accepted):
        logger.warning("--%s is not used by scheme %r; ignored", name, args.scheme)
    partitioner = get_partitioner(args.scheme, args.n_clients, **{k: v for k, v in given.items() if k in accepted})
    # Only the natural scheme reads sources; it names the problem when a family has none.
    sources = train[family.source_column].to_numpy() if family.source_column else None
    partition = partitioner.split(groups.to_numpy(), sources=sources)
    table = assignment_rows(args, train, groups, partition.client_of, test)
    spec, phases = parse_temporal(args.temporal), None
    if spec is None and args.n_rounds is not None:
        logger.warning("--n_rounds only shapes a --temporal schedule; ignored")
    if spec is not None:  # after the label and quantity skew: one compound partition
        table, phases = schedule_table(table, spec, args.n_rounds, numpy_rng(args.seed, "temporal"))
    sources = {"manifest": source_record(args.manifest)}
    if groups_file is not None:
        sources["groups"] = source_record(groups_file)
    meta = {
        "scheme": args.scheme, "alpha": getattr(partitioner, "alpha", None), "seed": args.seed, "n_clients": args.n_clients,
        "groups": args.groups, "parameters": partitioner.get_params(), "client_test_fraction": args.client_test_fraction,
        "client_tests": args.client_tests,
        "sources": sources, "n_train_samples": len(train), "n_assigned": int(len(table)),
        "n_unused": int(partition.unused.size), "client_labels": partition.client_labels,
        "temporal": None if spec is None else {**spec.as_dict(), "n_rounds": args.n_rounds},
    }
    if skews:
        meta[SKEWS_KEY] = skews
    unseen = draw_unseen_clients(args.unseen_fraction, args.n_clients, args.seed)
    if unseen:  # without the option the sidecar stays as it was, key for key
        meta.update({UNSEEN_FRACTION_KEY: args.unseen_fraction, UNSEEN_KEY: unseen})
    distances = {space: partition_distances(partition.client_of, values.to_numpy(), args.n_clients, space)
                 for space, (_, values) in (spaces or {}).items()}
    meta[DISTANCES_KEY] = distances_record(distances, spaces or {})
    write_assignments(args.out / "assignments.csv", table, meta)
    train.loc[partition.unused, ["sample_id"]].assign(group=groups.to_numpy()[partition.unused]).to_csv(args.out / "unused_samples.csv", index=False)

    stats = client_stats(partition.client_of, groups.to_numpy(), args.n_clients)
    stats = stats.assign(**skew_columns(skews or {}, args.n_clients))  # new columns after the existing ones
    if spec is not None:
        stats = stats.merge(phase_stats(table, phases, args.n_clients), on="client_id")
    stats = stats.assign(**distance_columns(distances, args.n_clients))  # after every other column
    stats.to_csv(args.out / "client_stats.csv", index=False)
    if args.plots:
        if spec is not None:
            write_schedule_plot(args, table, phases, spec)
        alpha = "" if meta["alpha"] is None else f", α={meta['alpha']:g}"  # iid and the shard schemes have none
        title = f"{args.scheme}{alpha}; groups: {Path(args.groups).name}" + (f"; skews: {', '.join(skews)}" if skews else "")
        plot_heatmap(stats, args.out / "client_group_heatmap.png", title,
                     row_notes=[skew_summary(skews, client) for client in range(args.n_clients)] if skews else None)
    summary = {
        "n_assigned": len(table), "n_unused": int(partition.unused.size), "n_client_test": int((table["subset"] == "test").sum()),
        "client_size_min": int(stats["size"].min()), "client_size_max": int(stats["size"].max()),
        "mean_js_divergence": float(stats["js_divergence"].mean()), "mean_effective_groups": float(stats["effective_groups"].mean()),
    }
    for space, table_of_space in distances.items():
        summary.update(mean_distances(table_of_space, space))
    pd.DataFrame({"metric": list(summary), "value": list(summary.values())}).to_csv(args.out / "metrics.csv", index=False)
    logger.info("%d train samples -> %d clients (%d unused, listed in unused_samples.csv); mean JS divergence %.3f, "
                "mean effective groups %.2f; wrote %s", len(train), args.n_clients, summary["n_unused"],
                summary["mean_js_divergence"], summary["mean_effective_groups"], args.out / "assignments.csv")
    for space in distances:
        logger.info("%s-space distance to the pooled mixture, mean over clients: JS %.3f, Hellinger %.3f", space,
                    summary[f"mean_{space}_js_distance"], summary[f"mean_{space}_hellinger"])
    if unseen:
        logger.info("--unseen_fraction %g: clients %s are held out of all training (assignments.json's %s); step 4 "
                    "evaluates them after their own adaptation", args.unseen_fraction, ", ".join(map(str, unseen)),
                    UNSEEN_KEY)
    return args.out / "assignments.csv"


DISTANCES_KEY = "distances"  # assignments.json's block of client-to-pooled distances
LABEL_SPACE, CLUSTER_SPACE = "label", "cluster"  # the spaces distances are measured in: column prefixes and keys


def distance_spaces(args: argparse.Namespace, train: pd.DataFrame, label_column: str, groups: pd.Series,
                    groups_file: Path | None, manifest_ids: pd.Series) -> dict[str, tuple[str, pd.Series]]:
    """What step 3b measures distances over: ``{space: (source, value per train row)}``.

    ``label``: the manifest's label column, always. ``cluster``: the embedding clusters, from ``--distance_groups``
    when given, else from ``--groups`` when it is a clusters file (an embedding-based partition), else absent: a
    label-based partition knows no clusters unless the pipeline passes step 3's clusters.csv.

    Raises:
        TaskHetError: a ``--distance_groups`` that is neither a manifest column nor a clusters file covering the
            train rows (the message names the flag and the file's row).
    """
    spaces = {LABEL_SPACE: (label_column, train[label_column])}
    if args.distance_groups is not None:
        try:
            # a clusters file covers every sample step 3 embedded: any manifest id may be listed
            values, path = resolve_groups(train, args.distance_groups, extra_ids=manifest_ids)
        except TaskHetError as error:  # resolve_groups speaks of --groups; this file came with --distance_groups
            raise TaskHetError(str(error).replace("--groups", "--distance_groups")) from None
        spaces[CLUSTER_SPACE] = (str(path if path is not None else args.distance_groups), values)
    elif groups_file is not None:
        spaces[CLUSTER_SPACE] = (str(groups_file), groups)
    return spaces


def distance_columns(distances: dict[str, pd.DataFrame], n_clients: int) -> dict[str, np.ndarray]:
    """client_stats.csv's distance columns: ``<space>_<kind>`` for both spaces; a space without groups (no clusters)
    is blank, so every client_stats.csv has the same header."""
    return {f"{space}_{kind}": (distances[space][f"{space}_{kind}"].to_numpy() if space in distances
                                else np.full(n_clients, np.nan))
            for space in (LABEL_SPACE, CLUSTER_SPACE) for kind in DISTANCES}


def distances_record(distances: dict[str, pd.DataFrame], spaces: dict[str, tuple[str, pd.Series]]) -> dict:
    """assignments.json's ``distances`` block (docs/DESIGN.md §3, "assignments.json's distances").

    ``label`` and ``cluster`` (None without clusters) each hold ``groups`` (the manifest column or clusters file),
    ``mean_js_distance`` and ``mean_hellinger`` (unweighted means over the clients) and the per-client lists
    ``js_distance`` and ``hellinger`` (client 0 first; None for a client without samples). ``js_gap`` and
    ``hellinger_gap`` are the cluster mean minus the label mean (None without clusters): > 0 when label-space
    distances under-state the heterogeneity the embedding clusters show.
    """
    record: dict = {"definition": "each client's group mixture against the pooled mixture, both over the "
                                  "partitioned train rows (held-out client-test rows included; test-split rows "
                                  "dealt to clients are not); "
                                  "js_distance: sqrt of the base-2 Jensen-Shannon divergence; hellinger: "
                                  "(1/sqrt 2)*||sqrt p - sqrt q||_2; both in [0, 1]; means unweighted over clients"}
    for space in (LABEL_SPACE, CLUSTER_SPACE):
        if space not in distances:
            record[space] = None
            continue
        table, means = distances[space], mean_distances(distances[space], space)
        record[space] = {"groups": spaces[space][0],
                         **{f"mean_{kind}": _json_number(means[f"mean_{space}_{kind}"]) for kind in DISTANCES},
                         **{kind: [_json_number(value) for value in table[f"{space}_{kind}"]] for kind in DISTANCES}}
    for kind in DISTANCES:
        record[f"{kind.removesuffix('_distance')}_gap"] = (
            None if record[CLUSTER_SPACE] is None or record[LABEL_SPACE][f"mean_{kind}"] is None
            or record[CLUSTER_SPACE][f"mean_{kind}"] is None
            else record[CLUSTER_SPACE][f"mean_{kind}"] - record[LABEL_SPACE][f"mean_{kind}"])
    return record


def _json_number(value: float) -> float | None:
    """A float for JSON: NaN (a client without samples) becomes null, which every JSON reader takes."""
    return None if np.isnan(value) else float(value)


def assignment_rows(args: argparse.Namespace, train: pd.DataFrame, groups: pd.Series, client_of: np.ndarray,
                    test: pd.DataFrame | None) -> pd.DataFrame:
    """assignments.csv's rows before any schedule: the partitioned train rows, a share of each client's own rows
    marked client-test (``test`` None: held_out), or all of them trained on and ``test``'s rows dealt as client tests."""
    ids, group_of, rng = train["sample_id"].to_numpy(), groups.to_numpy(), numpy_rng(args.seed, "client_test")
    if test is None:
        return assignments_table(ids, group_of, client_of, client_test_mask(client_of, args.client_test_fraction, rng))
    test_client_of = deal_test_split(client_of, group_of, test["group"].to_numpy(), rng)
    return pd.concat([assignments_table(ids, group_of, client_of, np.zeros(len(train), dtype=bool)),
                      assignments_table(test["sample_id"].to_numpy(), test["group"].to_numpy(), test_client_of,
                                        np.ones(len(test), dtype=bool))], ignore_index=True)


def write_schedule_plot(args: argparse.Namespace, table: pd.DataFrame, phases: np.ndarray, spec: TemporalSpec) -> None:
    """client_schedule_heatmap.png: the phase and train rows each client holds per round, up to --n_rounds (or one
    phase past the last change)."""
    is_train = (table["subset"] == "train").to_numpy()
    train = table[is_train]
    starts = train[FROM_ROUND].fillna(1).to_numpy(dtype=np.int64)
    ends = train[TO_ROUND].fillna(NO_END).to_numpy(dtype=np.int64)
    last = args.n_rounds or int(starts.max() + max(spec.phase_rounds, 1))
    plot_schedule(starts, ends, train["client_id"].to_numpy(dtype=np.int64), phases[is_train], args.n_clients, last,
                  args.out / "client_schedule_heatmap.png", f"--temporal {args.temporal}")
