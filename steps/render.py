"""Step 0 (data): render the embedded synthetic Taskonomy-format dataset (input of step 1).

The library half of render_synthetic_buildings.py, which pipeline.runner also calls."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from datasets.synthetic import BUILDINGS_FILE, META_FILE, PLACES_FILE, SPLIT_FILE, RenderConfig, render_dataset
from utils import cli
from utils.errors import TaskHetError
from utils.loaders import load_json
from utils.locks import folder_lock

DESCRIPTION = f"""Step 0 (data): render synthetic buildings in the Taskonomy/omnidata layout.
Inputs: none (a seed and sizes). Outputs under --out: <domain>/taskonomy/<building>/point_<p>_view_<v>_domain_<d>.<ext>
for 13 domains, {SPLIT_FILE} (id,train,val,test), {PLACES_FILE} and {BUILDINGS_FILE}.
Read by step 1 (extract_datapoints_for_experiments.py --data_path <out>). Re-running with the same
arguments keeps the existing render."""


MAX_BUILDINGS = 1_000
MAX_VIEWS = 1_000  # views per building (and per point)
MAX_RENDERED_VIEWS = 100_000  # buildings × views: each view is 13 image files
MAX_RENDER_SIZE = 512  # Taskonomy's own resolution
RENDER_SIZES = cli.ints(8, MAX_RENDER_SIZE)


def build_parser() -> argparse.ArgumentParser:
    """The step-0 command line (render_synthetic_buildings.py --help)."""
    parser = cli.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/synthetic"), help="data root to write (default: data/synthetic)")
    parser.add_argument("--n_buildings", type=cli.ints(1, MAX_BUILDINGS), default=24,
                        help=f"buildings (rooms) to render; with --n_views at most {MAX_RENDERED_VIEWS:,} views in all "
                             "(default: 24)")
    parser.add_argument("--n_views", type=cli.ints(1, MAX_VIEWS), default=50, help="views per building (default: 50)")
    parser.add_argument("--views_per_point", type=cli.ints(1, MAX_VIEWS), default=5,
                        help="views that look at the same point (default: 5)")
    parser.add_argument("--image_size", type=RENDER_SIZES, default=64, help="side of the square images in pixels (default: 64)")
    parser.add_argument("--seed", type=cli.SEEDS, default=0, help="root seed; the same seed gives byte-identical files (default: 0)")
    parser.add_argument("--workers", type=cli.ints(1, cli.MAX_WORKERS), default=2,
                        help="processes rendering buildings in parallel (default: 2)")
    parser.add_argument("--replace", action=argparse.BooleanOptionalAction, default=False,
                        help="replace a finished render with other settings in --out (default: refuse)")
    cli.add_runtime_flags(parser)
    return parser


def check_out(out: Path, config: RenderConfig, replace: bool) -> None:
    """Refuse a file as --out, and a finished render with other settings unless ``replace``: never delete it silently."""
    if out.exists() and not out.is_dir():
        raise TaskHetError(f"--out {out} is a file, not a folder")
    meta_path = out / META_FILE
    if not meta_path.is_file():
        return  # empty or missing: render; a non-empty folder without the record is refused by render_dataset
    meta = load_json(meta_path, "render record")
    recorded = meta.get("config") if isinstance(meta, dict) else None
    if isinstance(recorded, dict) and meta.get("complete") and recorded != asdict(config) and not replace:
        changed = ", ".join(f"{key} {recorded.get(key)!r} -> {value!r}" for key, value in asdict(config).items()
                            if recorded.get(key) != value)
        raise TaskHetError(f"--out {out} holds a finished render with other settings ({changed}); choose another "
                           "--out, or pass --replace to delete it and render anew")


def main(argv: list[str] | None = None) -> Path:
    """Render the synthetic buildings ``argv`` asks for.

    Args:
        argv: command-line arguments; None reads sys.argv.

    Returns:
        The data root written (or kept when already rendered).
    """
    args = cli.apply_runtime_flags(build_parser().parse_args(argv))
    config = RenderConfig(args.n_buildings, args.n_views, args.views_per_point, args.image_size, args.seed)
    config.validate()
    if args.n_buildings * args.n_views > MAX_RENDERED_VIEWS:
        raise TaskHetError(f"--n_buildings {args.n_buildings} × --n_views {args.n_views} = "
                           f"{args.n_buildings * args.n_views:,} views; at most {MAX_RENDERED_VIEWS:,} are rendered")
    with folder_lock(args.out):  # one run at a time writes the folder
        check_out(args.out, config, args.replace)
        start = time.perf_counter()
        out = render_dataset(args.out, config, workers=args.workers, progress=args.progress)
    seconds = time.perf_counter() - start
    sizes = f"{config.num_buildings} buildings x {config.views_per_building} views at {config.image_size}px"
    print(f"synthetic data: {sizes} in {out} ({seconds:.1f} s)")
    return out
