"""One federated run's setup behind one typed run config (step 4, the Flower app and the pipeline all use it).

:class:`network.run_config.RunConfig` holds every input of a run (its checks are there too). :func:`prepare`
reads and checks the inputs and builds the task model, the algorithm, its worker model and the engine config;
:func:`run` adds the client data and runs an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import torch

from datasets.encoded import model_input_key
from datasets.family import load_manifest
from models import build_task_model, get_task, load_task_model
from network.algorithms import build_algorithm
from network.algorithms.base import Algorithm
from network.engine_config import EngineConfig
from network.engine_sequential import check_vectorizable
from network.local_work import client_step_budgets
from network.lr_schedule import make_lr_schedule
from network.run_inputs import (default_assignments, skews_signature, split_unseen, train_class_groups,
                                unseen_signature)
from network.privacy import PrivacySettings, resolve_budget
from network.run_config import (NOT_IN_SIGNATURE, RunConfig, check_flower_counts, local_work, privacy_settings,
                                resolve)
from network.sampling import clients_per_round
from network.run_outputs import LOG_ONLY
from partitioning.assignments import load_assignments
from partitioning.temporal import check_horizon, has_schedule
from training.loop import evaluate
from utils.device import pick_device, prepare_model
from utils.errors import NonFiniteLossError, TaskHetError
from utils.seeding import set_deterministic

STEP = "step 4"

@dataclass
class FedSetup:
    """Everything a run needs except the client data (which a Flower node builds for its own clients only)."""

    config: RunConfig
    task: Any
    manifest: pd.DataFrame
    table: pd.DataFrame
    model: torch.nn.Module  # the worker model, on ``device``
    model_config: dict
    algorithm: Algorithm
    engine_config: EngineConfig
    device: torch.device
    loss_fn: Callable
    evaluate_fn: Callable
    feature_model: torch.nn.Module | None = None  # the task model whose frozen encoder's maps feed training (--cache_features)
    # The rows of the clients held out of all training (assignments.json's unseen_clients); None: no such client.
    # ``table`` then holds the federation's clients only.
    unseen_table: pd.DataFrame | None = None
    # Lines for run.log, (logging level, text): client-level DP's budget and warnings.
    notes: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def assigned_rows(self) -> pd.DataFrame:
        """Every row of the assignments, the unseen clients' included (no held-out split may draw from them)."""
        return self.table if self.unseen_table is None else pd.concat([self.table, self.unseen_table])


def prepare(config: RunConfig) -> FedSetup:
    """Read and check the inputs, then build the worker model, the algorithm and the engine config."""
    task = get_task(config.task)
    config = config.replace(assignments=config.assignments or default_assignments(config))
    family, manifest = load_manifest(config.manifest)
    family.check_task(config.task, f"--task (manifest {config.manifest})")
    table, meta = load_assignments(config.assignments, manifest)
    config = resolve(config, meta)
    table, unseen_table = split_unseen(table, meta)  # the federation is the seen clients alone
    check_horizon(table, config.n_rounds, str(config.assignments))  # temporal skew: a schedule fits the run
    check_flower_counts(config, table["client_id"].nunique())  # before a folder is written
    set_deterministic(config.deterministic)
    num_classes = family.output_channels(manifest, task)
    input_key = model_input_key(family, config.cache_features)
    groups = train_class_groups(family, manifest) if task.kind == "classification" else None
    device = pick_device(config.use_accelerator)
    task_model = initial_model(config, num_classes)
    # A schedule may list a sample on several rows of a client (temporal skew); it counts once in n_i.
    train_counts = table[table["subset"] == "train"].drop_duplicates(["client_id", "sample_id"]).groupby("client_id").size()
    sizes = {str(client_id): int(train_counts.get(client_id, 0)) for client_id in sorted(table["client_id"].unique())}
    algorithm, worker = build_algorithm(config.method, task_model, sizes, config.settings, seed=config.rand_seed,
                                        input_key=input_key)
    if config.vectorize_clients:  # refused here, before any data is read or folder written
        check_vectorizable(worker, algorithm)
    privacy, n_rounds, notes = private_budget(config, table, sizes)
    engine_config = EngineConfig(
        out_dir=config.out, n_rounds=n_rounds, privacy=privacy,
        lr_schedule=make_lr_schedule(config.lr_schedule, config.init_lr, config.n_rounds),
        seed=config.rand_seed, local_steps=config.local_steps, local_epochs=config.local_epochs,
        client_fraction=config.client_fraction, eval_every=config.eval_every,
        checkpoint_every=config.checkpoint_every, checkpoint_minutes=config.checkpoint_minutes,
        keep_client_state=config.keep_client_state, momentum=config.momentum,
        weight_decay=config.weight_decay, resume=config.resume, progress=config.progress,
        max_state_memory_bytes=int(config.client_state_memory_mb * 2**20), finetune_steps=config.finetune_steps,
        diagnostics=config.diagnostics, diagnostics_every=config.diagnostics_every,
        diagnostics_max_samples=config.diagnostics_max_samples, tensorboard=config.tensorboard,
        round_lines=config.round_lines, plots=config.plots,
        vectorize_chunk=config.vectorize_chunk if config.vectorize_clients else 0,
        client_steps=client_step_budgets(local_work(config), config.local_steps, sizes, config.rand_seed),
        signature={**{key: str(value) for key, value in dataclasses.asdict(config).items() if key not in NOT_IN_SIGNATURE},
                   **skews_signature(meta), **unseen_signature(meta)})
    return FedSetup(
        config=config, task=task, manifest=manifest, table=table, algorithm=algorithm, engine_config=engine_config,
        device=device, model=prepare_model(worker, device), model_config=task_model.config,
        loss_fn=lambda net, batch, reduction="mean": task.loss(net(batch[input_key])[0].float(), batch, reduction),
        # The model's own device, not the server's: Flower nodes may train on another device.
        evaluate_fn=lambda net, loader: evaluate(net, loader, task, next(net.parameters()).device, input_key=input_key,
                                                 progress=False, class_groups=groups),
        feature_model=task_model if config.cache_features else None, unseen_table=unseen_table, notes=notes)


