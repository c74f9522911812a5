"""The GPU check's stages of whole federated rounds: a round of experiments/paper.yaml for each of its algorithms
with the paper grid's projected cost (5), and FedLoGe at experiments/cifar10_lt_fedloge.yaml's sizes (6)."""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench import bench_train_loop
from bench.bench_engine import TensorDicts
from bench.gpu_stage_kit import DENSE_TASK, Context, Plan, Steps, repeated, reset_peak_memory, synced_seconds
from utils.device import prepare_model
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
PAPER_FILE = ROOT / "experiments" / "paper.yaml"
FEDLOGE_FILE = ROOT / "experiments" / "cifar10_lt_fedloge.yaml"
CIFAR_CLASSES = {"cifar10": 10, "cifar100": 100}
GPUS_IN_PROJECTION = 8


def federated_engine(model: torch.nn.Module, method: str, settings: dict, clients: list, loss: Callable, out: Path,
                     device: torch.device, *, steps: int, fraction: float, lr_schedule: Callable[[int], float],
                     momentum: float, weight_decay: float, input_key: str, n_rounds: int):
    """A sequential engine as step 4 builds one, without evaluation (timed separately) or checkpoints."""
    from network.algorithms import build_algorithm
    from network.engine_sequential import EngineConfig, SequentialEngine

    config = EngineConfig(out_dir=out, n_rounds=n_rounds, lr_schedule=lr_schedule, local_steps=steps,
                          client_fraction=fraction, momentum=momentum, weight_decay=weight_decay, progress=False)
    algorithm, worker = build_algorithm(method, model, {client.client_id: client.num_samples for client in clients},
                                        settings, input_key=input_key)
    return SequentialEngine(prepare_model(worker, device), algorithm, clients, loss, lambda net, loader: {"loss": 0.0},
                            [], config, device)


def in_memory_clients(count: int, dataset_of: Callable[[int], object], batch_size: int) -> list:
    from network.client import ClientData
    from training.loop import make_loader

    return [ClientData(str(index), len(dataset_of(index)), lambda seed, data=dataset_of(index): make_loader(
        data, batch_size, True, seed)) for index in range(count)]


@dataclass(frozen=True)
class PaperSetting:
    """experiments/paper.yaml's federated setting, the dry run's sizes put in where the plan sets them."""

    runs: int
    tasks: int
    algorithms: dict
    encoder: str
    image: int
    n_clients: int
    fraction: float
    per_round: int
    steps: int
    batch: int
    n_rounds: int
    eval_every: int
    init_lr: float
    lr_schedule: str
    momentum: float
    weight_decay: float
    count_text: str
    seeds: int = 1
    epochs: int = 1  # step 2's centralized.n_epochs
    optimizer: str = "adamw"  # step 2's
    readings: int = 0  # step-3c readings (heterogeneity_meter)
    checkpoint_every: int = 1

    @property
    def evaluations(self) -> int:
        """Evaluations a run makes: round 0, every ``eval_every``-th round and the last (EngineConfig.eval_every)."""
        return 1 + sum(1 for index in range(1, self.n_rounds + 1)
                       if index % self.eval_every == 0 or index == self.n_rounds)


