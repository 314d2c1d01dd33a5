"""Review 40c, whole runs of ``ampguard train`` with a factory (the parts built directly:
``tests/unit/test_startup_review40.py``): the run is bit for bit the hand-written loop after the
start-up's checks, with lazy modules (``nn.LazyLinear`` before dropout, over a DataLoader whose
reads draw from torch's RNG; ``nn.LazyBatchNorm1d``), a wrapper over a seeded shuffling
DataLoader, a wrapper returning a persistent-workers loader's iterator, a model that counts its
training calls, and an ``nn.Embedding(max_norm=...)``."""

from __future__ import annotations

import pytest
import torch

from helpers import NOISY_DATA, trains_as_the_hand_loop, write

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

RUN = ["--set", "device=cpu", "--set", "precision=fp32", "--set", "log.plot=false", "--set", "log.every=1000",
       "--set", "schedule.decay=constant", "--set", "eval.enabled=false"]

FACTORIES = NOISY_DATA + """


def lazy_dropout(config):  # the lazy weights drawn after the DataLoader's base seed, before the dropout masks
    x, y = xy()
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Dropout(0.3), nn.LazyLinear(2))
    return model, DataLoader(TensorDataset(x, y), batch_size=16), F.mse_loss


def lazy_batchnorm(config):
    x, y = xy()
    model = nn.Sequential(nn.Linear(8, 16), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    return model, DataLoader(TensorDataset(x, y), batch_size=16), F.mse_loss


class Wrapper:
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for x, y in self.loader:
            yield x.float(), y


def wrapper(config):
    x, y = xy()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), Wrapper(loader), F.mse_loss


class Wrap:
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


def wrapped_persistent(config):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), Wrap(persistent_loader()), F.mse_loss


class Counter(nn.Module):  # a warm-up ramp counted in the forward
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.net(x) * min(1.0, self.calls / 10)


def counter(config):
    x, y = xy()
    return Counter(), [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], F.mse_loss


def max_norm(config):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(0, 50, (64, 4), generator=g), torch.randn(64, 2, generator=g)
    model = nn.Sequential(nn.Embedding(50, 8, max_norm=1.0), nn.Flatten(), nn.Linear(32, 2))
    return model, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], F.mse_loss
"""


@pytest.mark.parametrize("fn", ["wrapper", "wrapped_persistent", "counter", "max_norm"])
def test_the_run_is_the_hand_written_loop_bit_for_bit_after_the_start_ups_checks(cli, tmp_path, fn):
    # wrapper: the start-up's reads moved the
    # wrapped loader's generator; wrapped_persistent: warned as a one-shot, its workers' RNGs moved;
    # counter: the check's four passes counted; max_norm: the check's passes renormalised the rows
    trains_as_the_hand_loop(cli, write(tmp_path / "f40.py", FACTORIES), fn, *RUN)


@pytest.mark.parametrize("fn", ["lazy_dropout", "lazy_batchnorm"])
def test_a_lazy_model_trains_from_weights_made_at_start_up_said_once_and_a_resume_goes_on_from_them_unsaid(cli, tmp_path, fn):
    # a traceback from the check's checksum (8caa52d); then weights drawn again at the first training forward,
    # which a resume, a step-0 checkpoint or a torchrun broadcast did not see (reviews 40g, 40k): made at
    # start-up, warned of, the same in every part of the run
    write(tmp_path / "f40.py", FACTORIES)
    args = [*RUN, "--set", f"task.factory=f40.py:{fn}", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=10"]
    code, out, err = cli("train", *args, "--set", "steps=4", "--set", "log.name=whole")
    assert code == 0, err
    said = [line for line in err.splitlines() if "lazy modules" in line]
    assert len(said) == 1 and "made their weights at start-up" in said[0], err
    code, out, err = cli("train", *args, "--set", "steps=2", "--set", "log.name=part")
    assert code == 0, err
    code, out, err = cli("train", "--resume", "runs/part", "--set", "steps=4")
    assert code == 0, err
    assert "lazy modules" not in err, err  # (review 41: said again on resume, where the checkpoint's weights count)
    whole, part = (torch.load(tmp_path / "runs" / name / "checkpoints" / "step-00000004.pt", weights_only=True)["model"]
                   for name in ("whole", "part"))
    assert whole.keys() == part.keys() and all(torch.equal(whole[k], part[k]) for k in whole), fn
