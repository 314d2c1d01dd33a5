"""Review 39e, whole runs of ``ampguard train`` with a factory (the parts built directly:
``tests/unit/test_startup_review39.py``): the run is bit for bit the hand-written loop after
the start-up's checks, with a plain DataLoader and dropout, a DataLoader's persistent workers
that augment at random, and an EMA model whose ``eval()`` swaps its weights; a BatchNorm batch
of one among the start-up's batches is one line, exit 2, nothing written."""

from __future__ import annotations

import pytest

from helpers import NOISY_DATA, one_error_line, trains_as_the_hand_loop, write

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

RUN = ["--set", "device=cpu", "--set", "precision=fp32", "--set", "log.plot=false", "--set", "log.every=1000",
       "--set", "schedule.decay=constant", "--set", "eval.enabled=false"]

FACTORIES = NOISY_DATA + """


def plain(config):  # no generator: each iter() draws its base seed from torch's RNG, as dropout does
    x, y = xy()
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 2))
    return model, DataLoader(TensorDataset(x, y), batch_size=16), F.mse_loss


def persistent(config):
    data = persistent_loader()
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)), data, F.mse_loss


class EMASwap(nn.Module):  # eval() swaps the EMA weights in, train() the trained ones back; training-only forward
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 2)
        self.ema = [p.detach().clone() + 0.5 for p in self.l.parameters()]
        self.backup = None

    def train(self, mode=True):
        if self.training and not mode:
            self.backup = [p.detach().clone() for p in self.l.parameters()]
            with torch.no_grad():
                for p, e in zip(self.l.parameters(), self.ema):
                    p.copy_(e)
        elif not self.training and mode and self.backup is not None:
            with torch.no_grad():
                for p, b in zip(self.l.parameters(), self.backup):
                    p.copy_(b)
        return super().train(mode)

    def forward(self, x):
        assert self.training, "this module's forward is for training only"
        return self.l(x)


def ema(config):
    x, y = xy()
    return EMASwap(), [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], F.mse_loss


def bn_last_one(config):  # 33 examples in batches of 16: the third batch holds one
    x, y = xy(33)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    return model, DataLoader(TensorDataset(x, y), batch_size=16), F.mse_loss
"""


@pytest.mark.parametrize("fn", ["plain", "persistent", "ema"])
def test_the_run_is_the_hand_written_loop_bit_for_bit_after_the_start_ups_checks(cli, tmp_path, fn):
    # plain: the start-up's reads drew two DataLoader seeds from torch's RNG, the dropout masks moved;
    # persistent: its reads advanced the workers' RNGs; ema: a retry in the check left the EMA weights
    # in place of the trained ones
    trains_as_the_hand_loop(cli, write(tmp_path / "f39.py", FACTORIES), fn, *RUN)


def test_a_batchnorm_batch_of_one_among_the_start_ups_batches_is_one_line_and_nothing_is_written(cli, unchanged,
                                                                                                 tmp_path):
    # it passed the check (eval mode) and crashed the run at step 3: a traceback, exit 1
    write(tmp_path / "f39.py", FACTORIES)
    check = unchanged()
    line = one_error_line(cli("train", *RUN, "--set", "task.factory=f39.py:bn_last_one", "--set", "steps=6",
                              "--set", "log.name=x"))
    assert line == ("ampguard: error: task.factory f39.py:bn_last_one: the model's forward pass on the third batch "
                    "failed: ValueError: Expected more than 1 value per channel when training, got input size "
                    "torch.Size([1, 16])")
    check()
