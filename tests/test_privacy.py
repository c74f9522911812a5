"""Client-level differential privacy (network/privacy.py) against hand-computed values, numpy and dp-accounting."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from network.algorithms import build_algorithm
from network.algorithms.base import ALGORITHMS
from network.engine_sequential import EngineConfig, SequentialEngine
from network.lr_schedule import make_lr_schedule
from network.privacy import (ADAPTIVE_KEY, CLIP_KEY, DP_GROUP, UNCLIPPED_KEY, Accountant, PrivacySettings,
                             ServerPrivacy, add_noise_to_sum, clip_upload, gaussian_like, resolve_budget,
                             update_noise_multiplier, upload_norm)
from tests.oracles import CPU, least_squares_clients, least_squares_loss, linear_model, mean_loss, oracle_clients
from utils.errors import TaskHetError
from tests.fixtures import tiny_data_root, tiny_manifest  # noqa: F401  (session fixtures)
from utils.seeding import torch_generator

F64 = torch.float64


def vector(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ----- the client's clipping -----

def test_clipping_scales_by_c_over_the_norm_and_leaves_a_norm_at_c_untouched():
    upload = {"delta": {"w": vector(3.0, 4.0)}}  # ‖Δ‖ = 5
    assert torch.allclose(clip_upload(upload, ("delta",), 1.0, False)["delta"]["w"], vector(0.6, 0.8), atol=0, rtol=1e-15)
    assert torch.allclose(clip_upload(upload, ("delta",), 2.5, False)["delta"]["w"], vector(1.5, 2.0), atol=0, rtol=1e-15)
    for clip in (5.0, 10.0, math.inf):  # min(1, C/‖Δ‖) = 1: the very tensor goes up, no multiplication
        assert clip_upload(upload, ("delta",), clip, False)["delta"]["w"] is upload["delta"]["w"]


def test_two_groups_are_clipped_as_one_vector_and_integer_entries_pass():
    upload = {"delta": {"w": vector(3.0), "steps": torch.tensor(7)}, "control_delta": {"c": vector(4.0)},
              "other": {"v": vector(100.0)}}
    clipped = clip_upload(upload, ("delta", "control_delta"), 1.0, True)
    assert upload_norm(upload, ("delta", "control_delta")) == 5.0  # the ungrouped 100 is not counted
    assert float(clipped["delta"]["w"]) == pytest.approx(0.6, abs=1e-15)
    assert float(clipped["control_delta"]["c"]) == pytest.approx(0.8, abs=1e-15)
    assert int(clipped["delta"]["steps"]) == 7 and clipped["other"] is upload["other"]
    assert float(clipped[DP_GROUP][UNCLIPPED_KEY]) == 0.0  # ‖Δ‖ = 5 > C: clipped, bit 0


def test_the_adaptive_bit_is_one_at_the_norm_equal_to_c_and_a_zero_update_is_never_clipped():
    upload = {"delta": {"w": vector(3.0, 4.0)}}
    assert float(clip_upload(upload, ("delta",), 5.0, True)[DP_GROUP][UNCLIPPED_KEY]) == 1.0
    assert float(clip_upload(upload, ("delta",), 4.999, True)[DP_GROUP][UNCLIPPED_KEY]) == 0.0
    zero = {"delta": {"w": torch.zeros(2, dtype=F64)}}
    assert upload_norm(zero, ("delta",)) == 0.0 and clip_upload(zero, ("delta",), 1e-9, False)["delta"]["w"] is zero["delta"]["w"]
    assert DP_GROUP not in clip_upload(upload, ("delta",), 5.0, False)  # no bit without adaptive clipping


# ----- the server's noise -----

def test_the_noise_has_the_stated_standard_deviation_over_many_draws():
    """200,000 draws at σ = 3: the sample std's own spread is σ/√(2n) ≈ 0.16% of σ, so 1% is a 6-spread bound; the
    mean's spread is σ/√n ≈ 0.0067."""
    draws = gaussian_like([torch.zeros(200_000, dtype=F64)], 3.0, torch_generator(0, "dp_noise", 1))[0].numpy()
    assert abs(draws.std() / 3.0 - 1) < 0.01 and abs(draws.mean()) < 0.04
    again = gaussian_like([torch.zeros(200_000, dtype=F64)], 3.0, torch_generator(0, "dp_noise", 1))[0]
    assert torch.equal(again, torch.from_numpy(draws))  # seeded: the same numbers on any engine


