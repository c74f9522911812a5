"""Mask rules: which entries to fine-tune, all selected at the same density (registry ``MASK_RULES``).

A rule turns the candidates' scores and weights into a *priority*: calibration trains
the entries of lowest priority first (``sparse.calibration.select``), so every rule
meets its density exactly and ties always break the same way (by flat index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from utils.registry import Registry

# priority(scores, weights, generator) -> [N]: flat vectors over the maskable entries; lowest trains first.
Priority = Callable[[Tensor | None, Tensor, torch.Generator], Tensor]


@dataclass(frozen=True)
class MaskRule:
    """A registered rule: its priority function and whether it reads sensitivity scores."""

    priority: Priority
    needs_scores: bool
    summary: str


MASK_RULES: Registry[MaskRule] = Registry("mask rule")


def _rule(name: str, needs_scores: bool, summary: str) -> Callable[[Priority], Priority]:
    def decorator(priority: Priority) -> Priority:
        MASK_RULES.register(name)(MaskRule(priority, needs_scores, summary))
        return priority

    return decorator


@_rule("least_sensitive", True, "TaLoS: fine-tune the entries of lowest score")
def least_sensitive(scores: Tensor | None, weights: Tensor, generator: torch.Generator) -> Tensor:
    return scores


@_rule("most_sensitive", True, "fine-tune the entries of highest score")
def most_sensitive(scores: Tensor | None, weights: Tensor, generator: torch.Generator) -> Tensor:
    return -scores


@_rule("lowest_magnitude", False, "fine-tune the entries of smallest |θ|")
def lowest_magnitude(scores: Tensor | None, weights: Tensor, generator: torch.Generator) -> Tensor:
    return weights.abs()


@_rule("highest_magnitude", False, "fine-tune the entries of largest |θ|")
def highest_magnitude(scores: Tensor | None, weights: Tensor, generator: torch.Generator) -> Tensor:
    return -weights.abs()


@_rule("random", False, "fine-tune uniformly random entries (seeded)")
def random(scores: Tensor | None, weights: Tensor, generator: torch.Generator) -> Tensor:
    # Drawn on the CPU generator so a seed gives the same mask on every device.
    return torch.rand(weights.shape, generator=generator).to(weights.device)


def get_rule(name: str) -> MaskRule:
    """The rule called ``name`` (an error listing the rules otherwise)."""
    return MASK_RULES.get(name)


def list_rules() -> list[str]:
    """Registered rule names, sorted."""
    return MASK_RULES.names()
