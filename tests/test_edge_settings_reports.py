"""Report rules at their edges, by hand: ties in the heterogeneity toolbox's winners and practitioners'-table verdicts
(equal means, and several recommended methods whose comparisons come out differently), and the round-0 rows of a
temporally scheduled run with fine-tuning (round 0 fine-tunes on the rows of round 1, at round 1's learning rate)."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from network import engine_sequential
from network.client import FINETUNED_TEST_SPLIT
from network.engine_sequential import SequentialEngine
from network.lr_schedule import make_lr_schedule
from pipeline.studies.heterogeneity_toolbox import Row, table_verdict, winner
from tests.test_temporal import CPU, engine_parts, expected_rows, with_clock
from tests.test_toolbox_report import runs_frame
from tests.tiny_models import evaluate, loss_fn

# Values whose sums are exact in binary, so equal multisets give bit-equal means (0.7 + 0.8 + 0.9 is not 0.8 + 0.9
# + 0.7 in floating point, and a tie would be decided by rounding).
ONE_WAY, OTHER_WAY = [0.5, 0.75, 0.25], [0.25, 0.5, 0.75]
SEVERE = Row("severe skew", ("fedem",), "personal")
MODERATE = Row("moderate skew", ("fedprox", "scaffold"), "personal")


# ----- winners: an exact tie of the best mean goes to the method listed first in the runs -----
def test_a_tied_best_mean_goes_to_the_method_listed_first():
    found = winner(runs_frame({"fedprox": ONE_WAY, "fedavg": OTHER_WAY}), "personal")
    assert found.method == "fedprox" and found.runner_up == "fedavg" and found.mean == 0.5
    assert found.vs_baseline.mean == 0.0 and not found.vs_baseline.decided  # +0.25, +0.25, −0.5: holds 0
    found = winner(runs_frame({"fedavg": OTHER_WAY, "fedprox": ONE_WAY}), "personal")
    assert found.method == "fedavg" and found.vs_baseline is None and found.runner_up == "fedprox"


# ----- verdicts: a recommended method tied with the best -----
def test_a_recommended_method_listed_first_in_a_tie_has_the_best_mean():
    verdict = table_verdict(runs_frame({"fedem": ONE_WAY, "local": ONE_WAY}), SEVERE)
    assert verdict.outcome == "agrees" and verdict.detail == "fedem has the best mean 50.0%"


def test_a_recommended_method_whose_mean_ties_the_best_on_varying_seeds_has_the_best_mean():
    verdict = table_verdict(runs_frame({"local": OTHER_WAY, "fedem": ONE_WAY}), SEVERE)
    # local − fedem per seed: −0.25, −0.25, +0.5: the means tie exactly, whichever is listed first.
    assert verdict.outcome == "agrees" and verdict.detail == "fedem has the best mean 50.0%"


def test_a_recommended_method_tied_with_the_best_on_every_seed_has_the_best_mean_in_either_order():
    verdict = table_verdict(runs_frame({"local": ONE_WAY, "fedem": ONE_WAY}), SEVERE)
    assert verdict.outcome == "agrees" and verdict.detail == "fedem has the best mean 50.0%"


# ----- verdicts: several recommended methods; one tie with the best is enough, then the undecidable ones -----
DECIDEDLY_BELOW = [0.5, 0.52, 0.5]  # best − it: +0.25, +0.23, +0.25 against the best below
BEST = [0.75, 0.75, 0.75]


@pytest.mark.parametrize("recommended, outcome, start, listed, unlisted", [
    # fedprox decidedly below, scaffold's interval holds 0 (+0.25, −0.25, +0.25): one tie suffices
    ({"fedprox": DECIDEDLY_BELOW, "scaffold": [0.5, 1.0, 0.5]}, "agrees", "not decidedly below the best, local",
     "scaffold", "fedprox"),
    # fedprox's interval holds 0 and scaffold has two seeds only: the tie decides, the untestable one does not matter
    ({"fedprox": [0.5, 1.0, 0.5], "scaffold": [0.5, 0.5]}, "agrees", "not decidedly below the best, local",
     "fedprox", "scaffold"),
    # fedprox decidedly below, scaffold on two seeds only: not testable, so no verdict
    ({"fedprox": DECIDEDLY_BELOW, "scaffold": [0.5, 0.5]}, "undecided", "best local 75.0%",
     "scaffold 50.0%, best − it: +25.0 pts, undecided: 2 paired seeds, 3 needed", None),
    # both decidedly below
    ({"fedprox": DECIDEDLY_BELOW, "scaffold": [0.25, 0.3, 0.25]}, "disagrees", "local 75.0% is decidedly better",
     "scaffold", None),
])
def test_several_recommended_methods_one_tie_agrees_else_an_untestable_one_leaves_it_undecided(
        recommended, outcome, start, listed, unlisted):
    verdict = table_verdict(runs_frame({"local": BEST, **recommended}), MODERATE)
    assert verdict.outcome == outcome and verdict.detail.startswith(start)
    assert listed in verdict.detail and (unlisted is None or unlisted not in verdict.detail)
    if outcome == "undecided":  # the decided one is listed too, after the undecidable ones
        assert verdict.detail.index("scaffold") < verdict.detail.index("fedprox")


# ----- round 0 of a temporally scheduled run with fine-tuning -----
def test_round_0_fine_tunes_each_client_on_its_rows_of_round_1_at_round_1s_learning_rate(tmp_path, monkeypatch):
    """The temporal tests' four scheduled clients (client 3 holds rows in round 1 and from round 3 on), 2 rounds,
    evaluated after rounds 0 and 2 with 2 fine-tuning steps."""
    monkeypatch.setattr(engine_sequential, "plot_curves", lambda *_: None)  # the plot is most of the run's time
    model, algorithm, clients, test, config, log, clock = engine_parts(tmp_path)
    # exponential:0.5 from 0.05: round 1 trains at 0.05, round 2 at 0.025; "round 0" would be 0.1.
    config = dataclasses.replace(config, n_rounds=2, eval_every=2, finetune_steps=2,
                                 lr_schedule=make_lr_schedule("exponential:0.5", 0.05, 2))
    engine = SequentialEngine(model, algorithm, clients, loss_fn, evaluate, test, config, CPU)
    with_clock(engine, clock)
    engine.run()
    metrics = pd.read_csv(tmp_path / "metrics.csv", dtype={"client": str})
    finetuned = metrics[(metrics.split == FINETUNED_TEST_SPLIT) & (metrics.metric == "loss")
                        & metrics.client.isin(["0", "1", "2", "3"])]
    # Every client holds rows in round 1, so round 0 (fine-tuned on them) lists all four; client 3 holds none in
    # round 2, so it has no fine-tuned row there.
    assert finetuned.groupby("round").client.apply(sorted).to_dict() == {0: ["0", "1", "2", "3"], 2: ["0", "1", "2"]}
    read_in_round_0 = sorted({row for clock_round, row in log if clock_round == 0})  # only fine-tuning reads then
    assert read_in_round_0 == sorted(row for client in range(4) for row in expected_rows(client, 1))
    assert [engine.finetune(round_index).lr for round_index in (0, 1, 2)] == [0.05, 0.05, 0.025]


def test_the_second_of_several_recommended_methods_may_have_the_best_mean():
    verdict = table_verdict(runs_frame({"local": BEST, "fedprox": DECIDEDLY_BELOW, "scaffold": [1.0, 1.0, 1.0]}),
                            MODERATE)
    assert verdict.outcome == "agrees" and verdict.detail == "scaffold has the best mean 100.0%"
