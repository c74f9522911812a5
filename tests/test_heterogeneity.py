"""The heterogeneity meter (network/heterogeneity.py): G² and B² against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from network.heterogeneity import dissimilarity, full_gradient
from tests.oracles import CPU, DIM, gradient, least_squares_clients, least_squares_loss, linear_model


def test_identical_clients_have_no_dissimilarity():
    grad = torch.tensor([1.0, -2.0, 0.5])
    reading = dissimilarity([grad, grad.clone(), grad.clone()], [5, 10, 1])
    assert reading.g2 == 0.0 and reading.b2 == pytest.approx(1.0, abs=1e-15)
    assert reading.global_grad_norm2 == pytest.approx(5.25)


def test_two_clients_by_hand():
    # p = (1/4, 3/4); g1 = (4, 0), g2 = (0, 4/3): ∇F = (1, 1); G² = 1/4·‖(3, −1)‖² + 3/4·‖(−1, 1/3)‖² = 10/4 + 3/4·10/9
    g1, g2 = torch.tensor([4.0, 0.0]), torch.tensor([0.0, 4.0 / 3.0])
    reading = dissimilarity([g1, g2], [1, 3])
    assert reading.global_grad_norm2 == pytest.approx(2.0)
    assert reading.g2 == pytest.approx(10 / 4 + 3 / 4 * 10 / 9)
    assert reading.b2 == pytest.approx((1 / 4 * 16 + 3 / 4 * 16 / 9) / 2.0)
    assert reading.b2 == pytest.approx(1 + reading.g2 / reading.global_grad_norm2)  # B² = 1 + G²/‖∇F‖²


def test_least_squares_clients_at_a_point_by_hand():
    data = least_squares_clients(sizes=(10, 30))
    model = linear_model()
    w = torch.linspace(-1, 1, DIM, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(w.unsqueeze(0))
    # Uneven batches: the gradient is still that of the client's mean loss.
    grads = [full_gradient(model, [{"x": a[:7], "y": b[:7]}, {"x": a[7:], "y": b[7:]}], least_squares_loss, CPU)
             for a, b in data]
    expected = [gradient(w, a, b) for a, b in data]
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    p = torch.tensor([0.25, 0.75], dtype=torch.float64)
    mean = p[0] * expected[0] + p[1] * expected[1]
    g2 = float(p[0] * (expected[0] - mean).norm() ** 2 + p[1] * (expected[1] - mean).norm() ** 2)
    b2 = float((p[0] * expected[0].norm() ** 2 + p[1] * expected[1].norm() ** 2) / mean.norm() ** 2)
    reading = dissimilarity(grads, [10, 30])
    assert reading.g2 == pytest.approx(g2, rel=1e-12) and reading.b2 == pytest.approx(b2, rel=1e-12)


def test_all_gradients_zero_and_a_zero_mean():
    assert dissimilarity([torch.zeros(2), torch.zeros(2)], [1, 1]).b2 == 1.0
    assert math.isinf(dissimilarity([torch.tensor([1.0]), torch.tensor([-1.0])], [1, 1]).b2)
    with pytest.raises(ValueError, match="one gradient per client"):
        dissimilarity([torch.zeros(2)], [1, 2])


def test_step_3c_refuses_a_missing_checkpoint_and_another_steps_folder(tmp_path, capsys):
    from steps import meter
    from utils.cli import run_main

    flags = ["--manifest", str(tmp_path / "manifest.csv"), "--assignments", str(tmp_path / "a.csv"),
             "--data_path", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        run_main(meter.main, ["--checkpoint", str(tmp_path / "best.pt"), "--out", str(tmp_path / "meter"), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--checkpoint" in err[0]
    assert not (tmp_path / "meter" / "meter.json").exists()
    other = tmp_path / "step2"
    other.mkdir()
    (other / "config.json").write_text('{"step": "step 2", "args": {}}')
    with pytest.raises(SystemExit):
        run_main(meter.main, ["--checkpoint", str(tmp_path / "best.pt"), "--out", str(other), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "step 2" in err[0]
    assert not (other / "meter.json").exists()


def test_small_gradients_and_client_sizes_at_their_edges():
    # ‖∇F‖² = 0.0025 (below 1, above 0): B² is still the ratio; a client of size 0 simply has no weight
    g1, g2, g3 = (torch.tensor(values, dtype=torch.float64) for values in ([0.1, 0.0], [0.0, 0.0], [7.0, 7.0]))
    reading = dissimilarity([g1, g2, g3], [1, 1, 0])
    assert reading.global_grad_norm2 == pytest.approx(0.0025, rel=1e-12)
    assert reading.b2 == pytest.approx((0.5 * 0.01) / 0.0025, rel=1e-12)  # = 2
    assert dissimilarity([g1], [1]).b2 == pytest.approx(1.0, abs=1e-15)  # one client of size 1 (sum = 1 is allowed)
    for sizes in ([1, -1, 1], [0, 0, 0]):
        with pytest.raises(ValueError, match=r"^client sizes must be >= 0 and not all 0, got \[" + ", ".join(
                str(size) for size in sizes).replace("-", r"\-") + r"\]$"):
            dissimilarity([g1, g2, g3], sizes)
    with pytest.raises(ValueError, match="^need one gradient per client and at least one client$"):
        dissimilarity([], [])


def test_full_gradient_is_float64_whatever_the_model_precision_and_refuses_no_samples():
    a, b = least_squares_clients(sizes=(12,))[0]
    model = torch.nn.Linear(DIM, 1, bias=False)  # float32
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1, 1, DIM).unsqueeze(0))
    batches = [{"x": a[:5].float(), "y": b[:5].float()}, {"x": a[5:].float(), "y": b[5:].float()}]
    got = full_gradient(model, batches, least_squares_loss, CPU)
    assert got.dtype == torch.float64
    want = gradient(model.weight.detach().double().squeeze(0), a.float().double(), b.float().double())
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="^a client has no samples to take a gradient over$"):
        full_gradient(model, [], least_squares_loss, CPU)
