"""Review 55w, a second look at the session's fixes: a QAT model fine-tuned in ``eval()`` mode
(its BatchNorm frozen) still had its observers left NaN by a skipped step (the put-back copied
layers in training mode only, and torch.ao's observers record in eval mode too); a sink given
``/dev/fd/N`` of a pipe or ``/dev/stdout`` was "No such file or directory" once appended logs went
through the checked walk; a scheduler subclass that shows ``param_groups`` was taken for an
optimizer."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn

from ampguard import Guard
from ampguard.sinks import JsonlSink


def _qat_in_eval() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), tq.QuantStub(), nn.Linear(16, 6), nn.BatchNorm1d(6), nn.ReLU(),
                          nn.Linear(6, 6), tq.DeQuantStub()).train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.prepare_qat(model).eval()  # (fine-tuned in eval mode: BatchNorm frozen, observers still record)


def _observers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()
            if "activation_post_process" in k or "weight_fake_quant" in k}


@pytest.mark.parametrize("sync_free", [False, True])
def test_a_skip_puts_back_the_observers_of_a_qat_model_trained_in_eval_mode(sync_free):
    model = _qat_in_eval()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True) if sync_free
                 else torch.optim.SGD(model.parameters(), lr=0.01))
    guard = Guard(model, optimizer, precision="fp32", sync_free=sync_free)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 4, 4, generator=g), torch.randn(8, 6, generator=g)
    for batch in (x, x.clone().index_put_((torch.tensor(0),), torch.tensor(float("nan")))):
        before = _observers(model)
        with guard.autocast():
            loss = F.mse_loss(model(batch).float(), y)
        guard.backward(loss)
        record = guard.step()
        skipped = (record.resolve() if sync_free else record).skipped
    assert skipped
    after = _observers(model)
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    with guard.autocast():
        assert F.mse_loss(model(x).float(), y).isfinite()  # (the run goes on: its next clean step is finite)


def test_a_sink_writes_to_a_pipe_named_under_dev_fd():
    read, write = os.pipe()
    try:
        sink = JsonlSink(f"/dev/fd/{write}")
        sink.write_event({"event": "probe"})
        sink.close()
        assert b'"event": "probe"' in os.read(read, 4096)
    finally:
        os.close(read)
        os.close(write)


def test_a_scheduler_that_shows_param_groups_is_still_a_scheduler():
    class GroupsShown(torch.optim.lr_scheduler.StepLR):
        @property
        def param_groups(self):  # (a scheduler of a library that shows its optimizer's groups)
            return self.optimizer.param_groups

    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, optimizer, precision="fp32", scheduler=GroupsShown(optimizer, step_size=1, gamma=0.5))
    guard.backward(model(torch.ones(3, 2)).pow(2).mean())
    guard.step()
    assert optimizer.param_groups[0]["lr"] == 0.05
