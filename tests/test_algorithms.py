"""What every registered algorithm must satisfy (run over ``list_algorithms()``), plus the shared local loop.

A new algorithm is covered here without new test code; its own test file checks its equations.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from network.algorithms import build_algorithm, describe_algorithms, list_algorithms
from network.algorithms.base import ALGORITHMS, Upload, get_settings_class
from network.algorithms.fedavg import FedAvg
from network.algorithms.fedrep import FedRep
from network import client as client_module
from network.client import FINETUNED_TEST_SPLIT, ClientFailure, Finetune, evaluate_client
from network.local_train import NonFiniteLossError, local_train
from network.settings import describe
from steps.federated import build_parser
from tests.test_engine import NUM_CLIENTS, make_clients, make_engine
from tests.tiny_models import TinyNet, loss_fn, tiny_model_for
from utils.errors import TaskHetError

CPU = torch.device("cpu")


# ----- settings -----
@pytest.mark.parametrize("name", list_algorithms())
def test_settings_are_a_frozen_documented_dataclass_whose_defaults_build(name):
    settings_class = ALGORITHMS.get(name).Settings
    assert dataclasses.is_dataclass(settings_class) and settings_class.__dataclass_params__.frozen
    for info in describe(settings_class):
        assert info.help and info.type in (int, float, str, bool), info.name
    build_algorithm(name, tiny_model_for(name), {"a": 1, "b": 1})  # IFCA's default k = 2 needs two clients


@pytest.mark.parametrize("name", list_algorithms())
def test_setting_names_never_shadow_a_flag_of_the_run(name):
    run_flags = {option.lstrip("-") for action in build_parser()._actions for option in action.option_strings}
    assert not {info.name for info in describe(ALGORITHMS.get(name).Settings)} & run_flags


def test_a_foreign_or_mistyped_setting_is_one_error_listing_the_algorithms_settings():
    with pytest.raises(TaskHetError, match=r"fedavg has no setting mu; its settings: weighting, cap, buckets, noise_scale, server_opt, server_lr"):
        build_algorithm("fedavg", TinyNet(), {"a": 1}, {"mu": 0.1})
    with pytest.raises(TaskHetError, match="fedprox setting mu must be a float, got 'abc'"):
        build_algorithm("fedprox", TinyNet(), {"a": 1}, {"mu": "abc"})
    with pytest.raises(TaskHetError, match="scaffold setting option must be one of I, II"):
        build_algorithm("scaffold", TinyNet(), {"a": 1}, {"option": "III"})
    with pytest.raises(TaskHetError, match="setting server_lr must be > 0"):
        build_algorithm("fedavg", TinyNet(), {"a": 1}, {"server_lr": "0"})
    settings = build_algorithm("fedprox", TinyNet(), {"a": 1}, {"mu": "0.5", "server_lr": 2})[0].settings
    assert settings.mu == 0.5 and settings.server_lr == 2.0
    assert "--lam" in describe_algorithms() and "--n_cluster_models" in describe_algorithms()


# Every setting of every algorithm: values its __post_init__ must refuse (with the exact message a user
# reads) and edge values it must accept. A new setting fails the test until it is listed here.
REFUSED = {
    "server_opt": [({"server_opt": "lamb"}, "setting server_opt must be one of sgd, momentum, adam, got 'lamb'")],
    "server_lr": [({"server_lr": 0.0}, "setting server_lr must be > 0, got 0.0")],
    "server_momentum": [({"server_momentum": 1.0}, "setting server_momentum must be in [0, 1), got 1.0"),
                        ({"server_momentum": -0.1}, "setting server_momentum must be in [0, 1), got -0.1")],
    "server_beta1": [({"server_beta1": 1.0}, "setting server_beta1 must be in [0, 1), got 1.0"),
                     ({"server_beta1": -0.1}, "setting server_beta1 must be in [0, 1), got -0.1")],
    "server_beta2": [({"server_beta2": 1.0}, "setting server_beta2 must be in [0, 1), got 1.0"),
                     ({"server_beta2": -0.1}, "setting server_beta2 must be in [0, 1), got -0.1")],
    "server_tau": [({"server_tau": 0.0}, "setting server_tau must be > 0, got 0.0")],
    "mu": [({"mu": -0.5}, "setting mu must be >= 0, got -0.5")],
    "lam": [({"lam": -0.5}, "setting lam must be >= 0, got -0.5")],
    "inner_steps": [({"inner_steps": 0}, "setting inner_steps must be >= 1, got 0")],
    "personal_lr": [({"personal_lr": 0.0}, "setting personal_lr must be > 0, got 0.0")],
    "prox_step": [({"prox_step": "newton"}, "setting prox_step must be one of explicit, implicit, got 'newton'")],
    "head_epochs": [({"head_epochs": -1}, "setting head_epochs/body_epochs must be >= 0 and not both 0, got (-1, 1)"),
                    ({"head_epochs": 0, "body_epochs": 0},
                     "setting head_epochs/body_epochs must be >= 0 and not both 0, got (0, 0)")],
    "body_epochs": [({"body_epochs": -1}, "setting head_epochs/body_epochs must be >= 0 and not both 0, got (1, -1)")],
    "n_cluster_models": [({"n_cluster_models": 0}, "setting n_cluster_models must be >= 1, got 0")],
    "init_noise": [({"init_noise": -0.1}, "setting init_noise must be >= 0, got -0.1")],
    "option": [({"option": "III"}, "setting option must be I or II, got 'III'")],
    "weighting": [({"weighting": "median"},
                   "setting weighting must be one of samples, uniform, capped, bucketed, noisy, got 'median'")],
    "buckets": [({"buckets": bad}, f"setting buckets must be 1 to 64 increasing integers in [1, 1e+09] joined by commas, "
                                   f"e.g. 10,100,1000,10000, got {bad!r}")
                for bad in ("100,10", "0,10", "10,10", "", "10;100", "1²", "2000000000", ",".join(map(str, range(1, 66))))],
    "noise_scale": [({"noise_scale": 0.0}, "setting noise_scale must be > 0, got 0.0")],
    "cap": [({"cap": 0.0}, "setting cap must be in (0, 1], got 0.0"), ({"cap": 1.5}, "setting cap must be in (0, 1], got 1.5")],
    "n_components": [({"n_components": 0}, "setting n_components must be >= 1, got 0")],
    "mix": [({"mix": "logits"}, "setting mix must be one of auto, probabilities, values, got 'logits'")],
    "variant": [({"variant": "adaptive"}, "setting variant must be one of fedamp, heuristic, got 'adaptive'")],
    "alpha_k": [({"alpha_k": 0.0}, "setting alpha_k must be > 0, got 0.0")],
    "sigma": [({"sigma": 0.0}, "setting sigma must be > 0, got 0.0"), ({"sigma": -1.0}, "setting sigma must be > 0, got -1.0")],
    "self_weight": [({"self_weight": 1.5}, "setting self_weight must be in [0, 1], got 1.5")],
    "eps": [({"eps": 0.0}, "setting eps must be in (0, 1), got 0.0")],
    "eps1": [({"eps1": 0.0}, "setting eps1 must be > 0, got 0.0"),
             ({"eps1": 2.0, "eps2": 1.0}, "setting eps1 must be < eps2 (1.0), got 2.0")],
    "eps2": [({"eps1": 0.5, "eps2": 0.5}, "setting eps1 must be < eps2 (0.5), got 0.5")],
    "start_round": [({"start_round": -1}, "setting start_round must be >= 0, got -1")],
    "min_size": [({"min_size": 1}, "setting min_size must be >= 2, got 1")],
    "q": [({"q": -1.0}, "setting q must be >= 0, got -1.0")],
    "density": [({"density": 0.0}, "setting density must be in (0, 1], got 0.0"),
                ({"density": 1.5}, "setting density must be in (0, 1], got 1.5")],
    "calibration_rounds": [({"calibration_rounds": 0}, "setting calibration_rounds must be >= 1, got 0")],
    "calibration_batches": [({"calibration_batches": 0}, "setting calibration_batches must be >= 1, got 0")],
    "beta": [({"beta": 1.0}, "setting beta must be in [0, 1), got 1.0"),
             ({"beta": -0.1}, "setting beta must be in [0, 1), got -0.1")],
    "tau": [({"tau": 0.0}, "setting tau must be > 0, got 0.0"), ({"tau": -1.7}, "setting tau must be > 0, got -1.7")],
    "etf_steps": [({"etf_steps": -1}, "setting etf_steps must be >= 0, got -1")],
    "etf_lr": [({"etf_lr": 0.0}, "setting etf_lr must be > 0, got 0.0")],
    "gamma": [({"gamma": -1.0}, "setting gamma must be >= 0, got -1.0")],
    "alpha_dyn": [({"alpha_dyn": 0.0}, "setting alpha_dyn must be > 0, got 0.0")],
    "version": [({"version": "so"}, "setting version must be one of fo, hf, got 'so'")],
    "outer_lr": [({"outer_lr": 0.0}, "setting outer_lr must be > 0, got 0.0")],
    "delta": [({"delta": 0.0}, "setting delta must be > 0, got 0.0")],
    "alpha_init": [({"alpha_init": -0.1}, "setting alpha_init must be in [0, 1], got -0.1"),
                   ({"alpha_init": 1.5}, "setting alpha_init must be in [0, 1], got 1.5")],
    "alpha_lr": [({"alpha_lr": -1.0}, "setting alpha_lr must be >= 0, got -1.0")],
    "ala_layers": [({"ala_layers": 0}, "setting ala_layers must be >= 1, got 0")],
    "rand_percent": [({"rand_percent": 0}, "setting rand_percent must be in [1, 100], got 0"),
                     ({"rand_percent": 101}, "setting rand_percent must be in [1, 100], got 101")],
    "ala_eta": [({"ala_eta": -1.0}, "setting ala_eta must be >= 0, got -1.0")],
    "ala_threshold": [({"ala_threshold": -0.1}, "setting ala_threshold must be >= 0, got -0.1")],
    "ala_window": [({"ala_window": 1}, "setting ala_window must be >= 2, got 1")],
    "ala_max_epochs": [({"ala_max_epochs": 0}, "setting ala_max_epochs must be >= 1, got 0")],
    "lc_tau": [({"lc_tau": -0.5}, "setting lc_tau must be >= 0, got -0.5")],
    "num_virtual": [({"num_virtual": 0}, "setting num_virtual must be >= 1, got 0")],
    "calib_epochs": [({"calib_epochs": -1}, "setting calib_epochs must be >= 0, got -1")],
    "calib_batch": [({"calib_batch": 0}, "setting calib_batch must be >= 1, got 0")],
    "calib_lr": [({"calib_lr": 0.0}, "setting calib_lr must be > 0, got 0.0")],
    "calib_momentum": [({"calib_momentum": 1.0}, "setting calib_momentum must be in [0, 1), got 1.0"),
                       ({"calib_momentum": -0.1}, "setting calib_momentum must be in [0, 1), got -0.1")],
    "covariance": [({"covariance": "low_rank"}, "setting covariance must be one of full, diagonal, got 'low_rank'")],
    # One algorithm's setting of a name another uses with another range: "<algorithm>.<setting>" wins.
    "feddecorr.beta": [({"beta": -0.1}, "setting beta must be >= 0, got -0.1"),
                       ({"beta": float("inf")}, "setting beta must be >= 0, got inf")],  # a Settings made in code
}
# Settings no __post_init__ check guards: their choices are enforced when the settings are built from a run's
# values (build_settings), or any value is valid.
NOT_CHECKED_AFTER_BUILD = {"mask_rule", "score", "likelihood", "mask_source", "input_key", "keep_local_models", "adaptive"}
ACCEPTED_EDGES = {"server_lr": [{"server_lr": 1e-9}], "server_momentum": [{"server_momentum": 0.0}],
                  "server_beta1": [{"server_beta1": 0.0}], "server_beta2": [{"server_beta2": 0.0}],
                  "mu": [{"mu": 0.0}], "lam": [{"lam": 0.0}], "head_epochs": [{"head_epochs": 0, "body_epochs": 1}],
                  "body_epochs": [{"head_epochs": 1, "body_epochs": 0}], "n_cluster_models": [{"n_cluster_models": 1}],
                  "init_noise": [{"init_noise": 0.0}], "density": [{"density": 1.0}], "cap": [{"cap": 1.0}], "q": [{"q": 0.0}],
                  "buckets": [{"buckets": "1"}, {"buckets": " 5, 50 "}], "noise_scale": [{"noise_scale": 1e-9}],
                  "inner_steps": [{"inner_steps": 1}], "n_components": [{"n_components": 1}],
                  "self_weight": [{"self_weight": 0.0}, {"self_weight": 1.0}],
                  "min_size": [{"min_size": 2}], "start_round": [{"start_round": 0}], "personal_lr": [{"personal_lr": 1e-9}],
                  "calibration_rounds": [{"calibration_rounds": 1}], "calibration_batches": [{"calibration_batches": 1}],
                  "beta": [{"beta": 0.0}, {"beta": 0.99}], "etf_steps": [{"etf_steps": 0}], "gamma": [{"gamma": 0.0}],
                  "alpha_dyn": [{"alpha_dyn": 1e-9}], "outer_lr": [{"outer_lr": 1e-9}], "delta": [{"delta": 1e-9}],
                  "alpha_init": [{"alpha_init": 0.0}, {"alpha_init": 1.0}], "alpha_lr": [{"alpha_lr": 0.0}],
                  "ala_layers": [{"ala_layers": 1}], "rand_percent": [{"rand_percent": 1}, {"rand_percent": 100}],
                  "ala_eta": [{"ala_eta": 0.0}], "ala_threshold": [{"ala_threshold": 0.0}], "ala_window": [{"ala_window": 2}],
                  "ala_max_epochs": [{"ala_max_epochs": 1}], "lc_tau": [{"lc_tau": 0.0}], "num_virtual": [{"num_virtual": 1}],
                  "calib_epochs": [{"calib_epochs": 0}], "calib_batch": [{"calib_batch": 1}],
                  "calib_momentum": [{"calib_momentum": 0.0}], "feddecorr.beta": [{"beta": 0.0}, {"beta": 6.0}]}


@pytest.mark.parametrize("name", list_algorithms())
def test_every_setting_refuses_bad_values_with_its_message_and_accepts_its_edges(name):
    settings_class = ALGORITHMS.get(name).Settings
    assert get_settings_class(name) is settings_class
    for info in describe(settings_class):
        own = f"{name}.{info.name}"  # this algorithm's own range of a shared name
        assert own in REFUSED or info.name in REFUSED or info.name in NOT_CHECKED_AFTER_BUILD, \
            f"{name}: list {info.name}'s bad values"
        for overrides, message in REFUSED.get(own, REFUSED.get(info.name, [])):
            with pytest.raises(TaskHetError) as error:
                settings_class(**overrides)
            assert str(error.value) == message
        for overrides in ACCEPTED_EDGES.get(own, ACCEPTED_EDGES.get(info.name, [])):
            settings = settings_class(**overrides)
            assert all(getattr(settings, key) == value for key, value in overrides.items())
        for choice in info.choices or ():
            assert getattr(settings_class(**{info.name: choice}), info.name) == choice


def test_list_methods_shows_each_algorithm_with_its_summary_and_settings():
    blocks = describe_algorithms().split("\n\n")
    assert len(blocks) == len(list_algorithms())
    for name, block in zip(list_algorithms(), blocks):
        algorithm_class = ALGORITHMS.get(name)
        lines = block.split("\n")
        assert lines[0] == f"{name}: {algorithm_class.__doc__.strip().splitlines()[0]}"
        flags = [line.split(" (")[0] for line in lines[1:] if line != "  (no settings)"]
        assert flags == [f"  --{info.name}" for info in describe(algorithm_class.Settings)]
        assert len(lines) > 1  # an algorithm without settings says so


# ----- the engine's view of every algorithm -----
class UploadRecorder:
    """Wraps an algorithm's client_update to keep (client, upload, state) of every call."""

    def __init__(self, engine) -> None:
        self.calls = []
        update = engine.algorithm.client_update

        def recording(model, broadcast, client_state, loader, cfg):
            result = update(model, broadcast, client_state, loader, cfg)
            self.calls.append((loader.client_id, result.upload, result.client_state))
            return result

        engine.algorithm.client_update = recording


