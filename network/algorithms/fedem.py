"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021).

The server holds M component models h_1 … h_M; client i holds mixture weights π_i (its state).
The worker model is a :class:`Mixture`: the M components plus the buffer ``mixture_weights``
(π, private to each client; the server's copy stays uniform).

Client, each round (Algorithm 1 of the paper):
1. E-step: for each of its training samples s, q_s(m) ∝ π_m·p_m(y_s|x_s), with
   −log p_m(y|x) the task's per-sample loss of component m (the authors' choice: cross-entropy
   for classification, a unit-variance Gaussian for a squared error). Computed in eval mode over
   one pass, in log space (a large loss cannot underflow to 0/0), and **keyed by the batch's
   ``sample_id``**, not by the position in the batch, so a loader that shuffles differently on
   every pass cannot misalign q with its samples.
2. M-step: π ← mean over samples of q.
3. Each component m trains for the local budget on the q-weighted loss mean_s q_s(m)·ℓ_m(s)
   (the other components frozen): the local compute is M× FedAvg's.
4. Upload Δ of every component (M× FedAvg's upload) and keep π.

With M = 1, q ≡ 1 and π = 1: the E-step is skipped and the one component trains on the task
loss itself, so FedEM with M = 1 is FedAvg bit for bit (tested).

Server: each component is averaged over the clients' uploads (the model-averaging server, so
``weighting`` and the server optimiser apply per component). Components 2..M start as the
initial model plus Gaussian noise of standard deviation ``init_noise`` (identical copies would
never separate).

Prediction: a client's model mixes its components with its π. ``mix probabilities`` (the
paper) mixes class *probabilities*, Σ_m π_m·softmax(z_m), returned as log-probabilities (valid
logits: cross-entropy then is the mixture's negative log-likelihood); it needs a model whose head
outputs class logits. ``mix values`` mixes predictions, Σ_m π_m·ŷ_m (the mixture's mean, for
regression and dense tasks). ``auto`` picks probabilities for a model that declares a logit head
(a TaskModel whose task has no output activation) and values otherwise. The global model uses
uniform π.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterable

import psutil
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from network.aggregation import ServerOptSettings, subtract
from network.algorithms.base import (ALGORITHMS, GLOBAL_MODEL, LOCAL_STEPS, TRAIN_LOSS, Bundle, ClientConfig,
                                     ClientResult, ServerState, Weights, copy_state, load_weights, require)
from network.algorithms.skeleton import DELTA, ModelAveraging, Phase, run_phases
from network.settings import check, setting
from utils.device import to_device
from utils.errors import TaskHetError
from utils.seeding import torch_generator

MIXES = ("auto", "probabilities", "values")
PI = "mixture_weights"  # the Mixture's buffer π (client state; the server's copy stays uniform)
SAMPLE_ID = "sample_id"  # the batch key the E-step is keyed by
PI_METRIC = "pi_{}"  # client metrics: π_m after the M-step


MAX_COMPONENTS = 64  # n_components: each component is a whole model, trained and kept per client


@dataclass(frozen=True)
class FedEMSettings(ServerOptSettings):
    n_components: int = setting(3, "M, the number of component models", high=MAX_COMPONENTS)
    init_noise: float = setting(0.01, "standard deviation of the noise that makes components 2..M differ at start")
    mix: str = setting("auto", "how a client's prediction mixes its components: probabilities (class logit heads), "
                               "values, or auto", choices=MIXES)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.n_components >= 1, "n_components", ">= 1", self.n_components)
        check(self.init_noise >= 0, "init_noise", ">= 0", self.init_noise)
        check(self.mix in MIXES, "mix", f"one of {', '.join(MIXES)}", self.mix)


def outputs_logits(model: nn.Module) -> bool | None:
    """True when the model declares class-logit outputs (a TaskModel whose task has no activation), None if unknown."""
    task = getattr(model, "task", None)
    return None if task is None else getattr(task, "activation", None) == "identity"


