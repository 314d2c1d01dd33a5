"""A guard in an Accelerate script built without ``make_guard`` (review 55l), with a real
``Accelerator`` on the CPU: ``Guard(model, prepared_optimizer)`` died in torch's
``AttributeError`` (the ``AcceleratedOptimizer`` never ran ``Optimizer.__init__``, so it has no
hook dicts) and is refused in one line naming ``make_guard``; the prepared optimizer given as
``scheduler=`` to ``make_guard`` was taken and stepped the optimizer a second time each update;
a prepared ``ChainedScheduler`` the loop also steps is refused as any prepared scheduler is."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampguard import Guard  # noqa: E402
from ampguard.integrations.accelerate import make_guard  # noqa: E402

L = torch.optim.lr_scheduler


@pytest.fixture
def accelerator():
    GradientState._reset_state()
    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _prepared(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_prepared_optimizer_handed_to_guard_itself_is_refused_in_one_line(accelerator):
    model, opt = _prepared(accelerator)
    for given in (opt, {"G": opt}):
        name = "G" if isinstance(given, dict) else "optimizer"
        with pytest.raises(ValueError, match=rf"^optimizer '{name}' is Accelerate's prepared AcceleratedOptimizer: "
                                             r"build the guard with ampguard\.integrations\.accelerate\.make_guard\("):
            Guard(model, given, precision="bf16")
    guard = make_guard(accelerator, model, opt, precision="bf16")  # the way it points to
    with guard.autocast():
        loss = model(torch.ones(2, 3)).float().pow(2).mean()
    guard.backward(loss)
    assert not guard.step().skipped


def test_the_prepared_optimizer_given_as_the_scheduler_is_refused(accelerator):
    model, opt = _prepared(accelerator)
    with pytest.raises(ValueError, match=r"^scheduler= was given an optimizer \(AcceleratedOptimizer\), not an LR "
                                         r"scheduler: .* every update would be applied twice"):
        make_guard(accelerator, model, opt, precision="bf16", scheduler=opt)
    with pytest.raises(ValueError, match=r"^scheduler= was given an optimizer \(AcceleratedOptimizer\)"):
        Guard(model, opt.optimizer, precision="bf16", scheduler=opt)
    assert not opt.state and model.weight.grad is None


def test_a_prepared_chained_scheduler_stepped_by_the_loop_too_is_refused(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    chain = L.ChainedScheduler([L.LinearLR(opt, 0.1, total_iters=4), L.ExponentialLR(opt, 0.9)])
    model, opt, sched = accelerator.prepare(model, opt, chain)
    guard = make_guard(accelerator, model, opt, precision="bf16", scheduler=sched)
    with guard.autocast():
        loss = model(torch.ones(2, 3)).float().pow(2).mean()
    guard.backward(loss)
    guard.step()
    sched.step()  # the loop's own, kept beside the guard's
    with guard.autocast():
        loss = model(torch.ones(2, 3)).float().pow(2).mean()
    with pytest.raises(RuntimeError, match=r"^the AcceleratedScheduler of optimizer 'optimizer' was stepped outside "
                                           r"the guard \(last_epoch 2, the guard left it at 1\)"):
        guard.backward(loss)