def paper_setting(plan: Plan) -> PaperSetting:
    from network.sampling import clients_per_round
    from partitioning.groupings import GROUPINGS
    from pipeline.experiment import load_experiment
    from pipeline.studies.main_job.config import combinations, count_combinations

    config = load_experiment(PAPER_FILE)
    federated, partition = config["federated"], config["partition"]
    n_clients = plan.paper_clients or partition["n_clients"]
    count_text = (f"{len(config['tasks'])} tasks × {len(partition['groupings'])} groupings × "
                  f"{len(partition['alphas'])} alphas × {len(federated['algorithms'])} algorithms × "
                  f"{len(config['seeds'])} seeds"
                  + (" (+ the iid reference)" if partition["iid_reference"] else ""))
    return PaperSetting(
        runs=count_combinations(config), tasks=len(config["tasks"]), algorithms=dict(federated["algorithms"]),
        encoder=plan.paper_encoder or config["model"]["encoder"],
        image=plan.paper_image or config["model"]["image_size"],
        n_clients=n_clients, fraction=federated["client_fraction"],
        per_round=clients_per_round(n_clients, federated["client_fraction"]),
        steps=plan.paper_steps or federated["local_steps"], batch=plan.paper_batch or federated["batch_size"],
        n_rounds=federated["n_rounds"], eval_every=federated["eval_every"], init_lr=federated["init_lr"],
        lr_schedule=federated["lr_schedule"], momentum=federated["momentum"], weight_decay=federated["weight_decay"],
        count_text=count_text, seeds=len(config["seeds"]), epochs=config["centralized"]["n_epochs"],
        optimizer=config["centralized"]["optimizer"], checkpoint_every=federated["checkpoint_every"],
        # step 3c reads each label- and embedding-based partition once (MainJob.metered)
        readings=len({(c.task, c.grouping, c.alpha, c.seed) for c in combinations(config) if c.grouping in GROUPINGS})
        if config["heterogeneity_meter"] else 0)


def paper_stage(ctx: Context) -> None:
    from models import build_task_model, get_task
    from network.client import evaluate_model
    from network.lr_schedule import make_lr_schedule
    from training.loop import evaluate, make_loader

    plan, setting, task = ctx.plan, paper_setting(ctx.plan), get_task(DENSE_TASK)
    ctx.add("runs", setting.runs, "runs", f"{setting.count_text}: count_combinations of experiments/paper.yaml")
    samples = bench_train_loop.rendered_samples(DENSE_TASK, setting.image, *plan.render)
    clients = in_memory_clients(setting.n_clients, lambda index: samples, setting.batch)

    def loss(net, batch, reduction="mean"):
        return task.loss(net(batch["rgb"])[0].float(), batch, reduction)

    detail = (f"{setting.per_round} of {setting.n_clients} clients × {setting.steps} local steps at batch "
              f"{setting.batch}, {setting.encoder} at {setting.image} px, {DENSE_TASK}; median of "
              f"{plan.paper_rounds} timed round(s)")
    round_seconds: dict[str, float] = {}
    steps = Steps(ctx, len(setting.algorithms))
    reset_peak_memory(ctx.device)
    with tempfile.TemporaryDirectory() as folder:
        for method, settings in setting.algorithms.items():
            if not steps.start(method):
                ctx.skip(f"{method}_round", "the stage's time budget is spent; the projection takes FedAvg's round")
                continue
            model = build_task_model(DENSE_TASK, setting.encoder, "none", seed=0)
            engine = federated_engine(
                model, method, settings, clients, loss, Path(folder) / method, ctx.device, steps=setting.steps,
                fraction=setting.fraction, lr_schedule=make_lr_schedule(setting.lr_schedule, setting.init_lr,
                                                                        setting.n_rounds),
                momentum=setting.momentum, weight_decay=setting.weight_decay, input_key="rgb",
                n_rounds=setting.n_rounds)
            # One warm-up round, before the first algorithm only: cuDNN's kernel choices and the allocator's pool
            # then serve the others (the same model), so the budget times every algorithm.
            warm_up = not round_seconds
            if warm_up:
                synced_seconds(lambda: engine.train_round(1), ctx.device)
            first = 2 if warm_up else 1
            round_seconds[method] = statistics.median(
                synced_seconds(lambda index=index: engine.train_round(index), ctx.device)
                for index in range(first, first + plan.paper_rounds))
            ctx.add(f"{method}_round", round_seconds[method], "s",
                    detail + ("; after a warm-up round" if warm_up else "; from its first round, the kernels warm"))
            del engine
            steps.finish()
    ctx.peak_memory(what="the largest algorithm's round")
    if not round_seconds:
        raise TaskHetError("no algorithm's round fitted in the stage's time budget")
    model = prepare_model(build_task_model(DENSE_TASK, setting.encoder, "none", seed=0), ctx.device)
    loader = make_loader(repeated(samples, plan.eval_batches * setting.batch), setting.batch, False, 0)

    def evaluate_fn(net, batches):
        return evaluate(net, batches, task, ctx.device, input_key="rgb", progress=False)

    evaluate_model(model, evaluate_fn, loader)  # warm-up
    eval_rate = len(loader.dataset) / synced_seconds(lambda: evaluate_model(model, evaluate_fn, loader), ctx.device)
    ctx.add("eval_samples_per_s", eval_rate, "samples/s", f"the evaluation's forward passes and metrics, batch "
            f"{setting.batch}, one pass of {len(loader.dataset)} samples after a warm-up pass")
    project_paper_grid(ctx, setting, round_seconds, eval_rate,
                       {key: value.detach().cpu() for key, value in model.state_dict().items()})


