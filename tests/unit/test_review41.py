"""Review 41, of a pass that leaves no trace (``untouched``, ``BufferSnapshot``) and of
validate's passes: a gradient hook a forward registers once behind a flag is not registered twice;
a deque, an OrderedDict, a defaultdict get their contents back and a tensor inside a list changed
in place is warned of (not a plain attribute that is a buffer); a buffer resized in place is put
back without cutting the put-back short; a hook that outlives a pass keeps its flags; a DDP
wrapper's own attributes are left to its reducer; validate runs the ``fp32_modules`` in float32
in its AMP passes."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn

from helpers import GLOO, write

from ampguard.untouched import BufferSnapshot, outlives_passes, untouched
from ampguard.config import validate as make_config
from ampguard.errors import AmpguardWarning


def halve_each_gradient_once(module: nn.Module) -> None:
    """A forward's helper: a gradient hook on each of ``module``'s parameters, once, behind its set."""
    for name, p in module.named_parameters():
        if name not in module.hooked:
            p.register_hook(lambda g: g * 0.5)
            module.hooked.add(name)


class HalvedGrads(nn.Linear):  # a forward that registers a gradient hook once per parameter, behind a set
    def __init__(self):
        super().__init__(2, 1)
        self.hooked: set[str] = set()

    def forward(self, x):
        halve_each_gradient_once(self)
        return super().forward(x)


@pytest.mark.parametrize("passes", [0, 1])
def test_a_gradient_hook_a_forward_registers_once_is_registered_once_after_a_pass(passes):
    # the put-back emptied the set (17f9435) but left the parameter's hook: the run's first forward
    # registered it again, and every gradient was halved twice
    # (41b: the hook stays, and the module as the pass left it: its set agrees with it, and a warning says so)
    model = HalvedGrads()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(passes):
            with untouched(model, by="the check", passes=2):  # (42a: two passes tell once from at every forward)
                model(torch.ones(4, 2)).sum()
                model(torch.ones(4, 2)).sum()
    model(torch.ones(4, 2)).sum().backward()
    assert model.weight.grad.tolist() == [[2.0, 2.0]] and len(model.weight._backward_hooks) == 1
    expected = ("the check registered a gradient hook once on 2 parameters (weight, bias): kept, as the run's first "
                "forward would register it, with the modules as its passes left them (whatever records the hooks "
                "agrees with them); what its passes changed in the modules stays too (HalvedGrads (hooked))")
    assert [str(w.message)[:len(expected)] for w in said] == [expected] * passes


class Hooking(nn.Module):  # the same, the record on the parent, the parameters its children's (review 41c)
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        self.hooked: set[str] = set()

    def forward(self, x):
        halve_each_gradient_once(self)
        return self.body(x)


@pytest.mark.parametrize("passes", [0, 1])
def test_a_gradient_hook_on_a_childs_parameter_recorded_on_the_parent_is_registered_once(passes):
    # 41c: the module left as the pass left it was the parameter's owner only: the parent's set was put back,
    # the child's hook stayed, and the run's first forward registered it again (silently)
    torch.manual_seed(0)
    model = Hooking()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpguardWarning)
        for _ in range(passes):
            with untouched(model):
                model(torch.ones(4, 2)).sum()
    model(torch.ones(4, 2)).sum().backward()
    torch.manual_seed(0)
    plain = Hooking()
    plain(torch.ones(4, 2)).sum().backward()
    assert torch.equal(model.body[1].weight.grad, plain.body[1].weight.grad)
    assert len(model.body[1].weight._backward_hooks) == 1


class Kept(nn.Module):  # state of the container kinds a forward changes in place
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.recent = collections.deque(maxlen=3)
        self.counts = collections.defaultdict(int)
        self.order = collections.OrderedDict()
        self.tally = collections.Counter()
        self.ring = [torch.zeros(1)]
        self.register_buffer("count", torch.zeros(2))
        self.shown = self.count  # (a plain attribute that is the buffer: put back with it)
        self.first = self.count[1:]  # (a view of it: its version counter is the buffer's)

    def forward(self, x):
        self.recent.append(1)
        self.counts["calls"] += 1
        self.order["k"] = 1
        self.tally["calls"] += 1
        self.ring[0].add_(1)
        self.count.add_(1)
        return self.lin(x)


def test_deques_and_dict_kinds_get_their_contents_back_and_a_tensor_in_a_list_changed_in_place_is_named():
    model = Kept()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with untouched(model, by="the check"):
            model(torch.ones(1, 2))
    assert (list(model.recent), dict(model.counts), dict(model.order), dict(model.tally)) == ([], {}, {}, {})
    assert model.count.tolist() == [0, 0] and model.shown is model.count
    messages = [str(w.message) for w in said if issubclass(w.category, AmpguardWarning)]
    assert len(messages) == 1 and messages[0].startswith("the check changed the tensor attribute Kept.ring in place")
    assert model.ring[0].item() == 1  # (changed in place: said, not put back)


class Growing(nn.Module):  # a buffer the forward resizes in place, and a counter and a hook after it
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("cache", torch.zeros(2))
        self.calls = 0

    def forward(self, x):
        self.cache.resize_(4)
        self.calls += 1
        self.lin.register_forward_hook(lambda *_: None)
        return self.lin(x)


class Swapping(nn.Module):  # buffers a forward points elsewhere: at its input, transposed
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("last", torch.zeros(1, 2))
        self.register_buffer("base", torch.arange(6.0).reshape(2, 3))
        self.register_buffer("view", self.base.t())

    def forward(self, x):
        self.last.data = x  # (now the user's batch's storage)
        self.view.set_(self.view.contiguous())  # (another layout)
        return self.lin(x)


def test_a_buffer_given_another_storage_is_set_back_without_writing_into_it():
    # 41c: the put-back copied the buffer's old values into whatever it viewed now: the user's batch was
    # zeroed (older), a transposed view came back contiguous and its base's values scrambled (8b12f97)
    model, batch = Swapping(), torch.ones(4, 2)
    base = model.base.clone()
    with untouched(model):
        model(batch)
    assert batch.tolist() == [[1.0, 1.0]] * 4 and model.last.tolist() == [[0.0, 0.0]]
    assert torch.equal(model.base, base) and model.view.stride() == (1, 3) and torch.equal(model.view, base.t())
    model.view.add_(1)  # (a view of base again)
    assert torch.equal(model.base, base + 1)


def test_a_buffer_resized_in_place_is_put_back_and_the_rest_with_it():
    # copying the old values into it raised, and the attributes, the hooks and the gradients after it
    # were left as the pass made them; 41b: put back as a clone, whoever else held it diverged
    model = Growing()
    held = model.cache
    model.lin.weight.grad = torch.ones(1, 2)
    with untouched(model):
        model(torch.ones(1, 2)).sum().backward()
    assert model.cache.tolist() == [0.0, 0.0] and model.calls == 0 and not model.lin._forward_hooks
    assert model.cache is held and model.lin.weight.grad.tolist() == [[1.0, 1.0]]
    snapshot = BufferSnapshot(model)
    model(torch.ones(1, 2))
    snapshot.put_back()
    snapshot.put_back()  # (as often as asked)
    assert model.cache.tolist() == [0.0, 0.0] and model.calls == 0


def test_a_hook_that_outlives_a_pass_keeps_its_keyword_flag():
    @outlives_passes
    def noted(module, args, kwargs):
        return None

    model = nn.Linear(2, 1)
    with untouched(model):
        handle = model.register_forward_pre_hook(noted, with_kwargs=True)
    assert handle.id in model._forward_pre_hooks and handle.id in model._forward_pre_hooks_with_kwargs
    model(torch.ones(1, 2))  # (called with its kwargs: it raised a TypeError without the flag)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo process group of one rank in this process (its store a file), for the module's tests."""
    if not GLOO:
        pytest.skip("needs gloo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('group') / 'store'}", rank=0,
                            world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_a_pass_with_a_backward_leaves_a_static_graph_ddp_training_as_without_it(group):
    # the wrapper's flag was put back apart from its C++ reducer's state: the next backward failed an
    # internal assert (reducer.cpp: expect_autograd_hooks_)
    from torch.nn.parallel import DistributedDataParallel

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))

    def trained(passes: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)), static_graph=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(passes):
            with untouched(model):
                model(x).sum().backward()
        for _ in range(3):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(trained(0), trained(1))


