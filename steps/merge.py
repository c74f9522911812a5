"""Task arithmetic over fine-tuned models (TaLoS, issue 15): merged model, λ search and interference.

Two sources of models: ``--run`` (a finished step-4 ``sparse_ft`` run made with
``--keep_local_models true``: θ_0, the clients' local models, their masks and their data,
read by sparse/from_run.py), or ``--base`` and ``--finetuned`` checkpoints (no data: one
fixed λ, the interference diagnostics only). The work is :func:`run_merge`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from models.frozen_encoder import load_full_checkpoint
from network.aggregation import Weights
from sparse.merge import (check_lambda, choose_lambda, cosine_matrix, jaccard_matrix, merge, plot_matrix, support,
                          task_vector)
from sparse.from_run import VAL_SPLITS
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock
from utils.run_dir import (MetricsCSV, atomic_torch_save, atomic_write_text, claim_folder, run_log, unfinished,
                           write_config)

STEP = "merge"
# λ scales the summed task vectors: task arithmetic uses λ around [0, 1]; 100 is far beyond and stays finite.
MAX_LAMBDA = 100.0
LAMBDAS = cli.floats(-MAX_LAMBDA, MAX_LAMBDA)
COLUMNS = ("split", "model", "other", "metric", "value")
DESCRIPTION = """Task arithmetic (TaLoS, Iurada et al., ICLR 2025): task vectors τ_k = θ_k − θ_0 of fine-tuned
models, the merged model θ_0 + λ Σ τ_k with λ chosen on validation data, pairwise cosine of the τ_k, Jaccard
overlap of the clients' masks, and each client's own model against the merged model on that client's test rows.
Inputs: --run (a step-4 sparse_ft run folder made with --keep_local_models true), or --base and --finetuned
NAME=PATH (state dicts or best.pt files; no data, so one --lam and no comparison).
Outputs under --out: config.json, run.log, metrics.csv (split, model, other, metric, value), merge.csv (per
client: own, merged and base loss; with --run), cosine.npy, jaccard.npy, cosine.png, jaccard.png, merged.pt."""


def load_model_weights(path: Path) -> Weights:
    """A state dict from ``path``: a plain state dict, or the ``model`` entry of a best.pt / checkpoint (with a
    frozen encoder that the checkpoint names put back, hash checked)."""
    loaded = load_full_checkpoint(path, "checkpoint to merge", finished=True)
    weights = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(weights, dict) or not weights or not all(hasattr(value, "shape") for value in weights.values()):
        raise TaskHetError(f"{path} holds no state dict (expected tensors, or a best.pt with a 'model' entry)")
    return weights


def run_merge(base: Weights, finetuned: Mapping[str, Weights], out_dir: Path, lambdas: Sequence[float],
              validation_loss: Callable[[Weights], float] | None = None,
              client_loss: Callable[[str, Weights], float] | None = None, config: dict | None = None,
              masks: Mapping[str, Weights] | None = None, sources: Mapping[str, str] | None = None) -> Weights:
    """Merge ``finetuned`` into ``base``, write the run folder, return the merged weights.

    Every input is checked before the folder is touched (finite λ, same keys and shapes); the folder
    holds ``INCOMPLETE`` from its first file until merged.pt is written, so a killed merge never looks done.

    Args:
        base: θ_0. finetuned: name (a client id) -> θ_k.
        lambdas: the λ grid (finite numbers); with no ``validation_loss`` it must hold exactly one λ.
        validation_loss: merged weights -> loss on validation data (chooses λ: the lowest finite loss, first on ties).
        client_loss: (name, weights) -> loss on that client's data: θ_k, the merged model and θ_0 (merge.csv).
        config: extra entries for config.json.
        masks: name -> the client's trained-entry masks (Jaccard); default: the supports of the τ_k.
        sources: ``"base"`` and each name -> where that model came from (a file), for error messages.
    """
    if len(lambdas) != 1 and validation_loss is None:
        raise TaskHetError("choosing λ from a grid needs validation data; give one λ")
    lambdas = [check_lambda(lam, "--lam/--lambdas value") for lam in lambdas]
    sources = dict(sources or {})
    names = list(finetuned)
    vectors = [task_vector(base, finetuned[name], sources.get("base", "the base model"),
                           sources.get(name, f"fine-tuned model {name}")) for name in names]
    out_dir = Path(out_dir)
    claim_folder(out_dir, STEP)
    out_dir.mkdir(parents=True, exist_ok=True)
    with unfinished(out_dir, STEP):  # first and last: a killed merge leaves INCOMPLETE beside its partial files
        merged = _write_merge(base, finetuned, out_dir, lambdas, vectors, validation_loss, client_loss, config, masks)
    return merged


def _write_merge(base: Weights, finetuned: Mapping[str, Weights], out_dir: Path, lambdas: list[float],
                 vectors: list[Weights], validation_loss: Callable[[Weights], float] | None,
                 client_loss: Callable[[str, Weights], float] | None, config: dict | None,
                 masks: Mapping[str, Weights] | None) -> Weights:
    write_config(out_dir, {**(config or {}), "models": list(finetuned), "lambdas": list(lambdas)}, step=STEP)
    with run_log(out_dir) as log:
        (out_dir / "merged.pt").unlink(missing_ok=True)  # a rerun's old result must not sit beside new tables
        (out_dir / "metrics.csv").unlink(missing_ok=True)  # a rerun into the same folder starts the table afresh
        metrics = MetricsCSV(out_dir / "metrics.csv", COLUMNS)
        names = list(finetuned)
        lam, losses = (lambdas[0], {}) if validation_loss is None else choose_lambda(base, vectors, validation_loss, lambdas)
        metrics.write({"split": "val", "model": "merged", "other": f"lambda={key}", "metric": "loss", "value": value}
                      for key, value in losses.items())
        log.info("λ = %s%s", lam, f" (validation losses {losses})" if losses else "")
        merged = merge(base, vectors, lam)
        cosine = cosine_matrix(vectors)
        jaccard = jaccard_matrix([masks[name] for name in names] if masks else [support(vector) for vector in vectors])
        for row, first in enumerate(names):
            metrics.write({"split": "interference", "model": first, "other": second, "metric": metric,
                           "value": float(matrix[row, column])}
                          for column, second in enumerate(names) for metric, matrix in (("cosine", cosine),
                                                                                         ("jaccard", jaccard)))
        if client_loss is not None:
            table = pd.DataFrame([_compare(name, finetuned[name], merged, base, client_loss, lam) for name in names])
            atomic_write_text(out_dir / "merge.csv", table.to_csv(index=False))
            metrics.write({"split": "client", "model": row.client, "other": other, "metric": "loss",
                           "value": getattr(row, f"{other}_loss")} for row in table.itertuples()
                          for other in ("own", "merged", "base"))
            log.info("clients: own model %.4f, merged %.4f, base %.4f (mean loss on their own data)",
                     table.own_loss.mean(), table.merged_loss.mean(), table.base_loss.mean())
        for name, matrix, vmin in (("cosine", cosine, -1.0), ("jaccard", jaccard, 0.0)):
            np.save(out_dir / f"{name}.npy", matrix.numpy())
            plot_matrix(matrix, names, f"{name} between clients' task vectors" if name == "cosine"
                        else "Jaccard overlap of the clients' masks", out_dir / f"{name}.png", vmin=vmin)
        atomic_torch_save({"model": merged, "lambda": lam}, out_dir / "merged.pt")
        log.info("wrote %s", out_dir)
        return merged


def _compare(name: str, own: Weights, merged: Weights, base: Weights, client_loss: Callable[[str, Weights], float],
             lam: float) -> dict:
    return {"client": name, "lambda": lam, "own_loss": client_loss(name, own),
            "merged_loss": client_loss(name, merged), "base_loss": client_loss(name, base)}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=None, help="step-4 sparse_ft run folder (--keep_local_models true)")
    parser.add_argument("--base", type=Path, default=None, help="θ_0: a state dict or a best.pt (without --run)")
    parser.add_argument("--finetuned", nargs="+", default=None, metavar="NAME=PATH",
                        help="fine-tuned checkpoints, each NAME once")
    parser.add_argument("--lam", type=LAMBDAS, default=None,
                        help="one fixed λ, no search (default without --run: 1.0)")
    parser.add_argument("--lambdas", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                        help=f"--run: the λ grid searched on the validation split (at most {cli.MAX_LIST_ITEMS} "
                             f"comma-separated numbers, each in {LAMBDAS})")
    parser.add_argument("--val_split", choices=VAL_SPLITS, default="auto",
                        help="--run: λ's validation data: manifest_val (the manifest's val = 1 rows, which no client "
                             "holds), held_out (--val_fraction of the manifest's train rows no client holds), "
                             "client_test (the clients' test rows), or auto (default: manifest_val when the manifest "
                             "has val rows, else held_out)")
    parser.add_argument("--val_fraction", type=cli.floats(0.0, 1.0, high_open=True), default=0.1,
                        help="--val_split held_out: the share of the train rows to hold out (default: 0.1)")
    parser.add_argument("--use_accelerator", action=argparse.BooleanOptionalAction, default=False,
                        help="--run: evaluate on CUDA/MPS when present (default: CPU)")
    parser.add_argument("--out", type=Path, required=True, help="the merge's run folder")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Weights:
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    _grid(args.lambdas)  # refused before the folder is locked
    with folder_lock(args.out):  # one run at a time writes the folder
        return merge_locked(args)


def merge_locked(args: argparse.Namespace) -> Weights:
    """:func:`main`'s work, holding the lock of ``args.out``."""
    if (args.run is None) == (args.base is None and args.finetuned is None):
        raise TaskHetError("pass --run RUN_DIR, or --base and --finetuned (not both)")
    if args.run is None:
        return _merge_checkpoints(args)
    from sparse.from_run import read_run, validation_loader  # only here: builds models and data

    grid = [args.lam] if args.lam is not None else _grid(args.lambdas)
    run = read_run(args.run, args.use_accelerator)
    loader, args.val_split = validation_loader(run, args.val_split, args.val_fraction)
    validation = run.loss_on(loader)
    return run_merge(run.base, run.local, args.out, grid, validation_loss=validation,
                     client_loss=lambda name, weights: run.loss_on(run.client_loaders[name])(weights),
                     config=vars(args), masks=run.masks,
                     sources={"base": f"{args.run}/checkpoint.pt (θ_0)",
                              **{name: f"{args.run}/checkpoint.pt (client {name})" for name in run.local}})