def test_the_noise_joins_the_sum_once_so_the_uniform_mean_is_the_noisy_sum_over_m():
    uploads = [{"delta": {"w": vector(1.0, 2.0)}}, {"delta": {"w": vector(3.0, -2.0)}}]
    noise = [vector(0.5, -1.5)]
    noisy_first = add_noise_to_sum(uploads[0], ("delta",), noise)
    mean = (noisy_first["delta"]["w"] + uploads[1]["delta"]["w"]) / 2
    assert torch.equal(mean, vector((1 + 3 + 0.5) / 2, (2 - 2 - 1.5) / 2))
    assert torch.equal(uploads[0]["delta"]["w"], vector(1.0, 2.0))  # the client's upload itself is not changed


def test_adaptive_clipping_raises_the_count_noise_into_the_update_multiplier():
    """Andrew et al.'s z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): z = 1, σ_b = 1 gives (1 − 1/4)^(−1/2) = 2/√3."""
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3), rel=1e-15)
    assert update_noise_multiplier(1.0, None) == 1.0 and update_noise_multiplier(0.0, 5.0) == 0.0
    with pytest.raises(TaskHetError, match="σ_b = 0.5 must exceed z/2 = 0.5"):
        ServerPrivacy(PrivacySettings(1.0, 1.0, adaptive_quantile=0.5, count_noise=0.5), ("delta",), 10, 10, 0, 1.0)


# ----- the engine: numpy oracle, privacy properties, resume -----

class Recorder:
    """Wraps an algorithm's aggregate to keep what reaches the server each round."""

    def __init__(self, algorithm):
        self.rounds, self.aggregate = [], algorithm.aggregate
        algorithm.aggregate = self

    def __call__(self, server, uploads):
        kept = list(uploads)
        self.rounds.append(kept)
        return self.aggregate(server, kept)


def dp_engine(tmp_path, name, data, rounds, privacy=None, fraction=1.0, steps=1, lr=0.1, method="fedavg",
              model=None, eval_every=None, vectorize_chunk=0, **settings):
    clients = oracle_clients(data)
    settings = {"weighting": "uniform", **settings}
    algorithm, worker = build_algorithm(method, model or linear_model(),
                                        {client.client_id: client.num_samples for client in clients}, settings, seed=3)
    config = EngineConfig(out_dir=tmp_path / name, n_rounds=rounds, lr_schedule=make_lr_schedule("constant", lr, rounds),
                          local_steps=steps, client_fraction=fraction, eval_every=eval_every or rounds, progress=False, plots=False,
                          seed=3, privacy=privacy, vectorize_chunk=vectorize_chunk)
    pooled = [{"x": torch.cat([a for a, _ in data]), "y": torch.cat([b for _, b in data])}]
    return SequentialEngine(worker, algorithm, clients, least_squares_loss, mean_loss, pooled, config, CPU), algorithm


def one_step_deltas(data, w, lr):
    """Each client's Δ after one full-batch gradient step from w, in numpy: −lr·Aᵀ(Aw − b)/n."""
    return [-lr * (a.numpy().T @ (a.numpy() @ w - b.numpy())) / len(b) for a, b in data]


