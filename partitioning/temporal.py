"""Temporal skew: which rows a client holds from which round (step 3b writes it, step 4 reads it).

**The schedule in assignments.csv.** Two optional columns, ``from_round`` and ``to_round``: the
first and last round (inclusive, rounds count from 1) in which a client holds that row; a blank cell
means "from the start" / "to the end". A file without the columns, or with every cell blank, is the
static partition it always was. A sample may appear on several rows (the same client again later, or
another client) as long as its windows never overlap: no sample is held twice in one round.
Client-test rows carry no window: a client's test set is fixed over the run, so its ``client_test``
numbers compare across rounds (the global test set never changes either).

**The generators** (``--temporal``), applied after the label and quantity skew of any scheme, so that
one step-3b call makes a compound partition:

* ``rotate:P:L``: each client's train rows, ordered by group (groups in a random order per client,
  rows at random within a group), are cut into P contiguous blocks of near-equal size: its phases.
  Phase p is held in rounds p·L+1 … (p+1)·L, so the client's group mixture moves through its groups
  phase by phase. With ``--n_rounds N`` the phases repeat (cycle length P·L) up to round N; without it
  each phase comes once and the last one stays to the end.
* ``abrupt:R``: the same cut into two blocks; the first is held in rounds 1 … R−1, the second from
  round R on (to ``--n_rounds`` when given): the mixture changes at once at round R.

Both draw from ``numpy_rng(seed, "temporal")`` only, so a temporal partition keeps the label/quantity
partition of the same seed exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from utils.cli import ints
from utils.errors import TaskHetError

FROM_ROUND, TO_ROUND = "from_round", "to_round"
SCHEDULE_COLUMNS = (FROM_ROUND, TO_ROUND)
FIRST_ROUND = 1  # round 0 evaluates the initial model only: nobody trains in it
NO_END = np.iinfo(np.int64).max  # a blank to_round, in memory
TEMPORAL_KINDS = ("rotate", "abrupt")
# The most rounds a federated run may have (--n_rounds of steps 3b and 4) and so the latest round a schedule may
# name: the paper runs 100; 10,000 keeps every per-round array and loop small.
MAX_ROUNDS = 10_000
MAX_PHASES = 1_000  # rotate's PHASES: each is a block of every client's rows
ROUNDS = ints(FIRST_ROUND, MAX_ROUNDS)
PHASES = ints(2, MAX_PHASES)
CHANGE_ROUNDS = ints(FIRST_ROUND + 1, MAX_ROUNDS)  # abrupt:ROUND; round 1 is the first that trains
# The schedule plot holds a phases × clients × rounds count table; a larger one is refused before anything is drawn.
MAX_SCHEDULE_CELLS = 10**8
# A schedule lists a row once per window of its phase; more rows than this is refused before the table is built.
MAX_SCHEDULED_ROWS = 5 * 10**7
TEMPORAL_HELP = (f"rotate:PHASES:ROUNDS_PER_PHASE (PHASES an integer in {PHASES}, ROUNDS_PER_PHASE in {ROUNDS}) or "
                 f"abrupt:ROUND (ROUND an integer in {CHANGE_ROUNDS})")
# An error message lists at most this many rows per kind of problem (and the total count).
MAX_LISTED = 20


@dataclass(frozen=True)
class TemporalSpec:
    """A parsed ``--temporal``: ``kind`` ("rotate" or "abrupt"), phases, rounds per phase, change round."""

    kind: str
    phases: int
    phase_rounds: int = 0  # rotate: rounds each phase lasts
    change_round: int = 0  # abrupt: the first round of the second phase

    def as_dict(self) -> dict[str, int | str]:
        return {"kind": self.kind, "phases": self.phases, "phase_rounds": self.phase_rounds,
                "change_round": self.change_round}


def parse_temporal(text: str | None) -> TemporalSpec | None:
    """Parse ``--temporal`` (:data:`TEMPORAL_HELP`): ``rotate:PHASES:ROUNDS_PER_PHASE`` or ``abrupt:ROUND``, each
    number ASCII digits in its range; None for a static partition."""
    if text is None:
        return None
    kind, *values = str(text).split(":")
    arity = {"rotate": 2, "abrupt": 1}
    if kind not in arity or len(values) != arity[kind]:
        raise TaskHetError(f"--temporal {text!r}: use {TEMPORAL_HELP}, e.g. rotate:3:5 or abrupt:10")
    if kind == "rotate":
        phases = PHASES.read(values[0], f"--temporal {text!r}: PHASES")
        rounds = ROUNDS.read(values[1], f"--temporal {text!r}: ROUNDS_PER_PHASE")
        last_start = FIRST_ROUND + (phases - 1) * rounds
        if last_start > MAX_ROUNDS:
            raise TaskHetError(f"--temporal {text!r}: the last phase would start at round {last_start}, after the "
                               f"{MAX_ROUNDS} rounds a run may have; use fewer or shorter phases")
        return TemporalSpec("rotate", phases, phase_rounds=rounds)
    change = CHANGE_ROUNDS.read(values[0], f"--temporal {text!r}: the change ROUND (round 1 is the first that trains)")
    return TemporalSpec("abrupt", 2, change_round=change)


def check_schedule_size(spec: TemporalSpec, n_clients: int, n_rounds: int | None) -> None:
    """Refuse a schedule whose plot table (phases × clients × rounds shown) would exceed :data:`MAX_SCHEDULE_CELLS`;
    every number here is a flag, so step 3b refuses it before any work."""
    shown = n_rounds or schedule_horizon(spec)
    cells = spec.phases * n_clients * shown
    if cells > MAX_SCHEDULE_CELLS:
        raise TaskHetError(f"--temporal {spec.kind} with {spec.phases} phases, --n_clients {n_clients} and {shown} "
                           f"rounds makes a schedule of {cells:,} phase × client × round cells (at most "
                           f"{MAX_SCHEDULE_CELLS:,}); use fewer phases, clients or rounds")


def schedule_horizon(spec: TemporalSpec) -> int:
    """The rounds a schedule without --n_rounds shows: one phase past its last change."""
    last_start = spec.change_round if spec.kind == "abrupt" else FIRST_ROUND + (spec.phases - 1) * spec.phase_rounds
    return last_start + max(spec.phase_rounds, 1)


def client_phases(client_of: np.ndarray, group_codes: np.ndarray, n_phases: int, rng: np.random.Generator) -> np.ndarray:
    """The phase of every row: each client's rows ordered by group (a random group order per client, rows at
    random inside a group) and cut into ``n_phases`` contiguous blocks of near-equal size.

    Args:
        client_of: int [n] client per row (rows to schedule only: train rows).
        group_codes: int [n] group code 0..G-1 per row.
        n_phases: P >= 2.

    Returns:
        int64 [n] in 0..P-1. A client of size s gets phase sizes ⌊s/P⌋ or ⌈s/P⌉ (all P non-empty when s >= P).
    """
    client_of, group_codes = np.asarray(client_of, dtype=np.int64), np.asarray(group_codes, dtype=np.int64)
    if client_of.size == 0:
        return np.zeros(0, dtype=np.int64)
    n_clients, n_groups = int(client_of.max()) + 1, int(group_codes.max()) + 1
    # Rank of each group in each client's own random order ([K, G] random keys, argsorted twice).
    group_rank = np.argsort(np.argsort(rng.random((n_clients, n_groups)), axis=1), axis=1)
    cell = client_of * n_groups + group_rank[client_of, group_codes]  # sorts by client, then the client's group order
    order = _order_with_random_ties(cell, rng)
    sizes = np.bincount(client_of, minlength=n_clients)
    position = np.empty(client_of.size, dtype=np.int64)
    position[order] = np.arange(client_of.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return position * n_phases // sizes[client_of]


def _order_with_random_ties(keys: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The indices that sort int ``keys``, rows of equal key in a uniformly random order.

    Why not ``np.lexsort((rng.random(n), keys))``: packing (key, random bits, row) into one int64 and sorting the
    values is several times faster at 1M rows (bench/bench_compound.py); two equal draws (rare) keep row order.
    With fewer than 20 random bits left (huge keys or row counts) it falls back to the lexsort.
    """
    n = keys.size
    row_bits, key_bits = max(int(n - 1).bit_length(), 1), max(int(keys.max(initial=0)).bit_length(), 1)
    random_bits = 63 - row_bits - key_bits
    if random_bits < 20:
        return np.lexsort((rng.random(n), keys))
    draws = rng.integers(0, 1 << random_bits, n, dtype=np.int64)
    packed = (keys.astype(np.int64) << (random_bits + row_bits)) | (draws << row_bits) | np.arange(n, dtype=np.int64)
    return np.sort(packed) & ((1 << row_bits) - 1)


