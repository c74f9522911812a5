"""``bench_vectorized.py --ceiling``: how far vectorising clients can go on a CPU for a conv model: the sequential
round's CPU time ÷ the CPU time of its convolutions and max-pools alone in their fastest form (each Conv2d layer
one client after another and as vmap's grouped convolution, each MaxPool2d one client after another and with the
clients' batches as one)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.vectorized_cases import CASES, STEPS, make_engine
from network.client import ClientData


KERNEL_LAYERS = (nn.Conv2d, nn.MaxPool2d)


def kernel_layers(model: nn.Module, clients: list[ClientData], loss) -> list[tuple[nn.Module, tuple, bool]]:
    """Each trained Conv2d and each MaxPool2d a training step runs: (module, its input's shape, whether its input
    needs a gradient)."""
    seen: list[tuple[nn.Module, tuple, bool]] = []
    hooks = [module.register_forward_pre_hook(lambda module, inputs: seen.append(
        (module, tuple(inputs[0].shape), inputs[0].requires_grad))) for module in model.modules()
        if isinstance(module, nn.MaxPool2d) or (isinstance(module, nn.Conv2d) and module.weight.requires_grad)]
    model.train()
    batch = next(iter(clients[0].train_loader(0)))
    loss(model, {key: value for key, value in batch.items() if key != "sample_id"}).backward()
    model.zero_grad(set_to_none=True)
    for hook in hooks:
        hook.remove()
    return [(module, shape, needs_grad) for module, shape, needs_grad in seen if not isinstance(module, nn.MaxPool2d)
            or needs_grad]  # a pool on the frozen encoder's side is not part of a training step's work


def conv_runs(module: nn.Conv2d, shape: tuple, input_grad: bool, count: int):
    """A convolution's forward and backward for ``count`` clients: client after client, as the sequential engine
    runs it, and as the grouped convolution ``vmap`` makes of it (groups = count)."""
    # Each client's own leaf tensors (as in the sequential engine), and their stacks (as in the lock-step).
    inputs = [torch.randn(*shape, requires_grad=input_grad) for _ in range(count)]
    weights = [module.weight.detach().clone().requires_grad_() for _ in range(count)]
    stacked_inputs = torch.stack(inputs).detach().requires_grad_(input_grad)
    stacked_weights = torch.stack(weights).detach().requires_grad_()
    options = dict(stride=module.stride, padding=module.padding, dilation=module.dilation)

    def one_by_one() -> None:
        for client_input, weight in zip(inputs, weights):
            output = nn.functional.conv2d(client_input, weight, **options)
            torch.autograd.grad(output.sum(), [weight] + ([client_input] if input_grad else []))

    def grouped() -> None:
        folded = stacked_inputs.movedim(0, 1).reshape(shape[0], count * shape[1], *shape[2:])
        output = nn.functional.conv2d(folded, stacked_weights.reshape(-1, *stacked_weights.shape[2:]),
                                      groups=count, **options)
        torch.autograd.grad(output.sum(), [stacked_weights] + ([stacked_inputs] if input_grad else []))

    return one_by_one, grouped


def pool_runs(module: nn.MaxPool2d, shape: tuple, count: int):
    """A max-pool's forward and backward for ``count`` clients: client after client, and the clients' batches as
    one (vmap's rule folds the clients into the batch dimension)."""
    inputs = [torch.randn(*shape, requires_grad=True) for _ in range(count)]
    folded = torch.cat(inputs).detach().requires_grad_()
    options = dict(kernel_size=module.kernel_size, stride=module.stride, padding=module.padding,
                   dilation=module.dilation, ceil_mode=module.ceil_mode)

    def one_by_one() -> None:
        for client_input in inputs:
            torch.autograd.grad(nn.functional.max_pool2d(client_input, **options).sum(), [client_input])

    def together() -> None:
        torch.autograd.grad(nn.functional.max_pool2d(folded, **options).sum(), [folded])

    return one_by_one, together


def kernel_seconds(layers: list[tuple[nn.Module, tuple, bool]], count: int, repeats: int = 3) -> tuple[float, float]:
    """CPU seconds of one step's convolutions and max-pools (forward and backward) for ``count`` clients, each
    layer timed client after client and batched (:func:`conv_runs`, :func:`pool_runs`); returns (client after
    client, the faster of the two per layer, summed)."""
    sequential = best = 0.0
    for module, shape, input_grad in layers:
        runs = (pool_runs(module, shape, count) if isinstance(module, nn.MaxPool2d)
                else conv_runs(module, shape, input_grad, count))
        times = []
        for run in runs:
            run()
            began = time.process_time()
            for _ in range(repeats):
                run()
            times.append((time.process_time() - began) / repeats)
        sequential, best = sequential + times[0], best + min(times)
    return sequential, best


def ceiling(name: str, count: int, device: torch.device, item_reads: bool) -> None:
    """How far vectorising can go on CPU for this model: the sequential round's CPU time ÷ the CPU time of its
    convolutions and max-pools alone in their fastest form (a ratio no engine that runs these kernels reaches)."""
    model, clients, loss = CASES[name](count, item_reads)
    layers = kernel_layers(model, clients, loss)
    with tempfile.TemporaryDirectory() as folder:
        engine = make_engine(model, clients, loss, 0, Path(folder), device)
        engine.train_round(1)
        began = time.process_time()
        engine.train_round(2)
        round_seconds = time.process_time() - began
    pools = sum(isinstance(module, nn.MaxPool2d) for module, _, _ in layers)
    sequential, best = (seconds * STEPS for seconds in kernel_seconds(layers, count))
    print(f"{name:8s} K={count:4d}: sequential round {round_seconds:.3f} CPU s, of which its convolutions and max-pools "
          f"{sequential:.3f} s; those in their fastest form (per layer, one by one or batched) {best:.3f} s; "
          f"ceiling {round_seconds / best:.2f}x ({len(layers) - pools} conv, {pools} max-pool layers)", flush=True)
