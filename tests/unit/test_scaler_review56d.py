"""Review 56d F3: a ``GradScaler`` handed to ``Guard(scaler=)`` stayed patched after the guard was
gone: the plain loop taken up again in the same process was refused for good, by a message naming
a guard that no longer existed and no way back. It is plain again once the guard is collected; while
the guard lives, the refusals say how to go back (a new GradScaler loading its state), and that
way is bit for bit the plain loop's."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

from ampguard import Guard

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    if i in (2, 6, 10):  # (an overflow in each phase)
        x[0, 0] = float("inf")
    return x, y


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _plain_step(model, opt, scaler, i: int) -> None:
    """PyTorch's AMP recipe, as a plain loop writes it."""
    x, y = _data(i)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _guarded_steps(guard, model, steps) -> None:
    for i in steps:
        x, y = _data(i)
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        guard.step()


SETTINGS = dict(init_scale=2.0**10, growth_interval=3)


def _a_plain_loop_and_its_reference():
    """A plain loop's 12 steps (the reference) and another's first 4, which a guard then takes over."""
    reference, ref_opt = _build()
    ref_scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    for i in range(12):
        _plain_step(reference, ref_opt, ref_scaler, i)
    model, opt = _build()
    scaler = torch.amp.GradScaler("cpu", **SETTINGS)
    for i in range(4):
        _plain_step(model, opt, scaler, i)
    return reference, ref_scaler, model, opt, scaler


@pytest.fixture
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fp16 on a CPU: SlowPrecisionWarning)
        yield


@pytest.mark.usefixtures("_quiet")
def test_a_gradscaler_handed_to_a_guard_is_plain_again_once_the_guard_is_collected():
    reference, ref_scaler, model, opt, scaler = _a_plain_loop_and_its_reference()
    guard = Guard(model, opt, precision="fp16", max_norm=1.0, scaler=scaler)
    second = Guard(model, opt, precision="fp16", max_norm=1.0, scaler=scaler)  # (two guards, one scale)
    _guarded_steps(guard, model, range(4, 8))
    del guard
    gc.collect()
    with pytest.raises(RuntimeError, match=r"^scaler\.update\(\) on the GradScaler handed to the Guard"):
        scaler.update()  # (the other guard still holds it)
    del second
    gc.collect()
    assert not set(vars(scaler)) & {"scale", "update", "load_state_dict"}
    for i in range(8, 12):  # (the plain loop again, on the scaler it had)
        _plain_step(model, opt, scaler, i)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert scaler.state_dict() == ref_scaler.state_dict()
    assert ref_scaler.state_dict()["scale"] < SETTINGS["init_scale"]  # (the overflows backed it off)


@pytest.mark.usefixtures("_quiet")
def test_while_the_guard_lives_its_refusals_say_how_to_go_back_and_that_way_is_bit_for_bit():
    reference, ref_scaler, model, opt, scaler = _a_plain_loop_and_its_reference()
    guard = Guard(model, opt, precision="fp16", max_norm=1.0, scaler=scaler)
    _guarded_steps(guard, model, range(4, 8))
    back = (r"\(to go back to the plain loop while the guard lives, make a new GradScaler and "
            r"load_state_dict\(this one's state_dict\(\)\); once the guard is collected this one is plain again\)$")
    with pytest.raises(RuntimeError, match=r"^scaler\.scale\(loss\) on the GradScaler handed to the Guard: .*" + back):
        scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match=r"^scaler\.update\(\) on the GradScaler handed to the Guard: .*" + back):
        scaler.update()
    fresh = torch.amp.GradScaler("cpu", **SETTINGS)
    fresh.load_state_dict(scaler.state_dict())
    for i in range(8, 12):
        _plain_step(model, opt, fresh, i)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert fresh.state_dict() == ref_scaler.state_dict()
    assert guard.steps == 4  # (alive to the end: its 4 steps)
