"""Review 52g: a ``GradScaler`` subclass handed to a guard as ``scaler=`` lost its own code (a
scale cap in ``update``): the guard steps with a ``GuardedGradScaler`` made from its settings and
state, and nothing said so. It is refused, naming what it overrides; a plain one, the deprecated
``torch.cuda.amp.GradScaler`` (its own ``__init__`` only) and a ``GuardedGradScaler`` subclass
are taken."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ampguard import Guard, GuardedGradScaler


class Capped(torch.amp.GradScaler):
    def update(self, new_scale=None):
        super().update(new_scale)
        self._scale.clamp_(max=2.0 ** 10)


class OwnStep(torch.amp.GradScaler):
    def unscale_(self, optimizer):
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        return super().step(optimizer, *args, **kwargs)


class CappedGuarded(GuardedGradScaler):
    def update(self, new_scale=None):
        super().update(new_scale)
        self._scale.clamp_(max=2.0 ** 10)


def _guard(scaler):
    model = nn.Linear(4, 1)
    return model, Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16", scaler=scaler)


@pytest.mark.parametrize("cls, said", [(Capped, "update()"), (OwnStep, "unscale_(), step()")])
def test_a_gradscaler_subclass_with_its_own_code_is_refused_in_one_line(cls, said):
    said = re.escape(f"scaler=: {cls.__name__} overrides GradScaler's {said}; the guard steps with a GuardedGradScaler")
    with pytest.raises(ValueError, match=rf"^{said} .*: pass no scaler \(the guard makes its own\) or a subclass of "
                                         r"ampguard.GuardedGradScaler$"):
        _guard(cls("cpu", init_scale=256.0))


def test_a_guarded_scaler_subclass_keeps_its_code_and_a_plain_one_is_taken_over():
    model, guard = _guard(CappedGuarded("cpu", init_scale=2.0 ** 8, growth_interval=1))
    for _ in range(5):
        with guard.autocast():
            loss = nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        guard.backward(loss)
        record = guard.step()
    assert record.values()["scaler_scale"] == 2.0 ** 10  # (the cap held: its update ran)
    for plain in (torch.amp.GradScaler("cpu"), torch.cpu.amp.GradScaler()):
        assert isinstance(_guard(plain)[1].scaler, GuardedGradScaler)
