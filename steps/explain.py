"""The quadratic explainer: FedAvg's fixed-point bias against η²E²G², on quadratics with closed forms.

K = 4 clients in R⁴, client k with loss ½ (x − s·e_k)ᵀ (I + 3 e_k e_kᵀ) (x − s·e_k) (the worked
example; s from --scales, 1 by default among them), and an IID control in which every client
holds the global loss. FedAvg runs E full-batch local steps of size η per round with every
client (network/quadratic_explainer.py). Outputs in --out:
explainer.csv (one row per case: G², η²E²G², the closed-form fixed point's distance from the
global optimum and the simulated distance after --rounds), metrics.csv (round, case, scale,
local_steps, eta, metric, value: the simulated distance every round), explainer.png,
config.json, run.log.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from network.quadratic_explainer import (SCALES, QuadraticFederation, fixed_point, global_optimum,
                                         gradient_dissimilarity, iid_control, run_fedavg, worked_example)
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.plots import plt, save_figure
from utils.run_dir import MetricsCSV, atomic_write_text, claim_folder, run_log, unfinished, write_config

STEP = "explain_heterogeneity"
TABLE_FILE = "explainer.csv"
FIGURE_FILE = "explainer.png"
# A squared distance at or below this is float rounding of an exact 0 (E = 1, iid).
ZERO_DISTANCE2 = 1e-20
METRICS_COLUMNS = ("round", "case", "scale", "local_steps", "eta", "metric", "value")
# The simulated runs: every (case, s, E, η) runs --rounds rounds of E steps on each of the 4 clients, step by step in
# Python, and writes one metrics.csv row per round. Each list and the rounds are bounded, and so is their product.
MAX_VALUES = 16  # values of --etas, --local_steps and --scales each
MAX_EXPLAIN_ROUNDS = 10_000
MAX_LOCAL_STEPS = 1_000
MAX_SIMULATED_STEPS = 2 * 10**7  # Σ over cases of rounds × E × 4 clients: about a minute
# η from 10^-6 (smaller ones make FedAvg's round map the identity in float64, with no fixed point to solve for) to 1;
# the worked example's own bound, 2/L_max = 0.5, is checked after.
ETAS = cli.floats(1e-6, 1.0)


def build_parser() -> argparse.ArgumentParser:
    """The explainer's command line (explain_heterogeneity.py --help)."""
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/explain_heterogeneity"), help="output folder")
    lists = f"at most {MAX_VALUES} values"
    parser.add_argument("--etas", type=ETAS, nargs="+", default=[0.01, 0.02, 0.05, 0.1, 0.2],
                        help=f"local step sizes η (each below 2/L_max = 0.5 for the worked example; {lists})")
    parser.add_argument("--local_steps", type=cli.ints(1, MAX_LOCAL_STEPS), nargs="+", default=[1, 5],
                        help=f"local steps E per round ({lists})")
    parser.add_argument("--scales", type=SCALES, nargs="+", default=[0.5, 1.0, 2.0],
                        help=f"client optima s·e_k (1: the unit vectors of the worked example); G² grows as s² ({lists})")
    parser.add_argument("--rounds", type=cli.ints(1, MAX_EXPLAIN_ROUNDS), default=500,
                        help=f"rounds of the simulated FedAvg runs (with the lists, at most {MAX_SIMULATED_STEPS:,} "
                             "simulated client steps in all)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """Run every case; returns the explainer table."""
    args = cli.apply_runtime_flags(check_arguments(argv))
    with folder_lock(args.out):  # one run at a time writes the folder
        claim_folder(args.out, STEP)
        write_config(args.out, vars(args), step=STEP)
        with run_log(args.out) as logger:
            with unfinished(args.out, STEP):
                return explain(args, logger)


def check_arguments(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line and refuse, before any folder is touched, a list with a value twice or too many, step
    sizes that diverge, and more simulated work than :data:`MAX_SIMULATED_STEPS`."""
    args = build_parser().parse_args(argv)
    for flag in ("etas", "local_steps", "scales"):
        cli.check_list(getattr(args, flag), f"--{flag}", MAX_VALUES)
    check_stable(worked_example(max(args.scales)), args.etas)
    steps = 2 * len(args.scales) * len(args.etas) * sum(args.local_steps) * args.rounds * 4  # cases × E × clients
    if steps > MAX_SIMULATED_STEPS:
        raise TaskHetError(f"--rounds {args.rounds} with {len(args.scales)} --scales, {len(args.etas)} --etas and "
                           f"--local_steps {' '.join(map(str, args.local_steps))} simulate {steps:,} client steps; at "
                           f"most {MAX_SIMULATED_STEPS:,}: fewer rounds or values")
    return args


def check_stable(federation: QuadraticFederation, etas: list[float]) -> None:
    """Refuse step sizes at which a client's own gradient descent diverges (η ≥ 2 / L_max)."""
    bound = 2.0 / federation.largest_curvature()
    unstable = [eta for eta in etas if eta >= bound]
    if unstable:
        raise TaskHetError(f"--etas {unstable}: local gradient descent diverges for η ≥ 2/L_max = {bound:g}")


def explain(args: argparse.Namespace, logger: logging.Logger) -> pd.DataFrame:
    """Closed-form fixed points and simulated runs for every (case, scale, E, η); writes the table, metrics and figure."""
    metrics = MetricsCSV(args.out / "metrics.csv", METRICS_COLUMNS)
    rows = []
    for scale in args.scales:
        heterogeneous = worked_example(scale)
        for case, federation in (("heterogeneous", heterogeneous), ("iid", iid_control(heterogeneous))):
            for local_steps in args.local_steps:
                for eta in args.etas:
                    row, distances = explain_case(federation, case, scale, local_steps, eta, args.rounds)
                    rows.append(row)
                    metrics.write({"round": step, "case": case, "scale": scale, "local_steps": local_steps, "eta": eta,
                                   "metric": "distance", "value": float(value)} for step, value in enumerate(distances))
    table = pd.DataFrame(rows)
    atomic_write_text(args.out / TABLE_FILE, table.to_csv(index=False))
    plot_explainer(table, pd.read_csv(args.out / "metrics.csv"), args.out / FIGURE_FILE)
    worst = table[table["case"] == "heterogeneous"].sort_values("fixed_point_distance").iloc[-1]
    logger.info("%d cases; iid: largest fixed-point distance %.2g; heterogeneous: up to %.3g (E=%d, η=%g, s=%g); %s",
                len(table), table.loc[table["case"] == "iid", "fixed_point_distance"].max(), worst["fixed_point_distance"],
                worst["local_steps"], worst["eta"], worst["scale"], args.out / FIGURE_FILE)
    return table


def explain_case(federation: QuadraticFederation, case: str, scale: float, local_steps: int, eta: float,
                 rounds: int) -> tuple[dict, np.ndarray]:
    """One case's table row and its simulated distance from x* after each round."""
    optimum = global_optimum(federation)
    g2 = gradient_dissimilarity(federation)
    limit = np.linalg.norm(fixed_point(federation, eta, local_steps) - optimum)
    distances = np.linalg.norm(run_fedavg(federation, eta, local_steps, rounds) - optimum, axis=1)
    row = {"case": case, "scale": scale, "local_steps": local_steps, "eta": eta, "G2": g2,
           "eta2_E2_G2": eta ** 2 * local_steps ** 2 * g2, "fixed_point_distance": limit,
           "fixed_point_distance2": limit ** 2, "simulated_distance": float(distances[-1]), "rounds": rounds}
    return row, distances


def plot_explainer(table: pd.DataFrame, metrics: pd.DataFrame, path: Path) -> None:
    """Left: squared fixed-point distance against η²E²G² (log-log); right: distance over rounds at the worked example's scale."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.6))
    biased = table[(table["case"] == "heterogeneous") & (table["fixed_point_distance2"] > ZERO_DISTANCE2)]
    markers = dict(zip(sorted(table["local_steps"].unique()), "osD^v<>"))
    for (scale, local_steps), group in biased.groupby(["scale", "local_steps"], sort=True):
        left.loglog(group["eta2_E2_G2"], group["fixed_point_distance2"], marker=markers[local_steps], linestyle="none",
                    label=f"s = {scale:g}, E = {local_steps}")
    if not biased.empty:  # the small-η law: ‖x_∞ − x*‖² ∝ η²E²G², fitted through the smallest point of each E
        smallest = biased.sort_values("eta").groupby("local_steps").head(1)
        slope = float((smallest["fixed_point_distance2"] / smallest["eta2_E2_G2"]).median())
        span = np.array([biased["eta2_E2_G2"].min(), biased["eta2_E2_G2"].max()])
        left.loglog(span, slope * span, color="grey", linestyle="--", label=f"{slope:.2g}·η²E²G² (slope 1)")
    zero = table[table["fixed_point_distance2"] <= ZERO_DISTANCE2]
    left.text(0.98, 0.03, f"exactly 0 (< 1e-20), not drawn: {len(zero)} cases\n(every E = 1: gradient descent; every iid: G² = 0)",
              transform=left.transAxes, ha="right", va="bottom", fontsize="small")
    left.set_xlabel("η²E²G²  (G²: gradient dissimilarity at x*)")
    left.set_ylabel("‖x_∞ − x*‖²  (FedAvg's fixed point)")
    left.set_title("Fixed-point bias grows with η²E²G²")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize="x-small", loc="upper left")
    shown_scale = 1.0 if (table["scale"] == 1.0).any() else float(table["scale"].iloc[0])
    shown_steps = int(table["local_steps"].max())
    shown = metrics[(metrics["scale"] == shown_scale) & (metrics["local_steps"] == shown_steps)]
    for (case, eta), group in shown.groupby(["case", "eta"], sort=True):
        right.plot(group["round"], group["value"], linestyle="--" if case == "iid" else "-", label=f"{case}, η = {eta:g}")
    right.set_xlabel("round")
    right.set_ylabel("‖x_t − x*‖  (distance from the global optimum)")
    right.set_title(f"More rounds do not remove it (E = {shown_steps}, s = {shown_scale:g})")
    right.grid(alpha=0.3)
    right.legend(fontsize="x-small", ncol=2, loc="upper right", title="solid: heterogeneous, dashed: iid",
                 title_fontsize="x-small")
    figure.suptitle("FedAvg on four quadratic clients with optima s·e_1..s·e_4 (full participation, full-batch local steps)")
    save_figure(figure, path)
