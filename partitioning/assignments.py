"""assignments.csv and its assignments.json sidecar (DESIGN.md §3): write, read, validate.

assignments.csv has one row per assigned sample: ``sample_id, client_id, group, subset``
(``subset`` is ``train`` or ``test``: the client-train / client-test split), plus the optional
schedule columns ``from_round, to_round`` of temporal skew (``partitioning/temporal.py``). The sidecar
records how the file was made (scheme, alpha, seed, n_clients, source files and their
sha256) and, with step 3b's ``--unseen_fraction``, the clients held out of all training
(``unseen_clients``, :func:`draw_unseen_clients`). A user may edit the CSV between steps;
:func:`load_assignments` checks an edited file against the manifest and names every problem row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from partitioning.temporal import FROM_ROUND, SCHEDULE_COLUMNS, overlapping, parse_windows
from utils.hashing import file_sha256
from utils.cli import floats
from utils.errors import TaskHetError
from utils.loaders import int_column, load_json, read_csv
from utils.run_dir import atomic_write_text
from utils.seeding import numpy_rng

COLUMNS = ("sample_id", "client_id", "group", "subset")
SUBSETS = ("train", "test")
# The most clients a partition may have (--n_clients of steps 3b and 4, a sidecar's n_clients, the client ids of
# assignments.csv: 0..MAX_CLIENTS-1). Benchmarks use 1,000; per-client tables and loops stay small at 10,000, and an
# id beyond it is a typo or an overflow, never a federation.
MAX_CLIENTS = 10_000
# Dirichlet α (--alpha of steps 3b and 4, a sidecar's alpha): 10^6 is iid for any data set here. It names folders
# (a{α}), so a sidecar's must be a number too.
MAX_ALPHA = 1e6
ALPHAS = floats(0.0, MAX_ALPHA, low_open=True)
# The largest cluster id a clusters file may name (groups only label samples: no table is as large as the ids).
MAX_CLUSTER_ID = 2**31
# An error message lists at most this many rows per kind of problem (and the total count).
MAX_LISTED = 50
# The sidecar's record of unseen clients (step 3b's --unseen_fraction): the ids no step-4 run trains on, and the share.
UNSEEN_KEY, UNSEEN_FRACTION_KEY = "unseen_clients", "unseen_fraction"
UNSEEN_FRACTIONS = floats(0.0, 1.0, high_open=True)  # at least one client must stay in the federation


def sidecar_path(csv_path: Path) -> Path:
    """``assignments.json`` next to ``assignments.csv``."""
    return Path(csv_path).with_suffix(".json")


def source_record(path: Path) -> dict[str, str]:
    """``{"path", "sha256"}`` of an input file, for the sidecar."""
    return {"path": str(Path(path)), "sha256": file_sha256(Path(path))}


def write_assignments(csv_path: Path, table: pd.DataFrame, meta: dict[str, Any]) -> None:
    """Write assignments.csv (rows sorted by client, then sample id) and its sidecar.

    Args:
        csv_path: where assignments.csv goes; the sidecar gets the ``.json`` suffix.
        table: the columns of :data:`COLUMNS`.
        meta: JSON-serialisable record (scheme, alpha, seed, n_clients, sources, ...).
    """
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"assignments table lacks columns {missing}")
    schedule = [column for column in SCHEDULE_COLUMNS if column in table.columns]  # partitioning/temporal.py
    ordered = table[list(COLUMNS) + schedule].sort_values(["client_id", "sample_id", *schedule[:1]], kind="stable")
    atomic_write_text(Path(csv_path), ordered.to_csv(index=False))
    atomic_write_text(sidecar_path(csv_path), json.dumps(meta, indent=2, sort_keys=True, default=str))


def read_assignments(csv_path: Path) -> pd.DataFrame:
    """Read assignments.csv, checking columns and cell formats.

    Returns:
        DataFrame with :data:`COLUMNS` (``client_id`` int64, the others str), the schedule's ``from_round`` and
        ``to_round`` when the file has either (int64; a blank cell: 1 and ``partitioning.temporal.NO_END``) and a
        ``row`` column: the line number in the file (the header is line 1).

    Raises:
        TaskHetError: a missing file or column, or rows with a bad cell (all named).
    """
    csv_path = Path(csv_path)
    table = read_csv(csv_path, "assignments file", COLUMNS, finished=True, hint="make it with make_client_assignments.py",
                     dtype=str, keep_default_na=False)
    if table.empty:
        raise TaskHetError(f"assignments file {csv_path} has a header but no rows")
    table = table[list(COLUMNS) + [column for column in SCHEDULE_COLUMNS if column in table.columns]].copy()
    table["row"] = np.arange(len(table)) + 2
    problems = []
    blank_id = table["sample_id"].str.strip() == ""
    problems.append(_describe(table, blank_id, "empty sample_id"))
    client = pd.to_numeric(table["client_id"], errors="coerce")
    # Checked as floats before any cast, so 1e30 cannot wrap; the bound keeps the per-client checks below small.
    bad_client = ~np.isfinite(client) | (client < 0) | (client != client.round()) | (client >= MAX_CLIENTS)
    problems.append(_describe(table, bad_client, f"client_id is not an integer in [0, {MAX_CLIENTS - 1}]"))
    problems.append(_describe(table, ~table["subset"].isin(SUBSETS), f"subset not in {SUBSETS}"))
    _raise_if_any(csv_path, problems)
    table["client_id"] = client.astype(np.int64)
    return parse_windows(table, str(csv_path))


def read_meta(csv_path: Path) -> dict[str, Any]:
    """The sidecar's record, or an empty dict when there is none (a hand-written file)."""
    path = sidecar_path(csv_path)
    if not path.is_file():
        return {}
    meta = load_json(path, "assignments sidecar")
    if not isinstance(meta, dict):
        raise TaskHetError(f"assignments sidecar {path} must hold a JSON object, got {type(meta).__name__}")
    n_clients = meta.get("n_clients")
    if n_clients is not None and (isinstance(n_clients, bool) or not isinstance(n_clients, int)
                                  or not 1 <= n_clients <= MAX_CLIENTS):
        raise TaskHetError(f"assignments sidecar {path}: n_clients must be an integer in [1, {MAX_CLIENTS}], "
                           f"got {n_clients!r}")
    alpha = meta.get("alpha")
    if alpha is not None:  # step 4 names its default run folder after it
        try:
            ALPHAS.check(alpha)
        except ValueError as error:
            raise TaskHetError(f"assignments sidecar {path}: alpha {error} (or null)") from None
    return meta


