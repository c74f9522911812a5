"""What every family's step 1 writes, written once: the manifest, its class counts and config.json.

The folder is claimed for step 1 before anything is written, and stays marked unfinished
until the last file is in place (utils/run_dir.py), so a killed step 1 never looks done.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pandas as pd

from datasets.folder_files import skipped_line
from utils.run_dir import atomic_write_text, claim_folder, unfinished, write_config

STEP = "step 1"


def claim_step1_folder(out: Path) -> None:
    """Refuse ``out`` unless it is empty or another step-1 run's folder (before any work)."""
    claim_folder(out, STEP)


def write_step1_outputs(args: argparse.Namespace, manifest: pd.DataFrame, counts: pd.DataFrame) -> Path:
    """Write ``manifest.csv``, ``class_counts.csv`` and ``config.json`` into ``args.out``; returns the manifest's path."""
    path = args.out / "manifest.csv"
    with unfinished(args.out, STEP):
        atomic_write_text(path, manifest.to_csv(index=False))
        atomic_write_text(args.out / "class_counts.csv", counts.to_csv(index=False))
        write_config(args.out, vars(args), step=STEP)
    return path


def log_folder_notes(logger: logging.Logger, root: Path, skipped: list[str], unlisted: int, kind: str) -> None:
    """A folder family's two notes: one warning on the entries under ``root`` it skipped (those that ``kind``), and
    how many images the split CSV leaves out."""
    warning = skipped_line(root, skipped, kind)
    if warning:
        logger.warning(warning)
    if unlisted:
        logger.info("the split CSV leaves out %d image(s) of %s", unlisted, root)
