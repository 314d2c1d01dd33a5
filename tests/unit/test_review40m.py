"""Review 40m, of the snapshot that puts a model back before each pass and of lazy modules made at
start-up: an attribute a pass replaced by another type is put back (it was taken out as added:
a crash at the run's first forward); a lazy module the first batches never reach is one line at
start-up (a traceback from a hook on its weight); a checkpoint loads into a lazy model (misfit
asked a lazy weight its shape); the first inputs kept for lazy modules hold no graph; a backward
overflow is replayed at the scaler's floor below 1 too."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard.build import _checked_copy, check_forward
from ampguard.checkpoint import misfit
from ampguard.untouched import BufferSnapshot, untouched
from ampguard.errors import InputError
from ampguard.locate import diagnose
from ampguard.precision import Precision

FP32 = Precision("fp32", "cpu")


class TypeChange(nn.Module):  # an attribute that starts as a tuple and becomes a tensor in the forward
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)
        self.prev = ()

    def forward(self, x):
        out = self.l(x)
        self.prev = out.detach()
        return out


def test_an_attribute_a_pass_gave_another_type_is_put_back_not_taken_out():
    model = TypeChange()
    snapshot = BufferSnapshot(model)
    model(torch.ones(2, 4))
    snapshot.put_back()
    assert model.prev == ()
    check_forward(model, F.mse_loss, lambda: (torch.ones(2, 4), torch.zeros(2, 1)), FP32, "f.py:build")
    assert model.prev == () and model(torch.ones(2, 4)).shape == (2, 1)


class Branch(nn.Module):  # a lazy module reached only from a later call on
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.late = nn.LazyLinear(2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.a(x) + (self.late(x) if self.calls > 8 else 0)


def test_a_lazy_module_the_first_batches_never_reach_is_one_line_at_start_up():
    with pytest.raises(InputError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_forward(Branch(), F.mse_loss, lambda: (torch.ones(2, 4), torch.zeros(2, 2)), FP32, "f.py:build")
    assert str(err.value) == ("f.py:build: the model's lazy modules late (LazyLinear) were not reached by the first "
                              "batches' forward passes, so their weights cannot be made at start-up; make them in the "
                              "factory (run a batch through them)")


def test_a_checkpoint_is_compared_with_a_lazy_model_by_what_is_made():
    lazy, made = nn.Sequential(nn.LazyLinear(2)), nn.Sequential(nn.Linear(3, 2))
    assert misfit(lazy.state_dict(), made.state_dict()) == ""
    lazy.load_state_dict(made.state_dict())
    assert lazy[0].weight.shape == (2, 3)


def test_the_first_inputs_kept_for_lazy_modules_hold_no_graph():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.LazyLinear(2))
    copied, firsts = _checked_copy(model)
    copied(torch.ones(2, 3))
    (args, kwargs), = firsts.values()
    assert args[0].grad_fn is None and not args[0].requires_grad


def test_a_backward_overflow_is_replayed_at_the_scalers_floor_below_1_too():
    # (the gradient overflows fp16 at scale 1 but not at 0.5: halving to the floor 0.5 answers it)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(0.25)
        model.bias.zero_()
    x, y = torch.full((1, 4), 200.0), torch.zeros(1, 1)
    found = diagnose(model, F.mse_loss, x, y, Precision("fp16", "cpu"), 65536.0, scale_floor=0.5)
    assert not found.overflows_unscaled and "halving the scale does not answer it" not in found.message()


class Hooked(nn.Module):  # a helper made once by the first forward: a hook and its handle kept in a list
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.handles = []

    def forward(self, x):
        if not self.handles:
            self.handles = [self.lin.register_forward_hook(lambda m, i, o: o * 2)]
        return self.lin(x)


def test_a_helper_a_first_forward_made_is_left_as_made():
    # review 40n #1: the list went back to [], and the next forward registered the hook a second time
    model = Hooked()
    check_forward(model, F.mse_loss, lambda: (torch.ones(2, 3), torch.zeros(2, 1)), FP32, "f.py:build")
    model(torch.ones(2, 3))
    assert len(model.handles) == 1 and len(model.lin._forward_hooks) == 1


class LateHead(nn.Module):  # a submodule a first forward makes, its name None before
    def __init__(self):
        super().__init__()
        self.head = None

    def forward(self, x):
        if self.head is None:
            self.head = nn.Linear(3, 1)
        return self.head(x)


def test_a_name_a_pass_moved_into_the_modules_is_not_hidden_by_its_old_value():
    # review 40n #2: None written back into __dict__ hid the module in _modules (m.head read None)
    model = LateHead()
    snapshot = BufferSnapshot(model)
    model(torch.ones(2, 3))
    snapshot.put_back()
    assert isinstance(model.head, nn.Linear) and "head" not in vars(model)


def test_a_checkpoint_of_a_lazy_model_not_made_is_a_misfit_line():
    # review 40n #3: misfit asked the checkpoint's lazy weight its shape: a traceback
    assert misfit(nn.Linear(3, 2).state_dict(), nn.LazyLinear(2).state_dict()) == (
        "weight: checkpoint not made (a lazy module's), model [2, 3]")


def test_a_model_refused_for_an_unreached_lazy_module_is_left_unmade():
    # review 40n #4: the reached lazy modules were made before the refusal: the model was left half made
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.late = nn.LazyLinear(2), nn.LazyLinear(2)

        def forward(self, x):
            return self.first(x)

    model = Two()
    with pytest.raises(InputError, match="late"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_forward(model, F.mse_loss, lambda: (torch.ones(2, 4), torch.zeros(2, 2)), FP32, "f.py:build")
    assert type(model.first).__name__ == "LazyLinear"


class Registrar(nn.Module):  # a helper made once by the first forward, from None: it registers a hook
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.helper = None

    def forward(self, x):
        if self.helper is None:
            self.helper = self.lin.register_forward_hook(lambda m, i, o: o * 2)
        return self.lin(x)


def test_a_helper_made_from_none_by_a_first_forward_is_left_as_made():
    # review 40o: None is plain, so it was put back, and the next forward registered the hook a second time
    model = Registrar()
    check_forward(model, F.mse_loss, lambda: (torch.ones(2, 3), torch.zeros(2, 1)), FP32, "f.py:build")
    model(torch.ones(2, 3))
    assert model.helper is not None and len(model.lin._forward_hooks) == 1


class Stateful(nn.Module):  # state of every kind a forward replaces or adds, and a once-flag behind a hook
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.h, self.d, self.n, self._hooked = (torch.zeros(1),), {"n": 0}, np.float64(0), False

    def forward(self, x):
        self.h, self.d, self.n = (self.h[0] + 1,), {"n": self.d["n"] + 1}, self.n + 1
        self.kv = (x,)  # (added by the forward: a cache)
        if not self._hooked:
            self.lin.register_forward_pre_hook(lambda m, args: None)
            self._hooked = True
        return self.lin(x)


def test_a_pass_leaves_no_state_of_any_type_and_no_hook_behind():
    # review 40o: a hidden-state tuple, a dict, a numpy scalar replaced, a cache added, were left after the
    # check (dbbe24d put back only plain values and tensors); a once-flag was put back while its hook stayed
    model = Stateful()
    check_forward(model, F.mse_loss, lambda: (torch.ones(2, 3), torch.zeros(2, 1)), FP32, "f.py:build")
    assert torch.equal(model.h[0], torch.zeros(1)) and model.d == {"n": 0} and model.n == 0
    assert not hasattr(model, "kv") and model._hooked is False and not model.lin._forward_pre_hooks
    model(torch.ones(2, 3))
    assert len(model.lin._forward_pre_hooks) == 1 and model._hooked is True


def test_the_guards_running_statistics_hook_a_pass_registers_stays():
    # review 41: a pass's forward (a live diagnosis's replay) ran the keeper's look for layers, which hooked a
    # BatchNorm added since; the put-back took that hook out while the keeper went on believing the layer
    # hooked: with the layer before it frozen, a skipped NaN step left the late layer's statistics NaN
    from ampguard.watch import RunningStats, _watch_registrations

    _watch_registrations()
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    stats = RunningStats([model])
    model.add_module("late", nn.BatchNorm1d(2))  # (after the keeper looked: found at its next look)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with untouched(model):
            model(torch.randn(4, 2))
    assert len(model.late._forward_pre_hooks) == 1
    stats.end_step(skipped=False)
    model[1].eval()  # (only the late layer writes statistics now: its own hook must copy them)
    model(torch.full((4, 2), float("nan")))
    stats.end_step(skipped=True)
    assert torch.equal(model.late.running_mean, torch.zeros(2)) and int(model.late.num_batches_tracked) == 0


class Appending(nn.Module):  # state a forward changes in place: a list it appends to, a dict and a set it fills
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.sizes, self.cache, self.seen = [], {}, set()

    def forward(self, x):
        self.sizes.append(x.shape[0])
        self.cache[len(self.cache)] = x.sum()
        self.seen.add(len(self.seen))
        return self.lin(x) * len(self.sizes)  # (the output depends on how many passes it saw)


def test_a_list_dict_or_set_a_pass_changed_in_place_gets_its_contents_back():
    # review 41 (40m #4): a list a forward appends to in place was neither put back nor warned of: the
    # start-up's passes left four entries, and the run's first step computed with five
    model = Appending()
    sizes = model.sizes
    check_forward(model, F.mse_loss, lambda: (torch.ones(2, 3), torch.zeros(2, 1)), FP32, "f.py:build")
    assert model.sizes == [] and model.sizes is sizes and model.cache == {} and model.seen == set()
    snapshot = BufferSnapshot(model)
    model(torch.ones(4, 3))
    snapshot.put_back()
    assert model.sizes == [] and model.cache == {} and model.seen == set()
