"""make_guard against review 53g, with a real ``Accelerator`` on the CPU: a loop over a loader
whose length is no multiple of the accumulation steps ends its short last group with
``guard.step(close=True)`` after ``unscale_()`` and hears no ``ShortGroupWarning``; the guard's
default scaler settings say nothing under bf16, and settings given there are said ignored."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.precision import SlowPrecisionWarning  # noqa: E402
from ampguard.integrations.accelerate import make_guard  # noqa: E402


@pytest.fixture
def accelerator():
    GradientState._reset_state()
    yield accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_loop_closing_its_short_last_group_and_the_default_scaler_settings_say_nothing(accelerator):
    model = torch.nn.Linear(4, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = make_guard(accelerator, model, opt, precision="bf16")
        records = []
        for i in range(6):  # groups of 4: one whole, then the loader's last 2
            with guard.autocast():
                loss = model(torch.ones(2, 4)).float().pow(2).mean()
            guard.backward(loss)
            if guard.micro_batches == 4 or i == 5:
                guard.unscale_()  # (a look at the true gradients before the step)
            records.append(guard.step(close=i == 5))
    assert [r.step for r in records if r is not None] == [1, 2]
    # (not the CPU's emulated-bf16 warning, said once a process: whether this test says it depends on the order)
    assert not [str(w.message) for w in caught
                if issubclass(w.category, AmpguardWarning) and not issubclass(w.category, SlowPrecisionWarning)]


def test_scaler_settings_given_under_bf16_are_said(accelerator):
    model = torch.nn.Linear(4, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(AmpguardWarning, match=r"^precision bf16 uses no loss scaler: scaler settings init_scale "
                                             r"ignored$"):
        make_guard(accelerator, model, opt, precision="bf16", scaler={"init_scale": 4.0})