@pytest.mark.parametrize("name", list_algorithms())
def test_private_entries_never_appear_in_a_real_upload(tmp_path, name):
    engine = make_engine(tmp_path, name, rounds=2)
    recorder = UploadRecorder(engine)
    engine.run()
    private = engine.algorithm.private_keys()
    assert recorder.calls
    for client_id, upload, state in recorder.calls:
        uploaded = {key for group in upload.values() for key in group}
        assert not uploaded & private, (client_id, sorted(uploaded & private))
        assert private <= set(state)  # what stays private is kept by the client
        for key in private:  # and no upload carries its values under another name
            assert all(not torch.equal(value, state[key]) for group in upload.values()
                       for value in group.values() if value.shape == state[key].shape), key


def test_an_algorithm_that_leaks_a_private_entry_is_stopped_naming_the_client(tmp_path):
    class LeakyFedRep(FedRep):
        def client_update(self, model, broadcast, client_state, loader, cfg):
            result = super().client_update(model, broadcast, client_state, loader, cfg)
            result.upload["delta"]["head.weight"] = result.client_state["head.weight"]
            return result

    with pytest.raises(ClientFailure, match=r"client \d+ failed: TaskHetError: fedrep uploaded 1 private entries"):
        make_engine(tmp_path, "fedrep", algorithm_class=LeakyFedRep).run()


