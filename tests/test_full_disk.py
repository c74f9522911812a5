"""A full disk is one ``error:`` line naming the path, never a torch traceback or a SIGBUS (issue 19, item 5).

Where the test machine lets us (root in a sandbox), the disk is real: a tmpfs of a few hundred KiB
mounted for the test, on which config.json, run.log and metrics.csv fit and a checkpoint does not.
Elsewhere those tests skip, and the injected ones (ENOSPC raised by the lowest write) still run.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from steps import assign, select
from tests.scripts_in_process import run_script
from utils import run_dir
from utils.cli import run_main
from utils.errors import DiskFullError
from utils.loaders import INCOMPLETE
from utils.run_dir import TEMP_PREFIX, MetricsCSV, atomic_torch_save, atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
DISK_BYTES = 512 * 1024  # holds the small files of a run, not a small_cnn checkpoint (~1 MB)


@pytest.fixture
def small_disk(tmp_path):
    """A real 512 KiB file system (tmpfs), or a skip where this machine cannot mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); the injected-ENOSPC tests still run")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def digits_inputs(tmp_path_factory):
    """A digits manifest and a 2-client partition (outside the small disk)."""
    root = tmp_path_factory.mktemp("digits")
    manifest = select.main(["--family", "digits", "--n_samples", "80", "--out", str(root / "step1")])
    assign.main(["--manifest", str(manifest), "--n_clients", "2", "--alpha", "1", "--out", str(root / "step3b")])
    return manifest, root / "step3b" / "assignments.csv"


def leftovers(folder: Path) -> list[str]:
    """Temporary files of atomic writes still in ``folder`` (there must be none)."""
    return [path.name for path in folder.rglob(f"{TEMP_PREFIX}*")]


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in stderr and "inline_container" not in stderr, stderr
    return lines[0]


def test_step2_on_a_full_disk_is_one_error_line_and_stays_incomplete(small_disk, digits_inputs, capsys, monkeypatch):
    manifest, _ = digits_inputs
    out = small_disk / "step2"
    result = run_script("train_centralized_task_model.py",
                        ["--task", "digit_class", "--manifest", str(manifest), "--encoder", "small_cnn", "--weights",
                         "none", "--image_size", "8", "--n_epochs", "1", "--batch_size", "16", "--out", str(out)],
                        capsys, monkeypatch)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith(f"error: {out}/") and ".pt: no space left on device" in line, line
    assert (out / INCOMPLETE).exists() and (out / "config.json").exists()
    assert not (out / "best.pt").exists() and leftovers(out) == []


def test_step4_on_a_full_disk_is_one_error_line_and_stays_incomplete(small_disk, digits_inputs, capsys):
    from steps import federated

    manifest, assignments = digits_inputs
    out = small_disk / "step4"
    argv = ["--task", "digit_class", "--method", "fedavg", "--manifest", str(manifest), "--assignments", str(assignments),
            "--encoder", "small_cnn", "--weights", "none", "--image_size", "8", "--n_rounds", "2", "--local_steps", "1",
            "--batch_size", "8", "--no-progress", "--out", str(out)]
    with pytest.raises(SystemExit) as stopped:
        run_main(federated.main, argv)
    assert stopped.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {out}/") and ".pt: no space left on device" in line, line
    assert (out / INCOMPLETE).exists() and not (out / "best.pt").exists() and leftovers(out) == []


def test_merge_on_a_full_disk_is_one_error_line_naming_merged_pt(small_disk, tmp_path, capsys, monkeypatch):
    base = {"weight": torch.zeros(300_000)}  # 1.2 MB: the merged model cannot fit on the 512 KiB disk
    torch.save(base, tmp_path / "base.pt")
    torch.save({"weight": torch.ones(300_000)}, tmp_path / "a.pt")
    out = small_disk / "merge"
    result = run_script("merge_task_vectors.py", ["--base", str(tmp_path / "base.pt"), "--finetuned",
                                                  f"a={tmp_path / 'a.pt'}", "--lam", "0.5", "--out", str(out)],
                        capsys, monkeypatch)
    assert result.returncode == 2, result.stderr
    assert one_error_line(result.stderr).startswith(f"error: {out / 'merged.pt'}: no space left on device")
    assert not (out / "merged.pt").exists() and leftovers(out) == []


