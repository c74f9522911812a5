"""Step 1 of any data family: ``--family`` picks the family's own step-1 command line (default: taskonomy).

The command line is parsed in two stages, as step 4's is: ``--family`` first, then
exactly the flags of that family's step 1, so a flag of another family is an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

from datasets.family import get_family
from steps import select_cifar, select_digits, select_imagefolder, select_paired, select_scenes
from utils import cli
from utils.errors import TaskHetError

# Each family's step-1 module (build_parser, main); tests check it covers every registered family.
STEP1_MODULES = {"taskonomy": select_scenes, "digits": select_digits, "cifar": select_cifar,
                 "imagefolder": select_imagefolder, "paired_folders": select_paired}


def main(argv: list[str] | None = None) -> Path:
    """Run the step 1 of the family ``--family`` names with the rest of ``argv``.

    Returns:
        The path of the manifest.csv written (its ``family`` column names the family).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    first = cli.ArgumentParser(add_help=False)
    first.add_argument("--family", default="taskonomy")
    known, rest = first.parse_known_args(argv)
    try:
        get_family(known.family)
    except TaskHetError as error:
        raise TaskHetError(f"--family: {error}") from None
    return STEP1_MODULES[known.family].main(rest)
