"""Review 40i: an expanded (stride 0) buffer put back, plain attributes put back between passes,
the scaler's floor in the scale-1 replay, and fewer copies of the buffers per diagnosis."""
import warnings

import torch
from torch import nn

from ampguard.untouched import BufferSnapshot, _kept_attributes, untouched
from ampguard.locate import diagnose, diagnose_group, find_fp32_scope
from ampguard.precision import Precision


class _Expanded(nn.Module):
    """A Linear whose forward reads a stride-0 buffer (``torch.ones(1).expand(3)``)."""

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        self.l = nn.Linear(3, 1)
        self.register_buffer("ones", torch.ones(1).expand(3))
        with torch.no_grad():
            self.l.weight.fill_(weight)

    def forward(self, x):
        return self.l(x * self.ones)


def test_an_expanded_buffer_is_put_back_without_a_copy():
    model = _Expanded()
    snapshot = BufferSnapshot(model)
    assert id(model.ones) not in snapshot.copies  # (referenced, not cloned: a clone materialises it)
    original = model.ones
    model.ones = torch.zeros(3)  # (replaced: the object is put back)
    snapshot.put_back()
    assert model.ones is original and model.ones.stride() == (0,) and model.ones.tolist() == [1.0, 1.0, 1.0]
    with untouched(model):
        model(torch.ones(2, 3))
    assert model.ones is original


def test_a_diagnosis_of_a_model_with_an_expanded_buffer_does_not_crash():
    model = _Expanded(weight=1e37)  # (overflows bf16 and FP32 alike: data/model, two passes put back between)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = diagnose(model, nn.functional.l1_loss, torch.full((2, 3), 50.0), torch.zeros(2, 1),
                     Precision("bf16", "cpu"))
    assert d.verdict == "data/model" and model.ones.stride() == (0,)


class _Counting(nn.Module):
    """Overflows at its first call only, by a plain attribute counter (40i #2; 40d's in a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 1)
        self._calls = 0
        with torch.no_grad():
            self.l.weight.fill_(1e37)

    def forward(self, x):
        self._calls += 1
        return self.l(x * (1.0 if self._calls < 2 else 1e-3))


def test_a_plain_attribute_counter_reads_the_same_in_every_pass():
    model = _Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = diagnose(model, nn.functional.l1_loss, torch.full((2, 4), 50.0), torch.zeros(2, 1),
                     Precision("bf16", "cpu"))
    assert d.verdict == "data/model", d.message()  # (the FP32 replay saw the same count: inf there too)
    assert model._calls == 0


def test_the_snapshot_puts_plain_attributes_back_and_takes_added_ones_out():
    model = _Counting()
    snapshot = BufferSnapshot(model)
    model._calls, model.l.cache = 7, torch.ones(1)
    snapshot.put_back()
    assert model._calls == 0 and not hasattr(model.l, "cache")
    assert _kept_attributes(model) == {"_calls": 0}  # (one rule, shared with _attributes_kept)


def _floor_case():
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(0.25)
        model.bias.zero_()
    return model, torch.full((1, 4), 10.0), torch.zeros(1, 1)  # (gradient ~200: inf at 1024, finite at 1)


def test_an_overflow_at_the_scalers_floor_is_no_routine_back_off():
    model, x, y = _floor_case()
    d = diagnose(model, nn.functional.mse_loss, x, y, Precision("fp16", "cpu"), 65536.0, scale_floor=1024.0)
    assert d.overflows_unscaled and d.scale_floor == 1024.0
    assert "it overflows fp16 at the scaler's floor 1024 too" in d.message()
    assert "routine" not in d.message()
    group = diagnose_group(model, nn.functional.mse_loss, [(x, y)], Precision("fp16", "cpu"), 65536.0,
                           scale_floor=1024.0)
    assert group.overflows_unscaled
    low = diagnose(model, nn.functional.mse_loss, x, y, Precision("fp16", "cpu"), 65536.0, scale_floor=1.0)
    assert not low.overflows_unscaled and "routine while it settles" in low.message()


def test_find_fp32_scope_takes_a_start_callback_and_one_diagnosis_copies_the_buffers_once(monkeypatch):
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), nn.Linear(2, 1))
    with torch.no_grad():
        model[0][0].weight.fill_(1e3)
        model[0][0].bias.zero_()
    x, y = torch.full((1, 2), 50.0), torch.zeros(1, 1)
    calls = []
    scope, tried, _ = find_fp32_scope(model, nn.functional.mse_loss, x, y, Precision("fp16", "cpu"), 1.0, "0.0",
                                      start=lambda: calls.append(1))
    assert scope == ["0.0"] and len(calls) == 2  # (before the replay, and at the end)
    made = []
    real = BufferSnapshot.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(BufferSnapshot, "__init__", counting)
    d = diagnose(model, nn.functional.mse_loss, x, y, Precision("fp16", "cpu"))
    assert d.fp32_scope == "0.0" and len(made) == 1  # (untouched's, reused)
