"""Mask rules (sparse/rules.py) and multi-round calibration (sparse/calibration.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparse.calibration import (calibrate_mask, default_maskable, density_schedule, fisher_score_fn, mask_density,
                                maskable_except, select)
from sparse.rules import list_rules
from utils.errors import TaskHetError


class Tiny(nn.Module):
    """Two maskable tensors (hand-made values) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([[0.5, -3.0, 1.0], [2.0, -0.1, 4.0]]))
        self.b = nn.Parameter(torch.tensor([-1.5, 0.2]))
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(x @ self.a[:, :2] + self.b)


SCORES = {"a": torch.tensor([[6.0, 1.0, 5.0], [2.0, 8.0, 3.0]]), "b": torch.tensor([7.0, 4.0])}


def constant_scores(round_index, masks):
    return SCORES


def chosen(masks) -> set[tuple[str, int]]:
    return {(name, index) for name, mask in masks.items() for index in mask.reshape(-1).nonzero().reshape(-1).tolist()}


@pytest.mark.parametrize("rule, expected", [
    ("least_sensitive", {("a", 1), ("a", 3), ("a", 5)}),  # scores 1, 2, 3
    ("most_sensitive", {("a", 4), ("b", 0), ("a", 0)}),  # scores 8, 7, 6
    ("lowest_magnitude", {("a", 4), ("b", 1), ("a", 0)}),  # |θ| 0.1, 0.2, 0.5
    ("highest_magnitude", {("a", 5), ("a", 1), ("a", 3)}),  # |θ| 4, 3, 2
])
def test_each_rule_selects_what_it_claims(rule, expected):
    masks = calibrate_mask(Tiny(), constant_scores, density=3 / 8, rule=rule)
    assert set(masks) == {"a", "b"} and chosen(masks) == expected


def test_random_is_seeded_and_exact():
    def draw(seed):
        return chosen(calibrate_mask(Tiny(), None, density=0.5, rounds=2, rule="random",
                                     generator=torch.Generator().manual_seed(seed)))

    assert draw(0) == draw(0) and len(draw(0)) == 4
    assert any(draw(seed) != draw(0) for seed in range(1, 4))


@pytest.mark.parametrize("rule", list_rules())
@pytest.mark.parametrize("rounds", [1, 3])
def test_every_rule_meets_the_density_exactly(rule, rounds):
    model = nn.Sequential(nn.Linear(7, 11), nn.LayerNorm(11), nn.Linear(11, 3))
    scores = {name: torch.rand(param.shape, generator=torch.Generator().manual_seed(1))
              for name, param in model.named_parameters()}
    masks = calibrate_mask(model, lambda r, m: scores, density=0.1, rounds=rounds, rule=rule)
    total = sum(param.numel() for param in model.parameters())
    assert sum(int(mask.sum()) for mask in masks.values()) == round(0.1 * total)
    assert mask_density(masks) == round(0.1 * total) / total


def test_the_schedule_is_d_to_the_r_plus_one_over_r_and_frozen_entries_never_return():
    assert density_schedule(0.01, 4) == pytest.approx([0.01 ** 0.25, 0.01 ** 0.5, 0.01 ** 0.75, 0.01])
    model = nn.Linear(40, 25)
    seen, generator = [], torch.Generator().manual_seed(0)

    def shifting_scores(round_index, masks):
        # Rank reversals between rounds: a frozen entry with the best new score must still stay frozen.
        seen.append({name: mask.clone() for name, mask in masks.items()})
        return {name: torch.rand(param.shape, generator=generator) for name, param in model.named_parameters()}

    final = calibrate_mask(model, shifting_scores, density=0.05, rounds=4)
    seen.append(final)
    total = 40 * 25 + 25
    counts = [sum(int(mask.sum()) for mask in masks.values()) for masks in seen]
    assert counts == [total] + [round(d * total) for d in density_schedule(0.05, 4)]
    for earlier, later in zip(seen, seen[1:]):
        for name in later:
            assert not (later[name] & ~earlier[name]).any()


def test_ties_break_by_flat_index():
    assert select(torch.zeros(6), torch.tensor([True, False, True, True, True, True]), 3).tolist() == \
        [True, False, True, True, False, False]


def test_the_maskable_rule_freezes_the_head_and_tokens_and_can_be_overridden():
    names = ["patch_embed.proj.weight", "cls_token", "pos_embed", "blocks.0.attn.qkv.weight", "blocks.0.norm1.bias",
             "blocks.0.mlp.fc1.weight", "norm.weight", "head.weight", "head.bias"]
    assert [name for name in names if default_maskable(name)] == [
        "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.norm1.bias", "blocks.0.mlp.fc1.weight",
        "norm.weight"]
    nested = maskable_except(prefixes=(), names=("pos_embed",))  # the last name of a nested entry counts
    assert not nested("encoder.backbone.pos_embed") and nested("encoder.pos_embed.proj")
    rule = maskable_except(prefixes=("blocks.",), names=(), frozen=("norm.weight",))
    assert [name for name in names if rule(name)] == ["patch_embed.proj.weight", "cls_token", "pos_embed",
                                                        "head.weight", "head.bias"]
    masks = calibrate_mask(Tiny(), constant_scores, density=1.0)
    assert set(masks) == {"a", "b"} and all(mask.all() for mask in masks.values())


def test_fisher_calibration_runs_end_to_end_and_bad_arguments_are_errors():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    batches = [{"x": torch.randn(5, 4, generator=torch.Generator().manual_seed(index))} for index in range(2)]
    score_fn = fisher_score_fn(model, lambda round_index: batches, seed=3)
    masks = calibrate_mask(model, score_fn, density=0.2, rounds=2, maskable=maskable_except(prefixes=("2.",)))
    assert set(masks) == {"0.weight", "0.bias"} and mask_density(masks) == round(0.2 * 40) / 40
    with pytest.raises(TaskHetError, match="density must be in"):
        density_schedule(0.0, 2)
    with pytest.raises(TaskHetError, match="needs sensitivity scores"):
        calibrate_mask(model, None, density=0.5)
    with pytest.raises(TaskHetError, match="unknown mask rule 'best'"):
        calibrate_mask(model, score_fn, density=0.5, rule="best")
    with pytest.raises(TaskHetError, match="no maskable parameter"):
        calibrate_mask(model, score_fn, density=0.5, maskable=lambda name: False)