def test_a_gradient_hook_a_library_registers_at_the_first_forward_stays(group, monkeypatch):
    # review 41b: transformers' tensor-parallel ReplicatedWithGradAllReduce hooks each parameter at the first
    # forward with gradients on, once (a dict in its hook's closure); the start-up check's pass is that
    # forward: taking its hook out (5b060c5) left the layer's gradients never all-reduced again
    tp = pytest.importorskip("transformers.distributed.tensor_parallel")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    calls = []
    real = group.all_reduce
    monkeypatch.setattr(group, "all_reduce", lambda t, *a, **k: (calls.append(1), real(t, *a, **k))[1])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for check in (False, True):
        norm = nn.LayerNorm(8)
        tp.ReplicatedWithGradAllReduce().install_forward(norm, mesh)
        if check:
            with untouched(norm):
                norm(x).sum()
        counts = []
        for _ in range(2):
            calls.clear()
            norm.zero_grad()
            norm(x).pow(2).sum().backward()
            counts.append(len(calls))
        assert counts == [2, 2], (check, counts)  # (weight and bias, every step)


def test_the_gradients_go_back_to_the_parameters_that_held_them_when_fsdp2_swaps_them(group):
    # review 41b: a forward-only pass leaves an FSDP2 root's parameters unsharded: other objects than on
    # entering; the gradients were set to None on the entering ones and given back to the leaving ones
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    fully_shard(model)
    model(torch.randn(8, 3)).sum().backward()
    entering = [(p, p.grad) for p in model.parameters()]
    assert all(grad is not None for _, grad in entering)
    with untouched(model), torch.no_grad():
        model(torch.randn(8, 3))
    assert all(p.grad is grad for p, grad in entering)


