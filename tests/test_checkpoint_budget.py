"""Checkpoints at the paper's scale: by a time budget, and without the clients' states once a run is over."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from network.engine_config import EngineConfig
from network.lr_schedule import make_lr_schedule
from tests.test_engine import assert_same_weights, make_engine
from tests.test_progress_lines import FakeClock as Clock  # seconds that advance a step at every reading
from utils.errors import TaskHetError
from utils.run_dir import load_checkpoint


def written_rounds(make, monkeypatch, clock: Clock) -> list[int]:
    """The rounds whose checkpoint.pt the engine ``make()`` builds writes, under ``clock``."""
    import network.engine_sequential as sequential

    monkeypatch.setattr(sequential.time, "monotonic", clock)  # before the engine exists: it reads the clock
    engine = make()
    rounds = []
    original = sequential.SequentialEngine._write_checkpoint

    def spy(self, round_index, server, global_weights):
        rounds.append(round_index)
        original(self, round_index, server, global_weights)

    monkeypatch.setattr(sequential.SequentialEngine, "_write_checkpoint", spy)
    engine.run()
    return rounds


def test_a_time_budget_checkpoints_when_the_minutes_have_passed_and_at_the_last_round(tmp_path, monkeypatch):
    # Each monotonic() call advances 25 s; the engine reads it once at start and once per round and write: a
    # checkpoint every 60 s of budget falls on every other or third round, never on every round.
    rounds = written_rounds(lambda: make_engine(tmp_path, "fedavg", rounds=7, checkpoint_minutes=1.0), monkeypatch,
                            Clock(25.0))
    assert rounds[0] == 0 and rounds[-1] == 7 and 1 < len(rounds) < 8
    steps = [b - a for a, b in zip(rounds, rounds[1:])]
    assert all(step >= 2 for step in steps[:-1])  # 25 s a round: two rounds before the minute has passed
    by_rounds = lambda: make_engine(tmp_path / "every", "fedavg", rounds=7, checkpoint_every=3)  # noqa: E731
    assert written_rounds(by_rounds, monkeypatch, Clock(1000.0)) == [0, 3, 6, 7]  # rounds, whatever the clock


def test_checkpoint_minutes_results_equal_every_round(tmp_path):
    budget = make_engine(tmp_path / "budget", "scaffold", rounds=4, checkpoint_minutes=0.001).run()
    every = make_engine(tmp_path / "every", "scaffold", rounds=4).run()
    assert_same_weights(budget, every)


@pytest.mark.parametrize("minutes, every", [(0.0, 1), (-1.0, 1), (5.0, 2)])
def test_a_bad_time_budget_is_one_line(minutes, every):
    with pytest.raises(TaskHetError, match="--checkpoint_minutes must be > 0 and replaces --checkpoint_every"):
        EngineConfig(out_dir=".", n_rounds=1, lr_schedule=lambda r: 0.1, local_steps=1, checkpoint_minutes=minutes,
                     checkpoint_every=every)


def test_a_finished_run_drops_its_client_states_and_refuses_to_train_on(tmp_path):
    engine = make_engine(tmp_path, "scaffold", rounds=3, keep_client_state=False, max_state_memory_bytes=0)
    final = engine.run()
    checkpoint = load_checkpoint(tmp_path / "checkpoint.pt")
    trained = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str}).query("split == 'train' and client != 'mean'")
    assert checkpoint["client_states"] == {} and checkpoint["dropped_client_states"] == trained.client.nunique() >= 3
    assert not (tmp_path / "client_states").exists()  # the spilled c_i are gone too
    again = make_engine(tmp_path, "scaffold", rounds=3, keep_client_state=False, max_state_memory_bytes=0)
    assert_same_weights(again.run(), final)  # the same rounds: nothing to train, the run reads back as it was
    with pytest.raises(TaskHetError, match=r"ended at round 3 and dropped its \d clients' states, so it cannot train "
                                           r"on to round 5; start over with --no-resume"):
        make_engine(tmp_path, "scaffold", rounds=5, keep_client_state=False).run()


def test_a_kept_or_stateless_run_keeps_resuming(tmp_path):
    constant = {"lr_schedule": make_lr_schedule("constant", 0.05, 3)}  # the same lr whatever n_rounds is
    make_engine(tmp_path / "kept", "scaffold", rounds=2, **constant).run()  # the engine's default keeps them
    assert load_checkpoint(tmp_path / "kept" / "checkpoint.pt")["client_states"]
    longer = make_engine(tmp_path / "kept", "scaffold", rounds=3, **constant).run()
    assert_same_weights(longer, make_engine(tmp_path / "straight", "scaffold", rounds=3, **constant).run())
    make_engine(tmp_path / "stateless", "fedavg", rounds=2, keep_client_state=False).run()
    assert load_checkpoint(tmp_path / "stateless" / "checkpoint.pt")["dropped_client_states"] == 0
    assert torch.is_tensor(next(iter(make_engine(tmp_path / "stateless", "fedavg", rounds=3,
                                                 keep_client_state=False).run().values())))
