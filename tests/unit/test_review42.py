"""Review 42a of the start-up check's put-back (``untouched``): a hook a pass took out
is put back; the warning of gradient hooks a pass left tells once from at every forward by the
function registered and by how many grad-enabled passes ran, and names what else it left."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import caught_warnings
from helpers import check_reader as reader
from ampguard.build import check_forward
from ampguard.untouched import untouched
from ampguard.precision import Precision

FP32 = Precision("fp32", "cpu")


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
    assert caught_warnings(lambda: check_forward(checked, nn.functional.mse_loss, reader(batch), FP32, "task toy")) == []
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
    said = caught_warnings(lambda: check_forward(EveryCall(2, 1), nn.functional.mse_loss, read, FP32, "task toy"))
    assert len(said) == 1 and " once " not in said[0] and "one pass cannot tell them apart" in said[0], said


def test_hooks_registered_at_every_pass_are_said_to_pile_up():
    said = caught_warnings(lambda: check_forward(EveryCall(2, 1), nn.functional.mse_loss,
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
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
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
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
                                         reader((torch.randn(2, 4), torch.zeros(2, 1))), FP32, "task toy"))
    assert len(said) == 1 and "Probe (4 hooks registered)" in said[0], said
    assert len(model[1]._forward_hooks) == 4


# ---------------------------------------------------------------------------- review 42b (of the fixes above)

def warmed_up(steps: int):
    """A model whose forward pre-hook halves its input for its first ``steps`` forwards, counting
    down in its closure, then takes itself out."""
    model = nn.Sequential(nn.Linear(2, 1))
    left = [steps]

    def warm_up(module, args):
        left[0] -= 1
        if left[0] == 0:
            handle.remove()
        return (args[0] * 0.5,)

    handle = model.register_forward_pre_hook(warm_up)
    return model


def test_a_hook_put_back_gets_back_what_its_closure_counted():
    # 42b #2: the warm-up hook was put back with its count spent by the check's passes: it never took itself out
    batch = (torch.ones(4, 2), torch.zeros(4, 1))
    plain, checked = warmed_up(3), warmed_up(3)
    assert caught_warnings(lambda: check_forward(checked, nn.functional.mse_loss, reader(batch), FP32, "task toy")) == []
    hooked = {}
    for name, model in (("plain", plain), ("checked", checked)):
        hooked[name] = []
        for _ in range(5):
            hooked[name].append(len(model._forward_pre_hooks))
            model(batch[0])
    assert hooked["checked"] == hooked["plain"] == [1, 1, 1, 0, 0]


class PerForward(nn.Module):
    """Registers, at every forward, a gradient hook on its weight that takes itself out when it fires."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        handles = []

        def once(g):
            handles[0].remove()
            return g * 0.5

        handles.append(self.lin.weight.register_hook(once))
        return self.lin(x)


def test_hooks_of_one_function_left_by_some_passes_but_not_all_are_not_said_once():
    # 42b #1: find_unused's backward at the first pass fired that pass's hook: 3 of 4 left read "once ... kept"
    model = PerForward()
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
                                         reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy",
                                         find_unused=True))
    assert len(model.lin.weight._backward_hooks) == 3
    assert len(said) == 1 and " once on " not in said[0] and "more than once over its 4 passes" in said[0], said


class Clamp:
    """An object whose method ``clip`` is a gradient hook: two objects' are two hooks, not one registered twice."""

    def __init__(self, bound: float) -> None:
        self.bound = bound

    def clip(self, g):
        return g.clamp(-self.bound, self.bound)


def test_bound_methods_of_two_objects_are_two_hooks_not_one_registered_twice():
    # 42b #4: hooks were grouped by code: two objects' methods (or two method descriptors) read as piled up
    from ampguard.untouched import _most_of_one

    assert _most_of_one([Clamp(1).clip, Clamp(2).clip]) == 1
    assert _most_of_one([torch.Tensor.clamp, torch.Tensor.nan_to_num]) == 1
    one = Clamp(1)
    assert _most_of_one([one.clip, one.clip]) == 2  # (the same object's, registered twice)


