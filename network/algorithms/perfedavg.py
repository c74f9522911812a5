"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020).

The global model w is trained for the MAML objective F(w) = Σ p_i f_i(w − α∇f_i(w)): a good start for one local
gradient step of size α. Each local (meta-)step of a client, from its current w (Algorithm 1 of the paper):

* FO (first order):   w̃ = w − α∇f(w; D);   w ← w − β∇f(w̃; D')
* HF (Hessian-free):  w̃ = w − α∇f(w; D);   w ← w − β(I − α∇²f(w; D''))∇f(w̃; D')

with the Hessian-vector product by the paper's finite difference,
∇²f(w; D'')u ≈ (∇f(w + δu; D'') − ∇f(w − δu; D''))/(2δ), u = ∇f(w̃; D').

Choices where the paper leaves room, and why:

* α is the run's local learning rate (``cfg.lr``: ``--init_lr`` and its schedule) and β the setting ``outer_lr``,
  so the engine's evaluation-time fine-tuning IS the paper's one-step personalisation at α: run with
  ``--finetune_steps 1`` and read the ``client_test_finetuned`` split of metrics.csv (one SGD step at the round's
  lr from the global model on one batch of the client's training rows; ``client_test`` is the unpersonalised
  global model). The lr schedule therefore moves α (and that step with it), never β.
* D, D', D'' are consecutive batches of the client's loader, cycled as every local loop cycles it (a new pass draws
  the loader's next shuffle): distinct batches of a shuffled loader are the paper's independent draws. One
  meta-step consumes 2 (FO) or 3 (HF) batches. The local budget counts meta-steps: ``--local_steps J`` takes J
  meta-steps (2J or 3J batches); ``--local_epochs E`` groups the batches of E passes, the last group
  completed from the loader's next pass. The metric ``local_steps`` counts meta-steps; ``train_loss`` is the mean
  f(w; D) over them (the shared model's loss, before its inner step).
* HF uses the paper's finite difference rather than an exact double-backward product: it needs only first-order
  gradients, so it runs on every model (fused attention and some cuDNN kernels have no double backward). Its two
  passes run outside bf16 autocast, in the parameters' precision (bf16's ~4e-3 rounding divided by δ = 1e-3 would
  swamp the product), and with the same random draws (dropout masks): otherwise the difference of two masks, over
  2δ, would dominate it. BatchNorm running statistics are those every forward pass leaves (4 passes in HF).
* The paper's steps are plain SGD. The run's weight decay is part of f (f + (wd/2)‖w‖², as torch's SGD applies it),
  so the inner step at α is exactly the evaluation's fine-tuning step; the run's momentum acts on the outer step
  (a fresh buffer each round, as every local optimizer). With momentum 0 and weight decay 0 (the paper) both are
  exactly the equations above; a single fine-tuning step is the same with or without momentum.

Defaults: ``version`` hf and β = δ = 0.001, the values of the paper's experiments, where HF is the
more accurate of the two; FO is the cheaper (2 gradient passes a step instead of 4).

Upload: Δ = w − w^t of every shared entry. Server: the sample-weighted mean of the Δs (the paper's server averages
the clients' models), applied by the model-averaging server step. Per-FedAvg has no personal state: its personal
model is the one step at evaluation.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from network.aggregation import ServerOptSettings, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Bundle, ClientConfig,
                                     ClientResult, Weights, load_weights, trainable)
from network.algorithms.skeleton import DELTA, ModelAveraging
from network.local_train import budget_batches
from network.settings import check, setting
from utils.device import autocast, to_device
from utils.errors import NonFiniteLossError

VERSIONS = ("fo", "hf")
BATCHES_PER_STEP = {"fo": 2, "hf": 3}  # D, D' (and D'') of one meta-step


@dataclass(frozen=True)
class PerFedAvgSettings(ServerOptSettings):
    version: str = setting("hf", "fo (first-order meta-gradient) or hf (Hessian-free: adds −α∇²f·∇f by a finite "
                                 "difference); the paper's experiments find hf the more accurate", choices=VERSIONS)
    outer_lr: float = setting(0.001, "β, the meta-step size w ← w − β·(meta-gradient); α, the inner step, is the run's "
                                     "local learning rate (--init_lr and its schedule)")
    delta: float = setting(0.001, "hf: δ of the finite difference (∇f(w + δu) − ∇f(w − δu))/(2δ) ≈ ∇²f(w)u")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.version in VERSIONS, "version", f"one of {', '.join(VERSIONS)}", self.version)
        check(self.outer_lr > 0, "outer_lr", "> 0", self.outer_lr)
        check(self.delta > 0, "delta", "> 0", self.delta)


@ALGORITHMS.register("perfedavg")
class PerFedAvg(ModelAveraging):
    """Model averaging of a MAML start: each local step descends the loss after one inner gradient step of size α."""

    name = "perfedavg"
    Settings = PerFedAvgSettings
    personalised_by_finetuning = True  # --finetune_steps gives its personal models
    use_when = "clients' tasks differ but one local gradient step from a shared start can fit each"

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)
        model.train()
        params = list(trainable(model).values())
        outer = torch.optim.SGD(params, lr=self.settings.outer_lr, momentum=cfg.momentum)
        losses = []
        for batches in meta_batches(loader, BATCHES_PER_STEP[self.settings.version], cfg):
            batches = [to_device(batch, cfg.device) for batch in batches]
            loss, direction = self.meta_gradient(model, params, batches, cfg)
            for param, grad in zip(params, direction):
                param.grad = grad
            outer.step()
            losses.append(loss)
        upload = {DELTA: subtract(model.state_dict(), start, self.shared_keys())}
        return ClientResult(upload, {}, {TRAIN_LOSS: finite_mean(losses), LOCAL_STEPS: len(losses)}, cfg.num_samples)

    def meta_gradient(self, model: nn.Module, params: list[nn.Parameter], batches: list[dict],
                      cfg: ClientConfig) -> tuple[Tensor, list[Tensor]]:
        """f(w; D) and the meta-gradient at the parameters' current w; the parameters are left at w."""
        start = [param.detach().clone() for param in params]
        loss, inner = task_gradient(model, params, batches[0], cfg)  # ∇f(w; D)
        with torch.no_grad():
            torch._foreach_add_(params, inner, alpha=-cfg.lr)  # w̃ = w − α∇f(w; D)
        _, adapted = task_gradient(model, params, batches[1], cfg)  # ∇f(w̃; D')
        set_values(params, start)
        if self.settings.version == "fo":
            return loss, adapted
        curvature = hessian_vector_product(model, params, batches[2], adapted, self.settings.delta, cfg)
        return loss, torch._foreach_add(adapted, curvature, alpha=-cfg.lr)  # (I − α∇²f(w; D''))∇f(w̃; D')


def meta_batches(loader: Iterable[dict], size: int, cfg: ClientConfig) -> Iterator[list[dict]]:
    """Groups of ``size`` consecutive batches: J groups (``local_steps``), or those of E passes (``local_epochs``),
    the last completed from the loader's next pass so no batch of the budget is left out."""
    group: list[dict] = []
    steps = None if cfg.local_steps is None else cfg.local_steps * size
    for batch in budget_batches(loader, steps, cfg.local_epochs if steps is None else None):
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group + list(budget_batches(loader, size - len(group), None))


def task_gradient(model: nn.Module, params: list[nn.Parameter], batch: dict, cfg: ClientConfig,
                  mixed_precision: bool = True) -> tuple[Tensor, list[Tensor]]:
    """The batch's loss and the gradient of f + (wd/2)‖w‖² at the parameters' current values (nothing is stepped)."""
    with autocast(cfg.device) if mixed_precision else contextlib.nullcontext():
        loss = cfg.loss_fn(model, batch)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(param) if grad is None else grad for param, grad in zip(params, grads)]
    if cfg.weight_decay:
        grads = torch._foreach_add(grads, [param.detach() for param in params], alpha=cfg.weight_decay)
    return loss.detach(), grads


def hessian_vector_product(model: nn.Module, params: list[nn.Parameter], batch: dict, vector: list[Tensor],
                           delta: float, cfg: ClientConfig) -> list[Tensor]:
    """(∇f(w + δu) − ∇f(w − δu))/(2δ) on ``batch``: both passes in full precision with the same random draws."""
    start = [param.detach().clone() for param in params]
    with same_random_draws(cfg.device):  # the minus pass below replays the plus pass's dropout masks
        set_values(params, torch._foreach_add(start, vector, alpha=delta))
        _, plus = task_gradient(model, params, batch, cfg, mixed_precision=False)
    set_values(params, torch._foreach_add(start, vector, alpha=-delta))
    _, minus = task_gradient(model, params, batch, cfg, mixed_precision=False)
    set_values(params, start)
    return torch._foreach_div(torch._foreach_sub(plus, minus), 2 * delta)


def same_random_draws(device: torch.device) -> contextlib.AbstractContextManager:
    """Torch's generators, restored on exit: what the block draws is drawn again after it (CPU and the CUDA device)."""
    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.random.fork_rng(devices=[index])


def set_values(params: list[nn.Parameter], values: list[Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_copy_(params, values)


def finite_mean(losses: list[Tensor]) -> float:
    """The mean loss, checked once at the end as the shared loop checks it."""
    mean = float(torch.stack(losses).float().mean()) if losses else 0.0
    if not math.isfinite(mean):
        raise NonFiniteLossError(f"the local training loss is {mean}")
    return mean
