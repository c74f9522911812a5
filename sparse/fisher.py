"""Sensitivity scores: the diagonal of the Fisher information at the current weights.

For calibration inputs x_n and the model's predictive distribution p_θ(y|x), the
Fisher diagonal is F_j = Σ_n E_{ŷ∼p_θ(·|x_n)}[(∂ log p_θ(ŷ|x_n)/∂θ_j)²]. The
estimator here draws one label per example from the model's *own* prediction (never
the data's label: that is the "empirical Fisher", a different quantity) with a seeded
generator and sums the squared per-example gradients.

Two variants (``variant``):

* ``log_prob``: the squared gradient of log p(ŷ|x), the Fisher above. For a softmax
  it is the gradient of z_ŷ − logsumexp(z): every logit's gradient enters, weighted by
  (δ − p).
* ``logit``: TaLoS's variant, the squared gradient of the sampled *logit* z_ŷ alone
  (no normalisation term). Its expectation is Σ_c p_c (∂z_c/∂θ)², so an entry that
  moves every logit together (the normaliser cancels it in ``log_prob``) still
  scores high; it is not a Fisher information, but it is what TaLoS ranks by.

``exact=True`` replaces the Monte-Carlo draw by the expectation over ŷ, computed in
closed form from the per-example Jacobian of the outputs (K rows per example): it
costs K times more and is meant for tests and small heads.

Per-example gradients come from ``torch.func`` (``functional_call`` under ``vmap`` of
``grad``/``jacrev``), never from a Python loop over examples. The model is scored in
``eval()`` mode (BatchNorm running statistics, no dropout), its mode restored after.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap

from utils.errors import TaskHetError

LIKELIHOODS = ("categorical", "gaussian")
VARIANTS = ("log_prob", "logit")

# output_fn(forward, batch) -> model outputs [B, ...] (flattened to [B, K]); forward(x) runs the model.
OutputFn = Callable[[Callable[..., Tensor], dict], Tensor]


def model_outputs(input_key: str = "x") -> OutputFn:
    """An ``OutputFn`` that feeds ``batch[input_key]`` to the model; a tuple output gives its first element."""

    def outputs(forward: Callable[..., Tensor], batch: dict) -> Tensor:
        if input_key not in batch:
            raise TaskHetError(f"the calibration batch has no input {input_key!r}; its keys: {sorted(batch)}")
        result = forward(batch[input_key])
        return result[0] if isinstance(result, (tuple, list)) else result

    return outputs


def fisher_diagonal(model: nn.Module, batches: Iterable[dict], output_fn: OutputFn | None = None, *,
                    likelihood: str = "categorical", variant: str = "log_prob", num_batches: int | None = None,
                    generator: torch.Generator | None = None, exact: bool = False,
                    keys: Iterable[str] | None = None, chunk_size: int | None = None) -> dict[str, Tensor]:
    """The (sampled or exact) Fisher diagonal of ``model`` summed over the calibration examples.

    Args:
        model: any module; its parameters are read, never changed.
        batches: dicts of tensors batched on dim 0 (non-tensor entries are ignored).
        output_fn: how a batch becomes outputs (default ``model_outputs("x")``).
        likelihood: ``categorical`` (outputs are K logits) or ``gaussian`` (outputs are
            means of independent unit-variance Gaussians; ``log_prob`` only).
        variant: ``log_prob`` (the Fisher) or ``logit`` (TaLoS's sampled-logit score).
        num_batches: use the first this many batches (None: all).
        generator: the CPU generator of the label draws (seeded by the caller).
        exact: the expectation over ŷ instead of one draw per example.
        keys: parameter names to score (None: every parameter).
        chunk_size: examples per vectorised chunk (bounds memory: per-example gradients).

    Returns:
        Parameter name -> scores of the parameter's shape, float32, on the parameter's device.
    """
    _check(likelihood, variant)
    output_fn = output_fn or model_outputs()
    wanted = None if keys is None else set(keys)
    params = {name: param.detach() for name, param in model.named_parameters() if wanted is None or name in wanted}
    constants = {name: tensor.detach() for name, tensor in [*model.named_parameters(), *model.named_buffers()]
                 if name not in params}
    scores = {name: torch.zeros_like(param, dtype=torch.float32) for name, param in params.items()}
    generator = generator or torch.Generator().manual_seed(0)

    def outputs(trained: dict[str, Tensor], example: dict) -> Tensor:
        single = {key: value.unsqueeze(0) for key, value in example.items()}
        forward = lambda *args: functional_call(model, (trained, constants), args)  # noqa: E731
        return output_fn(forward, single).reshape(-1).float()

    with evaluating(model):
        for batch in _take(batches, num_batches):
            batch = {key: value for key, value in batch.items() if torch.is_tensor(value)}
            square = _expected_squares if exact else _sampled_squares
            per_example = square(outputs, params, batch, likelihood, variant, generator, chunk_size)
            for name, value in per_example.items():
                scores[name] += value.sum(0)
    return scores


def _sampled_squares(outputs: Callable, params: dict, batch: dict, likelihood: str, variant: str,
                     generator: torch.Generator, chunk_size: int | None) -> dict[str, Tensor]:
    """Squared per-example gradients at one label drawn per example from the model's prediction."""
    with torch.no_grad():
        predicted = vmap(outputs, in_dims=(None, 0), chunk_size=chunk_size)(params, batch)
    if likelihood == "categorical":
        probabilities = F.softmax(predicted, dim=-1).cpu()
        target = torch.multinomial(probabilities, 1, generator=generator).squeeze(1).to(predicted.device)
    else:
        target = predicted + torch.randn(predicted.shape, generator=generator).to(predicted.device)

    def objective(trained: dict, example: dict, label: Tensor) -> Tensor:
        out = outputs(trained, example)
        if likelihood == "gaussian":
            return -0.5 * ((label - out) ** 2).sum()
        chosen = out if variant == "logit" else F.log_softmax(out, dim=-1)
        return chosen.gather(0, label.unsqueeze(0)).squeeze(0)  # not chosen[label]: vmap cannot index by a tensor

    grads = vmap(grad(objective), in_dims=(None, 0, 0), chunk_size=chunk_size)(params, batch, target)
    return {name: value.float() ** 2 for name, value in grads.items()}


def _expected_squares(outputs: Callable, params: dict, batch: dict, likelihood: str, variant: str,
                      generator: torch.Generator, chunk_size: int | None) -> dict[str, Tensor]:
    """E_ŷ[squared per-example gradient], from the Jacobian J (K rows) of each example's outputs.

    categorical, log_prob: Σ_c p_c (J_c − Σ_k p_k J_k)²; categorical, logit: Σ_c p_c J_c²;
    gaussian: Σ_c J_c² (ε ∼ N(0, I): E[(Σ_c ε_c J_c)²] = Σ_c J_c²).
    """
    def per_example(example: dict) -> dict[str, Tensor]:
        jacobian = jacrev(outputs)(params, example)
        if likelihood == "gaussian":
            return {name: (value.float() ** 2).sum(0) for name, value in jacobian.items()}
        probabilities = F.softmax(outputs(params, example), dim=-1)
        result = {}
        for name, value in jacobian.items():
            rows = value.float().reshape(value.shape[0], -1)
            if variant == "log_prob":
                rows = rows - probabilities @ rows
            result[name] = (probabilities @ rows ** 2).reshape(value.shape[1:])
        return result

    return vmap(per_example, chunk_size=chunk_size)(batch)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` within the block, each submodule's own mode restored on exit."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.train(training)


def _take(batches: Iterable[dict], count: int | None) -> Iterator[dict]:
    taken = 0
    for batch in batches:
        if count is not None and taken == count:
            return
        taken += 1
        yield batch
    if taken == 0:
        raise TaskHetError("the Fisher scores need at least one calibration batch; the loader is empty")


def _check(likelihood: str, variant: str) -> None:
    if likelihood not in LIKELIHOODS:
        raise TaskHetError(f"likelihood must be one of {', '.join(LIKELIHOODS)}, got {likelihood!r}")
    if variant not in VARIANTS:
        raise TaskHetError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if likelihood == "gaussian" and variant == "logit":
        raise TaskHetError("the logit variant needs class logits (likelihood categorical); "
                           "a Gaussian output has no sampled logit")
