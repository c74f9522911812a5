"""An optional TensorBoard copy of a run's metrics.csv (``--tensorboard``, steps 2 and 4).

metrics.csv stays the source of truth: :class:`TensorBoardMirror` has MetricsCSV's interface
(``write``, ``truncate_after``) and passes every call on to it, then writes the same rows as
TensorBoard scalars (torch's ``SummaryWriter``) under ``<run>/tensorboard``. A scalar's tag is
its row's other columns joined by ``/`` (``test/global/loss`` for step 4, ``val/top1`` for step
2) and its step the row's epoch or round. A resumed run truncates metrics.csv past its
checkpoint; the mirror then opens its writer with ``purge_step`` so TensorBoard drops the same
steps instead of showing them twice.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

from utils.errors import TaskHetError

TENSORBOARD_DIR = "tensorboard"


class TensorBoardMirror:
    """``metrics`` (a MetricsCSV) plus the same rows as TensorBoard scalars in ``log_dir``."""

    def __init__(self, metrics, log_dir: Path, step_column: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TaskHetError("--tensorboard needs the tensorboard package: "
                               "pip install -c constraints.txt tensorboard") from None
        self._writer_class = SummaryWriter
        self.metrics, self.log_dir, self.step_column = metrics, Path(log_dir), step_column
        self.path = metrics.path
        self._writer = None
        self._purge_step = 0  # a fresh run drops any events an earlier run left in the folder

    def truncate_after(self, column: str, last_kept: int) -> None:
        self.metrics.truncate_after(column, last_kept)
        self.close()
        self._purge_step = last_kept + 1

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        rows = list(rows)
        self.metrics.write(rows)
        if self._writer is None:
            self._writer = self._writer_class(str(self.log_dir), purge_step=self._purge_step)
        for row in rows:
            value = row["value"]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                tag = "/".join(str(row[key]) for key in row if key not in (self.step_column, "value"))
                self._writer.add_scalar(tag, float(value), int(row[self.step_column]))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def mirror_to_tensorboard(metrics, enabled: bool, run_dir: Path, step_column: str):
    """``metrics`` itself, or a :class:`TensorBoardMirror` of it writing into ``run_dir/tensorboard`` when ``enabled``."""
    return TensorBoardMirror(metrics, Path(run_dir) / TENSORBOARD_DIR, step_column) if enabled else metrics
