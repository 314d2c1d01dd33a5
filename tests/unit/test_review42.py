"""Review 42a of the start-up check's put-back (``checkpoint.untouched``): a hook a pass took out
is put back; the warning of gradient hooks a pass left tells once from at every forward by the
function registered and by how many grad-enabled passes ran, and names what else it left."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ampguard.build import check_forward
from ampguard.checkpoint import untouched
from ampguard.errors import AmpguardWarning
from ampguard.precision import Precision

FP32 = Precision("fp32", "cpu")


def said_by(call) -> list[str]:
    """The ampguard warnings ``call()`` gave."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in said if issubclass(w.category, AmpguardWarning)]


def reader(batch):
    """A ``read_batch`` of the start-up's check: ``batch``, or ``count`` of it (several passes)."""
    def read(count=None):
        return iter([batch] * count) if count else batch
    return read


class ActNorm(nn.Module):
    """A data-dependent initialisation: a pre-hook that sets the layer from its first batch, then
    takes itself out (Glow's ActNorm)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, 1)
        self.register_buffer("shift", torch.zeros(n))
        self.handle = self.register_forward_pre_hook(ActNorm.initialise)

    @staticmethod
    def initialise(m, args):
        m.shift.copy_(-args[0].mean(0))
        m.handle.remove()

    def forward(self, x):
        return self.lin(x + self.shift)


def test_a_hook_that_takes_itself_out_at_the_check_is_put_back_for_the_run():
    # review 42a #1: the check's forward used the hook up and the put-back reset the buffer it filled: the
    # run never initialised the layer (shift stayed 0), silently
    batch = (torch.arange(8.).reshape(4, 2), torch.zeros(4, 1))
    plain, checked = ActNorm(2), ActNorm(2)
    plain(batch[0])
    assert said_by(lambda: check_forward(checked, nn.functional.mse_loss, reader(batch), FP32, "task toy")) == []
    assert checked.shift.tolist() == [0.0, 0.0] and len(checked._forward_pre_hooks) == 1  # (as handed over)
    checked(batch[0])  # (the run's first forward)
    assert checked.shift.tolist() == plain.shift.tolist() == [-3.0, -4.0]
    assert len(checked._forward_pre_hooks) == len(plain._forward_pre_hooks) == 0


def test_a_gradient_hook_that_takes_itself_out_in_a_pass_is_put_back():
    m = nn.Linear(2, 1)
    handles = []

    def first_halved(g):
        handles[0].remove()
        return g / 2

    handles.append(m.weight.register_hook(first_halved))
    with untouched(m):
        m(torch.ones(1, 2)).sum().backward()
    assert list(m.weight._backward_hooks.values()) == [first_halved]
    m(torch.ones(1, 2)).sum().backward()  # (the run's first backward: halved once, then it is gone)
    assert m.weight.grad.tolist() == [[0.5, 0.5]] and not m.weight._backward_hooks


class EveryCall(nn.Linear):
    """Registers a halving gradient hook at every grad-enabled forward."""

    def forward(self, x):
        if torch.is_grad_enabled():
            self.weight.register_hook(lambda g: g / 2)
        return super().forward(x)


def test_one_pass_does_not_say_a_hook_was_registered_once():
    # review 42a #2: validate --train-steps' check runs one pass: a hook registered at every forward read as
    # "registered ... once ...: kept, as the run's first forward would register it"
    read = lambda: (torch.ones(4, 2), torch.zeros(4, 1))  # noqa: E731 (no count: one pass)
    said = said_by(lambda: check_forward(EveryCall(2, 1), nn.functional.mse_loss, read, FP32, "task toy"))
    assert len(said) == 1 and " once " not in said[0] and "one pass cannot tell them apart" in said[0], said


def test_hooks_registered_at_every_pass_are_said_to_pile_up():
    said = said_by(lambda: check_forward(EveryCall(2, 1), nn.functional.mse_loss,
                                         reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy"))
    assert len(said) == 1 and "weight (4), hooks of one function each" in said[0] and "not at every forward" in said[0]


class TwoOnce(nn.Linear):
    """Registers two different gradient hooks on its weight once, at its first grad-enabled forward."""

    def forward(self, x):
        if torch.is_grad_enabled() and not getattr(self, "_hooked", False):
            self._hooked = True
            self.weight.register_hook(lambda g: g.clamp(-1, 1))
            self.weight.register_post_accumulate_grad_hook(lambda p: None)
        return super().forward(x)


def test_two_different_hooks_registered_once_are_said_once():
    # review 42a #3: a gradient hook and a post-accumulate hook registered once counted as two of one: "piled up"
    model = TwoOnce(2, 1)
    said = said_by(lambda: check_forward(model, nn.functional.mse_loss,
                                         reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy"))
    assert len(said) == 1 and "registered a gradient hook once on 1 parameter (weight)" in said[0], said
    assert len(model.weight._backward_hooks) == len(model.weight._post_accumulate_grad_hooks) == 1


class Probe(nn.Linear):
    """Registers a forward hook at every call."""

    def forward(self, x):
        self.register_forward_hook(lambda m, a, o: None)
        return super().forward(x)


class HookedNorm(nn.LayerNorm):
    """A gradient hook on each parameter once, at the first grad-enabled forward (a tensor-parallel
    library's all-reduce): the model is then left as the passes left it."""

    def forward(self, x):
        if torch.is_grad_enabled() and not getattr(self, "_hooked", False):
            self._hooked = True
            for p in self.parameters():
                p.register_hook(lambda g: g)
        return super().forward(x)


def test_module_hooks_a_pass_left_beside_a_gradient_hook_are_named():
    # review 42a #4: the forward hooks Probe piled up (4) stayed, unsaid, because a gradient hook elsewhere left
    # the model as the passes left it
    model = nn.Sequential(HookedNorm(4), Probe(4, 1))
    said = said_by(lambda: check_forward(model, nn.functional.mse_loss,
                                         reader((torch.randn(2, 4), torch.zeros(2, 1))), FP32, "task toy"))
    assert len(said) == 1 and "Probe (4 hooks registered)" in said[0], said
    assert len(model[1]._forward_hooks) == 4