class OneShotBeside(nn.Module):
    """A factory's one-shot gradient hook on ``a.weight``, and a gradient hook the first forward
    registers once on ``b.weight``: the model is then left as the pass left it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)
        self.hooked = False

        def first(g):
            self.handle.remove()
            return g * 0

        self.handle = self.a.weight.register_hook(first)

    def forward(self, x):
        if not self.hooked:
            self.hooked = True
            self.b.weight.register_hook(lambda g: g)
        return self.b(self.a(x))


def test_a_gradient_hook_a_pass_took_out_beside_one_it_registered_is_named():
    # 42b #5: the one-shot hook fired in the pass's backward and stayed out, unsaid
    model = OneShotBeside()

    def one_pass():
        with untouched(model, passes=1):
            model(torch.ones(1, 2)).sum().backward()

    said = caught_warnings(one_pass)
    assert len(said) == 1 and "Linear (1 gradient hook taken out)" in said[0], said


class Busy(nn.Module):
    """Changes four attributes and registers a forward hook at every call, beside a gradient hook once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        if not hasattr(self, "ready"):
            self.ready = True
            self.lin.weight.register_hook(lambda g: g)
        self.a, self.b, self.c = 1, 2, 3
        self.register_forward_hook(lambda m, args, out: None)
        return self.lin(x)


def test_the_hooks_a_pass_left_on_a_module_are_named_before_its_attributes():
    # 42b #3: the count came after the attributes' names and listed() cut it off at three
    model = Busy()
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
                                         reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy"))
    assert len(said) == 1 and "Busy (4 hooks registered, " in said[0], said


# ---------------------------------------------------------------------------- a buffer that cannot be put back

class NoCopy(torch.Tensor):
    """A tensor class whose ``copy_`` is not supported (41g: the start-up died with torch's raw error)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise NotImplementedError(f"{cls.__name__} does not support copy_")
        return super().__torch_function__(func, types, args, kwargs or {})


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("count", torch.zeros(()))
        for name in ("first", "second", "third"):
            self.register_buffer(name, torch.zeros(2).as_subclass(NoCopy))

    def forward(self, x):
        self.count += 1
        return self.lin(x)


def test_buffers_that_cannot_be_put_back_are_one_line_naming_each_and_the_rest_are_put_back():
    from ampguard.errors import InputError

    model = nn.Sequential(Tables())
    with pytest.raises(InputError) as caught:
        with untouched(model, by="task toy: the start-up's check of the first batches"):
            model(torch.ones(1, 2))
    said = str(caught.value)
    assert "\n" not in said and said.startswith("task toy: the start-up's check of the first batches: the model's "
                                                "buffers 0.first (a NoCopy: NoCopy does not support copy_), "
                                                "0.second (a NoCopy: NoCopy does not support copy_) and 1 more "
                                                "cannot be put back"), said
    assert model[0].count.item() == 0  # (the buffers before and after them put back)


FACTORY = '''
import torch
from torch import nn
from torch.nn import functional as F


class NoCopy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise NotImplementedError("NoCopy does not support copy_")
        return super().__torch_function__(func, types, args, kwargs or {})


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("table", torch.zeros(2).as_subclass(NoCopy))

    def forward(self, x):
        return self.lin(x)


def build(config):
    x = torch.randn(32, 2)
    return Model(), [(x, x.sum(1, keepdim=True))], F.mse_loss
'''


def test_a_run_whose_buffer_cannot_be_put_back_is_one_line_exit_2_and_no_run_folder(cli, tmp_path):
    (tmp_path / "nocopy.py").write_text(FACTORY)
    code, out, err = cli("train", "--set", "task.factory=nocopy.py:build", "--set", "precision=fp32", "--set",
                         "steps=2", "--set", "eval.enabled=false", "--set", "log.plot=false")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the start-up's check of the first batches: the model's buffer table (a NoCopy: NoCopy does not " \
           "support copy_) cannot be put back" in err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- a trained tensor that is no parameter

class Temperature(nn.Module):
    """SAC's entropy temperature: ``log_alpha`` a leaf tensor trained by hand (no parameter), a
    gradient hook on it registered once, behind a flag, at the first grad-enabled forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.hooked = False

    def forward(self, x):
        if torch.is_grad_enabled() and not self.hooked:
            self.hooked = True
            self.log_alpha.register_hook(lambda g: g * 0.5)
        return self.lin(x) * self.log_alpha.exp()


