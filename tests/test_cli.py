"""run_main (utils/cli.py): bad input is one ``error:`` line, never a traceback, never on a progress bar's line."""

from __future__ import annotations

import errno

import pytest
from tqdm import tqdm

from utils.cli import run_main
from utils.errors import TaskHetError


def exit_of(main, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, [])
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("error, line", [
    (TaskHetError("--alpha must be > 0"), "error: --alpha must be > 0"),
    (PermissionError(errno.EACCES, "Permission denied", "/results/ro/metrics.csv"),
     "error: /results/ro/metrics.csv: Permission denied"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/tmp/file/run"), "error: /tmp/file/run: Not a directory"),
    (FileExistsError(errno.EEXIST, "File exists", "/tmp/out"), "error: /tmp/out: File exists"),
])
def test_bad_input_is_one_error_line_with_exit_code_2(capsys, error, line):
    def main(argv):
        raise error

    code, err = exit_of(main, capsys)
    assert code == 2 and err.strip().splitlines() == [line]


def test_the_error_line_never_shares_a_line_with_a_progress_bar(capsys):
    def main(argv):
        bar = tqdm(total=10, desc="rounds")
        bar.update(3)
        raise TaskHetError("round 4, client 2: the local training loss is nan")

    code, err = exit_of(main, capsys)
    assert code == 2
    lines = err.replace("\r", "\n").splitlines()
    assert "error: round 4, client 2: the local training loss is nan" in lines  # a line of its own


def test_an_os_error_without_a_path_is_a_bug_and_keeps_its_traceback():
    def main(argv):
        raise OSError("device not ready")

    with pytest.raises(OSError, match="device not ready"):
        run_main(main, [])
