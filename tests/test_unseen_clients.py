"""Unseen clients (step 3b's --unseen_fraction): held out of all training, evaluated after their own adaptation.

Step 3b records them in assignments.json without changing assignments.csv; step 4 never samples, trains or
aggregates them (a run with them equals, bit for bit, a run on the seen clients alone) and writes the
``unseen_test*`` splits; the heterogeneity study's report gives seen and unseen columns. Bad inputs are one line.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from partitioning.assignments import (UNSEEN_FRACTION_KEY, UNSEEN_KEY, draw_unseen_clients, load_assignments,
                                      unseen_count, write_assignments)
from steps import assign
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.cli import run_main
from utils.errors import TaskHetError


# ----- step 3b: the option and its record -----
def step3b(manifest, out, *extra):
    return assign.main(["--manifest", str(manifest), "--n_clients", "4", "--scheme", "iid", "--seed", "3",
                        "--no-progress", "--out", str(out), *extra])


def test_fraction_zero_is_the_partition_of_today_and_a_fraction_changes_only_the_sidecar(tiny_manifest, tmp_path):  # noqa: F811
    """F = 0 writes byte for byte what a run without the flag writes; F = 0.5 writes the same assignments.csv and a
    sidecar that differs only by the two unseen keys."""
    without, zero, half = (step3b(tiny_manifest, tmp_path / name, *extra) for name, extra in
                           (("without", ()), ("zero", ("--unseen_fraction", "0")), ("half", ("--unseen_fraction", "0.5"))))
    for name in ("assignments.csv", "assignments.json", "client_stats.csv", "metrics.csv", "unused_samples.csv"):
        assert (without.parent / name).read_bytes() == (zero.parent / name).read_bytes(), name
    assert without.read_bytes() == half.read_bytes()
    plain, held = (json.loads(path.with_suffix(".json").read_text()) for path in (without, half))
    assert UNSEEN_KEY not in plain and UNSEEN_FRACTION_KEY not in plain
    assert {key: value for key, value in held.items() if key not in (UNSEEN_KEY, UNSEEN_FRACTION_KEY)} == plain
    # round(0.5 · 4) = 2 clients, the first two of the seeded permutation of 0..3.
    expected = sorted(np.random.default_rng(_derived(3)).permutation(4)[:2].tolist())
    assert held[UNSEEN_KEY] == expected and held[UNSEEN_FRACTION_KEY] == 0.5
    assert "--unseen_fraction 0.5: clients " + ", ".join(map(str, expected)) in (half.parent / "run.log").read_text()


def _derived(seed: int) -> int:
    """utils.seeding.derive_seed(seed, "unseen_clients"), written out: SHA-256 of "seed/unseen_clients", 63 bits."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}/unseen_clients".encode()).digest()[:8], "little") >> 1


def test_the_draw_counts_by_round_is_nested_and_seeded():
    assert [unseen_count(fraction, 10) for fraction in (0.0, 0.1, 0.25, 0.35, 0.9)] == [0, 1, 2, 4, 9]  # half to even
    small, large = draw_unseen_clients(0.2, 50, seed=1), draw_unseen_clients(0.6, 50, seed=1)
    assert len(small) == 10 and len(large) == 30 and set(small) <= set(large)
    assert small == draw_unseen_clients(0.2, 50, seed=1) != draw_unseen_clients(0.2, 50, seed=2)
    assert draw_unseen_clients(0.0, 50, seed=1) == []


@pytest.mark.parametrize("value, words", [("1", "[0, 1)"), ("nan", "[0, 1)"), ("1e30", "[0, 1)"), ("-0.1", "[0, 1)"),
                                          ("0.05", "= 0 clients"), ("0.9", "all 4 of them")])
def test_a_bad_fraction_is_one_error_line_naming_the_flag(tiny_manifest, tmp_path, capsys, value, words):  # noqa: F811
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        run_main(assign.main, ["--manifest", str(tiny_manifest), "--n_clients", "4", "--out", str(out),
                               "--unseen_fraction", value])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:")
    assert "--unseen_fraction" in lines[0] and words in lines[0] and not out.exists()


def write_partition(folder, unseen, n_clients=3, rows_per_client=4):
    """Clients 0..n_clients-1 with ``rows_per_client`` train rows and one test row each; ``unseen`` goes to the
    sidecar as it is (None: no key)."""
    ids = [f"s{index}" for index in range(n_clients * (rows_per_client + 1))]
    table = pd.DataFrame({"sample_id": ids, "client_id": [index // (rows_per_client + 1) for index in range(len(ids))],
                          "group": 0, "subset": ["test" if index % (rows_per_client + 1) == rows_per_client
                                                 else "train" for index in range(len(ids))]})
    meta = {"scheme": "hand", "n_clients": n_clients, **({} if unseen is None else {UNSEEN_KEY: unseen})}
    path = folder / "assignments.csv"
    write_assignments(path, table, meta)
    return path, pd.DataFrame({"sample_id": ids, "split": "train"})


@pytest.mark.parametrize("unseen, words", [([3], "3 is not a client id"), ([-1], "-1 is not a client id"),
                                           ([1, 1], "lists client 1 twice"), ([0, 1, 2], "holds out all 3"),
                                           ("1", "must be a list"), ([True], "True is not a client id"),
                                           ([1.0], "1.0 is not a client id"), ([10**30], "is not a client id")])
def test_a_bad_sidecar_list_is_one_error_naming_the_sidecar_and_key(tmp_path, unseen, words):
    path, manifest = write_partition(tmp_path, unseen)
    with pytest.raises(TaskHetError) as error:
        load_assignments(path, manifest)
    message = str(error.value)
    assert "\n" not in message and "assignments.json" in message and UNSEEN_KEY in message and words in message


def test_a_good_sidecar_list_comes_back_sorted(tmp_path):
    path, manifest = write_partition(tmp_path, [2, 0], n_clients=4)
    assert load_assignments(path, manifest)[1][UNSEEN_KEY] == [0, 2]