def project_paper_grid(ctx: Context, setting: PaperSetting, round_seconds: dict[str, float], eval_rate: float,
                       state: dict[str, torch.Tensor]) -> None:
    """The grid's hours from the timed rounds and the evaluation's rate, then its other parts (steps 2, 3 and 3c and
    the checkpoint writes of ``state``'s model: bench/gpu_grid_projection.py); the assumptions go into the Markdown."""
    from bench.gpu_grid_projection import assumption_lines, complete_projection

    fallback = round_seconds.get("fedavg", statistics.mean(round_seconds.values()))
    per_method = setting.runs / len(setting.algorithms)
    eval_hours = setting.evaluations * ctx.eval_samples / eval_rate / 3600
    run_hours = {method: setting.n_rounds * round_seconds.get(method, fallback) / 3600 + eval_hours
                 for method in setting.algorithms}
    for method, hours in run_hours.items():
        ctx.add(f"{method}_run", hours, "h", f"{setting.n_rounds} rounds + {setting.evaluations} evaluations of "
                f"{ctx.eval_samples:,} samples" + ("" if method in round_seconds else "; FedAvg's round, not timed"))
    grid_hours = per_method * sum(run_hours.values())
    ctx.add("grid_1gpu", grid_hours, "h", f"{setting.runs} runs, {per_method:g} per algorithm; goal ≤ 48 h")
    per_gpu = math.ceil(setting.runs / GPUS_IN_PROJECTION)
    ctx.add("grid_8gpu", grid_hours / GPUS_IN_PROJECTION, "h",
            f"{per_gpu} runs per GPU, independent runs shared evenly")
    parts = complete_projection(ctx, setting, grid_hours, round_seconds.get("fedavg", fallback), eval_rate, state)
    notes = paper_assumptions(setting, round_seconds, eval_rate, ctx.eval_samples, ctx.report.dry_run)
    ctx.report.notes = [*notes[:-1], *assumption_lines(ctx, setting, parts), *notes[-1:]]


def paper_assumptions(setting: PaperSetting, round_seconds: dict[str, float], eval_rate: float, eval_samples: int,
                      dry_run: bool) -> list[str]:
    timed = ", ".join(f"{method} {seconds:.3g} s" for method, seconds in round_seconds.items())
    lines = [
        "## The paper-grid projection: its assumptions", "",
        f"- Runs: {setting.runs} = {setting.count_text} "
        "(`count_combinations(load_experiment('experiments/paper.yaml'))`).",
        f"- Each run: {setting.n_rounds} rounds of {setting.per_round} clients (client_fraction "
        f"{setting.fraction:g} of {setting.n_clients}) × {setting.steps} local steps at batch {setting.batch}, "
        f"{setting.encoder} at {setting.image} px, each algorithm's round as timed here ({timed}); an algorithm "
        "the budget left untimed costs FedAvg's round.",
        f"- Every task costs what {DENSE_TASK} costs: {setting.tasks - 1} of the {setting.tasks} tasks are dense "
        "with the same decoder; class_scene's classifier head is cheaper, so the grid's figure is an upper bound "
        "for it.",
        f"- Evaluation: {setting.evaluations} evaluations a run (round 0, every {setting.eval_every}th round and the "
        f"last), each a forward pass over {eval_samples:,} samples (`--eval_samples`: the global test split plus the "
        f"clients' test splits; set it to your manifest's) at the measured {eval_rate:,.0f} samples/s.",
        f"- {GPUS_IN_PROJECTION} GPUs: the runs are independent and shared evenly, "
        f"{math.ceil(setting.runs / GPUS_IN_PROJECTION)} per GPU, with no other overhead: `grid_1gpu` and `grid_8gpu` "
        "are step 4 alone; `complete_1gpu` and `complete_8gpu` add the parts below.",
    ]
    dry = "- Dry run: the rounds were timed at tiny sizes on the CPU, so the hours are not a projection."
    return [*lines, dry if dry_run else "- Measured on the GPU: every rate above is this machine's."]


