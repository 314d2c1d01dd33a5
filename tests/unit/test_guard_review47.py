"""Review 47c: ``Guard`` in a user's own loop, the cases that went wrong or said nothing.

A stray ``scaler.unscale_(opt)`` on a handed-over GradScaler blocked every later step, not only
its own; a loader that ended inside an accumulation group left a group nothing could close
("Guard.step() called twice"); a float16 loss overflowed under the loss scale as a run of
``non_finite_grad`` skips, unsaid; a monitor registered after ``load_state_dict`` started fresh,
unsaid; a bf16 state given to an fp16 guard was named by its missing scaler state, not its
precision; half weights under ``precision="fp32"`` trained pure half precision under the name
fp32, unsaid; ``backward(loss, retain_graph=True)`` was a bare TypeError.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import AmpTrainState, Guard, StepLog
from ampguard.errors import AmpguardWarning
from ampguard.monitor import RunMonitor


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _loss(guard: Guard, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with guard.autocast():
        return F.mse_loss(model(x).float(), y)


# ------------------------------------------------------------- a stray line of the recipe, once


@pytest.mark.parametrize("stray", ["unscale_", "step"])
def test_a_stray_scaler_line_kept_once_is_refused_at_its_step_and_the_loop_goes_on(stray):
    # the plain scaler stayed marked "unscaled" for good: every later guard.step() was refused,
    # in a new Guard too, and scaler.update() (the one reset in reach) the guard refuses
    model, opt = _model()
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = Guard(model, opt, precision="fp16", scaler=plain)
    batches = _batches(4)
    guard.backward(_loss(guard, model, *batches[0]))
    try:
        getattr(plain, stray)(opt)
    except RuntimeError:  # (scaler.step: the optimizer's step is refused, after the scaler unscaled)
        assert stray == "step"
    with pytest.raises(RuntimeError, match=r"GradScaler given as scaler= was used on the optimizer outside"):
        guard.step()
    records = []
    for x, y in batches[1:]:  # the line taken out again: every step is the guard's
        guard.backward(_loss(guard, model, x, y))
        records.append(guard.step())
    assert all(isinstance(r, StepLog) and not r.skipped for r in records), records
    assert [r.step for r in records] == [1, 2, 3] and guard.updates == 3
    fresh = Guard(model, opt, precision="fp16", scaler=plain)  # and a new guard over the same scaler
    fresh.backward(_loss(fresh, model, *batches[0]))
    assert isinstance(fresh.step(), StepLog)


# ------------------------------------------------------- a loader that ends inside a group


def _canonical_short_tail(batches, n: int) -> list[torch.Tensor]:
    model, opt = _model()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    micro = 0
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss / n).backward()
        micro += 1
        if micro == n:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            micro = 0
    if micro:  # the loop's end: the short group closes
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_a_group_a_streaming_loader_ended_inside_closes_after_the_loop_as_the_recipe_closes_it():
    batches = _batches(7)  # groups of 3: two full, one of a single micro-batch
    model, opt = _model()
    guard = Guard(model, opt, precision="bf16", accumulation_steps=3)
    for x, y in iter(batches):  # (no len(): the last batch is known when the loop has ended)
        guard.backward(_loss(guard, model, x, y))
        guard.step()
    assert guard.mid_group
    with pytest.raises(RuntimeError, match=r"the open group holds 1 of 3 micro-batches.*guard.step\(close=True\)"):
        guard.step()
    record = guard.step(close=True)
    assert isinstance(record, StepLog) and record.step == 3 and guard.updates == 3
    expected = _canonical_short_tail(batches, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected))
    assert guard.state_dict()["step"] == 3  # (a checkpoint at the end is no longer refused)
    # nothing open (a stream that ended on a group's boundary, review 47g): nothing to close, nothing done
    assert guard.step(close=True) is None and guard.steps == 3 and guard.updates == 3
    with pytest.raises(RuntimeError, match=r"Guard.step\(\) called twice"):
        guard.step()


def test_amp_train_state_closes_the_group_its_loader_ended_inside():
    batches = _batches(7)
    model, opt = _model()
    state = AmpTrainState(model, opt, F.mse_loss, precision="bf16", accumulation_steps=3)
    state.loss_fn = lambda out, y: F.mse_loss(out.float(), y)
    for x, y in batches:
        state.step(x, y)
    assert state.step(close=True).step == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _canonical_short_tail(batches, 3)))
    with pytest.raises(TypeError, match=r"only step\(close=True\) after the loop"):
        state.step()


# --------------------------------------------------------------------- a loss left in half


@pytest.mark.parametrize("precision, dtype, said", [
    ("fp16", torch.float16, "overflows float16 past 65504"),
    ("bf16", torch.bfloat16, "rounded to bfloat16"),
])
def test_a_half_precision_loss_is_said_once(precision, dtype, said):
    model, opt = _model()
    guard = Guard(model, opt, precision=precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(3):
            with guard.autocast():
                out = model(x)
                loss = ((out - y.to(out.dtype)) ** 2).sum()  # a reduction of autocast's output: in half
            assert loss.dtype == dtype
            guard.backward(loss)
            guard.step()
    said_ = [w for w in caught if issubclass(w.category, AmpguardWarning) and "the loss is" in str(w.message)]
    assert len(said_) == 1 and said in str(said_[0].message), [str(w.message) for w in caught]


def test_a_float32_loss_is_not_said():
    model, opt = _model()
    guard = Guard(model, opt, precision="fp16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.backward(_loss(guard, model, *_batches(1)[0]))
        guard.step()
    assert not [w for w in caught if "the loss is" in str(w.message)]


# ------------------------------------------------------------ monitors and the saved state


def _monitored(steps: int) -> tuple[Guard, RunMonitor]:
    """A bf16 guard with a RunMonitor registered as "run", ``steps`` steps in."""
    model, opt = _model()
    guard = Guard(model, opt, precision="bf16")
    guard.monitors["run"] = monitor = RunMonitor(window=10)
    for x, y in _batches(steps):
        guard.backward(_loss(guard, model, x, y))
        monitor.observe(guard.step())
    return guard, monitor


def test_a_monitor_registered_after_the_load_gets_its_saved_state():
    guard, monitor = _monitored(3)
    saved = copy.deepcopy(guard.state_dict())
    assert monitor.steps == 3

    model2, opt2 = _model()
    resumed = Guard(model2, opt2, precision="bf16")
    resumed.load_state_dict(saved)
    resumed.monitors["run"] = late = RunMonitor(window=10)  # registered after the load
    assert late.steps == 3 and late.state_dict() == monitor.state_dict()
    resumed.monitors["other"] = other = RunMonitor(window=10)  # no saved state: fresh
    assert other.steps == 0
    copied = pickle.loads(pickle.dumps(resumed.monitors))  # (the guard pickles: its monitors with it)
    assert type(copied) is type(resumed.monitors) and copied.saved == resumed.monitors.saved == {}


def test_a_monitor_registered_before_the_load_is_loaded_as_before():
    guard, _ = _monitored(1)
    model2, opt2 = _model()
    resumed = Guard(model2, opt2, precision="bf16")
    resumed.monitors["run"] = early = RunMonitor(window=10)
    resumed.load_state_dict(guard.state_dict())
    assert early.steps == 1 and resumed.monitors.saved == {}


def test_a_bf16_state_given_to_an_fp16_guard_is_named_by_its_precision():
    model, opt = _model()
    guard = Guard(model, opt, precision="bf16")
    guard.backward(_loss(guard, model, *_batches(1)[0]))
    guard.step()
    model2, opt2 = _model()
    with pytest.raises(ValueError, match=r"^state was saved with precision='bf16', this step uses 'fp16'$"):
        Guard(model2, opt2, precision="fp16").load_state_dict(guard.state_dict())


# ---------------------------------------------------------------- half weights under fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_under_fp32_are_trained_and_said(dtype):
    model = nn.Linear(2, 2).to(dtype)
    with pytest.warns(AmpguardWarning, match=rf"is {str(dtype)[6:]} under precision fp32: .* its records say fp32"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")


# --------------------------------------------------------------------------- retain_graph


def test_retain_graph_keeps_the_graph_for_a_later_backward():
    model, opt = _model()
    guard = Guard(model, opt, precision="fp32")
    x, y = _batches(1)[0]
    loss = _loss(guard, model, x, y)
    guard.backward(loss, retain_graph=True)
    again = torch.autograd.grad(loss, model[0].weight)[0]  # freed by a plain backward
    assert torch.isfinite(again).all()
    expected = model[0].weight.grad.clone()
    guard.step()
    assert torch.equal(again, expected)  # (fp32, accumulation 1, no scale: the same gradient)
    loss = _loss(guard, model, x, y)
    guard.backward(loss)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, model[0].weight)
    guard.step()


def test_retain_graph_with_a_backward_of_the_loops_own_is_refused_naming_fn():
    model, opt = _model()
    guard = Guard(model, opt, precision="fp32")
    with pytest.raises(ValueError, match=r"fn runs the backward, so it says retain_graph"):
        guard.backward(_loss(guard, model, *_batches(1)[0]), backward=lambda s: s.backward(), retain_graph=True)


# ------------------------------------------------------------------ review 47e, on the fixes


def test_a_refusal_in_one_guard_keeps_the_marks_of_another_sharing_the_scaler():
    # two guards over one plain GradScaler (a guard per model, the recipe's one scaler): guard 1's dropped
    # group forgot what was unscaled for every optimizer, so guard 2 applied gradients divided twice
    torch.manual_seed(0)
    m1, m2 = nn.Linear(4, 1), nn.Linear(4, 1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    g1, g2 = Guard(m1, o1, precision="fp16", scaler=plain), Guard(m2, o2, precision="fp16", scaler=plain)
    x, y = _batches(1)[0]
    g2.backward(_loss(g2, m2, x, y))
    plain.unscale_(o2)  # the stray line, on guard 2's optimizer
    loss = _loss(g1, m1, x, y)
    g1.backward(loss)
    with pytest.raises(RuntimeError, match=r"Guard.backward\(\) called twice"):
        g1.backward(loss)  # guard 1's group dropped
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(RuntimeError, match="GradScaler given as scaler= was used on the optimizer outside"):
        g2.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))


def test_a_state_loaded_for_a_monitor_not_registered_yet_travels_on_in_the_next_state():
    guard, _ = _monitored(1)
    first = guard.state_dict()
    model2, opt2 = _model()
    resumed = Guard(model2, opt2, precision="bf16")
    resumed.load_state_dict(first)
    second = resumed.state_dict()  # (a checkpoint before the loop registers its monitor again)
    assert second["monitors"] == first["monitors"]
    model3, opt3 = _model()
    again = Guard(model3, opt3, precision="bf16")
    again.load_state_dict(second)
    again.monitors |= {"run": RunMonitor(window=10)}  # (|= registers as [] does)
    assert again.monitors["run"].steps == 1


def test_the_new_warnings_name_the_users_line_through_amp_train_state_too():
    model = nn.Linear(2, 1).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda out, y: ((out - y) ** 2).sum(), precision="fp32")
        state.step(torch.ones(4, 2, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=torch.bfloat16))
        for _ in range(3):  # (modules built elsewhere: the guard reads its parameters again, says nothing again)
            nn.Linear(2, 2)
            state.step(torch.ones(4, 2, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=torch.bfloat16))
    said = [w for w in caught if issubclass(w.category, AmpguardWarning)]
    assert {w.filename for w in said} == {__file__}, [(w.filename, str(w.message)[:60]) for w in said]
    assert sum("under precision fp32" in str(w.message) for w in said) == 1
    assert sum("the loss is bfloat16" in str(w.message) for w in said) == 1


def test_a_frozen_half_backbone_under_fp32_is_not_said_to_train():
    backbone, head = nn.Linear(2, 2).to(torch.bfloat16).requires_grad_(False), nn.Linear(2, 1)
    model = nn.Sequential(backbone, head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Guard(model, torch.optim.SGD(head.parameters(), lr=0.1), precision="fp32", frozen="ignore")
    assert not [w for w in caught if "under precision fp32" in str(w.message)]


def test_a_monitor_state_its_monitor_refuses_is_refused_before_anything_is_restored():
    guard, _ = _monitored(2)
    state = copy.deepcopy(guard.state_dict())
    state["monitors"]["run"]["steps"] = -1  # (a hand edit, a corrupt checkpoint)
    model2, opt2 = _model()
    fresh = Guard(model2, opt2, precision="bf16")
    fresh.monitors["run"] = RunMonitor(window=10)
    with pytest.raises(ValueError, match=r"Guard.load_state_dict\(\): monitors.run.steps"):
        fresh.load_state_dict(state)
    assert (fresh.steps, fresh.updates, fresh.monitors["run"].steps) == (0, 0, 0)  # (nothing half restored)


def test_a_warning_names_ampguards_integration_line_not_the_frameworks():
    # review 47f: through the Lightning plugin the warning named Lightning's line (a filter on
    # module="lightning" hid it); the plugin's own line is the first that is not ampguard's core
    from pathlib import Path

    from ampguard import errors

    inner = compile("def inner():\n    return user_stacklevel()\n", errors._PACKAGE + "step_fake.py", "exec")
    outer = compile("def outer():\n    return inner()\n", str(Path(errors._INTEGRATIONS) / "fake.py"), "exec")
    ns = {"user_stacklevel": errors.user_stacklevel}
    exec(inner, ns)
    exec(outer, ns)
    assert ns["inner"]() == 2 and ns["outer"]() == 2  # (inner's caller: this file; outer's line: the plugin's)


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_frozen_half_backbone_under_trained_float32_layers_trains_as_the_recipe(precision, dtype):
    # a bf16 backbone under trained adapters (LoRA's shape): refused as weights "cast to half" although
    # nothing updates them (no master weights to keep); a trainable half weight is still refused
    def build():
        torch.manual_seed(0)
        backbone = nn.Linear(4, 8).to(dtype).requires_grad_(False)
        model = nn.Sequential(backbone, nn.Linear(8, 1))
        return model, torch.optim.SGD(model[1].parameters(), lr=0.1)

    model, opt = build()
    guard = Guard(model, opt, precision=precision, frozen="ignore")
    ref, ref_opt = build()
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")  # (the guard's defaults: 2**16)
    for x, y in _batches(5):
        with guard.autocast():
            loss = F.mse_loss(model(x).float(), y)
        guard.backward(loss)
        guard.step()
        with torch.autocast("cpu", dtype=dtype):
            ref_loss = F.mse_loss(ref(x).float(), y)
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref[1].parameters(), 1.0)
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert guard.updates >= 1
    model, opt = build()
    model[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is .*mixed precision keeps FP32 master weights"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    # frozen, but the optimizer holds it (AdamW(model.parameters())): unfrozen mid-run it trained in half,
    # unsaid (review 47g): refused up front, saying why
    model, opt = build()
    with pytest.raises(ValueError, match=r"^parameter '0.weight' is \w+ and frozen, but an optimizer holds it: "
                                         r"unfrozen, it would train in \w+, .*; give the optimizer the trainable "
                                         r"parameters only \(a frozen half backbone no optimizer holds is taken\), "
                                         r"or keep the model in float32$"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
