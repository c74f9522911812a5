"""Test setup: the repository root on sys.path and the torchvision fallback installed."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import utils.tv_compat  # noqa: E402,F401  (before anything imports torchvision)


import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw 50 examples in the suite (their own settings leave max_examples to the profile); a deeper
# search: HYPOTHESIS_PROFILE=thorough (the 150 examples they took before). No deadline: a loaded machine is slow.
settings.register_profile("suite", max_examples=50, deadline=None)
settings.register_profile("thorough", max_examples=150, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: took 9 s or more on the 2-core machine (`-m 'not slow'` leaves them out "
                                       "of a quick local pass; CI runs them)")
    config.addinivalue_line("markers", "kernels: claims floats equal across two computations (resume, engines, "
                                       "batched vs one by one); `make test` runs these again under ATen's AVX2 and "
                                       "scalar kernels with oneDNN capped at AVX2, so a claim that holds under one "
                                       "CPU's kernels only fails on every machine")


def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort: the rest keep their order). pytest-xdist hands tests out in this order,
    and a slow test met last keeps one worker busy after the other has finished: the suite lasts as long as its
    busiest worker."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The tests' tensors are tiny: extra OpenMP threads only add synchronisation, and thrash
    when another process shares the 2 cores (seen: 5 s -> 40 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def figures(monkeypatch):
    """The figures the code under test closes, kept open to be read through matplotlib's objects."""
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", lambda figure=None: kept.append(figure))
    yield kept
    monkeypatch.undo()
    plt.close("all")