class Mixture(nn.Module):
    """M copies of a model and the mixture weights π; ``forward`` mixes their predictions (see the module docstring).

    A component's output may be a tensor or a tuple whose first item is the prediction (a
    TaskModel's ``(prediction, embedding)``); the mixture then returns the mixed prediction with
    the first component's other items.
    """

    def __init__(self, model: nn.Module, n_components: int, mix_probabilities: bool) -> None:
        super().__init__()
        self.components = nn.ModuleList([model] + [copy.deepcopy(model) for _ in range(n_components - 1)])
        self.mix_probabilities = mix_probabilities
        reference = next(model.parameters())
        self.register_buffer(PI, torch.full((n_components,), 1.0 / n_components, dtype=reference.dtype))

    def forward(self, inputs):
        outputs = [component(inputs) for component in self.components]
        predictions = [output[0] if isinstance(output, tuple) else output for output in outputs]
        pi = getattr(self, PI)
        if self.mix_probabilities:
            log_probabilities = torch.stack([F.log_softmax(prediction.float(), dim=1) for prediction in predictions])
            log_pi = pi.float().log().view(-1, *([1] * predictions[0].dim()))
            mixed = torch.logsumexp(log_probabilities + log_pi, dim=0)
        else:
            mixed = sum(weight * prediction for weight, prediction in zip(pi, predictions))
        return (mixed, *outputs[0][1:]) if isinstance(outputs[0], tuple) else mixed

    def head_keys(self) -> list[str]:
        inner = getattr(self.components[0], "head_keys", None)
        heads = inner() if callable(inner) else []
        return [f"components.{index}.{key}" for index in range(len(self.components)) for key in heads]


def _check_components_fit_in_memory(model: nn.Module, n_components: int) -> None:
    """One clear line, before any copy is made, when M copies of the model cannot fit in the free memory (a typo
    such as 100000000 would otherwise end in an allocation traceback). M is not bounded by the number of clients:
    the E-step weighs components per sample, so M > K is a legitimate (if unusual) FedEM run."""
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    available = psutil.virtual_memory().available
    require(n_components * model_bytes <= available,
            f"fedem setting n_components={n_components} needs {n_components} copies of the model "
            f"({n_components * model_bytes / 2**30:.3g} GiB), more than the free memory ({available / 2**30:.3g} GiB)")


