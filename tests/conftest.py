"""Test setup: the repository root on sys.path and the torchvision fallback installed."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import utils.tv_compat  # noqa: E402,F401  (before anything imports torchvision)