def test_one_round_of_dp_fedavg_equals_the_numpy_formula_with_and_without_noise(tmp_path):
    """x⁺ = x + (Σ_i Δ_i·min(1, C/‖Δ_i‖) + N(0, (zC)²))/m, in numpy from the paper, the noise from the documented
    stream (torch_generator(seed, "dp_noise", round), float32 draws): 4 clients of unequal sizes, all sampled."""
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    deltas = one_step_deltas(data, np.zeros(5), 0.1)
    clip = float(np.median([np.linalg.norm(delta) for delta in deltas]))  # two clients clipped, two not
    clipped = [delta * min(1.0, clip / np.linalg.norm(delta)) for delta in deltas]
    for z in (0.0, 0.7):
        engine, _ = dp_engine(tmp_path, f"z{z}", data, 1, PrivacySettings(clip, z))
        final = engine.run()["weight"].squeeze(0).numpy()
        noise = (torch.randn(5, generator=torch_generator(3, "dp_noise", 1), dtype=torch.float32).double()
                 * (z * clip)).numpy() if z else 0.0
        np.testing.assert_allclose(final, (sum(clipped) + noise) / 4, rtol=1e-12, atol=1e-14)


def test_no_unclipped_update_reaches_the_server_and_the_clients_add_no_noise(tmp_path):
    """Every upload the server receives has norm ≤ C, except the first, which carries the server's one draw: with
    z = 1 it differs from the same round's z = 0 upload by exactly that draw, and every other upload not at all."""
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    clip, seen = 0.05, {}
    for z in (0.0, 1.0):
        engine, algorithm = dp_engine(tmp_path, f"z{z}", data, 3, PrivacySettings(clip, z), fraction=0.5, steps=3)
        recorder = Recorder(algorithm)
        engine.run()
        seen[z] = recorder.rounds
        assert [len(uploads) for uploads in recorder.rounds] == [2, 2, 2]  # m = 2 of N = 4 each round
        assert all(upload_norm(upload.tensors, ("delta",)) <= clip * (1 + 1e-12)
                   for uploads in recorder.rounds for upload in (uploads if z == 0 else uploads[1:]))
        assert all(DP_GROUP not in upload.tensors for uploads in recorder.rounds for upload in uploads)
    first, other = [upload.tensors["delta"]["weight"] for upload in seen[1.0][0]]
    quiet_first, quiet_other = [upload.tensors["delta"]["weight"] for upload in seen[0.0][0]]
    draw = torch.randn(1, 5, generator=torch_generator(3, "dp_noise", 1), dtype=torch.float32).double() * clip
    assert torch.allclose(first - quiet_first, draw, rtol=1e-12, atol=1e-15) and torch.equal(other, quiet_other)


def test_the_noise_is_drawn_once_per_round_at_the_server(tmp_path, monkeypatch):
    """One draw of the model's shape per round, whatever m: counting the draws the privacy module makes."""
    import network.privacy as privacy

    draws = []
    real = privacy.gaussian_like
    monkeypatch.setattr(privacy, "gaussian_like", lambda tensors, std, generator: draws.append(len(tensors)) or
                        real(tensors, std, generator))
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    engine, _ = dp_engine(tmp_path, "once", data, 3, PrivacySettings(1.0, 1.0), fraction=0.75)
    engine.run()
    assert draws == [1, 1, 1]  # one tensor (the weight) once in each of 3 rounds, not once per client


def test_z_zero_and_no_clipping_is_the_uniform_run_bit_for_bit(tmp_path):
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    plain, _ = dp_engine(tmp_path, "plain", data, 4, None, fraction=0.5, steps=2)
    private, _ = dp_engine(tmp_path, "private", data, 4, PrivacySettings(math.inf, 0.0), fraction=0.5, steps=2)
    assert torch.equal(plain.run()["weight"], private.run()["weight"])
    ordinary = pd.read_csv(tmp_path / "plain" / "metrics.csv")
    dp_rows = pd.read_csv(tmp_path / "private" / "metrics.csv")
    pd.testing.assert_frame_equal(ordinary, dp_rows[dp_rows["split"] != "privacy"].reset_index(drop=True))
    epsilon = dp_rows.query("split == 'privacy' and metric == 'dp_epsilon'")["value"]
    assert len(epsilon) == 4 and np.isinf(epsilon).all()  # z = 0: no privacy, said as ε = ∞


