"""Multi-round mask calibration (TaLoS): shrink the trainable set to density d in R rounds.

Round r = 0..R−1 keeps the fraction d_r = d^{(r+1)/R} of the maskable entries (so
d_{R−1} = d): it recomputes the scores, considers only entries still trainable (a
frozen entry never returns) and keeps the ``round(d_r · N)`` candidates of lowest
priority under the rule, by one global threshold over all maskable parameters
together. Selection is by count (a stable sort, ties broken by flat index in the
models' parameter order), so the final density is the target exactly up to the
rounding of d·N to an integer. Weights are never changed: frozen entries keep their
pretrained values (this is not pruning), so what changes between rounds is the draw
of calibration labels and the candidate set the scores are ranked within.

Which parameters are maskable is a rule over parameter names (``maskable``): by
default every parameter except the classification head and the learned tokens and
position embeddings — for a timm ViT, the weights and biases of the patch embedding,
attention, MLP and LayerNorm layers. Non-maskable parameters are frozen entirely.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from sparse.fisher import OutputFn, fisher_diagonal
from sparse.rules import get_rule
from utils.errors import TaskHetError
from utils.seeding import torch_generator

Masks = dict[str, Tensor]  # parameter name -> bool tensor of its shape, True = trainable
# score_fn(round_index, masks) -> parameter name -> scores (at least every maskable name that has a candidate)
ScoreFn = Callable[[int, Masks], dict[str, Tensor]]

HEAD_PREFIXES = ("head.", "fc.", "classifier.")  # timm's classifier names (get_classifier)
TOKEN_NAMES = ("cls_token", "reg_token", "dist_token", "pos_embed", "mask_token")


def default_maskable(name: str) -> bool:
    """True unless ``name`` is in the classification head or is a learned token / position embedding."""
    return not name.startswith(HEAD_PREFIXES) and name.rsplit(".", 1)[-1] not in TOKEN_NAMES


def maskable_except(prefixes: Iterable[str] = HEAD_PREFIXES, names: Iterable[str] = TOKEN_NAMES,
                    frozen: Iterable[str] = ()) -> Callable[[str], bool]:
    """A maskable rule excluding parameters under ``prefixes``, with a last name in ``names``, or listed in ``frozen``."""
    prefixes, names, frozen = tuple(prefixes), frozenset(names), frozenset(frozen)
    return lambda name: (name not in frozen and not name.startswith(prefixes)
                         and name.rsplit(".", 1)[-1] not in names)


def density_schedule(density: float, rounds: int) -> list[float]:
    """d_r = d^{(r+1)/R} for r = 0..R−1."""
    if not 0 < density <= 1:
        raise TaskHetError(f"density must be in (0, 1], got {density}")
    if rounds < 1:
        raise TaskHetError(f"calibration rounds must be >= 1, got {rounds}")
    return [density ** ((index + 1) / rounds) for index in range(rounds)]


def select(priority: Tensor, candidates: Tensor, count: int) -> Tensor:
    """The ``count`` candidates of lowest priority (ties: lower flat index first) as a flat bool mask."""
    index = candidates.nonzero().squeeze(1)
    if count > index.numel():
        raise TaskHetError(f"cannot keep {count} entries out of {index.numel()} candidates")
    order = torch.sort(priority[index], stable=True).indices[:count]
    mask = torch.zeros_like(candidates)
    mask[index[order]] = True
    return mask


def calibrate_mask(model: nn.Module, score_fn: ScoreFn | None, *, density: float, rounds: int = 1,
                   rule: str = "least_sensitive", maskable: Callable[[str], bool] = default_maskable,
                   generator: torch.Generator | None = None) -> Masks:
    """A mask over the maskable parameters at exactly ``density``, narrowed over ``rounds`` rounds.

    Args:
        model: any module (its weights are read, never changed).
        score_fn: the sensitivity scores of a round (None is allowed for rules that read none).
        density: the final fraction of maskable entries that train, in (0, 1].
        rounds: R, the number of calibration rounds.
        rule: a name from ``sparse.rules.list_rules()``.
        maskable: which parameter names may train at all.
        generator: the CPU generator of the ``random`` rule.

    Returns:
        Maskable parameter name -> bool mask (True = trainable); absent parameters are frozen.
    """
    chosen = get_rule(rule)
    params = {name: param.detach() for name, param in model.named_parameters() if maskable(name)}
    if not params:
        raise TaskHetError("no maskable parameter: the maskable rule excludes every parameter of the model")
    if chosen.needs_scores and score_fn is None:
        raise TaskHetError(f"mask rule {rule} needs sensitivity scores")
    weights = torch.cat([param.reshape(-1) for param in params.values()])
    candidates = torch.ones_like(weights, dtype=torch.bool)
    generator = generator or torch.Generator().manual_seed(0)
    masks = _split(candidates, params)
    for index, round_density in enumerate(density_schedule(density, rounds)):
        scores = None
        if chosen.needs_scores:
            round_scores = score_fn(index, masks)
            scores = torch.cat([round_scores[name].reshape(-1).to(weights.device).float() for name in params])
        count = round(round_density * weights.numel())
        candidates = select(chosen.priority(scores, weights, generator), candidates, count)
        masks = _split(candidates, params)
    return masks


def fisher_score_fn(model: nn.Module, batches: Callable[[int], Iterable[dict]], output_fn: OutputFn | None = None, *,
                    likelihood: str = "categorical", variant: str = "log_prob", num_batches: int | None = None,
                    seed: int = 0) -> ScoreFn:
    """A ``ScoreFn`` computing Fisher scores on ``batches(round_index)`` with fresh, seeded label draws per round.

    Only parameters with a remaining candidate are scored (a frozen parameter costs nothing).
    """

    def scores(round_index: int, masks: Masks) -> dict[str, Tensor]:
        keys = [name for name, mask in masks.items() if bool(mask.any())]
        generator = torch_generator(seed, "fisher_labels", round_index)
        result = fisher_diagonal(model, batches(round_index), output_fn, likelihood=likelihood, variant=variant,
                                 num_batches=num_batches, generator=generator, keys=keys)
        return {name: result.get(name, torch.zeros_like(mask, dtype=torch.float32)) for name, mask in masks.items()}

    return scores


def mask_density(masks: Masks) -> float:
    """The fraction of True entries over all masks."""
    total = sum(mask.numel() for mask in masks.values())
    return sum(int(mask.sum()) for mask in masks.values()) / max(total, 1)


def _split(flat: Tensor, params: dict[str, Tensor]) -> Masks:
    masks, start = {}, 0
    for name, param in params.items():
        masks[name] = flat[start:start + param.numel()].reshape(param.shape).clone()
        start += param.numel()
    return masks