@pytest.mark.parametrize("name", list_algorithms())
def test_a_client_that_raises_is_reported_by_its_id(tmp_path, name):
    clients = make_clients()
    broken = clients[3]

    def failing_loader(seed):
        raise RuntimeError("disk on fire")

    clients[3] = dataclasses.replace(broken, train_loader=failing_loader)
    with pytest.raises(ClientFailure, match=r"round 1, client 3 failed: RuntimeError: disk on fire"):
        make_engine(tmp_path, name, clients=clients, client_fraction=1.0).run()


@pytest.mark.parametrize("name", list_algorithms())
def test_all_zero_uploads_leave_every_server_model_unchanged(tmp_path, name):
    engine = make_engine(tmp_path, name, rounds=1)
    recorder = UploadRecorder(engine)
    server = engine.server  # before any round: FedDyn's h is 0 (a later all-zero round moves its model by −h/α)
    engine.train_round(1)
    _, upload, _ = recorder.calls[0]
    zeros = {group: {key: torch.zeros_like(value) for key, value in tensors.items()} for group, tensors in upload.items()}
    new = engine.algorithm.aggregate(server, [Upload("0", zeros, 10), Upload("1", zeros, 30)])
    assert new.models.keys() == server.models.keys()
    for name_, weights in server.models.items():
        for key, value in weights.items():
            assert torch.equal(new.models[name_][key], value), (name_, key)


