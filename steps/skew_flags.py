"""Step 3b's flags for per-client skews (partitioning/skews.py): feature skew and concept shift on top of any scheme."""

from __future__ import annotations

import argparse

from partitioning.skews import (CONCEPT_FRACTIONS, LABEL_SWAP_HELP, NOISE_SIGMAS, SHIFT_LIMITS, SHIFT_ORDER,
                                TARGET_VARIANTS, parse_pairs)
from utils import cli
from utils.errors import TaskHetError


# The flags below, by argparse dest: what an experiment file's partition.skews may set.
SKEW_FLAGS = ("feature_noise", "feature_shift", "label_swap", "target_variant", "concept_fraction")
# A --feature_shift magnitude is read as any finite number first; its transform's own range is checked after.
_MAGNITUDE = cli.floats(-1e308, 1e308)


def add_skew_flags(parser: argparse.ArgumentParser) -> None:
    """The skew flags of make_client_assignments.py (any combination, with any --scheme and --size_skew)."""
    group = parser.add_argument_group("per-client skews (recorded per client in assignments.json, applied by step 4)")
    group.add_argument("--feature_noise", type=NOISE_SIGMAS, default=None, metavar="SIGMA",
                       help="feature skew, NIID-Bench's noise form: client i adds Gaussian noise of σ·i/(N−1) "
                            "(image units in [0, 1]); client 0 stays clean")
    limits = ", ".join(f"{name} in [0, {limit:g}]" for name, limit in SHIFT_LIMITS.items())
    group.add_argument("--feature_shift", default=None, metavar="NAME=MAX,...",
                       help="feature skew: per-client image shifts drawn in ±MAX (factors 1±MAX for brightness, "
                            "contrast, saturation; hue ±MAX; blur σ in [0, MAX] px; rotation ±MAX°); MAX per name: "
                            f"{limits}")
    group.add_argument("--label_swap", default=None, metavar="K|A-B,C-D",
                       help=f"concept shift (classification): {LABEL_SWAP_HELP}; K disjoint class pairs are drawn per "
                            "affected client, or the given pairs apply to every affected client")
    variants = " or ".join(f"{task}:{variant}" for task, names in TARGET_VARIANTS.items() for variant in names)
    group.add_argument("--target_variant", default=None, metavar="TASK:VARIANT",
                       help=f"concept shift (dense): affected clients' TASK targets come from VARIANT ({variants})")
    group.add_argument("--concept_fraction", type=CONCEPT_FRACTIONS, default=0.5,
                       help="share of clients a concept shift affects (rounded half up)")


def skew_settings(args: argparse.Namespace) -> dict[str, dict]:
    """Skew name -> its flag settings (checked by :func:`partitioning.skew_record.check_skew_settings` from the flags
    alone, and by :func:`partitioning.skew_record.draw_skews` against the data)."""
    settings: dict[str, dict] = {}
    if args.feature_noise is not None:
        settings["feature_noise"] = {"sigma": args.feature_noise}
    if args.feature_shift is not None:
        settings["feature_shift"] = {"limits": parse_limits(args.feature_shift)}
    if args.label_swap is not None:
        settings["label_swap"] = {"pairs": parse_pairs(args.label_swap), "fraction": args.concept_fraction}
    if args.target_variant is not None:
        task, _, variant = args.target_variant.partition(":")
        settings["target_variant"] = {"task": task.strip(), "variant": variant.strip(), "fraction": args.concept_fraction}
    return settings


def parse_limits(text: str) -> dict[str, float]:
    """``--feature_shift brightness=0.3,blur=1`` -> ``{"brightness": 0.3, "blur": 1.0}`` (numbers of ASCII digits; each
    transform's range is checked by the skew)."""
    limits: dict[str, float] = {}
    for part in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            number = _MAGNITUDE.parse(value)
        except ValueError:
            number = None
        if not sep or number is None:
            raise TaskHetError(f"--feature_shift {text!r}: expected NAME=MAX pairs ({', '.join(SHIFT_ORDER)}), got {part!r}")
        if name.strip() in limits:
            raise TaskHetError(f"--feature_shift {text!r}: {name.strip()!r} is given twice")
        limits[name.strip()] = number
    return limits