def _merge_checkpoints(args: argparse.Namespace) -> Weights:
    if args.base is None or not args.finetuned:
        raise TaskHetError("--base needs --finetuned NAME=PATH (and --finetuned needs --base)")
    pairs = [item.split("=", 1) for item in args.finetuned]
    if any(len(pair) != 2 or not pair[0] or not pair[1] for pair in pairs):
        raise TaskHetError(f"--finetuned takes NAME=PATH items, got {args.finetuned}")
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TaskHetError(f"--finetuned names {', '.join(repeated)} more than once ({' '.join(args.finetuned)}); "
                           "give each fine-tuned model its own NAME")
    finetuned = {name: load_model_weights(Path(path)) for name, path in pairs}
    lam = 1.0 if args.lam is None else args.lam
    return run_merge(load_model_weights(args.base), finetuned, args.out, [lam], config=vars(args),
                     sources={"base": f"--base {args.base}", **{name: f"--finetuned {name}={path}" for name, path in pairs}})


def _grid(text: str) -> list[float]:
    """--lambdas as numbers of ASCII digits in :data:`LAMBDAS`, each once, at most :data:`utils.cli.MAX_LIST_ITEMS`."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise TaskHetError("--lambdas is empty")
    if len(items) > cli.MAX_LIST_ITEMS:
        raise TaskHetError(f"--lambdas lists {len(items)} values; at most {cli.MAX_LIST_ITEMS} are allowed")
    bad = [item for item in items if not _is_lambda(item)]
    if bad:
        raise TaskHetError(f"--lambdas must hold numbers in {LAMBDAS}, got {', '.join(bad)} in {text!r}")
    grid = [LAMBDAS.parse(item) for item in items]
    if len(set(grid)) != len(grid):
        raise TaskHetError(f"--lambdas repeats a value: {text!r}")
    return grid


def _is_lambda(text: str) -> bool:
    try:
        LAMBDAS.parse(text)
    except ValueError:
        return False
    return True
