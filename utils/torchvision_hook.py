"""A startup hook for the project's virtual environment: ``import torchvision`` works in any code.

``make setup`` copies this file and ``utils/tv_compat.py`` into the venv's site-packages
(as ``taskhet_torchvision_hook`` and ``taskhet_tv_compat``) with a ``.pth`` line that
imports the hook at interpreter start. The hook only adds a finder to ``sys.meta_path``
(no torch import at start-up, so ``pip`` and other tools stay fast); the first
``import torchvision`` anywhere, in a user's own script or notebook, first loads the
CPU fallbacks of ``tv_compat`` and then lets the import proceed normally.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys


class _LoadFallbacksFirst(importlib.abc.MetaPathFinder):
    """Runs once: before torchvision itself is found, import the fallback registration."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - the importlib protocol
        if name == "torchvision" and self in sys.meta_path:
            sys.meta_path.remove(self)
            importlib.import_module("taskhet_tv_compat")
        return None  # the regular finders locate torchvision


if not any(isinstance(finder, _LoadFallbacksFirst) for finder in sys.meta_path):
    sys.meta_path.insert(0, _LoadFallbacksFirst())
