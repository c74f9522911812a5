"""make setup: pip installs uv, torch and torchvision (pip reads the machine's own settings, such as a folder with a
local torch wheel), then uv installs every other requirement file, falling back to pip; every install holds the
packages to constraints.txt."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import bench_setup
from utils.errors import TaskHetError

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def install_commands(*targets: str) -> list[str]:
    """The install commands ``make -n -B TARGETS`` would run (every stamp remade), none run."""
    done = subprocess.run(["make", "--no-print-directory", "-n", "-B", *targets], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return [line for line in done.stdout.replace("\\\n", " ").splitlines() if " install " in line]


def requirement_files(words: list[str]) -> list[str]:
    return [words[k + 1] for k, word in enumerate(words) if word == "-r"]


def test_pip_installs_uv_torch_and_torchvision_first_under_the_constraints():
    first = shlex.split(install_commands("setup")[0])
    assert first[:4] == [".venv/bin/python", "-m", "pip", "install"] and "||" not in first
    assert requirement_files(first) == ["requirements-setup.txt"] and "constraints.txt" in first
    wanted = [line.split("#")[0].strip() for line in (ROOT / "requirements-setup.txt").read_text().splitlines()]
    assert [line for line in wanted if line] == ["uv==0.12.24", "torch", "torchvision"]  # their versions: constraints.txt


@pytest.mark.parametrize("target, files", [
    ("setup", ["requirements.txt", "requirements-flower.txt", "requirements-flwr-datasets.txt"]),
    (".venv/.docs_installed", ["requirements-docs.txt"]),
])
def test_uv_installs_the_other_files_under_the_constraints_and_pip_takes_over_where_it_fails(target, files):
    commands = [line for line in install_commands(target) if f"-r {files[0]}" in line]
    assert len(commands) == 1, commands
    uv, pip = (shlex.split(part) for part in commands[0].split(" || "))
    assert uv[:3] == [".venv/bin/uv", "pip", "install"]
    assert uv[uv.index("--python") + 1] == ".venv/bin/python" and "--compile-bytecode" in uv
    assert pip[:4] == [".venv/bin/python", "-m", "pip", "install"]
    for words in (uv, pip):
        assert words[words.index("-c") + 1] == "constraints.txt"
        assert requirement_files(words) == files


def test_every_requirement_file_make_setup_reads_is_installed():
    files = [file for line in install_commands("setup", ".venv/.docs_installed")
             for file in requirement_files(shlex.split(line.split(" || ")[0]))]
    shipped = sorted(path.name for path in ROOT.glob("requirements*.txt") if path.name != "requirements-dev.txt")
    assert sorted(files) == shipped


@pytest.mark.parametrize("side", list(bench_setup.SIDES))
def test_the_setup_benchmark_installs_into_its_own_venv_only(side, tmp_path):
    venv = tmp_path / "venv"
    command = bench_setup.make_command(venv, bench_setup.SIDES[side])
    done = subprocess.run([*command[:1], "-n", *command[1:]], capture_output=True, text=True, check=True)
    installs = [line for line in done.stdout.splitlines() if " install " in line]
    assert len(installs) == 3 and f"python3 -m venv {venv}" in done.stdout
    assert all(line.startswith((f"{venv}/bin/python -m pip", f"{venv}/bin/uv", "/bin/false"))
               for line in installs) and ".venv" not in done.stdout
    assert (f"{venv}/bin/uv pip install" in done.stdout) == (side == "uv")


def test_the_setup_benchmark_names_each_package_that_differs():
    assert bench_setup.differences(["a==1", "b==2"], ["a==1", "b==3", "c==1"]) == ["-b==2", "+b==3", "+c==1"]
    assert bench_setup.differences(["a==1"], ["a==1"]) == []


def test_the_pinned_uv_is_one_flwr_admits_so_uv_never_replaces_itself_during_the_install():
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        wanted = [Requirement(line) for line in metadata.requires("flwr") or []]
    except metadata.PackageNotFoundError:
        pytest.skip("flwr is not installed")
    uv = next(requirement for requirement in wanted if requirement.name == "uv")
    pin = next(line for line in (ROOT / "requirements-setup.txt").read_text().splitlines() if line.startswith("uv=="))
    assert uv.specifier.contains(pin.split("==")[1]), f"flwr needs {uv}, requirements-setup.txt pins {pin}"


def test_a_failed_setup_is_one_error_naming_the_side_and_the_exit_code(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_setup, "make_command", lambda venv, variables: ["sh", "-c", "echo broken >&2; exit 3"])
    with pytest.raises(TaskHetError, match=r"^make setup \(UV=/bin/false\) failed with exit code 3: broken$"):
        bench_setup.time_setup(["UV=/bin/false"], tmp_path)
