"""A top-level script run in the test's process as ``python script.py ARGS`` runs it, without a Python start-up.

:func:`run_script` executes the script file itself (``runpy``, as ``__main__``, with ``sys.argv`` set), so its
``run_main(main)`` parses, checks and prints its one-line errors exactly as in a shell, without the 3-5 s of
imports a ``subprocess.run([sys.executable, "script.py", ...])`` pays. Tests whose subject is the process itself
(a signal, a kill, a worker process, the environment at start-up, the modules a fresh interpreter imports) keep
their subprocess.
"""

from __future__ import annotations

import runpy
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ScriptResult:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have given."""

    returncode: int
    stdout: str
    stderr: str


def run_script(script: str, argv: list[str], capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> ScriptResult:
    """Run the repository's ``script`` (a file name at its root) with ``argv``: its exit code and console.

    The signal handlers ``run_main`` sets (SIGTERM raises, a second Ctrl-C is ignored) are put back after.
    """
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    capsys.readouterr()  # what the test printed before
    monkeypatch.setattr(sys, "argv", [script, *map(str, argv)])
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else (0 if exit_info.code is None else 1)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    captured = capsys.readouterr()
    return ScriptResult(code, captured.out, captured.err)