def test_a_personal_head_never_leaves_the_client_under_dp(tmp_path):
    from tests.oracles import TwoLayer

    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    engine, algorithm = dp_engine(tmp_path, "fedrep", data, 2, PrivacySettings(0.1, 0.5), method="fedrep",
                                  model=TwoLayer())
    recorder = Recorder(algorithm)
    engine.run()
    private = algorithm.private_keys()
    assert private == {"head.weight"}
    assert all(set(upload.tensors["delta"]) == {"body.weight"} for uploads in recorder.rounds for upload in uploads)


def test_scaffold_clips_its_model_and_control_updates_together(tmp_path):
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    engine, algorithm = dp_engine(tmp_path, "scaffold", data, 2, PrivacySettings(0.05, 0.0), method="scaffold",
                                  steps=3)
    recorder = Recorder(algorithm)
    engine.run()
    norms = [upload_norm(upload.tensors, ("delta", "control_delta")) for uploads in recorder.rounds for upload in uploads]
    assert max(norms) == pytest.approx(0.05, rel=1e-12)  # every joint norm at most C, the large ones exactly C
    assert all(norm <= 0.05 * (1 + 1e-12) for norm in norms)


def test_adaptive_clipping_moves_c_by_the_papers_rule_by_hand(tmp_path):
    """z = 0 (no count noise): C⁺ = C·exp(−η(b̄ − γ)). Round 1: C = 1e-4 clips all 4 (b̄ = 0), so
    C⁺ = 1e-4·e^(0.2·0.5); then the rule goes on from there (checked from each round's own share)."""
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    engine, _ = dp_engine(tmp_path, "adaptive", data, 3, PrivacySettings(1e-4, 0.0, adaptive_quantile=0.5))
    engine.run()
    rows = pd.read_csv(tmp_path / "adaptive" / "metrics.csv").query("split == 'privacy'")
    clips = rows.query("metric == 'dp_clip'")["value"].tolist()
    shares = rows.query("metric == 'dp_unclipped_share'")["value"].tolist()
    assert clips[0] == 1e-4 and shares[0] == 0.0
    assert clips[1] == pytest.approx(1e-4 * math.exp(0.2 * 0.5), rel=1e-12)
    assert clips[2] == pytest.approx(clips[1] * math.exp(-0.2 * (shares[1] - 0.5)), rel=1e-12)


def test_a_dp_run_killed_after_a_round_resumes_to_the_same_bits(tmp_path):
    """C's path (adaptive) and the released rounds are in the checkpoint: 2 rounds, then 2 more on resume, equal
    4 rounds at once, the privacy rows included."""
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    settings = PrivacySettings(0.05, 0.8, adaptive_quantile=0.5, count_noise=2.0)
    whole, _ = dp_engine(tmp_path, "whole", data, 4, settings, fraction=0.5, eval_every=1)
    whole.run()
    first, _ = dp_engine(tmp_path, "parts", data, 2, settings, fraction=0.5, eval_every=1)
    first.run()
    second, _ = dp_engine(tmp_path, "parts", data, 4, settings, fraction=0.5, eval_every=1)
    second.run()
    assert (tmp_path / "whole" / "metrics.csv").read_bytes() == (tmp_path / "parts" / "metrics.csv").read_bytes()