def phase_windows(spec: TemporalSpec, n_rounds: int | None) -> list[list[tuple[int, int]]]:
    """Per phase, its windows ``(from_round, to_round)`` (inclusive; ``NO_END``: to the end).

    Raises:
        TaskHetError: a phase that would start after ``n_rounds``.
    """
    if spec.kind == "abrupt":
        starts, length = [FIRST_ROUND, spec.change_round], None
    else:
        starts, length = [FIRST_ROUND + p * spec.phase_rounds for p in range(spec.phases)], spec.phase_rounds
    if n_rounds is not None and starts[-1] > n_rounds:
        raise TaskHetError(f"--temporal: phase {len(starts) - 1} would start at round {starts[-1]}, after --n_rounds "
                           f"{n_rounds}; shorten the phases or raise --n_rounds")
    end = NO_END if n_rounds is None else n_rounds
    if length is None:  # abrupt: two windows, no repeats
        return [[(starts[0], starts[1] - 1)], [(starts[1], end)]]
    cycle = spec.phases * length
    windows = []
    for p, start in enumerate(starts):
        if n_rounds is None:  # one pass; the last phase stays
            windows.append([(start, start + length - 1 if p < spec.phases - 1 else NO_END)])
        else:
            windows.append([(s, min(s + length - 1, n_rounds)) for s in range(start, n_rounds + 1, cycle)])
    return windows


