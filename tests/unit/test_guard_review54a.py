"""Review 54a: the guard in loops of one's own, under unusual but legitimate shapes.

A copy of a guarded model (an EMA or teacher's ``copy.deepcopy``, swa_utils' ``AveragedModel``)
kept ampguard's forward pre-hooks for good, so ``torch.save(copy)`` needed ampguard to load; a
scheduler made over the inner optimizer of a plain optimizer wrapper (Lookahead's shape, which
torch's ``LRScheduler`` cannot be built over) was refused as "drives none of the guard's
optimizers"; a sparse gradient was refused for clipping when an ``nn.Embedding(sparse=True)``
made it and clipped when ``F.embedding(..., sparse=True)`` did.
"""

from __future__ import annotations

import copy
import gc
import io
import json
import select
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

from ampguard import Guard
from ampguard.watch import _keep_running_stats, _note_autocast

NAN = float("nan")


# ---------------------------------------------------------------------------- a copy's hooks


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))


def _ampguard_hooks(model: nn.Module) -> list[str]:
    return [f"{name}:{hook.__name__}" for name, m in model.named_modules() for hook in m._forward_pre_hooks.values()
            if hook in (_keep_running_stats, _note_autocast)]


def _train_step(guard: Guard, model: nn.Module, x: torch.Tensor, bad: bool = False):
    with guard.autocast():
        loss = model(x).pow(2).mean() * (NAN if bad else 1.0)
    guard.backward(loss)
    return guard.step()


