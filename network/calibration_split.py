"""The server's held-out calibration split (``--calibration_fraction``): manifest train rows no client holds.

Server-side calibration (sparse_ft's ``mask_source server``: the mask calibrated once,
before round 1) needs data no client trains on, or the server would see client data.
The rows come from the manifest's train split minus every row of the assignments: a
seeded draw of ``round(fraction · |manifest train rows|)`` of them, so the size does not
depend on how many rows the partition left over. A partition that assigns every train
row leaves none: make it from a manifest without the rows to hold out (step 3b reads
only the rows it is given), then run step 4 on the full manifest.
"""

from __future__ import annotations

import pandas as pd

from datasets.family import validation_mask

from utils.errors import TaskHetError
from utils.seeding import numpy_rng


def calibration_ids(manifest: pd.DataFrame, table: pd.DataFrame, fraction: float, seed: int,
                    purpose: str = "calibration_split", flag: str = "--calibration_fraction") -> list:
    """Sample ids of the calibration split, in manifest order (empty when ``fraction`` is 0).

    Args:
        manifest: the step-1 manifest (``sample_id``, ``split``).
        table: the assignments (``sample_id``): rows a client holds are never drawn.
        fraction: share of the manifest's train rows to draw, in [0, 1).
        seed: the run's root seed (the draw uses its own generator).
        purpose, flag: another held-out draw (merge_task_vectors.py's validation split) names its own
            generator and flag.
    """
    if not 0 <= fraction < 1:
        raise TaskHetError(f"{flag} must be in [0, 1), got {fraction}")
    if fraction == 0:
        return []
    # Validation rows (val = 1) select models; a draw from them would leak into that choice.
    train = manifest.loc[(manifest["split"] == "train") & ~validation_mask(manifest), "sample_id"]
    free = train[~train.isin(table["sample_id"])]
    count = max(1, round(fraction * len(train)))
    if count > len(free):
        raise TaskHetError(f"{flag} {fraction} needs {count} of the manifest's {len(train)} train rows "
                           f"that no client holds, but the assignments leave {len(free)}; make the assignments from a "
                           "manifest without the rows to hold out (network/calibration_split.py)")
    chosen = numpy_rng(seed, purpose).choice(len(free), size=count, replace=False)
    return free.iloc[sorted(chosen)].tolist()