def validate_assignments(table: pd.DataFrame, manifest: pd.DataFrame, n_clients: int | None, source: str) -> None:
    """Check assignments against the manifest; one TaskHetError naming every problem row.

    Problems: a sample id not in the manifest, an id on two rows, a train row from the
    manifest's test split (no client trains on the global test set; a client-test row may
    come from it: step 3b's ``--client_tests test_split``), a client id
    outside ``0..n_clients-1``, and a client with no train rows (rows named) or no rows
    at all (client named).

    Args:
        table: from :func:`read_assignments` (with its ``row`` column).
        manifest: the step-1 manifest (``sample_id``, ``split``).
        n_clients: expected number of clients (from the sidecar); None: the largest id + 1.
        source: the file name used in the message.
    """
    split_of = manifest.set_index("sample_id")["split"]
    known = table["sample_id"].isin(split_of.index)
    problems = [_describe(table, ~known, "unknown sample id (not in the manifest)")]
    # A schedule may hold a sample again in a later, disjoint window (partitioning/temporal.py); never twice at once.
    repeated = overlapping(table) if FROM_ROUND in table.columns else table["sample_id"].duplicated(keep=False)
    problems.append(_describe(table, repeated, "duplicated sample id (held twice in one round)"))
    in_test = known & (table["sample_id"].map(split_of) == "test") & (table["subset"] == "train")
    problems.append(_describe(table, in_test, "train row from the manifest's test split"))
    expected = int(table["client_id"].max()) + 1 if n_clients is None else int(n_clients)
    problems.append(_describe(table, table["client_id"] >= expected, f"client_id >= n_clients ({expected})"))
    train_rows = table["subset"] == "train"
    clients_with_rows = set(table["client_id"].unique().tolist())
    no_train = sorted(clients_with_rows - set(table.loc[train_rows, "client_id"].unique().tolist()))
    problems.append(_describe(table, table["client_id"].isin(no_train), "client with no train samples"))
    empty = sorted(set(range(expected)) - clients_with_rows)
    if empty:
        listed = ", ".join(map(str, empty[:MAX_LISTED])) + (f" ... ({len(empty)} in all)" if len(empty) > MAX_LISTED else "")
        problems.append(f"empty clients (no rows): {listed}")
    _raise_if_any(Path(source), problems)


