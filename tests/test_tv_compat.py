import subprocess
import sys
from pathlib import Path

import torch

import utils.tv_compat
from utils.tv_compat import nms_reference

ROOT = Path(__file__).resolve().parent.parent


def test_resnet50_forward_backward():
    import torchvision

    model = torchvision.models.resnet50(weights=None)
    output = model(torch.randn(2, 3, 64, 64))
    output.sum().backward()
    assert output.shape == (2, 1000)
    assert model.conv1.weight.grad is not None and model.conv1.weight.grad.abs().sum() > 0


def test_nms_operator_keeps_highest_non_overlapping_boxes():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9.0]])
    scores = torch.tensor([0.8, 0.9, 0.7, 0.1])
    kept = torch.ops.torchvision.nms(boxes, scores, 0.5)
    assert kept.tolist() == [1, 2]
    assert nms_reference(boxes, scores, 0.99).tolist() == [1, 0, 2, 3]


def test_torchvision_imports_in_a_fresh_worker_process():
    # A worker process starts with nothing imported; importing the project's
    # compat module first must be enough, as it is for DataLoader/Ray workers.
    code = (
        "import utils.tv_compat, torch, torchvision;"
        "print(tuple(torchvision.models.resnet18(weights=None)(torch.zeros(2, 3, 32, 32)).shape))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(2, 1000)"


def test_install_is_a_no_op_once_ops_exist():
    assert utils.tv_compat.install() is None


def test_the_venv_imports_torchvision_in_code_that_never_imports_the_project(tmp_path):
    """make setup installs a start-up hook, so a user's own script needs no project import first."""
    import subprocess
    import sys

    script = tmp_path / "mine.py"
    script.write_text("import torchvision, torch\nprint(torchvision.__version__, hasattr(torch.ops.torchvision, 'nms'))\n")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("True")
