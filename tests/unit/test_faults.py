"""Fault injection: KIND@WHEN parsing, step mapping, and what each fault does."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard import AmpTrainState, SkipLog
from ampguard.faults import KINDS, SPIKE_FACTOR, Fault, FaultInjector, parse_fault

WHENS = ["5", "5,9,12", "every:10", "rate:0.05"]


# ---------------------------------------------------------------------------- parsing


def test_the_five_kinds():
    assert set(KINDS) == {"inf_grad", "nan_grad", "nan_loss", "spike", "nan_input"}
    assert SPIKE_FACTOR == 1e8


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("when", WHENS)
def test_parse_every_kind_and_when(kind, when):
    fault = parse_fault(f"{kind}@{when}")
    assert fault.kind == kind
    if when.startswith("every:"):
        assert fault.every == 10 and fault.rate is None
    elif when.startswith("rate:"):
        assert fault.rate == 0.05 and fault.every is None
    else:
        assert fault.steps == frozenset(int(s) for s in when.split(","))
    assert parse_fault(fault.spec()) == fault  # spec() round-trips


def test_parse_tolerates_spaces():
    assert parse_fault(" nan_loss @ 3 ") == parse_fault("nan_loss@3")


@pytest.mark.parametrize(
    "spec",
    ["melt@5", "@5", "inf_grad", "inf_grad@", "inf_grad@0", "inf_grad@-1", "inf_grad@5,0", "inf_grad@5,,9",
     "inf_grad@x", "inf_grad@2.5", "inf_grad@every:0", "inf_grad@every:x", "inf_grad@every:",
     "inf_grad@rate:1.5", "inf_grad@rate:-0.1", "inf_grad@rate:nan", "inf_grad@rate:", "none"],
)
def test_parse_rejects_bad_specs(spec):
    with pytest.raises(ValueError) as info:
        parse_fault(spec)
    assert "\n" not in str(info.value) and str(info.value)


def test_step_list_hits_exactly_those_steps():
    fault = parse_fault("inf_grad@5,9,12")
    assert [s for s in range(1, 200) if fault.hits(s)] == [5, 9, 12]
    assert [s for s in range(1, 50) if parse_fault("spike@7").hits(s)] == [7]


def test_every_k():
    fault = parse_fault("nan_grad@every:7")
    assert [s for s in range(1, 60) if fault.hits(s)] == [7, 14, 21, 28, 35, 42, 49, 56]
    assert all(parse_fault("nan_grad@every:1").hits(s) for s in range(1, 20))


def test_rate_is_seeded_order_independent_and_near_p():
    steps = range(1, 10_001)
    a = parse_fault("nan_loss@rate:0.05", seed=3)
    hits = [s for s in steps if a.hits(s)]
    assert hits == [s for s in steps if parse_fault("nan_loss@rate:0.05", seed=3).hits(s)]  # same seed
    assert hits != [s for s in steps if parse_fault("nan_loss@rate:0.05", seed=4).hits(s)]  # other seed
    assert sorted(s for s in reversed(steps) if a.hits(s)) == hits  # any order
    assert [a.hits(s) for s in (hits[3], 1, hits[3], 2, hits[3])][::2] == [True] * 3  # asking twice
    assert abs(len(hits) / len(steps) - 0.05) < 0.01


def test_rate_extremes():
    with pytest.raises(ValueError, match=r"rate:P with 0 < P <= 1"):  # rate:0 never fires: refused
        parse_fault("spike@rate:0")
    assert all(parse_fault("spike@rate:1").hits(s) for s in range(1, 500))


# ---------------------------------------------------------------------------- the injector


def _batches(n, in_features=3, out_features=2):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(4, in_features, generator=gen), torch.randn(4, out_features, generator=gen))
            for _ in range(n)]


def test_accumulation_maps_micro_batches_to_steps():
    inj = FaultInjector([parse_fault("spike@2")], accumulation_steps=3)
    data = [(torch.ones(2, 3), torch.ones(2, 1)) for _ in range(9)]
    seen = [(inj.current_step, float(y.max())) for _, y in inj.wrap_data(data)]
    assert [s for s, _ in seen] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [v for _, v in seen] == [1, 1, 1, SPIKE_FACTOR, SPIKE_FACTOR, SPIKE_FACTOR, 1, 1, 1]


def test_first_step_offsets_the_mapping():
    inj = FaultInjector([parse_fault("nan_input@5")], accumulation_steps=2, first_step=4)
    flags = []
    for x, _ in inj.wrap_data([(torch.zeros(2, 3), torch.zeros(2, 1)) for _ in range(6)]):
        flags.append((inj.current_step, bool(torch.isnan(x).any())))
    assert flags == [(4, False), (4, False), (5, True), (5, True), (6, False), (6, False)]


def test_spike_multiplies_float_targets_only_on_its_step():
    data = _batches(3)
    originals = [(x.clone(), y.clone()) for x, y in data]
    inj = FaultInjector([parse_fault("spike@2")])
    out = list(inj.wrap_data(data))
    for i, ((x, y), (x0, y0)) in enumerate(zip(out, originals), start=1):
        assert torch.equal(x, x0)
        assert torch.equal(y, y0 * 1e8 if i == 2 else y0)
    assert all(torch.equal(y, y0) for (_, y), (_, y0) in zip(data, originals))  # caller's data untouched


def test_spike_with_integer_targets_scales_the_loss():
    inj = FaultInjector([parse_fault("spike@2")])
    loss_fn = inj.wrap_loss(F.cross_entropy)
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 3])
    data = [(logits, labels)] * 3
    for i, (x, y) in enumerate(inj.wrap_data(data), start=1):
        assert torch.equal(y, labels)  # integer targets cannot be scaled themselves
        clean = F.cross_entropy(x, y)
        assert torch.equal(loss_fn(x, y), clean * 1e8 if i == 2 else clean)


def test_nan_input_puts_one_nan_in_the_inputs():
    data = _batches(3)
    originals = [(x.clone(), y.clone()) for x, y in data]
    inj = FaultInjector([parse_fault("nan_input@3")])
    for i, ((x, y), (x0, y0)) in enumerate(zip(inj.wrap_data(data), originals), start=1):
        assert torch.equal(y, y0)
        if i == 3:
            assert int(torch.isnan(x).sum()) == 1
            mask = ~torch.isnan(x)
            assert torch.equal(x[mask], x0[mask])
        else:
            assert torch.equal(x, x0)
    assert not any(torch.isnan(x).any() for x, _ in data)  # caller's data untouched


def test_nan_input_needs_float_inputs():
    inj = FaultInjector([parse_fault("nan_input@1")])
    with pytest.raises(ValueError):
        list(inj.wrap_data([(torch.tensor([[1, 2]]), torch.tensor([1]))]))


def test_nan_loss_wraps_the_loss():
    inj = FaultInjector([parse_fault("nan_loss@2,3")])
    loss_fn = inj.wrap_loss(F.mse_loss)
    for i, (x, y) in enumerate(inj.wrap_data(_batches(4, 2, 2)), start=1):
        loss = loss_fn(x, y)
        if i in (2, 3):
            assert math.isnan(float(loss))
        else:
            assert torch.equal(loss, F.mse_loss(x, y))


@pytest.mark.parametrize(("kind", "check"), [("inf_grad", math.isinf), ("nan_grad", math.isnan)])
def test_grad_hook_corrupts_only_the_faulted_step(kind, check):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    inj = FaultInjector([parse_fault(f"{kind}@2")])
    inj.attach(model)
    for i, (x, y) in enumerate(inj.wrap_data(_batches(3)), start=1):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        bad = [p for p in model.parameters() if not bool(torch.isfinite(p.grad).all())]
        if i == 2:  # (element 0 of one gradient: the first the backward made, review 52f)
            assert len(bad) == 1
            flat = bad[0].grad.view(-1)
            assert check(float(flat[0]))
            assert bool(torch.isfinite(flat[1:]).all())
        else:
            assert bad == []
    inj.detach()
    inj.current_step = 2  # the faulted step again, but the hooks are gone
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(torch.ones(1, 3)), torch.zeros(1, 2)).backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# ---------------------------------------------------------------------------- end to end through the step


def _guarded_run(spec: str, steps: int = 5, accumulation: int = 1, precision: str = "fp16"):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inj = FaultInjector([parse_fault(spec)], accumulation_steps=accumulation)
    state = AmpTrainState(model, opt, inj.wrap_loss(F.mse_loss), precision=precision, device="cpu",
                          accumulation_steps=accumulation, scaler={"init_scale": 1024.0})
    inj.attach(model)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen))
            for _ in range(steps * accumulation)]
    records = [r for r in (state.step(x, y) for x, y in inj.wrap_data(data)) if r is not None]
    return records, state


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("inf_grad", "non_finite_grad"), ("nan_grad", "non_finite_grad"), ("spike", "non_finite_grad"),
     ("nan_loss", "non_finite_loss"), ("nan_input", "non_finite_loss")],
)
def test_each_kind_gives_its_skip_reason_at_its_step_fp16(kind, reason):
    records, state = _guarded_run(f"{kind}@3")
    assert [r.step for r in records] == [1, 2, 3, 4, 5]
    assert [r.skipped for r in records] == [False, False, True, False, False]
    skip = records[2]
    assert isinstance(skip, SkipLog) and skip.reason == reason
    scales = [r.values()["scaler_scale"] for r in records]
    assert scales[2] == scales[1] * 0.5  # the skip is visible in the scale
    if reason == "non_finite_loss":
        assert skip.values()["grad_l2_pre_clip"] is None  # no backward, no norm
    else:
        assert not math.isfinite(skip.values()["grad_l2_pre_clip"])
    assert state.updates == 4


def test_fault_in_an_accumulation_group_skips_that_step():
    records, state = _guarded_run("nan_loss@2", steps=3, accumulation=3)
    assert [(r.step, r.skipped) for r in records] == [(1, False), (2, True), (3, False)]
    assert records[1].reason == "non_finite_loss"
    assert state.updates == 2


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_grad_fault_is_still_a_skip_without_a_scaler(precision):
    records, _ = _guarded_run("inf_grad@2", steps=3, precision=precision)
    assert [r.skipped for r in records] == [False, True, False]
    assert records[1].reason == "non_finite_grad"
    assert {r.values()["scaler_scale"] for r in records} == {1.0}


def test_fault_dataclass_defaults_never_hit():
    assert not any(Fault("spike").hits(s) for s in range(1, 100))


# ---------------------------------------------------------------------------- a rank the run has (issue 16)


def test_a_fault_for_a_rank_the_run_does_not_have_is_refused():
    from ampguard.faults import check_ranks

    check_ranks([parse_fault("nan_loss@4"), parse_fault("nan_loss@4@rank1")], world_size=2)
    with pytest.raises(ValueError, match=r"^fault 'nan_loss@40@rank3' targets rank 3, but this run has 1 process"):
        check_ranks([parse_fault("nan_loss@40@rank3")], world_size=1)
    with pytest.raises(ValueError, match=r"targets rank 2, but this run has 2 processes \(ranks 0 to 1\)$"):
        check_ranks([parse_fault("spike@1@rank2")], world_size=2)


@pytest.mark.parametrize(("spec", "steps", "fires"), [
    ("nan_loss@20", 20, True),  # the last step
    ("nan_loss@21", 20, False),
    ("nan_loss@21,3", 20, True),  # one of its steps is in the run
    ("nan_loss@every:20", 20, True),
    ("nan_loss@every:21", 20, False),
    ("nan_loss@rate:0.01", 1, True),  # a rate may fire at any step: never refused
])
def test_a_fault_that_can_never_fire_within_the_runs_steps_is_refused(spec, steps, fires):
    from ampguard.errors import InputError
    from ampguard.faults import check_steps, parse_faults

    fault = parse_fault(spec)
    if fires:
        check_steps([fault], steps)
        assert [f.spec() for f in parse_faults([spec], seed=0, steps=steps)] == [fault.spec()]
    else:
        assert not any(fault.hits(s) for s in range(1, steps + 1))
        with pytest.raises(ValueError, match=rf"^fault '{re.escape(fault.spec())}' never fires: the run has {steps} steps"):
            check_steps([fault], steps)
        with pytest.raises(InputError, match="^inject: fault .* never fires"):
            parse_faults([spec], seed=0, steps=steps)