@pytest.mark.parametrize("name", [name for name in ALGORITHMS.names() if ALGORITHMS.get(name).dp_groups])
def test_every_algorithm_offering_dp_trains_under_it_with_bounded_uploads(tmp_path, name):
    from tests.test_engine import FAST_SETTINGS, make_engine

    engine = make_engine(tmp_path, name, rounds=2, settings={**(FAST_SETTINGS.get(name) or {}), "weighting": "uniform"},
                         privacy=PrivacySettings(0.05, 0.5))
    recorder = Recorder(engine.algorithm)
    engine.run()
    groups = engine.algorithm.dp_groups
    # TinyNet is float32: an entry times C/‖Δ‖ rounds to float32, so the clipped norm is C within a few float32 ulps
    assert all(upload_norm(upload.tensors, groups) <= 0.05 * (1 + 1e-6)
               for uploads in recorder.rounds for upload in uploads[1:])
    assert len(recorder.rounds) == 2 and all(len(uploads) == 3 for uploads in recorder.rounds)  # 0.6 of 5 clients


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_algorithm_offers_dp_or_says_why_not_on_its_reference_page(name):
    from docsgen.algorithms import section

    algorithm = ALGORITHMS.get(name)
    assert algorithm.dp_groups or len(algorithm.dp_refusal) > 20
    line = next(part for part in section(name).split("\n\n") if part.startswith("Client-level DP:"))
    assert ("refused" in line) != bool(algorithm.dp_groups)
    assert all(f"`{group}`" in line for group in algorithm.dp_groups)


# ----- the accountant -----

@pytest.mark.parametrize("clients, per_round, z, rounds, delta", [(100, 10, 1.1, 50, 1e-5), (10, 10, 2.0, 3, 1e-3),
                                                                  (1000, 1, 0.6, 1000, 1e-6), (2, 1, 4.0, 1, 0.1)])
def test_epsilon_is_dp_accountings_own_figure_for_sampling_without_replacement(clients, per_round, z, rounds, delta):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        clients, per_round, dp_accounting.GaussianDpEvent(z / 2)), rounds)  # replace-one: sensitivity 2C
    assert Accountant(clients, per_round, z, delta).epsilon(rounds) == pytest.approx(
        accountant.get_epsilon(delta), abs=1e-9, rel=0)


def test_full_participation_is_the_gaussian_mechanisms_rdp_by_hand():
    """m = N: each round is the Gaussian mechanism of multiplier σ = z/2, RDP α/(2σ²) per round, so after R rounds
    ε = min over α of R·α/(2σ²) + log(1 − 1/α) − log(δα)/(α − 1) (the library's conversion). Over a fine grid of
    α the hand minimum is at most the library's figure (it searches fewer orders) and within 0.5% of it."""
    z, rounds, delta = 4.0, 20, 1e-5
    sigma = z / 2
    alphas = np.linspace(1.02, 200, 200_000)
    by_hand = np.min(rounds * alphas / (2 * sigma**2) + np.log1p(-1 / alphas) - np.log(delta * alphas) / (alphas - 1))
    library = Accountant(10, 10, z, delta).epsilon(rounds)
    assert by_hand <= library + 1e-9 and library < by_hand * 1.005


def test_epsilon_grows_with_rounds_and_falls_with_noise_and_is_infinite_without_noise():
    accountant = Accountant(50, 5, 1.0, 1e-5)
    assert accountant.epsilon(0) == 0.0 and math.isinf(Accountant(50, 5, 0.0, 1e-5).epsilon(1))
    assert accountant.epsilon(1) < accountant.epsilon(2) < accountant.epsilon(10)
    assert accountant.epsilon(10, 2.0) < accountant.epsilon(10, 1.0)


def test_a_target_epsilon_stops_before_the_round_that_would_exceed_it():
    accountant = Accountant(20, 4, 1.5, 1e-5)
    target = (accountant.epsilon(7) + accountant.epsilon(8)) / 2  # between rounds 7 and 8
    settings, rounds, notes = resolve_budget(PrivacySettings(1.0, 1.5, target_epsilon=target, delta=1e-5), 20, 4, 30)
    assert rounds == 7 and settings.noise_multiplier == 1.5
    assert "round 8 would spend" in notes[-1][1] and "stops after round 7 of --n_rounds 30" in notes[-1][1]
    assert resolve_budget(PrivacySettings(1.0, 1.5, target_epsilon=accountant.epsilon(8)), 20, 4, 8)[1] == 8  # tie
    with pytest.raises(TaskHetError, match="one round already spends"):
        resolve_budget(PrivacySettings(1.0, 1.5, target_epsilon=accountant.epsilon(1) / 2), 20, 4, 30)


