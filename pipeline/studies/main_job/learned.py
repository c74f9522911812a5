"""Did a task learn anything? Its losses against the trivial predictors step 2 wrote beside the centralized model.

A model that learned nothing can still end with a small loss: on the demo's renders 68% of keypoints2d's target
pixels are 0, so predicting all zeros scores 0.005629 on the test split, and a centralized model at 0.0153 is 2.7
times worse than that. A partition gap measured on such a task compares models that both learned nothing.

Step 2 writes, for every task, the test loss of two predictors that never look at the input
(:func:`training.loop.trivial_predictors`, read back by :func:`pipeline.run_results.trivial_losses`): all zeros,
and the best constant of the training targets under the task's loss (the median for L1 tasks, the class prior for
cross-entropy). The rule here: a task **learned** when the centralized model's test loss, and the mean final test
loss of its federated runs on the iid partition where there are any, each end at least :data:`LEARN_MARGIN` (5%)
below the better (smaller) of the two trivial losses, i.e. ``loss <= (1 - 5/100) * trivial``; exactly 5% below
counts as learned. The relative difference is compared after rounding to :data:`PERCENT_DIGITS` decimals of a
percentage point, so that float rounding (0.95 / 1.0 - 1 computes as -5.000000000000004%) never decides.

Without trivial rows (a step-2 folder made before they were written) there is nothing to compare with, and no
claim is made: :func:`did_not_learn` returns None, as it does for a task that learned. A non-finite centralized or
mean iid loss makes no claim either (it says nothing about learning). The iid losses must be on the same test split
as the trivial predictors': the global model's, never the clients' own models' on their own splits (FedRep).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from partitioning.groupings import IID_REFERENCE

LEARN_MARGIN = 5.0  # % below the better trivial predictor's loss that a task's losses must reach to count as learned
PERCENT_DIGITS = 9  # relative differences in % are compared rounded to 1e-9 percentage points
# How the report names each trivial predictor (pipeline.run_results.trivial_losses's keys).
TRIVIAL_NAMES = {"zero": "all zeros", "median": "training median", "prior": "training class prior"}


def did_not_learn(centralized_loss: float, iid_losses: list[float] | None, trivial: dict[str, float],
                  margin: float = LEARN_MARGIN) -> str | None:
    """None when the task learned (or nothing can say it did not), else why not, in one short clause.

    Args:
        centralized_loss: the centralized model's test loss (the report's reference).
        iid_losses: the final global test losses of the task's federated runs on the iid partition (any algorithms
            and seeds the caller pools; their mean is checked), or None / empty: the centralized loss alone.
        trivial: predictor -> its test loss (:func:`pipeline.run_results.trivial_losses`); empty: no claim.
        margin: in %, how far below the better trivial loss each checked loss must end.

    Returns:
        e.g. ``"centralized 0.0153 (+171.8%) is not 5% below the better trivial predictor (all zeros 0.005629)"``;
        both clauses joined by ``"; "`` when the iid mean fails too.
    """
    finite = {name: loss for name, loss in trivial.items() if math.isfinite(loss)}
    if not finite:
        return None
    name = min(finite, key=finite.get)  # the better trivial predictor; on a tie the first of them
    best = finite[name]
    checked = [("centralized", centralized_loss)]
    if iid_losses:
        runs = f"{len(iid_losses)} run" + ("s" if len(iid_losses) > 1 else "")
        checked.append((f"the iid federated mean over {runs}", sum(iid_losses) / len(iid_losses)))
    reasons = [f"{what} {loss:.4g} ({_change(loss, best)}) is not {margin:g}% below the better trivial predictor "
               f"({TRIVIAL_NAMES.get(name, name)} {best:.4g})"
               for what, loss in checked if math.isfinite(loss) and not _below_by(loss, best, margin)]
    return "; ".join(reasons) or None


def _below_by(loss: float, trivial: float, margin: float) -> bool:
    """Whether ``loss`` is at least ``margin`` % below ``trivial`` (never, when the trivial loss is 0: nothing is below)."""
    if trivial <= 0:
        return False
    return round(100.0 * (loss / trivial - 1.0), PERCENT_DIGITS) <= -margin


def _change(loss: float, trivial: float) -> str:
    return f"{100.0 * (loss / trivial - 1.0):+.1f}%" if trivial > 0 else "the trivial loss is 0"


def best_constant(trivial: dict[str, float]) -> float:
    """The loss of the best constant predictor step 2 measured (training median or class prior; NaN if none)."""
    constants = [loss for name, loss in trivial.items() if name != "zero"]
    return min(constants) if constants else np.nan


def learning_failures(finals: pd.DataFrame, centralized: dict[str, float],
                      trivial: dict[str, dict[str, float]]) -> dict[str, str]:
    """Task -> why it did not learn (:func:`pipeline.studies.main_job.learned.did_not_learn`), for the tasks whose
    centralized model or whose iid federated global models do not beat the better trivial predictor by the margin."""
    iid = finals[(finals.grouping == IID_REFERENCE) & (finals.model == "global")]
    failures = {}
    for task, reference in centralized.items():
        losses = list(iid[iid.task == task].loss)
        reason = did_not_learn(reference, losses or None, trivial.get(task, {}))
        if reason:
            failures[task] = reason
    return failures


def trivial_markdown(centralized: dict[str, float], trivial: dict[str, dict[str, float]],
                     failures: dict[str, str]) -> str:
    """Per task: the centralized reference beside the trivial predictors' test losses, and whether the task learned."""
    lines = ["| task | centralized (mean over seeds) | all zeros | best constant | learned? |", "|---|---|---|---|---|"]
    for task in sorted(centralized):
        losses = trivial.get(task, {})
        constant = " / ".join(f"{TRIVIAL_NAMES.get(name, name)} {loss:.4g}" for name, loss in losses.items()
                              if name != "zero") or "–"
        zero = f"{losses['zero']:.4g}" if "zero" in losses else "–"
        verdict = f"**no**: {failures[task]}" if task in failures else ("yes" if losses else "not measured")
        lines.append(f"| {task} | {centralized[task]:.4g} | {zero} | {constant} | {verdict} |")
    return "\n".join(lines)


def trivial_section(centralized: dict[str, float], trivial: dict[str, dict[str, float]],
                    failures: dict[str, str]) -> list[str]:
    """The report's "Trivial predictors" section: what they are, the rule, and :func:`trivial_markdown`'s table."""
    return ["## Trivial predictors", "",
            "Each task's test loss under two predictors that look at no image: the all-zero map and the best "
            "constant of the training targets (step 2 measures both with the task's own loss and masks). A task "
            f"whose centralized model or whose iid federated global models do not end at least {LEARN_MARGIN:g}% "
            "below the better of the two did not learn, and its rows are kept out of the headline.", "",
            trivial_markdown(centralized, trivial, failures), ""]
