"""A complete bring-your-own-model example for ``ampguard train``.

    ampguard train --set task.factory=examples/my_model.py:build --set precision=bf16 --set steps=200

``build(config)`` gets the run's config (your own settings live in ``config.task.options``) and
returns the model, the data and the loss function; ``evaluate``/``metrics`` are optional. The
same guard rails apply: clipping, skips, the scaler, the monitors, checkpoints and resume.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build(config):
    options = config.task.options
    width = int(options.get("width", 64))

    # Data: a small synthetic two-moons-like problem, made here (no download).
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 2, generator=g)
    y = ((x[:, 0] ** 2 - x[:, 1]) > 0).long()
    train = TensorDataset(x[:1792], y[:1792])
    x_test, y_test = x[1792:], y[1792:]

    # Its own seeded generator makes the shuffle the same on every pass: resume stays exact.
    loader = DataLoader(train, batch_size=config.task.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(config.seed))

    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(2, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 2))

    def evaluate(model, device):
        logits = model(x_test.to(device)).float()
        return {"val_accuracy": float((logits.argmax(1) == y_test.to(device)).float().mean())}

    return {
        "model": model,
        "data": loader,
        "loss_fn": nn.functional.cross_entropy,
        "evaluate": evaluate,
        "metrics": ("val_accuracy",),
    }
