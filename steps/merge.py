"""Task arithmetic over fine-tuned checkpoints (issue 15): merge, choose λ, report interference.

Library entry point :func:`run_merge` (λ search and per-client comparison need a loss
callable: they run from Python until a data family gives the command line one), and
the command ``merge_task_vectors.py``, which merges at a fixed λ and writes the
diagnostics that need no data.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from network.aggregation import Weights
from network.diagnostics import plot_cosine
from sparse.merge import choose_lambda, cosine_matrix, jaccard_matrix, merge, support, task_vector
from utils import cli
from utils.errors import TaskHetError
from utils.run_dir import MetricsCSV, atomic_torch_save, load_checkpoint, setup_logging, write_config

COLUMNS = ("split", "model", "other", "metric", "value")
DESCRIPTION = """Task arithmetic (TaLoS, issue 15): task vectors τ_k = θ_k − θ_0 of fine-tuned checkpoints,
the merged model θ_0 + λ Σ τ_k, pairwise cosine of the τ_k and Jaccard overlap of their supports.
Inputs: --base (a state dict or a best.pt), --finetuned NAME=PATH (two or more). Outputs under --out:
config.json, run.log, metrics.csv (split, model, other, metric, value), cosine.png, merged.pt."""


def load_model_weights(path: Path) -> Weights:
    """A state dict from ``path``: a plain state dict, or the ``model`` entry of a best.pt / checkpoint."""
    loaded = load_checkpoint(path, "checkpoint to merge", finished=True)
    weights = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(weights, dict) or not weights or not all(hasattr(value, "shape") for value in weights.values()):
        raise TaskHetError(f"{path} holds no state dict (expected tensors, or a best.pt with a 'model' entry)")
    return weights


def run_merge(base: Weights, finetuned: Mapping[str, Weights], out_dir: Path, lambdas: Sequence[float],
              validation_loss: Callable[[Weights], float] | None = None,
              client_loss: Callable[[str, Weights], float] | None = None, config: dict | None = None) -> Weights:
    """Merge ``finetuned`` into ``base``, write the run folder, return the merged weights.

    Args:
        base: θ_0. finetuned: name (a client id) -> θ_k.
        lambdas: the λ grid; with no ``validation_loss`` it must hold exactly one λ.
        validation_loss: merged weights -> loss on validation data (chooses λ).
        client_loss: (name, weights) -> loss on that client's data: each θ_k vs the merged model.
        config: extra entries for config.json.
    """
    if len(lambdas) != 1 and validation_loss is None:
        raise TaskHetError("choosing λ from a grid needs validation data; give one λ")
    out_dir = Path(out_dir)
    log = setup_logging(out_dir, "merge")
    write_config(out_dir, {**(config or {}), "models": list(finetuned), "lambdas": list(lambdas)})
    metrics = MetricsCSV(out_dir / "metrics.csv", COLUMNS)
    names = list(finetuned)
    vectors = [task_vector(base, finetuned[name]) for name in names]
    lam, losses = (lambdas[0], {}) if validation_loss is None else choose_lambda(base, vectors, validation_loss, lambdas)
    metrics.write({"split": "val", "model": "merged", "other": f"lambda={key}", "metric": "loss", "value": value}
                  for key, value in losses.items())
    log.info("λ = %s%s", lam, f" (validation losses {losses})" if losses else "")
    merged = merge(base, vectors, lam)
    cosine, jaccard = cosine_matrix(vectors), jaccard_matrix([support(vector) for vector in vectors])
    for row, first in enumerate(names):
        for column, second in enumerate(names):
            metrics.write([{"split": "interference", "model": first, "other": second, "metric": "cosine",
                            "value": float(cosine[row, column])},
                           {"split": "interference", "model": first, "other": second, "metric": "jaccard",
                            "value": float(jaccard[row, column])}])
        if client_loss is not None:
            own, joint = client_loss(first, finetuned[first]), client_loss(first, merged)
            metrics.write([{"split": "client", "model": first, "other": "own", "metric": "loss", "value": own},
                           {"split": "client", "model": first, "other": "merged", "metric": "loss", "value": joint}])
            log.info("client %s: own model %.4f, merged %.4f", first, own, joint)
    plot_cosine(np.asarray(cosine), names, 0, out_dir / "cosine.png")
    atomic_torch_save({"model": merged, "lambda": lam}, out_dir / "merged.pt")
    log.info("wrote %s", out_dir)
    return merged


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="θ_0: a state dict or a best.pt")
    parser.add_argument("--finetuned", nargs="+", required=True, metavar="NAME=PATH", help="fine-tuned checkpoints")
    parser.add_argument("--lam", type=float, default=1.0, help="λ of the merge θ_0 + λ Σ τ_k (default: 1.0)")
    parser.add_argument("--out", type=Path, required=True, help="the run folder")
    return parser


def main(argv: list[str] | None = None) -> Weights:
    args = build_parser().parse_args(argv)
    pairs = [item.split("=", 1) for item in args.finetuned]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise TaskHetError(f"--finetuned takes NAME=PATH items, got {args.finetuned}")
    finetuned = {name: load_model_weights(Path(path)) for name, path in pairs}
    return run_merge(load_model_weights(args.base), finetuned, args.out, [args.lam], config=vars(args))
