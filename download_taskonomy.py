"""Download real Taskonomy (omnidata layout) with omnidata-tools' downloader; input of step 1."""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from omnidata_tools.dataset.starter_dataset.component_datasets import taskonomy as omnidata_taskonomy

from datasets.selection import DEFAULT_TASK_DOMAINS
from datasets.synthetic import write_places_file
from datasets.taskonomy import DOMAINS, get_domain
from utils.cli import positive_float, run_main
from utils.errors import TaskHetError

DATA_SERVER = ("datasets.epfl.ch", 443)
SUBSETS = ("debug", "tiny", "medium", "full", "fullplus")
DEFAULT_DOMAINS = ("rgb", *DEFAULT_TASK_DOMAINS, "mask_valid")
DESCRIPTION = """Step 0 (data): download real Taskonomy for the pipeline via omnidata-tools (`omnitools.download`).
Inputs: the domains and the subset (debug/tiny/medium/full/fullplus). Outputs under --dest:
<domain>/taskonomy/<building>/... for each domain, train_val_test_<subset>.csv (the subset's split CSV,
id,train,val,test) and places_class_names.txt. Then run step 1:
  extract_datapoints_for_experiments.py --data_path <dest> --client_file_name train_val_test_<subset>.csv
Needs internet and aria2c; offline it stops at once. The data's license requires --name and --email
with --agree_all (or answering omnidata's prompt)."""


def check_online(host: str, port: int, timeout_s: float) -> None:
    """Open (and close) a TCP connection, so an offline machine fails in seconds, not mid-download."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as error:
        raise TaskHetError(f"cannot reach the Taskonomy server {host}:{port} ({error}); downloading needs internet access") from error


def downloader_command(args: argparse.Namespace) -> list[str]:
    """The ``omnitools.download`` command line for the chosen domains and subset."""
    executable = shutil.which("omnitools.download") or str(Path(sys.executable).with_name("omnitools.download"))
    command = [executable, *args.domains, "--components", "taskonomy", "--subset", args.subset, "--dest", str(args.dest)]
    command += ["--dest_compressed", str(args.dest / "compressed")]
    if args.agree_all:
        command += ["--agree_all", "--name", args.name, "--email", args.email]
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", nargs="+", default=list(DEFAULT_DOMAINS), help="domains to download (default: every domain the loader decodes)")
    parser.add_argument("--subset", choices=SUBSETS, default="tiny", help="Taskonomy subset (default: tiny)")
    parser.add_argument("--dest", type=Path, default=Path("data/taskonomy"), help="data root to write (default: data/taskonomy)")
    parser.add_argument("--agree_all", action=argparse.BooleanOptionalAction, default=False, help="accept the data licenses (needs --name, --email)")
    parser.add_argument("--name", default="", help="your name, for the license click-through")
    parser.add_argument("--email", default="", help="your email, for the license click-through")
    parser.add_argument("--timeout_s", type=positive_float, default=5.0, help="connectivity check timeout in seconds (default: 5)")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    for domain in args.domains:
        get_domain(domain)
    if args.agree_all and not (args.name and args.email):
        raise TaskHetError("--agree_all needs --name and --email (omnidata records who accepted the licenses)")
    check_online(*DATA_SERVER, args.timeout_s)
    if shutil.which("aria2c") is None:
        raise TaskHetError("omnitools.download needs the aria2c program: install it (e.g. apt-get install aria2) and retry")
    args.dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(downloader_command(args), check=False)
    if result.returncode != 0:
        raise TaskHetError(f"omnitools.download failed with exit code {result.returncode}; see its output above")
    shutil.copy(omnidata_taskonomy.taskonomy_split_files[args.subset], args.dest / f"train_val_test_{args.subset}.csv")
    write_places_file(args.dest)
    missing = [domain for domain in args.domains if not (args.dest / domain / "taskonomy").is_dir()]
    if missing:
        raise TaskHetError(f"download finished but {args.dest} has no data for: {', '.join(missing)}")
    print(f"Taskonomy {args.subset} ({len(args.domains)} of {len(DOMAINS)} domains) in {args.dest}")
    return args.dest


if __name__ == "__main__":
    run_main(main)
