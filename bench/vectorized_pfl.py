"""``bench_vectorized.py --pfl``: the tiny-MLP FedAvg workload in Apple's pfl-research (a bench-only dependency,
imported only here, when it is importable) beside TaskHet's sequential and vectorised engines."""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.bench_engine import tiny_mlp
from bench.vectorized_cases import CASES, STEPS, make_engine, time_engines


def pfl_unavailable() -> str | None:
    """Why pfl-research cannot be imported here (its ImportError), or None when it can."""
    try:
        import pfl  # noqa: F401  (bench-only, never a project dependency)
    except ImportError as error:
        return str(error)
    return None


def pfl_rounds_per_second(count: int, rounds: int) -> float:
    """pfl-research's FedAvg on the tiny MLP case: K users of 5 batches of 16, 1 local epoch (5 steps), SGD
    momentum 0.9, every user sampled each round (cohort K), no evaluation; rounds per second after a warm-up."""
    import functools

    import numpy as np
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002 (pfl's name)
            self.eval() if eval else self.train()
            return nn.functional.cross_entropy(self(x), y)

        def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:  # noqa: A002
            return {}

    generator = torch.Generator().manual_seed(0)
    samples = 16 * STEPS
    data = {str(index): (torch.randn(samples, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator))
            for index in range(count)}
    module = Module()
    model = PyTorchModel(model=module, local_optimizer_create=functools.partial(torch.optim.SGD, momentum=0.9),
                         central_optimizer=torch.optim.SGD(module.parameters(), 1.0))
    users = list(data)
    federated = FederatedDataset(make_dataset_fn=lambda user: Dataset(raw_data=list(data[user]), user_id=user),
                                 user_sampler=get_user_sampler("minimize_reuse", users))
    backend = SimulatedBackend(training_data=federated, val_data=federated, postprocessors=[])
    np.random.seed(0)

    def run(iterations: int) -> float:
        params = NNAlgorithmParams(central_num_iterations=iterations, evaluation_frequency=10**6,
                                   train_cohort_size=count, val_cohort_size=0)
        began = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # pfl prints every round's metrics
            FederatedAveraging().run(backend=backend, model=model, algorithm_params=params,
                                     model_train_params=NNTrainHyperParams(local_learning_rate=0.01,
                                                                           local_num_epochs=1, local_batch_size=16),
                                     model_eval_params=NNEvalHyperParams(local_batch_size=16))
        return time.perf_counter() - began

    run(1)  # warm-up
    return rounds / run(rounds)


def taskhet_and_pfl(count: int, chunk: int, rounds: int, device: torch.device, item_reads: bool) -> dict[str, float]:
    """Rounds per second on the tiny-MLP FedAvg workload: TaskHet's sequential and vectorised engines, and pfl's."""
    model, clients, loss = CASES["mlp"](count, item_reads)
    with tempfile.TemporaryDirectory() as folder:
        engines = {name: make_engine(model, clients, loss, chunk_size, Path(folder) / name, device)
                   for name, chunk_size in (("sequential", 0), ("vectorised", min(chunk, count)))}
        rates = {name: 1 / seconds for name, seconds in time_engines(engines, rounds, device)[0].items()}
    return {**rates, "pfl": pfl_rounds_per_second(count, rounds)}