def test_every_shared_write_names_its_file_on_a_real_full_disk(small_disk):
    (small_disk / "filler").write_bytes(b"\0" * (DISK_BYTES - 64 * 1024))
    metrics = MetricsCSV(small_disk / "metrics.csv", ["round", "note"])
    metrics.write([{"round": 0, "note": "kept"}])
    with pytest.raises(DiskFullError, match=f"^{re.escape(str(small_disk / 'model.pt'))}: no space left on device"):
        atomic_torch_save({"w": torch.zeros(100_000)}, small_disk / "model.pt")
    with pytest.raises(DiskFullError, match=f"^{re.escape(str(small_disk / 'report.md'))}: no space left on device"):
        atomic_write_text(small_disk / "report.md", "x" * 200_000)
    with pytest.raises(DiskFullError, match=f"^{re.escape(str(small_disk / 'metrics.csv'))}: no space left on device"):
        metrics.write([{"round": r, "note": "y" * 1000} for r in range(1, 200)])
    # The rows that did not fit are cut off whole: the file ends where it ended before the failed append.
    assert (small_disk / "metrics.csv").read_text() == "round,note\n0,kept\n"
    assert sorted(path.name for path in small_disk.iterdir()) == ["filler", "metrics.csv"]


def test_a_run_log_that_cannot_be_written_stops_the_run_naming_it(small_disk, capsys):
    logger = run_dir.setup_logging(small_disk / "run")
    logger.info("started")
    (small_disk / "filler").write_bytes(b"\0" * (DISK_BYTES - 16 * 1024))
    with pytest.raises(DiskFullError, match=f"^{re.escape(str(small_disk / 'run' / 'run.log'))}: no space left"):
        logger.info("x" * 100_000)
    assert "Logging error" not in capsys.readouterr().err
    run_dir.close_logging(small_disk / "run")


@pytest.mark.parametrize("quota", [errno.ENOSPC, errno.EDQUOT])
def test_an_injected_full_disk_in_the_lowest_write_names_the_checkpoint(tmp_path, monkeypatch, quota):
    """Where no tmpfs can be mounted: the file object's write raises ENOSPC/EDQUOT, as a full disk's does."""
    real_open = open

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            raise OSError(quota, os.strerror(quota))

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    monkeypatch.setattr(run_dir, "open", lambda *args, **kwargs: FullDisk(real_open(*args, **kwargs)), raising=False)
    reason = "no space left on device" if quota == errno.ENOSPC else "disk quota exceeded"
    with pytest.raises(DiskFullError, match=f"^{re.escape(str(tmp_path / 'best.pt'))}: {reason} while writing it"):
        atomic_torch_save({"w": torch.zeros(10)}, tmp_path / "best.pt")
    assert list(tmp_path.iterdir()) == []


CACHE_SCRIPT = """
import numpy as np
from datasets.cache import DecodedSampleCache
from utils.cli import run_main

def fill(argv):
    cache = DecodedSampleCache({folder!r}, "k" * 64, 64, {{"x": ((64, 64), np.float32)}})  # 1 MiB of rows
    for row in range(64):
        cache.put(row, {{"x": np.ones((64, 64), np.float32)}})
    print("filled", cache.num_filled())

run_main(fill)
"""


def run_cache_script(folder: Path) -> subprocess.CompletedProcess:
    code = CACHE_SCRIPT.format(folder=str(folder))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_memory_mapped_cache_on_a_full_disk_is_an_error_not_sigbus(small_disk):
    result = run_cache_script(small_disk / "cache")
    assert result.returncode != -signal.SIGBUS, "the process died of SIGBUS writing through the map"
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith(f"error: {small_disk / 'cache'}/decoded_") and "no space left on device" in line, line
    assert list((small_disk / "cache").iterdir()) == []  # no half-made cache left to be reused


def test_the_cache_reports_a_failing_reservation_as_an_error_line(tmp_path, monkeypatch, capsys):
    """Injected: posix_fallocate refuses (ENOSPC) on an ordinary disk; the run must not go on to map. In this
    process: on an ordinary disk a map would not fault (the SIGBUS case above has its own process)."""
    import numpy as np

    from datasets.cache import DecodedSampleCache

    def refuse(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fill(argv):  # CACHE_SCRIPT's run
        cache = DecodedSampleCache(tmp_path / "cache", "k" * 64, 64, {"x": ((64, 64), np.float32)})
        for row in range(64):
            cache.put(row, {"x": np.ones((64, 64), np.float32)})
        print("filled", cache.num_filled())

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    with pytest.raises(SystemExit) as stopped:
        run_main(fill, [])
    captured = capsys.readouterr()
    assert stopped.value.code == 2, captured.out
    assert one_error_line(captured.err).startswith(f"error: {tmp_path / 'cache'}/decoded_")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_new_cache_holds_its_disk_blocks_before_any_row_is_written(tmp_path):
    import numpy as np

    from datasets.cache import DecodedSampleCache

    cache = DecodedSampleCache(tmp_path, "k" * 64, 64, {"x": ((64, 64), np.float32)})
    data = os.stat(cache.directory / "x.npy")
    assert data.st_size >= 64 * 64 * 64 * 4 and data.st_blocks * 512 >= data.st_size  # no holes left to fault on
    assert cache.num_filled() == 0
