"""The Guard from a user's loop, review_51c: a loop's own optimizer.step() in one thread went
through while another thread's guard stepped; a loop's own torch.autocast(float16) under an fp32
guard went unsaid; None or a bound forward for the model, and a loss_fn that is not callable, were
bare TypeErrors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ampguard import Guard
from ampguard.errors import AmpguardWarning
from ampguard.step import AmpTrainState


def _guard(n: int = 4) -> tuple[nn.Module, Guard]:
    model = nn.Linear(n, n)
    return model, Guard(model, torch.optim.Adam(model.parameters(), lr=1e-3), precision="fp32")


def test_a_stray_step_in_one_thread_is_refused_while_another_threads_guard_steps():
    # thread A's guard is held inside its own optimizer.step() (a step post-hook waits) while thread B
    # makes its loop's own optimizer.step() after guard.backward(): the process-wide "a guard is
    # stepping" count let it through, and B's gradients were applied twice
    model_a, guard_a = _guard()
    model_b, guard_b = _guard()
    inside, release = threading.Event(), threading.Event()

    def hold(optimizer, args, kwargs):
        inside.set()
        assert release.wait(30)

    guard_a.optimizer.register_step_post_hook(hold)
    x = torch.randn(2, 4)

    def thread_a():
        guard_a.backward(model_a(x).pow(2).mean())
        guard_a.step()

    a = threading.Thread(target=thread_a)
    a.start()
    try:
        assert inside.wait(30)
        guard_b.backward(model_b(x).pow(2).mean())
        before = [p.detach().clone() for p in model_b.parameters()]
        with pytest.raises(RuntimeError, match=r"Adam\.step\(\) called outside the guard after guard\.backward\(\)"):
            guard_b.optimizer.step()
        assert all(torch.equal(p, q) for p, q in zip(before, model_b.parameters()))
    finally:
        release.set()
        a.join()
    guard_b.step()
    assert guard_a.updates == guard_b.updates == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_loops_own_autocast_under_an_fp32_guard_is_said(dtype):
    model, guard = _guard()
    with torch.autocast("cpu", dtype=dtype):
        loss = model(torch.randn(2, 4)).float().pow(2).mean()
    with pytest.warns(AmpguardWarning, match=(
            rf"Guard\(precision='fp32'\): the model's forward ran under autocast\({str(dtype)[6:]}\), not the "
            r"guard's float32, with no loss scaler")):
        guard.backward(loss)
    guard.step()


def test_an_fp32_guards_forward_without_autocast_is_not_warned(recwarn):
    model, guard = _guard()
    guard.backward(model(torch.randn(2, 4)).pow(2).mean())
    guard.step()
    assert not [w for w in recwarn if issubclass(w.category, AmpguardWarning)]


@pytest.mark.parametrize("model, named", [(None, "NoneType"), (nn.Linear(2, 2).forward, "method")])
def test_a_model_that_is_no_module_is_one_line(model, named):
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rf"^model must be an nn\.Module or a list/dict of them, got {named}$"):
        Guard(model, opt)


def test_a_loss_fn_that_is_not_callable_is_refused_when_built():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"AmpTrainState calls loss_fn\(outputs, targets\): it must be callable, "
                                         r"got NoneType"):
        AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), None)


def test_a_stray_step_from_a_hook_inside_another_guards_step_is_refused():
    # review_51l: the per-thread count still let guard B's raw optimizer.step(), called from a hook
    # inside guard A's own step in the same thread, through: B's gradients applied twice
    model_a, guard_a = _guard()
    model_b, guard_b = _guard()
    x = torch.randn(2, 4)
    guard_b.backward(model_b(x).pow(2).mean())
    before = [p.detach().clone() for p in model_b.parameters()]
    guard_a.optimizer.register_step_post_hook(lambda opt, args, kwargs: guard_b.optimizer.step())
    guard_a.backward(model_a(x).pow(2).mean())
    with pytest.raises(RuntimeError, match=r"Adam\.step\(\) called outside the guard after guard\.backward\(\)"):
        guard_a.step()
    assert all(torch.equal(p, q) for p, q in zip(before, model_b.parameters()))


def test_an_fp32_guard_judges_the_training_forward_not_an_evaluation_before_it(recwarn):
    # review_51l: an evaluation under autocast with gradients on, before training, was taken for the
    # training forward: "ran under autocast(bfloat16)" for a loop that trained in fp32
    model, guard = _guard()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
    guard.backward(model(torch.randn(2, 4)).pow(2).mean())
    guard.step()
    assert not [w for w in recwarn if issubclass(w.category, AmpguardWarning)]


def test_numpys_booleans_are_taken_for_the_monitors_flag():
    import numpy as np

    from ampguard.monitor import RunMonitor

    assert RunMonitor(fail_on_scale_collapse=np.True_).fail_on_scale_collapse is True