def test_a_target_epsilon_alone_calibrates_z_to_spend_it_over_the_rounds():
    settings, rounds, _ = resolve_budget(PrivacySettings(1.0, None, target_epsilon=2.0, delta=1e-5), 100, 10, 40)
    accountant = Accountant(100, 10, settings.noise_multiplier, 1e-5)
    assert rounds == 40 and accountant.epsilon(40) <= 2.0 < accountant.epsilon(40, settings.noise_multiplier - 1e-4)


def test_the_engine_writes_epsilon_after_every_round(tmp_path):
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    engine, _ = dp_engine(tmp_path, "eps", data, 3, PrivacySettings(0.1, 1.2, delta=1e-3), fraction=0.5)
    engine.run()
    rows = pd.read_csv(tmp_path / "eps" / "metrics.csv").query("split == 'privacy' and metric == 'dp_epsilon'")
    expected = [Accountant(4, 2, 1.2, 1e-3).epsilon(r) for r in (1, 2, 3)]
    assert rows["round"].tolist() == [1, 2, 3] and rows["value"].tolist() == pytest.approx(expected, abs=1e-12)


# ----- bad settings -----

@pytest.mark.parametrize("extra, message", [
    (["--dp_clip", "0"], "--dp_clip"), (["--dp_clip", "-1"], "--dp_clip"), (["--dp_clip", "nan"], "--dp_clip"),
    (["--dp_clip", "1e300"], "--dp_clip"), (["--dp_clip", "1", "--dp_noise_multiplier", "-0.5"], "--dp_noise_multiplier"),
    (["--dp_clip", "1", "--dp_noise_multiplier", "1e9"], "--dp_noise_multiplier"),
    (["--dp_clip", "1", "--dp_target_epsilon", "0"], "--dp_target_epsilon"),
    (["--dp_clip", "1", "--dp_target_epsilon", "inf"], "--dp_target_epsilon"),
    (["--dp_clip", "1", "--dp_noise_multiplier", "1", "--dp_delta", "0"], "--dp_delta"),
    (["--dp_clip", "1", "--dp_noise_multiplier", "1", "--dp_delta", "1"], "--dp_delta"),
    (["--dp_clip", "1", "--dp_noise_multiplier", "1", "--dp_adaptive_quantile", "1.5"], "--dp_adaptive_quantile"),
    (["--dp_clip", "inf", "--dp_noise_multiplier", "1"], "--dp_clip inf"),
    (["--dp_clip", "1"], "--dp_noise_multiplier Z"), (["--dp_noise_multiplier", "1"], "needs --dp_clip"),
    (["--dp_clip", "1", "--dp_noise_multiplier", "1", "--weighting", "samples"], "--weighting uniform"),
    (["--dp_clip", "1", "--dp_noise_multiplier", "1", "--method", "qfedavg", "--weighting", "none"], "not offered for qfedavg"),
])
def test_bad_dp_settings_are_one_line_naming_the_flag(extra, message, capsys):
    from steps.federated import check_arguments

    weighting = [] if "--weighting" in extra else ["--weighting", "uniform"]
    extra = [item for item in extra if item not in ("--weighting", "none")] if "none" in extra else extra
    with pytest.raises((TaskHetError, SystemExit)) as caught:
        check_arguments(["--task", "normal", *weighting, *extra])
    if caught.type is TaskHetError:
        assert message in str(caught.value) and "\n" not in str(caught.value)
    else:  # argparse's own line, on stderr: the flag and its range
        printed = capsys.readouterr().err.strip().splitlines()
        assert len(printed) == 1 and printed[0].startswith(f"error: argument {message}: must be a number in"), printed


def test_a_delta_of_one_over_n_or_more_gets_a_warning():
    _, _, notes = resolve_budget(PrivacySettings(1.0, 1.0, delta=0.1), 10, 5, 3)
    assert notes and "1/N = 1/10" in notes[0][1] and notes[0][0] >= 30  # logging.WARNING
    assert resolve_budget(PrivacySettings(1.0, 1.0, delta=0.099), 10, 5, 3)[2] == []