def load_assignments(csv_path: Path, manifest: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read assignments.csv and its sidecar, and validate them against the manifest.

    Returns:
        ``(table, meta)``: the table of :func:`read_assignments`, the sidecar record; a sidecar's ``unseen_clients``
        is checked (:func:`check_unseen_clients`) and comes back as a sorted list of ints.
    """
    table = read_assignments(csv_path)
    meta = read_meta(csv_path)
    validate_assignments(table, manifest, meta.get("n_clients"), str(csv_path))
    if UNSEEN_KEY in meta:
        n_clients = meta.get("n_clients") or int(table["client_id"].max()) + 1
        meta[UNSEEN_KEY] = check_unseen_clients(meta[UNSEEN_KEY], n_clients, sidecar_path(csv_path))
    return table, meta


def unseen_count(fraction: float, n_clients: int) -> int:
    """How many of ``n_clients`` clients ``--unseen_fraction fraction`` holds out: ``round(fraction · n_clients)``
    (Python's round, half to even, as ``--client_fraction`` counts its clients); 0 for a fraction of 0.

    Raises:
        TaskHetError: a fraction outside [0, 1) or not finite, one that rounds to no client (the option would do
            nothing) or to every client (none would be left to train).
    """
    try:
        UNSEEN_FRACTIONS.check(fraction)
    except ValueError as error:
        raise TaskHetError(f"--unseen_fraction {error}") from None
    count = round(fraction * n_clients)
    if fraction and count == 0:
        raise TaskHetError(f"--unseen_fraction {fraction:g} of {n_clients} clients holds out round({fraction * n_clients:g}) "
                           f"= 0 clients; give more than {0.5 / n_clients:.3g}, or 0 for none")
    if count >= n_clients:
        raise TaskHetError(f"--unseen_fraction {fraction:g} of {n_clients} clients holds out all {count} of them; at "
                           "least one client must stay in the federation to train")
    return count


def draw_unseen_clients(fraction: float, n_clients: int, seed: int) -> list[int]:
    """The ids step 3b holds out as unseen clients, sorted: the first :func:`unseen_count` of a permutation of
    0..n_clients−1 drawn from the generator ``numpy_rng(seed, "unseen_clients")``.

    The generator is the option's own (the partition, the client tests and the schedule never see it), so
    assignments.csv is the same for every fraction; and the draw is nested: a larger fraction at the same seed and
    number of clients holds out the smaller one's clients and more.
    """
    count = unseen_count(fraction, n_clients)
    if not count:
        return []
    return sorted(int(client) for client in numpy_rng(seed, UNSEEN_KEY).permutation(n_clients)[:count])


def check_unseen_clients(value: Any, n_clients: int, source: Path) -> list[int]:
    """A sidecar's ``unseen_clients`` (a user may edit it): distinct integer client ids in [0, n_clients), leaving at
    least one client in the federation. Returns them sorted.

    Raises:
        TaskHetError: one line naming the sidecar, the key and the first bad id.
    """
    where = f"assignments sidecar {source}: {UNSEEN_KEY}"
    if not isinstance(value, list):
        raise TaskHetError(f"{where} must be a list of client ids, got {value!r}")
    for client in value:
        if isinstance(client, bool) or not isinstance(client, int) or not 0 <= client < n_clients:
            raise TaskHetError(f"{where}: {client!r} is not a client id of this partition, an integer in "
                               f"[0, {n_clients - 1}]")
    seen: set[int] = set()
    for client in value:
        if client in seen:
            raise TaskHetError(f"{where} lists client {client} twice")
        seen.add(client)
    if len(value) >= n_clients:
        raise TaskHetError(f"{where} holds out all {n_clients} clients; at least one must stay in the federation")
    return sorted(value)


def _describe(table: pd.DataFrame, bad: pd.Series, what: str) -> str:
    if not bad.any():
        return ""
    rows = table.loc[bad, ["row", "sample_id"]]
    listed = ", ".join(f"row {row} ({sample_id!r})" for row, sample_id in rows.head(MAX_LISTED).itertuples(index=False))
    more = f" ... ({len(rows)} rows in all)" if len(rows) > MAX_LISTED else ""
    return f"{what}: {listed}{more}"


def _raise_if_any(source: Path, problems: list[str]) -> None:
    problems = [p for p in problems if p]
    if problems:
        raise TaskHetError(f"{source}: " + "; ".join(problems))


def resolve_groups(manifest: pd.DataFrame, groups: str, extra_ids: Iterable[str] = ()) -> tuple[pd.Series, Path | None]:
    """The group of every manifest row, from a manifest column or a clusters CSV.

    Args:
        manifest: the step-1 manifest rows to group.
        extra_ids: other sample ids a clusters file may list (step 3b passes the test and validation rows).
        groups: a manifest column name (the family's label column, e.g. ``scene_class``: label-based) or the path of a
            ``clusters.csv`` with ``sample_id, cluster`` (embedding-based).

    Returns:
        ``(group per manifest row, the clusters file or None)``; integer-like groups
        come back as int64 so that they sort numerically (2 before 10).

    Raises:
        TaskHetError: neither a column nor a file, or a file that misses manifest samples.
    """
    if groups in manifest.columns:
        return _numeric_if_integer(manifest[groups]), None
    path = Path(groups)
    if not path.is_file() and not path.is_dir():
        raise TaskHetError(f"--groups {groups!r} is neither a manifest column ({', '.join(manifest.columns)}) nor an existing clusters CSV")
    clusters = read_csv(path, "--groups clusters file", ("sample_id", "cluster"), finished=True, dtype=str,
                        keep_default_na=False)
    known = clusters["sample_id"].isin(manifest["sample_id"]) | clusters["sample_id"].isin(extra_ids)
    if not known.all():
        row = int(np.flatnonzero(~known.to_numpy())[0])
        raise TaskHetError(f"{path}: row {row + 2} has sample_id {clusters['sample_id'].iloc[row]!r}, which is not in "
                           f"the manifest ({int((~known).sum())} unknown rows); was it made from this manifest?")
    int_column(clusters, "cluster", str(path), low=0, high=MAX_CLUSTER_ID)
    duplicated = clusters["sample_id"].duplicated()
    if duplicated.any():
        raise TaskHetError(f"{path}: sample id {clusters.loc[duplicated, 'sample_id'].iloc[0]!r} appears twice (row {int(np.flatnonzero(duplicated)[0]) + 2})")
    cluster_of = clusters.set_index("sample_id")["cluster"]
    mapped = manifest["sample_id"].map(cluster_of)
    if mapped.isna().any():
        missing = manifest.loc[mapped.isna(), "sample_id"]
        raise TaskHetError(f"{path}: has no cluster for {len(missing)} manifest samples, e.g. {missing.iloc[0]!r}; was it made from this manifest?")
    return _numeric_if_integer(mapped), path


def _numeric_if_integer(values: pd.Series) -> pd.Series:
    numbers = pd.to_numeric(values, errors="coerce")
    if numbers.notna().all() and (numbers == numbers.round()).all():
        return numbers.astype(np.int64)
    return values.astype(str)


def assignments_table(sample_ids: np.ndarray, groups: np.ndarray, client_of: np.ndarray, is_test: np.ndarray) -> pd.DataFrame:
    """The assignments.csv rows of the assigned samples (unused ones are left out).

    Args:
        sample_ids, groups: [n_samples] per partitioned sample.
        client_of: int [n_samples], ``-1`` for unused.
        is_test: bool [n_samples], client-test samples.
    """
    held = client_of >= 0
    return pd.DataFrame(
        {
            "sample_id": np.asarray(sample_ids)[held],
            "client_id": client_of[held],
            "group": np.asarray(groups)[held],
            "subset": np.where(is_test[held], "test", "train"),
        }
    )
