"""Review 50a: factories whose batches a plain loop trains, and the faults injected into them.
A 0-dim target per batch crashed start-up (the default evaluation set joined the first batches);
a spike with a tuple of targets failed the run as "bad data" at the spiked step; ``nan_input``
refused a dict of float inputs as "integer tokens"; and the default evaluation set held four
joined batches in host memory through the whole run, for ``validate`` alone."""

from __future__ import annotations

import csv
import gc
import math
import weakref

import pytest
import torch

from ampguard.config import validate
from ampguard.faults import FaultInjector, parse_fault
from ampguard.tasks import build_task

FACTORIES = '''
import torch
from torch import nn

READS = []  # (each read of the data from its start)


class MeanHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 1)

    def forward(self, x):
        return self.l(x).mean()


def scalar_target(config):  # one target per batch: the mean output regressed onto it
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 2, generator=g), torch.randn((), generator=g)) for _ in range(6)]
    return MeanHead(), data, nn.functional.mse_loss


class DictIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 1)

    def forward(self, batch):
        return self.l(batch["features"])


def dict_inputs(config):
    g = torch.Generator().manual_seed(0)
    data = [({"ids": torch.arange(4), "features": torch.randn(4, 2, generator=g)}, torch.randn(4, 1, generator=g))
            for _ in range(5)]
    return DictIn(), data, nn.functional.mse_loss


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.r, self.c = nn.Linear(2, 1), nn.Linear(2, 3)

    def forward(self, x):
        return self.r(x), self.c(x)


def tuple_targets(config):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 2, generator=g), (torch.randn(4, 1, generator=g), torch.randint(0, 3, (4,), generator=g)))
            for _ in range(5)]

    def loss(out, y):
        return nn.functional.mse_loss(out[0], y[0]) + nn.functional.cross_entropy(out[1], y[1])
    return TwoHeads(), data, loss


def counted_reads(config):
    def data():
        READS.append(1)
        g = torch.Generator().manual_seed(0)
        for _ in range(10):
            yield torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)
    return nn.Linear(2, 1), data, nn.functional.mse_loss
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "f.py").write_text(FACTORIES, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "f.py"


def _rows(run) -> list[dict[str, str]]:
    with open(run / "steps.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_a_batch_of_one_zero_dim_target_trains(cli, factories):
    code, _, err = cli("train", "--set", "task.factory=f.py:scalar_target", "--set", "steps=3", "--set", "log.name=s")
    assert code == 0 and "Traceback" not in err, err
    assert [r["step"] for r in _rows(factories.parent / "runs" / "s")] == ["1", "2", "3"]
    # no default evaluation set can be joined of them: validate asks for one, in one line
    code, _, err = cli("validate", "--set", "task.factory=f.py:scalar_target")
    assert code == 2 and err.strip().splitlines() == [
        "ampguard: error: validate: task factory has no held-out set (a factory can return 'held_out')"], err


def test_a_spike_on_a_tuple_of_targets_scales_the_loss_and_the_run_goes_on(cli, factories):
    code, _, err = cli("train", "--set", "task.factory=f.py:tuple_targets", "--set", "steps=4", "--set", "log.name=t",
                       "--inject", "spike@2")
    assert code == 0, err
    rows = _rows(factories.parent / "runs" / "t")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert float(rows[1]["loss"]) > 1e6 * max(float(rows[0]["loss"]), float(rows[2]["loss"]))  # x 1e8 at step 2


def test_the_spike_scales_float_targets_and_the_loss_of_any_other():
    inj = FaultInjector([parse_fault("spike@1")])
    (_, y), = inj.wrap_data([(torch.zeros(1), torch.ones(2))])
    assert y.tolist() == [1e8, 1e8]
    loss_fn = inj.wrap_loss(lambda out, target: out.sum())
    inj.current_step = 1
    assert loss_fn(torch.ones(1), (torch.ones(1), torch.tensor([1]))).item() == 1e8
    assert loss_fn(torch.ones(1), torch.ones(1)).item() == 1.0  # (its targets were scaled instead)


def test_nan_input_corrupts_the_first_float_tensor_of_a_dict_of_inputs(cli, factories):
    code, _, err = cli("train", "--set", "task.factory=f.py:dict_inputs", "--set", "steps=3", "--set", "log.name=d",
                       "--inject", "nan_input@2")
    assert code == 0, err
    rows = _rows(factories.parent / "runs" / "d")
    assert [(r["skipped"], r["skip_reason"]) for r in rows] == [("0", ""), ("1", "non_finite_loss"), ("0", "")]
    assert math.isnan(float(rows[1]["loss"]))


def test_the_default_evaluation_set_is_read_when_asked_not_held_through_the_run(factories):
    import sys

    task = build_task(validate({"task": {"factory": "f.py:counted_reads"}}))
    reads = next(m.READS for m in sys.modules.values() if getattr(m, "__file__", None) == str(factories))
    before = len(reads)
    first = [next(iter(task.batches())) for _ in range(1)]
    x, y = task.held_out()
    assert len(reads) == before + 2  # (one read of the data's start each: nothing kept from start-up)
    assert tuple(x.shape) == (16, 2) and tuple(y.shape) == (16, 1)
    assert torch.equal(x[:4], first[0][0])
    held = weakref.ref(x)
    del x, y, first
    gc.collect()
    assert held() is None  # (the task keeps no joined copy)
    rng = torch.get_rng_state()
    task.held_out()
    assert torch.equal(torch.get_rng_state(), rng)


def test_nan_input_corrupts_a_non_contiguous_input_too():
    # review 50h: clone().view(-1) failed on a channels_last batch: "bad data" in train, a traceback in locate
    from ampguard.faults import _with_nan

    images = torch.rand(2, 3, 4, 4).to(memory_format=torch.channels_last)
    for inputs in (images, images[:, :, ::2], torch.tensor(1.5)):
        out = _with_nan(inputs)
        assert out.isnan().sum().item() == 1 and math.isnan(out.reshape(-1)[0].item())
        assert not inputs.isnan().any()  # (a copy: the batch itself untouched)