def private_budget(config: RunConfig, table: pd.DataFrame, sizes: dict[str, int]
                   ) -> tuple[PrivacySettings | None, int, list[tuple[int, str]]]:
    """Client-level DP's settings with z resolved, the rounds its budget allows, and lines for run.log (no DP: the
    config's rounds)."""
    settings = privacy_settings(config)
    if settings is None:
        return None, config.n_rounds, []
    if has_schedule(table):
        raise TaskHetError(f"--dp_clip: {config.assignments} has a temporal schedule, so the clients a round can sample "
                           "change with the data; the accountant assumes m of the same N clients every round")
    return resolve_budget(settings, len(sizes), clients_per_round(len(sizes), config.client_fraction), config.n_rounds)


def initial_model(config: RunConfig, num_classes: int | None) -> torch.nn.Module:
    if config.init_from == "scratch":
        return build_task_model(config.task, config.encoder, config.weights, num_classes=num_classes, seed=config.rand_seed,
                                freeze_encoder=config.freeze_encoder, decoder_width=config.decoder_width)
    model = load_task_model(config.centralized_checkpoint, "--centralized_checkpoint (a step-2 best.pt)")
    if model.config["task"] != config.task:
        raise TaskHetError(f"--centralized_checkpoint {config.centralized_checkpoint} is a {model.config['task']} model, "
                           f"not {config.task}")
    return model.freeze_encoder_() if config.freeze_encoder else model


