"""Step 0 (real data): download Taskonomy (omnidata layout) with omnidata-tools' downloader, non-interactively.

omnidata's downloader asks for a name and an email and for agreement to the data
licence unless it is given ``--agree_all --name --email``; a prompt would hang a
``make download`` with no terminal, so this step always passes them (and no standard
input), and refuses to start without them, printing the licence terms first.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from omnidata_tools.dataset.starter_dataset.component_datasets import taskonomy as omnidata_taskonomy

from datasets.synthetic import write_places_file
from datasets.taskonomy_domains import DOMAINS, get_domain
from utils import cli
from utils.errors import TaskHetError
from utils.locks import folder_lock

DATA_SERVER = ("datasets.epfl.ch", 443)
SUBSETS = ("debug", "tiny", "medium", "full", "fullplus")
# Every domain the loader decodes, so any experiment's tasks find their data.
DEFAULT_DOMAINS = ("rgb", *(domain for domain in DOMAINS if domain not in ("rgb", "mask_valid")), "mask_valid")
DESCRIPTION = """Step 0 (data): download real Taskonomy for the pipeline via omnidata-tools (`omnitools.download`).
Inputs: the domains and the subset (debug/tiny/medium/full/fullplus). Outputs under --dest:
<domain>/taskonomy/<building>/... for each domain, train_val_test_<subset>.csv (the subset's split CSV,
id,train,val,test) and places_class_names.txt. Then run step 1:
  extract_datapoints_for_experiments.py --data_path <dest> --client_file_name train_val_test_<subset>.csv
Needs internet and aria2c; offline it stops at once. The data's licence must be accepted: pass --agree_all
with --name and --email (make download NAME=... EMAIL=... AGREE=yes)."""

LICENCE_TERMS = """Taskonomy / Omnidata licence terms (summary; the full terms are shown at https://omnidata.vision):
the data may be used for non-commercial research and educational purposes only, and may not be
redistributed. omnidata-tools records the name and email of whoever accepts the terms."""
EMAIL_PATTERN = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")


def check_online(host: str, port: int, timeout_s: float) -> None:
    """Open (and close) a TCP connection, so an offline machine fails in seconds, not mid-download."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as error:
        raise TaskHetError(f"cannot reach the Taskonomy server {host}:{port} ({error}); downloading needs internet access") from error


def check_licence(args: argparse.Namespace) -> None:
    """The licence must be accepted, with a name and a valid email, before anything is downloaded."""
    missing = [what for what, given in (("--agree_all (AGREE=yes)", args.agree_all), ("--name (NAME=...)", args.name),
                                        ("--email (EMAIL=...)", args.email)) if not given]
    if missing:
        raise TaskHetError(f"downloading Taskonomy needs {', '.join(missing)}: accept the licence terms printed above, "
                           "e.g. make download NAME='Ada Lovelace' EMAIL=ada@example.org AGREE=yes")
    if not EMAIL_PATTERN.fullmatch(args.email):
        raise TaskHetError(f"--email {args.email!r} is not an email address (EMAIL=...)")


def downloader_command(args: argparse.Namespace) -> list[str]:
    """The ``omnitools.download`` command line for the chosen domains and subset."""
    executable = shutil.which("omnitools.download") or str(Path(sys.executable).with_name("omnitools.download"))
    command = [executable, *args.domains, "--components", "taskonomy", "--subset", args.subset, "--dest", str(args.dest)]
    command += ["--dest_compressed", str(args.dest / "compressed")]
    return command + ["--agree_all", "--name", args.name, "--email", args.email]


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", nargs="+", default=list(DEFAULT_DOMAINS), help="domains to download (default: every domain the loader decodes)")
    parser.add_argument("--subset", choices=SUBSETS, default="tiny", help="Taskonomy subset (default: tiny)")
    parser.add_argument("--dest", type=Path, default=Path("data/taskonomy"), help="data root to write (default: data/taskonomy)")
    parser.add_argument("--agree_all", action=argparse.BooleanOptionalAction, default=False,
                        help="accept the Taskonomy licence (required; needs --name and --email; make: AGREE=yes)")
    parser.add_argument("--name", default="", help="your name, recorded by omnidata with the licence (make: NAME=...)")
    parser.add_argument("--email", default="", help="your email, recorded by omnidata with the licence (make: EMAIL=...)")
    parser.add_argument("--timeout_s", type=cli.floats(0.0, 600.0, low_open=True), default=5.0,
                        help="connectivity check timeout in seconds (default: 5)")
    cli.add_runtime_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> Path:
    """Download the chosen domains and subset, then write the split CSV and the Places365 names; returns the root."""
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    for domain in args.domains:
        get_domain(domain)
    print(LICENCE_TERMS, flush=True)
    check_licence(args)
    check_online(*DATA_SERVER, args.timeout_s)
    if shutil.which("aria2c") is None:
        raise TaskHetError("omnitools.download needs the aria2c program: install it (e.g. apt-get install aria2) and retry")
    with folder_lock(args.dest, "--dest"):  # one run at a time writes the data root
        return download_into(args)


def download_into(args: argparse.Namespace) -> Path:
    """Run the downloader and write the split CSV and the Places365 names, holding the lock of ``args.dest``."""
    # No standard input: a prompt of the downloader fails at once instead of waiting for an answer.
    result = subprocess.run(downloader_command(args), check=False, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise TaskHetError(f"omnitools.download failed with exit code {result.returncode}; see its output above")
    shutil.copy(omnidata_taskonomy.taskonomy_split_files[args.subset], args.dest / f"train_val_test_{args.subset}.csv")
    write_places_file(args.dest)
    missing = [domain for domain in args.domains if not (args.dest / domain / "taskonomy").is_dir()]
    if missing:
        raise TaskHetError(f"download finished but {args.dest} has no data for: {', '.join(missing)}")
    print(f"Taskonomy {args.subset} ({len(args.domains)} of {len(DOMAINS)} domains) in {args.dest}")
    return args.dest