def _saved(model: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


LOADER = """
import json, sys, traceback

sys.modules["ampguard"] = None  # (and -I: a process where ampguard cannot be imported)
import torch

for line in sys.stdin:
    try:
        for path in json.loads(line):
            torch.load(path, weights_only=False)
        print(json.dumps("loaded"), flush=True)
    except Exception:
        print(json.dumps(traceback.format_exc()), flush=True)
"""


@pytest.fixture(scope="module")
def load_without_ampguard():
    """``load(*paths)``: "loaded" once a process where ampguard cannot be imported loaded each
    ``torch.save``'d file (or the traceback it raised). One process for the module's cases (one
    torch import): each asks it in turn."""
    proc = subprocess.Popen([sys.executable, "-I", "-c", LOADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def load(*paths: object) -> str:
        proc.stdin.write(json.dumps([str(p) for p in paths]) + "\n")
        proc.stdin.flush()
        if not select.select([proc.stdout], [], [], 120)[0]:
            return "no answer in 120 s"
        line = proc.stdout.readline()
        return json.loads(line) if line else f"the loader ended: {proc.stderr.read()[-2000:]}"

    try:
        yield load
    finally:
        try:
            proc.communicate(timeout=60)  # (its stdin closed: it ends)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("when", ["before the first backward", "after it"])
def test_a_copy_of_a_guarded_model_sheds_ampguards_hooks_and_loads_without_ampguard(when, tmp_path,
                                                                                    load_without_ampguard):
    model = _bn_model()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", max_norm=1.0)
    x = torch.randn(8, 4)
    if when == "after it":
        _train_step(guard, model, x)
    ema = copy.deepcopy(model)  # (an EMA, a teacher)
    swa = AveragedModel(model)  # (swa_utils' copy, made up front or at swa_start)
    assert _ampguard_hooks(ema)  # (torch's deepcopy takes the hooks dict with it)
    _ = ema.eval()(x)  # an EMA's evaluation: eval mode, under no_grad
    update_bn([x], swa)  # swa_utils' BatchNorm pass: training mode, under no_grad
    assert _ampguard_hooks(ema) == _ampguard_hooks(swa) == []  # review 54a: they stayed for good
    for name, copied in [("ema", ema), ("swa", swa)]:
        data = _saved(copied)
        assert b"ampguard" not in data
        (tmp_path / f"{name}.pt").write_bytes(data)
    # the guarded model keeps its own, and its guard goes on as before
    assert "1:_keep_running_stats" in _ampguard_hooks(model)
    _train_step(guard, model, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _ = swa.train()(x * 100)  # (a copy's training forward between steps: the original's stats untouched)
    assert guard.__dict__["_running_stats"]._kept == []  # (nothing of the original's kept by a copy's forward)
    assert _train_step(guard, model, x, bad=True).skipped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # its statistics put back
    # a process where ampguard cannot be imported loads both copies
    said = load_without_ampguard(tmp_path / "ema.pt", tmp_path / "swa.pt")
    assert said == "loaded", said


def test_a_copy_a_guard_watches_keeps_the_hook_until_that_guard_is_gone():
    model = _bn_model()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", max_norm=1.0)
    x = torch.randn(8, 4)
    _train_step(guard, model, x)
    student = copy.deepcopy(model)  # its BatchNorm has the hook already: the second guard adopts it
    second = Guard(student, torch.optim.SGD(student.parameters(), lr=0.1), precision="fp32", max_norm=1.0)
    _train_step(second, student, x)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    assert _train_step(second, student, x, bad=True).skipped
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())  # kept by the adopted hook
    del second
    gc.collect()
    _ = student(x)
    assert _ampguard_hooks(student) == []  # gone with the last guard watching it
    assert b"ampguard" not in _saved(student)
    assert "1:_keep_running_stats" in _ampguard_hooks(model)  # (the first guard's own, on its model)
    del guard
    gc.collect()
    assert _ampguard_hooks(model) == []


@pytest.mark.parametrize("make", ["copy.copy", "a DataParallel replica"])
def test_a_shallow_copys_forward_leaves_the_originals_hooks(make):
    """Review 54i: a shallow copy (``copy.copy``, the replicas ``nn.DataParallel`` makes) shares
    its hook tables with the original; shedding the hook from the copy took it off the original
    too, so a skipped step left BatchNorm's statistics NaN and a bf16 forward without autocast
    was no longer told."""
    model = _bn_model()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", max_norm=1.0)
    bn = model[1]
    if make == "copy.copy":
        view = copy.copy(bn)
    else:
        view = bn._replicate_for_data_parallel()
        view._parameters.update(bn._parameters)
    assert view._forward_pre_hooks is bn._forward_pre_hooks  # (shared: what made the shed reach the original)
    view(torch.randn(8, 6))
    assert "1:_keep_running_stats" in _ampguard_hooks(model)
    assert not any(h is _keep_running_stats for h in view._forward_pre_hooks.values())  # (the copy's own, shed)
    x = torch.randn(8, 4)
    _train_step(guard, model, x)
    before = bn.running_mean.clone()
    assert _train_step(guard, model, x, bad=True).skipped
    assert torch.equal(bn.running_mean, before)  # put back by the original's hook


def test_a_users_hook_on_a_copy_still_comes_off_after_the_copy_shed_ampguards():
    """Review 54l: the shed gave every copy new hook tables, and the handle of a hook a user had put
    on the copy before its first forward pointed at the old ones: ``handle.remove()`` did nothing,
    the hook kept firing (torchinfo, fvcore and thop register, run a forward and remove)."""
    model = _bn_model()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", max_norm=1.0)
    ema = copy.deepcopy(model)
    calls = []
    handle = ema[1].register_forward_pre_hook(lambda module, args: calls.append(1))
    ema(torch.randn(8, 4))  # (ampguard's hook sheds itself here)
    assert calls == [1] and _ampguard_hooks(ema) == []
    handle.remove()
    ema(torch.randn(8, 4))
    assert calls == [1] and not ema[1]._forward_pre_hooks
    assert "1:_keep_running_stats" in _ampguard_hooks(model) and guard.steps == 0


def test_a_shallow_copys_forward_leaves_the_autocast_probe_on_the_original():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    copy.copy(model)(torch.randn(2, 4))
    with pytest.warns(Warning, match="without autocast"):
        guard.backward(model(torch.randn(4, 4)).pow(2).mean())  # (forgot guard.autocast())
        guard.step()


# ---------------------------------------------------------------------------- a wrapper's scheduler


class Lookahead:
    """A plain optimizer wrapper (no ``torch.optim.Optimizer``: torch's schedulers refuse it),
    sharing the inner optimizer's ``param_groups``, as many Lookahead ports are."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 3, alpha: float = 0.5) -> None:
        self.optimizer, self.k, self.alpha, self.n = base, k, alpha, 0
        self.param_groups, self.state, self.defaults = base.param_groups, base.state, base.defaults
        self.slow = [[p.detach().clone() for p in g["params"]] for g in self.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            with torch.no_grad():
                for group, slow in zip(self.param_groups, self.slow):
                    for p, s in zip(group["params"], slow):
                        s.add_(p - s, alpha=self.alpha)
                        p.copy_(s)
        return loss

    def state_dict(self):
        return {"base": self.optimizer.state_dict(), "n": self.n}

    def load_state_dict(self, state) -> None:
        self.optimizer.load_state_dict(state["base"])
        self.n = state["n"]


@pytest.mark.parametrize("form", ["scheduler", "dict"])
def test_a_scheduler_over_a_wrappers_inner_optimizer_is_held_on_skips(form):
    bad = {2, 5}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(9)]

    def run(guarded: bool):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = Lookahead(torch.optim.AdamW(model.parameters(), lr=0.05))
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt.optimizer, T_0=3)
        guard = (Guard(model, opt, precision="fp32", max_norm=0.5,
                       scheduler=sched if form == "scheduler" else {"optimizer": sched}) if guarded else None)
        lrs = []
        for i, (x, y) in enumerate(batches):
            scale = NAN if i in bad else 1.0
            if guarded:
                loss = F.mse_loss(model(x), y) * scale
                guard.backward(loss)
                assert guard.step().skipped == (i in bad)
            else:  # the recipe: a non-finite step neither steps the optimizer nor the schedule
                if i not in bad:
                    F.mse_loss(model(x), y).backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
                    sched.step()
                opt.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
        return model, lrs

    (ref, ref_lrs), (got, got_lrs) = run(False), run(True)
    assert got_lrs == ref_lrs and len(set(ref_lrs)) > 2
    assert torch.equal(got.weight, ref.weight) and torch.equal(got.bias, ref.bias)


def test_a_dict_scheduler_of_another_optimizer_is_said_in_one_plain_line():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 2)
    with pytest.raises(ValueError) as caught:
        Guard(model, opt, precision="fp32", scheduler={"optimizer": sched})
    assert str(caught.value) == ("scheduler 'optimizer': the StepLR given drives another optimizer than "
                                 "'optimizer' (it would follow the updates and skips of 'optimizer', not "
                                 "those of its own optimizer)")


# ---------------------------------------------------------------------------- sparse gradients, clipped


class ByModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids))


class ByFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(20, 4))
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(F.embedding(ids, self.table, sparse=True))


def test_pytorchs_clip_cannot_clip_a_sparse_gradient():
    # (why the guard refuses: the recipe it stands for has no clip of them)
    model = ByFunction()
    model(torch.tensor([1, 3])).sum().backward()
    assert model.table.grad.is_sparse
    with pytest.raises(NotImplementedError):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


@pytest.mark.parametrize("set_when", ["at Guard()", "between steps"])
def test_a_sparse_gradient_from_a_function_is_refused_for_clipping_at_the_step(set_when):
    # review 54a: F.embedding(..., sparse=True) passed the check of modules, and was clipped
    ids = torch.tensor([1, 1, 3, 5])
    model = ByFunction()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32",
                  max_norm=0.5 if set_when == "at Guard()" else None)
    if set_when == "between steps":
        guard.backward(model(ids).pow(2).mean())
        assert not guard.step().skipped
        guard.max_norm = 0.5
    steps = guard.steps
    guard.backward(model(ids).pow(2).mean())
    with pytest.raises(ValueError) as caught:
        guard.step()
    assert str(caught.value) == (
        "Guard.step(): parameter 'table' has a sparse gradient (F.embedding(..., sparse=True)?), which PyTorch's "
        "clip_grad_norm_ cannot clip: pass max_norm=None (the norm and the non-finite check still cover it)")
    assert guard.steps == steps and all(p.grad is None for p in model.parameters())  # (not counted, the group dropped)
    guard.max_norm = None  # ... and the loop goes on, unclipped
    guard.backward(model(ids).pow(2).mean())
    record = guard.step()
    assert not record.skipped and record.values()["grad_l2_pre_clip"] > 0


def test_a_sparse_embedding_module_is_refused_for_clipping_up_front_as_before():
    model = ByModule()
    with pytest.raises(ValueError, match=r"^module 'emb' makes sparse gradients, which PyTorch's clip_grad_norm_ "
                                         r"cannot clip: pass max_norm=None"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", max_norm=0.5)