def fedloge_stage(ctx: Context) -> None:
    from models import build_task_model, get_task
    from network.lr_schedule import make_lr_schedule
    from network.sampling import clients_per_round
    from pipeline.experiment import load_experiment

    plan, config = ctx.plan, load_experiment(FEDLOGE_FILE)
    federated, grid = config["federated"], config["grid"][0]
    local_steps = grid["local_steps"][0]
    total_rounds = federated["rounds_x_local_steps"] // local_steps
    settings = dict(next(variant.settings for variant in grid["variants"] if variant.algorithm == "fedloge"))
    if plan.fedloge_etf_steps is not None:
        settings["etf_steps"] = plan.fedloge_etf_steps
    steps, n_clients = plan.fedloge_steps or local_steps, plan.fedloge_clients or federated["n_clients"]
    encoder, image = plan.fedloge_encoder or config["model"]["encoder"], config["model"]["image_size"]
    classes, task = CIFAR_CLASSES[config["data"]["source"]], get_task(config["task"])
    generator = torch.Generator().manual_seed(0)
    data = [TensorDicts.of(image=torch.rand(plan.client_samples, 3, image, image, generator=generator),
                           **{task.domain: torch.randint(0, classes, (plan.client_samples,), generator=generator)})
            for _ in range(n_clients)]
    clients = in_memory_clients(n_clients, lambda index: data[index], federated["batch_size"])

    def loss(net, batch, reduction="mean"):
        return task.loss(net(batch["image"])[0].float(), batch, reduction)

    model = build_task_model(config["task"], encoder, "none", num_classes=classes, seed=0)
    per_round = clients_per_round(n_clients, federated["client_fraction"])
    detail = (f"{per_round} of {n_clients} clients × {steps} local steps at batch {federated['batch_size']}, "
              f"{encoder}, {classes} classes at {image} px, random data")
    reset_peak_memory(ctx.device)
    with tempfile.TemporaryDirectory() as folder:
        engine = federated_engine(
            model, "fedloge", settings, clients, loss, Path(folder), ctx.device, steps=steps,
            fraction=federated["client_fraction"],
            lr_schedule=make_lr_schedule(federated["lr_schedule"], federated["init_lr"], total_rounds),
            momentum=federated["momentum"], weight_decay=federated["weight_decay"], input_key="image",
            n_rounds=total_rounds)
        ctx.note(f"SSE-C refinement ({settings.get('etf_steps')} Adam steps)")
        init = synced_seconds(lambda: engine.server, ctx.device)
        ctx.add("sse_c_init", init, "s", f"init_server: the SSE-C refinement, etf_steps {settings.get('etf_steps')}")
        times = []
        rounds = Steps(ctx, plan.fedloge_rounds)
        for index in range(1, plan.fedloge_rounds + 1):
            if not rounds.start(f"round {index}"):
                break
            times.append(synced_seconds(lambda index=index: engine.train_round(index), ctx.device))
            rounds.finish()
    ctx.add("first_round", times[0], "s", detail + "; includes the warm-up")
    if len(times) < 2:
        ctx.skip("round", "only the warm-up round fitted in the stage's time budget")
        return
    round_seconds = statistics.median(times[1:])
    ctx.add("round", round_seconds, "s", detail + f"; median of rounds 2–{len(times)}")
    ctx.add("projected_run", (init + total_rounds * round_seconds) / 3600, "h",
            f"SSE-C + {total_rounds} rounds ({federated['rounds_x_local_steps']:,} rounds × local steps ÷ J = "
            f"{local_steps}); its {federated['evaluations']} evaluations not included")
    ctx.peak_memory(what="FedLoGe's rounds")
