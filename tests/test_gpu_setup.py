"""make setup-gpu pins the versions constraints.txt pins (the Makefile reads them from the file, so the two cannot
drift), make gpu-check runs the quick GPU check, and utils/gpu_setup.py names what differs from the CUDA builds."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from utils.errors import TaskHetError
from utils.gpu_setup import build_problems, main, read_pins

ROOT = Path(__file__).resolve().parent.parent
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def dry_run(target: str, *variables: str) -> str:
    """``make -n TARGET`` in the repository: the commands it would run (continuation lines joined), none run."""
    done = subprocess.run(["make", "--no-print-directory", "-n", target, *variables], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return done.stdout.replace("\\\n", " ")


def pip_pins(commands: str) -> tuple[str, dict[str, str]]:
    """The index and the ``name==version`` requirements of the one pip command that names --index-url."""
    lines = [line for line in commands.splitlines() if "pip install" in line and "--index-url" in line]
    assert len(lines) == 1, commands
    words = lines[0].split()
    index = words[words.index("--index-url") + 1]
    pins = dict(word.split("==", 1) for word in words if "==" in word)
    return index, pins


def constraint_pins(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {name: re.search(rf"^{name}==(\S+)$", text, re.MULTILINE).group(1) for name in ("torch", "torchvision")}


@needs_make
def test_setup_gpu_installs_the_cuda_builds_of_the_constraints_pins():
    index, pins = pip_pins(dry_run("setup-gpu"))
    expected = constraint_pins(ROOT / "constraints.txt")
    assert index == "https://download.pytorch.org/whl/cu130"
    assert pins == {name: f"{version}+cu130" for name, version in expected.items()}
    command = next(line for line in dry_run("setup-gpu").splitlines() if "--index-url" in line)
    assert "-c constraints.txt" in command  # the resolver also holds every other package to its pin


@needs_make
def test_setup_gpu_reads_the_pins_and_the_cuda_tag_it_is_given(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# a comment\nnumpy==2.4.6\ntorch==9.8.7 ; sys_platform == 'linux'\ntorchvision==0.99.1\n")
    index, pins = pip_pins(dry_run("setup-gpu", "CUDA=cu126", f"CONSTRAINTS={constraints}"))
    assert index == "https://download.pytorch.org/whl/cu126"
    assert pins == {"torch": "9.8.7+cu126", "torchvision": "0.99.1+cu126"}


@needs_make
def test_setup_gpu_checks_the_installed_builds_and_gpu_targets_run_the_check():
    commands = dry_run("setup-gpu", "CUDA=cu129").splitlines()
    assert commands[-1] == ".venv/bin/python -m utils.gpu_setup --cuda cu129 --constraints constraints.txt"
    assert dry_run("gpu-check").splitlines()[-1] == ".venv/bin/python bench/gpu_check.py --quick"
    assert dry_run("gpu-bench", "OUT=/tmp/x").splitlines()[-1] == ".venv/bin/python bench/gpu_check.py /tmp/x"


def test_read_pins_takes_the_name_equals_version_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# every pip call passes -c\ntorchaudio==1.0\ntorch == 2.13.0  # the CPU wheel here\n"
                    "torchvision==0.28.0\n")
    assert read_pins(path) == {"torch": "2.13.0", "torchvision": "0.28.0"}
    path.write_text("torch==2.13.0\n")
    with pytest.raises(TaskHetError, match=r"c.txt: no 'torchvision==VERSION' line"):
        read_pins(path)


def test_build_problems_name_every_difference():
    pins = {"torch": "2.13.0", "torchvision": "0.28.0"}
    assert build_problems(pins, {"torch": "2.13.0+cu128", "torchvision": "0.28.0+cu128"}, "cu128", "12.8") == []
    assert build_problems(pins, {"torch": "2.13.0+cpu", "torchvision": None}, "cu128", None) == [
        "torch 2.13.0+cpu is installed, not 2.13.0+cu128", "torchvision is not installed",
        "torch reports no CUDA version (a CPU build)"]
    assert build_problems(pins, {"torch": "2.13.0+cu126", "torchvision": "0.28.0+cu128"}, "cu128", "12.6") == [
        "torch 2.13.0+cu126 is installed, not 2.13.0+cu128"]


def test_a_cpu_build_is_one_error_line(capsys, monkeypatch, tmp_path):
    from utils import gpu_setup
    from utils.cli import run_main

    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.13.0\ntorchvision==0.28.0\n")
    monkeypatch.setattr(gpu_setup, "installed_versions", lambda: {"torch": "2.13.0+cpu", "torchvision": "0.28.0"})
    with pytest.raises(SystemExit) as stopped:
        run_main(main, ["--cuda", "cu128", "--constraints", str(constraints)])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: make setup-gpu: torch 2.13.0+cpu is installed, not 2.13.0+cu128; torchvision 0.28.0 is installed, "
        "not 0.28.0+cu128")


def test_a_cuda_tag_must_look_like_one(capsys):
    from utils.cli import run_main

    with pytest.raises(SystemExit):
        run_main(main, ["--cuda", "12.8"])
    assert "must be a CUDA tag such as cu126 or cu130, got '12.8'" in capsys.readouterr().err