@pytest.mark.parametrize("name", list_algorithms())
def test_every_client_metric_is_finite_and_local_steps_are_counted(tmp_path, name):
    engine = make_engine(tmp_path, name, rounds=1)
    rows = engine.train_round(1)
    per_client = [row for row in rows if row["client"] != "mean"]
    assert per_client and all(math.isfinite(row["value"]) for row in rows)
    steps = {row["client"]: row["value"] for row in per_client if row["metric"] == "local_steps"}
    # J = 3, or a multiple for algorithms with several parts (FedRep, Ditto: 2·J; FedEM: M·J; pFedMe: K·J)
    assert steps and all(value > 0 and value % 3 == 0 for value in steps.values())


def test_an_algorithm_may_shape_its_worker_model(tmp_path):
    class TwoHeads(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model, self.extra = model, nn.Linear(1, 1)

        def forward(self, x):
            return self.extra(self.model(x))

    class ShapedFedAvg(FedAvg):
        @classmethod
        def worker_model(cls, model, settings):
            return TwoHeads(model)

    algorithm, _ = build_algorithm("fedavg", TinyNet(), {str(index): 1 for index in range(NUM_CLIENTS)})
    worker = ShapedFedAvg.worker_model(TinyNet(), algorithm.settings)
    shaped = ShapedFedAvg(algorithm.settings, dataclasses.replace(algorithm.federation,
                                                                  layout=type(algorithm.federation.layout).of(worker)))
    server = shaped.init_server({key: value.clone() for key, value in worker.state_dict().items()})
    assert {"extra.weight", "model.head.weight"} <= set(server.models["global"])


# ----- the shared loop -----
def regression_batches(seed: int, count: int = 3) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, 4, generator=generator), "y": torch.randn(8, generator=generator) + seed}
            for _ in range(count)]