@ALGORITHMS.register("fedem")
class FedEM(ModelAveraging):
    """M shared component models; each client learns its mixture weights π by EM and mixes their predictions."""

    name = "fedem"
    use_when = "each client's data mixes a few shared distributions; M× the compute"
    Settings = FedEMSettings
    personalized = True

    @classmethod
    def worker_model(cls, model: nn.Module, settings: FedEMSettings) -> nn.Module:
        logits = outputs_logits(model)
        if settings.mix == "probabilities" and not logits:
            raise TaskHetError("fedem setting mix probabilities needs a model whose head outputs class logits "
                               f"(a classifier head); {type(model).__name__} does not declare one (use mix values)")
        _check_components_fit_in_memory(model, settings.n_components)
        return Mixture(model, settings.n_components, bool(logits) if settings.mix == "auto" else
                       settings.mix == "probabilities")

    def private_keys(self) -> frozenset[str]:
        return frozenset({PI})

    def init_server(self, weights: Weights) -> ServerState:
        layout = self.federation.layout
        noisy = (layout.param_keys - layout.fixed_keys) if self.settings.init_noise else frozenset()
        perturbed = dict(weights)
        for index in range(1, self.settings.n_components):
            generator = torch_generator(self.federation.seed, "fedem-init", index)
            prefix = f"components.{index}."
            for key in (key for key in weights if key.startswith(prefix) and key in noisy):
                noise = torch.randn(weights[key].shape, generator=generator, dtype=torch.float64)
                perturbed[key] = weights[key] + (self.settings.init_noise * noise).to(weights[key].dtype)
        return super().init_server(perturbed)

    def client_update(self, model: nn.Module, broadcast: Bundle, client_state: Weights,
                      loader: Iterable[dict], cfg: ClientConfig) -> ClientResult:
        start = broadcast[GLOBAL_MODEL]
        load_weights(model, start)
        load_weights(model, client_state)
        count = self.settings.n_components
        metrics: dict[str, float] = {LOCAL_STEPS: 0}
        if count == 1:  # q ≡ 1: the component trains on the task loss itself (FedAvg, bit for bit)
            phases = [(Phase(keys=self._component_keys(0)), _component_loss(cfg.loss_fn, 0, None))]
        else:
            responsibilities = self.responsibilities(model, loader, cfg)
            pi = torch.stack(list(responsibilities.values())).mean(0)
            getattr(model, PI).copy_(pi.to(getattr(model, PI).dtype))
            metrics.update({PI_METRIC.format(index): float(value) for index, value in enumerate(pi)})
            phases = [(Phase(keys=self._component_keys(index)),
                       _component_loss(cfg.loss_fn, index, {key: row[index] for key, row in responsibilities.items()}))
                      for index in range(count)]
        losses = []
        for phase, loss_fn in phases:
            result = run_phases(model, [phase], loader, dataclasses.replace(cfg, loss_fn=loss_fn))
            losses.append(result[TRAIN_LOSS])
            metrics[LOCAL_STEPS] += result[LOCAL_STEPS]
        metrics[TRAIN_LOSS] = sum(losses) / len(losses)
        upload = {DELTA: subtract(model.state_dict(), start, self.shared_keys())}
        return ClientResult(upload, copy_state(model, [PI]), metrics, cfg.num_samples)

    def responsibilities(self, model: nn.Module, loader: Iterable[dict], cfg: ClientConfig) -> dict[str, Tensor]:
        """E-step: sample id -> q (a float64 vector over the M components), from one pass in eval mode."""
        log_pi = getattr(model, PI).double().log()
        rows: dict[str, Tensor] = {}
        model.eval()
        with torch.no_grad():
            for batch in loader:
                ids = sample_ids(batch)
                batch = to_device(batch, cfg.device)
                losses = torch.stack([cfg.loss_fn(component, batch, reduction="none").double()
                                      for component in model.components], dim=1)  # [B, M]
                log_q = log_pi.to(losses.device) - losses
                q = (log_q - torch.logsumexp(log_q, dim=1, keepdim=True)).exp().cpu()
                rows.update(zip(ids, q))
        require(bool(rows), "fedem needs a client with training data (the E-step saw no sample)")
        return rows

    def _component_keys(self, index: int) -> list[str]:
        prefix = f"components.{index}."
        return [key for key in self.federation.layout.state_keys if key.startswith(prefix)]


def sample_ids(batch: dict) -> list[str]:
    """The batch's sample ids as strings (a tensor of ids or a collated list of strings)."""
    if SAMPLE_ID not in batch:
        raise TaskHetError(f"fedem keys its E-step by sample id: every batch needs a {SAMPLE_ID!r} entry "
                           f"(this one has {sorted(batch)})")
    ids = batch[SAMPLE_ID]
    return [str(value) for value in (ids.tolist() if torch.is_tensor(ids) else ids)]


def _component_loss(loss_fn, index: int, weights: dict[str, Tensor] | None):
    """The loss of component ``index``: the task loss (weights None) or mean_s q_s(m)·ℓ_m(s) with q looked up by id."""

    def loss(model: nn.Module, batch: dict, reduction: str = "mean") -> Tensor:
        component = model.components[index]
        if weights is None:
            return loss_fn(component, batch, reduction)
        per_sample = loss_fn(component, batch, reduction="none")
        try:
            q = torch.stack([weights[key] for key in sample_ids(batch)]).to(per_sample.device, per_sample.dtype)
        except KeyError as missing:
            raise TaskHetError(f"fedem: sample {missing} of a training batch was not in the E-step's pass") from None
        weighted = q * per_sample
        return weighted.mean() if reduction == "mean" else weighted

    return loss
