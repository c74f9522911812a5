"""`make test` runs the tests marked `kernels` again under other CPU kernels, so a float comparison that holds under
one CPU's kernels only fails on every machine (an AVX-512 host computes the last bits differently from an AVX2 one)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
def test_make_test_reruns_the_kernels_tests_under_avx2_and_scalar_aten_kernels():
    dry = subprocess.run(["make", "--no-print-directory", "-n", "test-kernels"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "for isa in avx2 default; do" in dry
    assert "ATEN_CPU_CAPABILITY=$isa ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" in dry
    assert "-m pytest -q -n auto -m kernels tests || exit 1" in dry
    test_recipe = subprocess.run(["make", "--no-print-directory", "-n", "test"], cwd=ROOT,
                                 capture_output=True, text=True).stdout
    assert test_recipe.index("--durations=20 tests") < test_recipe.index("-m kernels tests")


@pytest.mark.parametrize("capability, shown", [("avx2", "AVX2"), ("default", "DEFAULT")])
def test_the_variable_the_step_sets_selects_atens_kernels(capability, shown):
    # If torch ever stopped reading ATEN_CPU_CAPABILITY, the step would silently rerun the same kernels.
    printed = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                             env={"ATEN_CPU_CAPABILITY": capability, "PATH": ""}, capture_output=True, text=True,
                             check=True).stdout.strip()
    assert printed == shown


def test_the_marked_tests_cover_the_claims_of_bit_identity():
    # One process against two compares within a stated tolerance (a sum over one process or gathered from two): not a
    # claim of bit-identity, so not rerun under other kernels.
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "kernels", "-p",
                                "no:cacheprovider", "tests/test_mocha.py", "tests/test_step2_accelerate.py",
                                "tests/test_engine.py"], cwd=ROOT, capture_output=True, text=True).stdout
    ids = {line.split("[")[0] for line in collected.splitlines() if "::" in line}
    assert ids == {
        "tests/test_mocha.py::test_each_client_gets_its_own_row_of_omega_and_uploads_its_heads_change",
        "tests/test_engine.py::test_killed_and_resumed_run_is_bit_identical",
        "tests/test_engine.py::test_a_client_trains_identically_whoever_else_is_sampled",
        "tests/test_engine.py::test_checkpoint_every_resumes_from_the_last_one_and_redoes_the_rest_bit_for_bit",
    }