def test_a_gradient_hook_on_a_trained_tensor_attribute_is_kept_with_its_flag_and_said():
    # 41g: only parameters' hooks were looked at: the flag was put back, the hook stayed, and the run's first
    # forward registered it again (the gradient halved twice), unsaid
    model = Temperature()
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
                                         reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy"))
    assert len(said) == 1 and "registered a gradient hook once on 1 parameter (log_alpha)" in said[0], said
    assert model.hooked and len(model.log_alpha._backward_hooks) == 1
    model(torch.ones(4, 2)).sum().backward()  # (the run's first step: the hook once)
    assert len(model.log_alpha._backward_hooks) == 1


def test_a_backward_in_a_replay_leaves_a_trained_tensor_attributes_gradient_as_it_was():
    model = Temperature()
    model.hooked = True  # (no hook: the put-back path)
    model.log_alpha.grad = torch.full((1,), 7.0)
    with untouched(model):
        model(torch.ones(4, 2)).sum().backward()
    assert model.log_alpha.grad.tolist() == [7.0]


# ---------------------------------------------------------------------------- review 42c (of 42b's fixes)

def test_a_change_to_the_state_of_a_hook_the_passes_leave_in_place_is_said():
    # 42c #1: a warm-up of 6 steps was not used up by the check's 4 passes, so its hook stayed with 4 of the run's
    # 6 warm-up steps spent, silently. 42d/42e: rewinding such state undid records of registrations the put-back
    # does not undo, and a count cannot be told from a record: left, and said
    batch = (torch.ones(4, 2), torch.zeros(4, 1))
    checked = warmed_up(6)
    said = caught_warnings(lambda: check_forward(checked, nn.functional.mse_loss, reader(batch), FP32, "task toy"))
    assert len(said) == 1 and said[0].startswith("task toy: the start-up's check of the first batches changed the "
                                                 "state a hook of the model keeps in its closure or object (a "
                                                 "forward pre-hook on Sequential): it is not put back"), said
    hooked = []
    for _ in range(4):
        hooked.append(len(checked._forward_pre_hooks))
        checked(batch[0])
    assert hooked == [1, 1, 0, 0]  # (as the check left it: 2 of its 6 steps)


def test_a_hook_that_leaves_its_state_as_it_found_it_is_not_said():
    model = nn.Linear(2, 1)
    model.register_forward_pre_hook(lambda m, args: None)
    names = {"w": 1}

    def look(m, args, out):  # (reads its closure's dict, changes nothing)
        names.get("w")

    model.register_forward_hook(look)
    assert caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
                                                 reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy")) == []


def decorated_warm_up(steps: int):
    """The warm-up's hook behind a decorator and a nested counter: its state two closures deep."""
    model = nn.Sequential(nn.Linear(2, 1))

    def counter(n):
        left = [n]

        def tick():
            left[0] -= 1
            return left[0]
        return tick

    tick = counter(steps)

    @torch.no_grad()
    def warm_up(module, args):
        if tick() == 0:
            handle.remove()

    handle = model.register_forward_pre_hook(warm_up)
    return model


def test_a_hooks_state_behind_a_decorator_and_a_nested_closure_is_put_back():
    batch = (torch.ones(4, 2), torch.zeros(4, 1))
    model = decorated_warm_up(3)
    check_forward(model, nn.functional.mse_loss, reader(batch), FP32, "task toy")
    hooked = []
    for _ in range(5):
        hooked.append(len(model._forward_pre_hooks))
        model(batch[0])
    assert hooked == [1, 1, 1, 0, 0]