def run(setup: FedSetup) -> dict:
    """Build the clients and run the chosen engine; returns the run folder and the best global test loss."""
    from network.client_data import global_test_loader, global_val_loader, make_clients
    from network.engine_sequential import SequentialEngine
    from utils.run_dir import run_log, unfinished

    config = setup.config
    clients = make_clients(config, setup.manifest, setup.table, setup.task, setup.feature_model)
    unseen = ([] if setup.unseen_table is None
              else make_clients(config, setup.manifest, setup.unseen_table, setup.task, setup.feature_model))
    calibration = calibration_loader(setup)  # before the folder is claimed: a refused split leaves it untouched
    open_run_folder(setup)
    with run_log(config.out) as logger:
        for level, note in setup.notes:
            logger.log(level, "%s", note)
        if calibration is not None:
            logger.info("server calibration split: %d held-out train samples", len(calibration.dataset))
        test_loader = global_test_loader(config, setup.manifest, setup.task, setup.feature_model)
        val_loader = global_val_loader(config, setup.manifest, setup.task, setup.feature_model)
        logger.info("%s on %s: %d clients (%d train samples), %d test samples, device %s", config.method, config.task,
                    len(clients), sum(client.num_samples for client in clients), len(test_loader.dataset), setup.device)
        if unseen:
            log_unseen(logger, unseen, setup.algorithm, config.finetune_steps)
        inputs = (setup.model, setup.algorithm, clients, setup.loss_fn, setup.evaluate_fn, test_loader,
                  setup.engine_config, setup.device)
        with unfinished(config.out, STEP), stop_reason_in(logger):  # later steps refuse an unfinished run
            if config.engine == "flower":
                from network.flower.simulation import FlowerOptions, run_flower  # only here: the sequential path never imports flwr

                engine = run_flower(*inputs, model_config=setup.model_config, logger=logger, options=FlowerOptions(
                    mode=config.flower_mode, num_cpus=config.flower_num_cpus, num_gpus=config.flower_num_gpus,
                    min_available_clients=config.min_available_clients, num_nodes=config.flower_num_nodes),
                    val_loader=val_loader)
            else:
                engine = SequentialEngine(*inputs, model_config=setup.model_config, logger=logger, val_loader=val_loader,
                                          calibration_loader=calibration, unseen_clients=unseen)
                engine.run()
        return {"out": config.out, "best_test_loss": engine.best_loss}


@contextlib.contextmanager
def stop_reason_in(logger: logging.Logger) -> Iterator[None]:
    """A run stopped as non-finite (a NaN loss, MOCHA's divergence guards) writes its reason to run.log before the
    error goes on to the console's ``error:`` line: run.log is what a later look at the folder finds."""
    try:
        yield
    except NonFiniteLossError as error:
        # LOG_ONLY: the engine keeps such records off the console, which prints the error itself.
        logger.error("%s", error, extra={LOG_ONLY: True})
        raise


def log_unseen(logger: logging.Logger, unseen: list, algorithm: Algorithm, finetune_steps: int) -> None:
    """One line on the unseen clients and how they are evaluated; a warning names those without test rows."""
    from network.client import adapts_new_clients

    adaptation = ("its personalisation step (one client_update from the broadcast)" if adapts_new_clients(algorithm)
                  else "no personalisation step" + (" (it tailors messages to federation members)"
                                                    if algorithm.personalized else ""))
    logger.info("%d unseen clients held out of training (%s): each evaluation round evaluates them after %s%s",
                len(unseen), ", ".join(client.client_id for client in unseen), adaptation,
                f" and {finetune_steps} fine-tuning steps" if finetune_steps else "")
    untested = [client.client_id for client in unseen if client.test_loader is None]
    if untested:
        logger.warning("unseen clients %s have no client-test rows and are never evaluated", ", ".join(untested))


def calibration_loader(setup: FedSetup) -> torch.utils.data.DataLoader | None:
    """The server's calibration batches (network.calibration_split), or None without --calibration_fraction."""
    from network.calibration_split import calibration_ids
    from network.client_data import task_dataset
    from training.loop import make_loader

    config = setup.config
    # The unseen clients' rows too: they are held out of every training, the server's included.
    ids = calibration_ids(setup.manifest, setup.assigned_rows, config.calibration_fraction, config.rand_seed)
    if not ids:
        return None
    return make_loader(task_dataset(config, setup.manifest, setup.task, ids, setup.feature_model), config.batch_size, False, 0,
                       config.num_workers)


def open_run_folder(setup: FedSetup) -> None:
    """Check that the run folder is step 4's (or empty) and that a resume matches it, then write config.json.

    Every check comes first: a refused run leaves the folder exactly as it was.
    """
    from network.checkpoints import CHECKPOINT_FILE, load_resumable, run_fingerprint
    from utils.run_dir import claim_folder, write_config

    config = setup.config
    claim_folder(config.out, STEP)
    checkpoint = Path(config.out) / CHECKPOINT_FILE
    if config.resume and checkpoint.exists():
        client_ids = [str(client_id) for client_id in sorted(setup.table["client_id"].unique())]
        load_resumable(checkpoint, run_fingerprint(setup.algorithm, setup.engine_config, client_ids))
    config.out.mkdir(parents=True, exist_ok=True)
    write_config(config.out, dataclasses.asdict(config), step=STEP)