def linear_loss(model, batch, reduction="mean"):
    return ((model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()


def test_local_train_cycles_the_loader_for_j_steps_and_calls_every_hook():
    model = nn.Linear(4, 1)
    calls = {"extra": 0, "hook": 0, "post": 0}

    def extra(_):
        calls["extra"] += 1
        return torch.zeros(())

    def count(kind):
        def hook(_):
            calls[kind] += 1
        return hook

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result = local_train(model, regression_batches(0, count=3), linear_loss, optimizer, CPU, steps=7,
                         extra_loss=extra, grad_hook=count("hook"), post_step=count("post"))
    assert result.steps == 7 and calls == {"extra": 7, "hook": 7, "post": 7}
    assert local_train(model, regression_batches(0, count=3), linear_loss, optimizer, CPU, epochs=2).steps == 6


def test_local_train_stops_on_a_nan_loss_and_on_an_empty_loader():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = regression_batches(0)
    batches[1]["y"] = torch.full((8,), math.nan)
    with pytest.raises(NonFiniteLossError, match="nan"):
        local_train(model, batches, linear_loss, optimizer, CPU, steps=3)
    with pytest.raises(TaskHetError, match="no training batches"):
        local_train(model, [], linear_loss, optimizer, CPU, steps=3)


def test_loading_weights_the_model_does_not_have_is_an_error():
    from network.algorithms.base import load_weights

    with pytest.raises(TaskHetError, match="unknown entries"):
        load_weights(nn.Linear(2, 1), {"weight": torch.zeros(1, 2), "cluster0.weight": torch.zeros(1, 2)})


def test_run_phases_passes_each_phases_grad_hook_to_the_loop():
    from network.algorithms.skeleton import Phase, run_phases
    from tests.oracles import client_config

    model = nn.Linear(4, 1)
    start = {key: value.clone() for key, value in model.state_dict().items()}

    def unit_gradient(module):  # every step then moves each parameter by exactly −lr
        for param in module.parameters():
            param.grad = torch.ones_like(param)

    metrics = run_phases(model, [Phase(grad_hook=unit_gradient)], regression_batches(0),
                         client_config(1, lr=0.1, steps=3, loss_fn=linear_loss))
    assert metrics["local_steps"] == 3
    for key, value in model.state_dict().items():
        assert torch.allclose(value, start[key] - 0.3, rtol=0, atol=1e-6), key


def test_server_state_to_moves_every_tensor_and_leaves_the_original():
    from network.algorithms.base import ServerState

    state = ServerState({"global": {"w": torch.ones(2, requires_grad=True)}}, {"m": torch.zeros(2)})
    moved = state.to("meta")
    assert moved.models["global"]["w"].device.type == "meta" and moved.tensors["m"].device.type == "meta"
    assert not moved.models["global"]["w"].requires_grad
    assert state.models["global"]["w"].device.type == "cpu"


def test_an_algorithm_refuses_another_algorithms_settings():
    algorithm, _ = build_algorithm("fedavg", TinyNet(), {"a": 1})
    scaffold_settings = ALGORITHMS.get("scaffold").Settings()
    with pytest.raises(TypeError, match="^fedavg takes ServerOptSettings, got ScaffoldSettings$"):
        FedAvg(scaffold_settings, algorithm.federation)


# ----- what a personalised algorithm keeps (issue 19: bugs that passed every test) -----
def layer_entries(model: nn.Module) -> dict[str, set[str]]:
    """Layer name -> the state-dict entries the layer holds itself (parameters and buffers, not its children's)."""
    return {name: {f"{name}.{key}" if name else key for key in module.state_dict(keep_vars=True) if "." not in key}
            for name, module in model.named_modules()}


@pytest.mark.parametrize("name", list_algorithms())
def test_a_private_entry_makes_every_tensor_of_its_layer_and_of_the_head_private(tmp_path, name):
    # e.g. a head whose weight stays on the client while its bias is averaged fails here
    engine = make_engine(tmp_path, name, rounds=2, client_fraction=1.0)
    private = engine.algorithm.private_keys()
    for layer, entries in layer_entries(engine.model).items():
        assert not entries & private or entries <= private, (layer, sorted(entries - private))
    if not type(engine.algorithm).needs_classifier:  # FedLoGe/FedRoD's head holds shared and private sub-heads by design
        head = set(engine.model.head_keys())
        assert not head & private or head <= private, sorted(head - private)
    initial = {model: {key: value.clone() for key, value in weights.items()}
               for model, weights in engine.server.models.items()}
    engine.run()
    for model, weights in engine.server.models.items():
        for key in private:  # the server never receives any element of a private tensor
            assert torch.equal(weights[key], initial[model][key]), (model, key)


def personalised_algorithms() -> list[str]:
    return [name for name in list_algorithms() if build_algorithm(name, tiny_model_for(name), {"0": 1, "1": 1})[0].personalized]


@pytest.mark.parametrize("name", personalised_algorithms())
def test_evaluation_fine_tuning_starts_from_the_clients_own_model(tmp_path, monkeypatch, name):
    engine = make_engine(tmp_path, name, rounds=2, client_fraction=1.0)
    engine.run()
    starts = {}
    train = client_module.local_train

    def spy(model, loader, *args, **kwargs):
        starts[loader.client_id] = {key: value.clone() for key, value in model.state_dict().items()}
        return train(model, loader, *args, **kwargs)

    monkeypatch.setattr(client_module, "local_train", spy)
    # a global model that is no client's own, so starting from it cannot pass for starting from the own one
    other = {key: value + 1 if value.is_floating_point() else value for key, value in engine.global_weights.items()}
    for client_id, client in engine.clients.items():
        state = engine.store.get(client_id)
        splits = evaluate_client(engine.algorithm, engine.model, engine.evaluate_fn, engine.server.models, other,
                                 state, client, engine.loss_fn, CPU, Finetune(steps=2, lr=0.01), seed=3)
        own = engine.algorithm.personal_model(engine.server.models, state)
        assert own is not None and FINETUNED_TEST_SPLIT in splits, client_id
        assert starts[client_id].keys() == own.keys()
        for key, value in own.items():
            assert torch.equal(starts[client_id][key], value), (client_id, key)
    assert len(starts) == len(engine.clients)


@pytest.mark.parametrize("name", list_algorithms())
def test_an_algorithm_whose_global_head_never_trains_reports_its_personal_models(tmp_path, name):
    """result_is_personal (the reports read the clients' own models, pipeline/studies/main_job/report.py) exactly when the
    algorithm has personal models and keeps a whole part private, the head (FedRep, FedPer) or the body (LG-FedAvg), so
    that part of the server's model stays at its init."""
    engine = make_engine(tmp_path, name, rounds=2, client_fraction=1.0)
    head = set(engine.model.head_keys())
    body = {key for key in engine.algorithm.federation.layout.varying_keys if key not in head}
    initial = {key: value.clone() for key, value in engine.server.models["global"].items()} \
        if "global" in engine.server.models else {}
    engine.run()
    private = engine.algorithm.private_keys()
    verdicts = []
    for part in (head, body):
        untrained = bool(initial) and all(torch.equal(engine.server.models["global"][key], initial[key]) for key in part)
        verdicts.append(engine.algorithm.personalized and bool(part) and part <= private and untrained)
    assert type(engine.algorithm).result_is_personal == any(verdicts), verdicts


def test_training_loss_is_the_per_sample_mean_over_unequal_batches_in_eval_mode():
    """F_i(θ) of IFCA and q-FedAvg, by hand: batches of 3, 5 and 1 samples weigh by their samples, not per batch."""
    from network.algorithms.base import ClientConfig
    from network.algorithms.skeleton import training_loss

    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Dropout(0.9))
    with torch.no_grad():
        model[0].weight.fill_(2.0)
    model.train()
    xs = torch.arange(9, dtype=torch.float32).unsqueeze(1)
    batches = [{"x": xs[:3], "y": torch.zeros(3)}, {"x": xs[3:8], "y": torch.zeros(5)}, {"x": xs[8:], "y": torch.zeros(1)}]

    def squared(model, batch, reduction="mean"):
        per_sample = (model(batch["x"]).squeeze(1) - batch["y"]) ** 2
        return per_sample.mean() if reduction == "mean" else per_sample

    cfg = ClientConfig(lr=0.1, loss_fn=squared, device=torch.device("cpu"), num_samples=9, local_steps=1)
    expected = sum((2.0 * x) ** 2 for x in range(9)) / 9  # 4·Σx²/9 = 4·204/9
    assert training_loss(model, batches, cfg) == pytest.approx(expected, rel=1e-12)
    assert training_loss(model, batches[2:], cfg) == pytest.approx(4 * 64.0)  # one sample: divided by 1
    assert model.training  # the caller's mode is restored


class _PhasesByClient(FedAvg):
    """A client with state trains only the weight: its phases differ from a fresh client's in their keys alone."""

    def phases(self, model, broadcast, client_state, cfg):
        from network.algorithms.skeleton import Phase

        return [Phase(keys=["weight"] if client_state else None)]


def test_lockstep_refuses_clients_whose_phases_train_different_entries():
    from network.algorithms.base import ClientConfig

    fedavg, model = build_algorithm("fedavg", nn.Linear(2, 1), {"0": 4, "1": 4}, {}, seed=0)
    spy = _PhasesByClient(fedavg.settings, fedavg.federation)
    broadcast = spy.broadcast(spy.init_server({key: value.clone() for key, value in model.state_dict().items()}))
    cfgs = [ClientConfig(lr=0.1, loss_fn=loss_fn, device=torch.device("cpu"), num_samples=4, local_steps=1)] * 2
    with pytest.raises(TaskHetError, match="fedavg: clients of one round have different phases"):
        spy.client_updates(model, broadcast, [{}, {"weight": torch.zeros(1, 2)}], [[], []], cfgs)


def _halve_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(0.5)


_halve_gradients.functional = lambda grads: {key: 0.5 * grad for key, grad in grads.items()}  # type: ignore[attr-defined]


class _HalvedGradients(FedAvg):
    """A phase with a gradient hook (its functional form for lock-step): the generic path no built-in phase uses."""

    def phases(self, model, broadcast, client_state, cfg):
        from network.algorithms.skeleton import Phase

        # A phase of length 0 first: skipped, and the phases after it still run.
        return [Phase(keys=["bias"], multiple=0), Phase(grad_hook=_halve_gradients), Phase(keys=["weight"], multiple=2)]


def test_a_phase_gradient_hook_trains_alike_in_lockstep_and_in_turn_and_by_hand():
    from network.algorithms.base import ClientConfig
    from network.algorithms.skeleton import DELTA

    fedavg, model = build_algorithm("fedavg", nn.Linear(2, 1), {"0": 4, "1": 6}, {}, seed=0)
    algorithm = _HalvedGradients(fedavg.settings, fedavg.federation)
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    broadcast = algorithm.broadcast(algorithm.init_server(initial))
    generator = torch.Generator().manual_seed(5)
    loaders = [[{"x": torch.randn(n, 2, generator=generator), "y": torch.randn(n, generator=generator)}] for n in (4, 6)]

    def squared(model, batch, reduction="mean"):
        per_sample = (model(batch["x"]).squeeze(1) - batch["y"]) ** 2
        return per_sample.mean() if reduction == "mean" else per_sample

    cfgs = [ClientConfig(lr=0.2, loss_fn=squared, device=torch.device("cpu"), num_samples=n, local_steps=1,
                         momentum=0.0) for n in (4, 6)]
    lockstep = algorithm.client_updates(model, broadcast, [{}, {}], loaders, cfgs)
    for loader, cfg, together in zip(loaders, cfgs, lockstep):
        alone = algorithm.client_update(model, broadcast, {}, loader, cfg)
        for key in ("weight", "bias"):
            torch.testing.assert_close(together.upload[DELTA][key], alone.upload[DELTA][key])
        # By hand: one step at lr·0.5 on every entry, then two steps on the weight alone at lr.
        x, y = loader[0]["x"], loader[0]["y"]
        w, b = initial["weight"].clone(), initial["bias"].clone()
        residual = x @ w.T + b - y.unsqueeze(1)
        w, b = w - 0.2 * 0.5 * (2 * residual * x).mean(0, keepdim=True), b - 0.2 * 0.5 * (2 * residual).mean(0)
        for _ in range(2):
            w = w - 0.2 * (2 * (x @ w.T + b - y.unsqueeze(1)) * x).mean(0, keepdim=True)
        torch.testing.assert_close(alone.upload[DELTA]["weight"], w - initial["weight"])
        torch.testing.assert_close(alone.upload[DELTA]["bias"], b - initial["bias"])