SPY = """
import torch
from torch import nn
from torch.nn import functional as F

SEEN = []


class Spy(nn.Linear):
    def forward(self, x):
        out = super().forward(x)
        SEEN.append(out.dtype)
        return out


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Spy(32, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(32, 16) * 3
    y = model(x).argmax(1).detach()
    return {"model": model, "data": [(x, y)], "loss_fn": F.cross_entropy, "held_out": (x, y)}
"""


def test_validate_runs_the_fp32_modules_in_float32_in_its_amp_passes(tmp_path):
    # validate snapshotted the model before prepare_model gave the fp32_modules their float32 forward,
    # and each pass's put-back took it out: the bf16 verdict judged a model training never runs
    from ampguard.tasks import build_task
    from ampguard.validate import compare

    factory = write(tmp_path / "spy41.py", SPY)
    config = make_config({"task": {"factory": f"{factory}:build"}, "fp32_modules": ["1"],
                          "validation": {"precisions": ["bf16"], "min_accuracy": 0.0, "boundary": 0,
                                         "edge_cases": False}})
    task = build_task(config)
    spy = next(m for m in task.model.modules() if type(m).__name__ == "Spy")
    seen = type(spy).forward.__globals__["SEEN"]  # (the factory module's, however it was loaded)
    seen.clear()
    compare(task, task.model, config, torch.device("cpu"))
    assert len(seen) == 4 and set(seen) == {torch.float32}, seen  # (two FP32 passes, then two bf16 ones)


def test_fsdp2s_state_dict_hooks_its_first_forward_registers_in_a_pass_stay(group):
    # review 41b: FSDP2's root registers its to_sharded state-dict hooks at its first forward, once (recorded
    # on its parameter group); a pass took them out: after an evaluation forward, state_dict() gave plain
    # tensors instead of DTensors
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    fully_shard(model)
    with untouched(model), torch.no_grad():
        model(torch.randn(8, 3))
    with torch.no_grad():
        model(torch.randn(8, 3))
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())