class Clip:
    def __init__(self, bound: float) -> None:
        self.bound = bound

    def apply(self, g):
        return g.clamp(-self.bound, self.bound)


class ClipEveryCall(nn.Linear):
    """``Clip(1.0).apply`` registered at every forward: a new object each time, the same code and state."""

    def forward(self, x):
        self.weight.register_hook(Clip(1.0).apply)
        return super().forward(x)


def test_a_new_objects_method_registered_at_every_forward_is_said_to_pile_up():
    # 42c #3: keyed by the object's identity, each pass's hook read as another: "registered ... once ... kept"
    said = caught_warnings(lambda: check_forward(ClipEveryCall(2, 1), nn.functional.mse_loss,
                                                 reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy"))
    assert len(said) == 1 and "weight (4), hooks of one function each" in said[0], said


def test_hooks_of_one_code_with_different_state_are_different_hooks():
    # 42c #4: scaled(0.5) and scaled(2), two no_grad-decorated functions, read as one registered twice
    import functools

    from ampguard.untouched import _most_of_one

    def scaled(k):
        return lambda g: g * k

    @torch.no_grad()
    def clip(g):
        return g.clamp(-1, 1)

    @torch.no_grad()
    def denoise(g):
        return g.nan_to_num()

    assert _most_of_one([scaled(0.5), scaled(2), scaled(4)]) == 1
    assert _most_of_one([clip, denoise]) == 1
    assert _most_of_one([functools.partial(torch.clamp, min=-b, max=b) for b in (1, 2)]) == 1
    assert _most_of_one([scaled(2), scaled(2)]) == 2 and _most_of_one([Clip(1).apply, Clip(1).apply]) == 2


def test_a_lasting_hook_taken_out_and_registered_again_is_kept_once():
    # 42c #5: put back under its old handle and kept under its new one, it ran twice at every forward
    from ampguard.untouched import outlives_passes

    calls = []

    @outlives_passes
    def watch(module, args):
        calls.append(1)

    model = nn.Linear(2, 1)
    first = model.register_forward_pre_hook(watch)
    with untouched(model):
        first.remove()
        model.register_forward_pre_hook(watch)
    model(torch.ones(1, 2))
    assert len(model._forward_pre_hooks) == 1 and len(calls) == 1


class TiedOneShot(nn.Module):
    """A tied weight with a one-shot gradient hook, and a gradient hook once on another layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head, self.mid = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False), nn.Linear(2, 2)
        self.head.weight = self.emb.weight
        self.hooked = False

        def first(g):
            self.handle.remove()
            return g

        self.handle = self.emb.weight.register_hook(first)

    def forward(self, x):
        if not self.hooked:
            self.hooked = True
            self.mid.weight.register_hook(lambda g: g)
        return self.head(self.mid(self.emb(x)))


def test_a_tied_parameters_gradient_hook_taken_out_is_counted_once():
    # 42c #6: counted under each module holding the tied weight: "Embedding (1 ...) and Linear (1 ...)"
    from ampguard.untouched import BufferSnapshot

    model = TiedOneShot()
    snapshot = BufferSnapshot(model)
    model(torch.tensor([0, 1])).sum().backward()
    hooked, modules = snapshot.put_back()
    assert hooked == [("mid.weight", 1)]
    assert [m for m in modules if "gradient hook taken out" in m] == ["Embedding (1 gradient hook taken out)"], modules


# ---------------------------------------------------------------------------- review 42d (of 42c's fixes)

def test_a_hooks_record_of_what_it_registered_once_is_not_rewound():
    # 42d #1: a pre-hook that registers a state-dict hook at its first forward and records it in its closure;
    # the record was rewound, the state-dict hook was not taken out: the run registered it a second time
    model = nn.Linear(2, 1)
    calls, done = [], set()

    def lazily(module, args):
        if "state" not in done:
            done.add("state")
            module.register_state_dict_pre_hook(lambda *a, **k: calls.append(1))

    model.register_forward_pre_hook(lazily)
    check_forward(model, nn.functional.mse_loss, reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy")
    model(torch.ones(4, 2))  # (the run's first forward)
    model.state_dict()
    assert len(calls) == 1


def test_a_record_of_shapes_in_a_hooks_closure_is_given_back_as_it_was():
    # 42d #4: a user's hook logging into a list of its closure: the replay emptied the user's own record
    # (what it held before); what the replays logged there, shapes, is a capture (review 44a: a summary
    # hook's ``shapes[name] = tuple(o.shape)`` was read as state, said and left), as a log of numbers is
    model = nn.Linear(2, 1)
    seen = [(1, 1)]
    model.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    with untouched(model):
        model(torch.ones(3, 2))
    assert seen == [(1, 1)]


def test_a_dead_weak_proxy_in_a_hooks_closure_does_not_stop_the_check():
    # 42d #2: the state walk asked the dead proxy its class: ReferenceError at start-up
    import weakref

    model = nn.Linear(2, 1)
    gone = nn.Linear(1, 1)
    proxy = weakref.proxy(gone)
    model.register_forward_hook(lambda m, args, out: proxy if False else None)
    del gone
    with untouched(model):
        model(torch.ones(1, 2))


class BoundPerBatch(nn.Linear):
    """Registers at every forward a clamp whose bound it takes from the batch: one code, its state new each time."""

    def forward(self, x):
        bound = float(x.abs().max())
        self.weight.register_hook(lambda g: g.clamp(-bound, bound))
        return super().forward(x)


def test_a_container_every_hook_shares_is_copied_once_in_a_snapshot():
    # 42d #5: each hook copied the dict they all close over: a snapshot's memory grew with hooks x entries
    from ampguard.untouched import BufferSnapshot

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    names = {id(m): n for n, m in model.named_modules()}
    for m in model:
        m.register_forward_hook(lambda m, args, out: names.get(id(m)))
    snapshot = BufferSnapshot(model)
    copies = {id(held[3]) for _, _, hooks, _ in snapshot.attributes for owner, _, _, states in hooks
              for state in states.values() for held in state if held[0] == "cell" and held[2] is names}
    assert len(copies) == 1


class PartialPerPass(nn.Linear):
    """Registers at every forward a partial of one function with the batch's own bound."""

    def forward(self, x):
        import functools

        self.weight.register_hook(functools.partial(torch.clamp, min=-float(x.max()), max=float(x.max())))
        return super().forward(x)


@pytest.mark.parametrize("layer", [BoundPerBatch, PartialPerPass])
def test_one_code_registered_at_each_pass_piles_up_whatever_each_captured(layer):
    # 42d #3: keyed by the captured value, four per-batch bounds read as four hooks registered once: "kept";
    # 42e #4: only plain functions were grouped by code: a partial at each pass read so too
    batches = iter([(torch.full((4, 2), float(i + 1)), torch.zeros(4, 1)) for i in range(4)])

    def read(count=None):
        return batches if count else next(batches)

    said = caught_warnings(lambda: check_forward(layer(2, 1), nn.functional.mse_loss, read, FP32, "task toy"))
    assert len(said) == 1 and "weight (4), hooks of one function each" in said[0], said


def capturing(into: str):
    """A model whose hooks capture each layer's output into a dict (or a list) of their closure: the
    feature-extraction pattern, a cache each forward writes again."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    acts: dict = {}
    outs: list = []

    def keep(name):
        def hook(module, args, out):
            if into == "dict":
                acts[name] = out.detach()
            else:
                outs.append((out.detach(), out.detach()))
        return hook

    for name, m in model.named_children():
        m.register_forward_hook(keep(name))
    return model


@pytest.mark.parametrize("into", ["dict", "list"])
def test_hooks_that_capture_outputs_in_their_closure_are_not_said(into):
    # 42f: an activation-capture dict (each forward writes it again) read as a hook's state the check spent
    model = capturing(into)
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss,
                                                 reader((torch.ones(4, 2), torch.zeros(4, 1))), FP32, "task toy"))
    assert said == []