def schedule_rows(phase: np.ndarray, spec: TemporalSpec, n_rounds: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Expand rows with phases into scheduled rows: one per (row, window of its phase).

    Returns:
        ``(source_row, from_round, to_round)``: int64 arrays; ``source_row`` indexes ``phase``.
    """
    windows = phase_windows(spec, n_rounds)
    counts = np.array([len(w) for w in windows], dtype=np.int64)
    total = int(counts[phase].sum()) if phase.size else 0
    if total > MAX_SCHEDULED_ROWS:
        raise TaskHetError(f"--temporal: the schedule would list {total:,} rows ({phase.size:,} train rows, each once "
                           f"per window of its phase); at most {MAX_SCHEDULED_ROWS:,}: lengthen the phases or lower "
                           "--n_rounds")
    flat = np.array([window for phase_windows_ in windows for window in phase_windows_], dtype=np.int64).reshape(-1, 2)
    first = np.cumsum(counts) - counts
    repeats = counts[phase]
    source = np.repeat(np.arange(phase.size), repeats)
    within = np.arange(source.size) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    window = first[phase[source]] + within
    return source, flat[window, 0], flat[window, 1]


def schedule_table(table: pd.DataFrame, spec: TemporalSpec, n_rounds: int | None,
                   rng: np.random.Generator) -> tuple[pd.DataFrame, np.ndarray]:
    """assignments.csv rows with a schedule: train rows get their phases' windows, test rows none.

    Args:
        table: ``sample_id, client_id, group, subset`` (``partitioning.assignments.assignments_table``).

    Returns:
        ``(table with from_round / to_round as nullable Int64 (blank = NA), phase per row (-1 for test rows))``.
    """
    train = (table["subset"] == "train").to_numpy()
    _, group_codes = np.unique(table["group"].to_numpy()[train], return_inverse=True)
    phase = client_phases(table["client_id"].to_numpy()[train], group_codes, spec.phases, rng)
    source, starts, ends = schedule_rows(phase, spec, n_rounds)
    train_rows = table[train].iloc[source].reset_index(drop=True)
    # Blank cells (nullable Int64's NA) where a window is open: the file reads "always" there.
    train_rows[FROM_ROUND] = pd.arrays.IntegerArray(starts, starts == FIRST_ROUND)
    train_rows[TO_ROUND] = pd.arrays.IntegerArray(np.where(ends == NO_END, 0, ends), ends == NO_END)
    n_test = int((~train).sum())
    blank = pd.arrays.IntegerArray(np.zeros(n_test, dtype=np.int64), np.ones(n_test, dtype=bool))
    test_rows = table[~train].reset_index(drop=True).assign(**{FROM_ROUND: blank, TO_ROUND: blank.copy()})
    phases = np.concatenate([phase[source], np.full(len(test_rows), -1, dtype=np.int64)])
    return pd.concat([train_rows, test_rows], ignore_index=True), phases


# ----- reading and checking a (possibly hand-edited) schedule -----
def has_schedule(table: pd.DataFrame) -> bool:
    """True when a table carries a real schedule (a window that is not "always")."""
    if not all(column in table.columns for column in SCHEDULE_COLUMNS):
        return False
    return bool(((table[FROM_ROUND] != FIRST_ROUND) | (table[TO_ROUND] != NO_END)).any())


def parse_windows(table: pd.DataFrame, source: str) -> pd.DataFrame:
    """Turn the optional schedule columns of a read assignments table (str cells) into int64 rounds.

    Blank ``from_round`` becomes 1, blank ``to_round`` :data:`NO_END` (a file with only one of the columns gets
    the other as all blank); a file with neither comes back unchanged. ``table`` needs its ``row`` column
    (file line numbers).

    Raises:
        TaskHetError: one message naming the file and every bad row and column: a cell that is not an
            integer in [1, MAX_ROUNDS] (NaN, inf, 2.5, text, 1e30), an empty window (to_round < from_round), a window on a
            client-test row. (A sample held twice in one round is the assignments check's "duplicated sample
            id": ``partitioning.assignments.validate_assignments`` with :func:`overlapping`.)
    """
    if not any(column in table.columns for column in SCHEDULE_COLUMNS):
        return table  # a static partition: the table stays as it always was
    problems = []
    for column, blank in ((FROM_ROUND, FIRST_ROUND), (TO_ROUND, NO_END)):
        if column not in table.columns:
            table[column] = blank
            continue
        text = table[column].astype(str).str.strip()
        values = pd.to_numeric(text.where(text != ""), errors="coerce")
        given = text != ""
        bad = given & (~np.isfinite(values) | (values != values.round()) | (values < FIRST_ROUND) | (values > MAX_ROUNDS))
        problems.append(_rows(table, bad, f"column {column}: not an integer in {ROUNDS} (blank = "
                                          f"{'from the start' if column == FROM_ROUND else 'to the end'})"))
        rounds = np.full(len(table), blank, dtype=np.int64)
        good = (given & ~bad).to_numpy()
        rounds[good] = values.to_numpy()[good].astype(np.int64)
        table[column] = rounds
    problems.append(_rows(table, table[TO_ROUND] < table[FROM_ROUND], f"columns {FROM_ROUND}/{TO_ROUND}: empty window "
                                                                     f"({TO_ROUND} before {FROM_ROUND})"))
    windowed = (table[FROM_ROUND] != FIRST_ROUND) | (table[TO_ROUND] != NO_END)
    problems.append(_rows(table, windowed & (table["subset"] == "test"),
                          f"columns {FROM_ROUND}/{TO_ROUND}: a window on a client-test row (test rows are held for the "
                          "whole run; leave both cells blank)"))
    problems = [p for p in problems if p]
    if problems:
        raise TaskHetError(f"{source}: " + "; ".join(problems))
    return table


def overlapping(table: pd.DataFrame) -> pd.Series:
    """Rows whose sample also appears on another row with a window that overlaps theirs."""
    repeated = table["sample_id"].duplicated(keep=False)
    bad = pd.Series(False, index=table.index)
    if not repeated.any():
        return bad
    rows = table.loc[repeated, ["sample_id", FROM_ROUND, TO_ROUND]].sort_values(["sample_id", FROM_ROUND], kind="stable")
    same = rows["sample_id"].to_numpy()[1:] == rows["sample_id"].to_numpy()[:-1]
    # Sorted by start: a window overlaps an earlier one iff it starts before the latest end seen so far.
    latest_end = rows.groupby("sample_id", sort=False)[TO_ROUND].cummax().to_numpy()
    clash = same & (rows[FROM_ROUND].to_numpy()[1:] <= latest_end[:-1])
    bad.loc[rows.index[1:][clash]] = True
    bad.loc[rows.index[:-1][clash]] = True
    return bad


def check_horizon(table: pd.DataFrame, n_rounds: int, source: str) -> None:
    """Refuse a schedule that names a round after ``n_rounds``, or a round 1..n_rounds in which no client holds
    a train row (it could train nobody). ``table`` comes from :func:`parse_windows`."""
    if not has_schedule(table):
        return
    problems = [_rows(table, table[FROM_ROUND] > n_rounds, f"column {FROM_ROUND}: round beyond --n_rounds {n_rounds}"),
                _rows(table, (table[TO_ROUND] != NO_END) & (table[TO_ROUND] > n_rounds),
                      f"column {TO_ROUND}: round beyond --n_rounds {n_rounds}")]
    problems = [p for p in problems if p]
    if problems:
        raise TaskHetError(f"{source}: " + "; ".join(problems))
    train = table[table["subset"] == "train"]
    held = np.zeros(n_rounds + 2, dtype=np.int64)  # +1 at a start, -1 after an end: a running sum counts rows held
    np.add.at(held, np.minimum(train[FROM_ROUND].to_numpy(), n_rounds + 1), 1)
    np.add.at(held, np.minimum(train[TO_ROUND].to_numpy(), n_rounds) + 1, -1)
    empty = np.flatnonzero(np.cumsum(held)[FIRST_ROUND:n_rounds + 1] == 0) + FIRST_ROUND
    if empty.size:
        raise TaskHetError(f"{source}: no client holds a train row in round(s) "
                           f"{', '.join(map(str, empty[:MAX_LISTED]))}{' ...' if empty.size > MAX_LISTED else ''} "
                           f"of --n_rounds {n_rounds}; every round needs someone to train")


def _rows(table: pd.DataFrame, bad: pd.Series, what: str) -> str:
    if not bad.any():
        return ""
    rows = table.loc[bad, ["row", "sample_id"]]
    listed = ", ".join(f"row {row} ({sample_id!r})" for row, sample_id in rows.head(MAX_LISTED).itertuples(index=False))
    return f"{what}: {listed}" + (f" ... ({len(rows)} rows in all)" if len(rows) > MAX_LISTED else "")