class Grows(nn.Linear):  # an empty tensor attribute a forward grows in place, beside an empty buffer
    def __init__(self):
        super().__init__(2, 1)
        self.cache = torch.empty(0)
        self.register_buffer("marker", torch.empty(0), persistent=False)

    def forward(self, x):
        self.cache.resize_(x.numel()).copy_(x.flatten())
        return super().forward(x)


def test_an_empty_buffer_hides_no_empty_tensor_attribute_from_the_in_place_warning():
    # 41c: every empty storage's address is 0: the buffer made the attribute look like a view of it
    model = Grows()
    with pytest.warns(AmpguardWarning, match="changed the tensor attribute Grows.cache in place"):
        with untouched(model, by="the check"):
            model(torch.ones(1, 2))


class Retyped(nn.Module):  # a buffer a forward gives another dtype, one it frees, and a BatchNorm after them
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(2))
        self.register_buffer("scratch", torch.ones(4))
        self.norm = nn.BatchNorm1d(2)

    def forward(self, x):
        self.table.data = self.table.data.to(x.dtype)
        self.scratch.untyped_storage().resize_(0)
        return self.norm(x.float())


def test_a_buffer_given_another_dtype_or_freed_is_put_back_and_the_buffers_after_it_too():
    # 41e: set_ read the old float32 storage with the new dtype's item size (a raw RuntimeError, and the
    # BatchNorm's statistics after it left moved); a freed storage was copied into (the process crashed)
    model = Retyped()
    with untouched(model):
        model(torch.randn(4, 2, dtype=torch.float64))
    assert model.table.dtype == torch.float32 and model.table.tolist() == [0.0, 0.0]
    assert model.scratch.tolist() == [1.0] * 4
    assert model.norm.running_mean.tolist() == [0.0, 0.0] and int(model.norm.num_batches_tracked) == 0


class EveryCall(nn.Module):  # a gradient hook and a forward hook registered at every call, no attribute changed
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

    def forward(self, x):
        self.a.weight.register_hook(lambda g: g * 0.5)
        self.b.register_forward_hook(lambda m, args, out: out * 2)
        return self.b(self.a(x))


def test_hooks_left_by_a_pass_are_said_even_when_no_attribute_changed():
    # 41e: the warning named only modules whose attributes changed: the hooks a pass left, piled up at each
    # pass, went unsaid
    # (41g: two passes tell a hook registered at every call from one registered once)
    model = EveryCall()
    with pytest.warns(AmpguardWarning, match=r"registered gradient hooks on 1 parameter at its passes \(a.weight "
                      r"\(2\), hooks of one function each\): they stay, so the run starts with hooks a plain loop's "
                      r"would not have; what its passes changed in the modules stays too \(Linear \(2 hooks "
                      r"registered\)\); register such a hook once"):
        with untouched(model, by="the check"):
            model(torch.ones(1, 2)).sum()
            model(torch.ones(1, 2)).sum()


def test_a_model_whose_buffers_are_dtensors_passes_the_start_up_check_and_is_put_back(group):
    # 41f: a wrapper subclass's storage has no readable address: the set-back raised a raw RuntimeError at
    # start-up (tensor parallelism's distribute_module makes every buffer a DTensor) and left a BatchNorm's
    # count moved
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_module

    from ampguard.build import check_forward
    from ampguard.precision import Precision

    model = distribute_module(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)),
                              init_device_mesh("cpu", (1,)),
                              input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(t, mesh) for t in inputs),
                              output_fn=lambda mod, out, mesh: out.full_tensor())
    assert isinstance(model[1].running_mean, DTensor)
    batch = (torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 1))
    assert check_forward(model, nn.functional.mse_loss, lambda: batch, Precision("fp32", "cpu"), "f.py:build") == []
    assert model[1].num_batches_tracked.full_tensor().item() == 0
    assert model[1].running_mean.full_tensor().tolist() == [0.0] * 4
