"""A bare Flower PyTorch ClientApp: the baseline of ``bench/bench_flower_message.py``.

The train handler of Flower's PyTorch app template (``flwr new``, flwr 1.41), cut to what
every PyTorch ClientApp pays: import flwr and torch, build a small CNN, load the server's
weights from the message, take ``local-steps`` SGD steps on a batch and reply with the
weights and the loss. Its batch is drawn from a generator seeded by the message, where the
template loads a Flower Datasets partition (``flwr_datasets`` and torchvision's transforms,
which would make this baseline slower).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"  # the template's record names

app = ClientApp()


class Net(nn.Module):
    """The template's CNN for 32×32 RGB images (LeNet-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@app.train()
def train(message: Message, context: Context) -> Message:
    """Load the weights, train ``local-steps`` steps on one seeded batch, reply with the weights and the loss."""
    config = message.content[CONFIG]
    model = Net()
    model.load_state_dict(message.content[ARRAYS].to_torch_state_dict())
    generator = torch.Generator().manual_seed(int(config["seed"]))
    batch_size = int(config["batch-size"])
    x = torch.randn(batch_size, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (batch_size,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    for _ in range(int(config["local-steps"])):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    metrics = MetricRecord({"train_loss": float(loss), "num-examples": batch_size})
    return Message(RecordDict({ARRAYS: ArrayRecord(model.state_dict()), METRICS: metrics}), reply_to=message)