def test_the_broadcast_carries_c_and_the_adaptive_flag():
    fixed = ServerPrivacy(PrivacySettings(2.0, 1.0), ("delta",), 10, 5, 0, 1.0)
    adaptive = ServerPrivacy(PrivacySettings(2.0, 1.0, adaptive_quantile=0.5, count_noise=5.0), ("delta",), 10, 5, 0, 1.0)
    assert float(fixed.broadcast()[CLIP_KEY]) == 2.0 and ADAPTIVE_KEY not in fixed.broadcast()
    assert ADAPTIVE_KEY in adaptive.broadcast()


# ----- step 4's command line on real-format data -----

def test_step4_with_a_target_epsilon_stops_before_the_round_that_would_exceed_it_and_logs_why(
        tiny_data_root, tiny_manifest, tmp_path):  # noqa: F811
    """3 clients, all sampled, z = 2: the target lies between ε(2) and ε(3), so of --n_rounds 5 the run trains 2
    rounds, says so in run.log, and writes ε after each round; its global model is a finite DP-FedAvg model."""
    import test_fed
    from tests.test_step4 import N_CLIENTS, argv

    accountant = Accountant(N_CLIENTS, N_CLIENTS, 2.0, 1e-3)
    target = (accountant.epsilon(2) + accountant.epsilon(3)) / 2
    out = tmp_path / "dp"
    assignments = write_round_robin(tiny_manifest, tmp_path)
    test_fed.main(argv(tiny_data_root, tiny_manifest, assignments, out, "--n_rounds", "5", "--weighting", "uniform",
                       "--dp_clip", "0.5", "--dp_noise_multiplier", "2", "--dp_delta", "1e-3",
                       "--dp_target_epsilon", f"{target!r}"))  # the last --n_rounds counts
    metrics = pd.read_csv(out / "metrics.csv")
    epsilon = metrics.query("split == 'privacy' and metric == 'dp_epsilon'")
    assert epsilon["round"].tolist() == [1, 2] and metrics["round"].max() == 2
    assert epsilon["value"].tolist() == pytest.approx([accountant.epsilon(1), accountant.epsilon(2)], abs=1e-12)
    log = (out / "run.log").read_text()
    assert "round 3 would spend ε" in log and "stops after round 2 of --n_rounds 5" in log
    assert "--dp_delta 0.001" not in log  # δ = 1e-3 < 1/3: no warning


def write_round_robin(manifest, tmp_path):
    from datasets.taskonomy import read_manifest
    from partitioning.assignments import write_assignments
    from tests.test_step4 import N_CLIENTS

    train = read_manifest(manifest).query("split == 'train'").sort_values("sample_id").reset_index(drop=True)
    table = pd.DataFrame({"sample_id": train["sample_id"], "client_id": train.index % N_CLIENTS,
                          "group": train["scene_class"], "subset": "train"})
    path = tmp_path / "assignments" / "assignments.csv"
    write_assignments(path, table, {"scheme": "round_robin", "alpha": 1.0, "n_clients": N_CLIENTS, "groups": "scene_class"})
    return path


def test_lockstep_clients_are_clipped_as_one_after_another(tmp_path):
    """--vectorize_clients trains a chunk in lock-step; its uploads are clipped as train_client clips them, so the run
    equals the one-after-another run (to float64 rounding: lock-step sums in another order)."""
    data = least_squares_clients(sizes=(8, 12, 20, 30), seed=1)
    runs = {}
    for chunk in (0, 4):
        engine, _ = dp_engine(tmp_path, f"chunk{chunk}", data, 2, PrivacySettings(0.05, 0.0), steps=3,
                              vectorize_chunk=chunk)
        runs[chunk] = engine.run()["weight"]
    assert torch.allclose(runs[0], runs[4], rtol=1e-12, atol=1e-15)
    assert not torch.allclose(runs[0], dp_engine(tmp_path, "free", data, 2, None, steps=3)[0].run()["weight"])
