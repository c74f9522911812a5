"""``make setup-gpu``'s last step: are the venv's torch and torchvision the CUDA builds of constraints.txt's pins?

The Makefile reads the pins from constraints.txt and installs ``torch==<pin>+<tag>`` and
``torchvision==<pin>+<tag>`` from PyTorch's wheel index for that CUDA tag (``cu130``: docs/howto/gpu.md). A
``+cu130`` build satisfies the plain ``==<pin>`` of constraints.txt, so every later ``pip install -c
constraints.txt`` keeps it. This check reads the installed versions back and prints one line, or one ``error:``
line (exit code 2) naming what differs.

Run: ``.venv/bin/python -m utils.gpu_setup --cuda cu130``.
"""

from __future__ import annotations

import argparse
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from utils.errors import TaskHetError

PACKAGES = ("torch", "torchvision")
CUDA_TAG = re.compile(r"cu\d{3,4}")
PIN = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)")


def read_pins(path: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """``{name: version}`` of each package's ``name==version`` line in a constraints file."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        found = PIN.match(line)
        if found and found.group(1).lower() in packages:
            pins[found.group(1).lower()] = found.group(2)
    missing = [name for name in packages if name not in pins]
    if missing:
        raise TaskHetError(f"{path}: no '{missing[0]}==VERSION' line; make setup-gpu installs the pinned version")
    return pins


def build_problems(pins: dict[str, str], installed: dict[str, str | None], tag: str,
                   torch_cuda: str | None) -> list[str]:
    """What differs from the CUDA ``tag`` builds of ``pins`` (empty: all is as pinned).

    Args:
        installed: each package's installed version (None: not installed).
        torch_cuda: ``torch.version.cuda`` (None: a CPU build).
    """
    problems = []
    for name, pin in pins.items():
        found = installed.get(name)
        if found is None:
            problems.append(f"{name} is not installed")
        elif found != f"{pin}+{tag}":
            problems.append(f"{name} {found} is installed, not {pin}+{tag}")
    if installed.get("torch") is not None and torch_cuda is None:
        problems.append("torch reports no CUDA version (a CPU build)")
    return problems


def installed_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def cuda_tag(text: str) -> str:
    """argparse type: a PyTorch wheel index's CUDA tag, ``cu`` and 3 or 4 digits (``cu126``, ``cu130``)."""
    if not CUDA_TAG.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be a CUDA tag such as cu126 or cu130, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> None:
    from utils.cli import ArgumentParser

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", type=cuda_tag, required=True, help="the CUDA tag make setup-gpu installed (cu130)")
    parser.add_argument("--constraints", type=Path, default=Path("constraints.txt"))
    args = parser.parse_args(argv)
    pins = read_pins(args.constraints)
    installed = installed_versions()
    import torch

    problems = build_problems(pins, installed, args.cuda, torch.version.cuda)
    if problems:
        raise TaskHetError(f"make setup-gpu: {'; '.join(problems)} (see docs/howto/gpu.md, 'Troubleshooting')")
    visible = "yes" if torch.cuda.is_available() else "no"
    print(f"torch {installed['torch']} (CUDA {torch.version.cuda}), torchvision {installed['torchvision']}: the "
          f"{args.cuda} builds of {args.constraints}'s pins; GPU visible: {visible}")


if __name__ == "__main__":
    from utils.cli import run_main

    run_main(main)
