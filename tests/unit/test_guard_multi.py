"""``Guard`` over several optimizers and models: ``GradScaler``'s multi-optimizer semantics.

Each optimizer is skipped only when its own gradients are non-finite; the one loss scale backs
off when any was; the records name the optimizers stepped and skipped. Checked against PyTorch's
own ``test_grad_scaling_multiple`` (ported), against hand-written canonical loops bit for bit (two
optimizers over one model; a GAN alternating two optimizers), and at the edges: a partial skip
clips only what is applied, schedulers hold per optimizer, misuse raises.
"""

from __future__ import annotations

import csv
from itertools import chain

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import CsvSink, Guard, SkipLog, StepLog

INF = float("inf")


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


# ------------------------------------------------ PyTorch's test_grad_scaling_multiple, on Guard


def _scaling_models(device: str = "cpu"):
    # as PyTorch's _create_scaling_models_optimizers: a control and a scaling copy, SGD lr 1.0
    mod_control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(device)
    mod_scaling = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)
    return (mod_control, mod_scaling, torch.optim.SGD(mod_control.parameters(), lr=1.0),
            torch.optim.SGD(mod_scaling.parameters(), lr=1.0))


@pytest.mark.parametrize("enabled", [True, False])
def test_pytorch_grad_scaling_multiple_ported_onto_guard(enabled):
    # test/test_torch.py::test_grad_scaling_multiple: 2 models, 2 optimizers, both receiving
    # gradients from 2 losses; an inf injected into model1's gradient at skip_iter must skip
    # optimizer1 only, and the scale grows 3 times and backs off once (growth_interval=1).
    torch.manual_seed(0)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    skip_iter = 2
    mod_control0, mod_scaling0, opt_control0, opt_scaling0 = _scaling_models()
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _scaling_models()
    loss_fn = nn.MSELoss()

    guard = Guard([mod_scaling0, mod_scaling1], [opt_scaling0, opt_scaling1],
                  precision="fp16" if enabled else "fp32", max_norm=None,
                  scaler=dict(init_scale=128.0, growth_factor=2.0, growth_interval=1) if enabled else None)

    records = []
    for i, (x, target) in enumerate(data):
        # the control: no scaling; optimizer1 does not step at skip_iter
        opt_control0.zero_grad()
        opt_control1.zero_grad()
        out0, out1 = mod_control0(x), mod_control1(x)
        loss0 = loss_fn(0.3 * out0 + 0.7 * out1, target)
        loss1 = loss_fn(0.6 * out0 - 0.4 * out1, target)
        loss0.backward(retain_graph=True)
        loss1.backward()
        opt_control0.step()
        if not enabled or i != skip_iter:
            opt_control1.step()

        # the guard: the same forward (no autocast in the original), two losses, one backward call each
        out0, out1 = mod_scaling0(x), mod_scaling1(x)
        guard.backward(loss_fn(0.3 * out0 + 0.7 * out1, target), loss_fn(0.6 * out0 - 0.4 * out1, target))
        if i == skip_iter and enabled:
            mod_scaling1[1].weight.grad.data.fill_(INF)
        records.append(guard.step())

    expected_scale = 128.0 * 2.0**3 * 0.5**1 if enabled else 1.0
    assert guard.scaler.get_scale() == expected_scale
    for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                    chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)

    # and what the guard says about it
    assert [r.optimizers for r in records] == [("0", "1")] * 4
    assert [r.skipped_optimizers for r in records] == [(), (), ("1",) if enabled else (), ()]
    assert [r.skipped for r in records] == [False, False, enabled, False]
    assert guard.applied == {"0": 4, "1": 3 if enabled else 4}
    assert guard.updates == (3 if enabled else 4) and guard.steps == 4


# --------------------------------------------- two optimizers over one model, bit for bit


class Tagger(nn.Module):
    """An embedding table with its own optimizer (as people give embeddings one), and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _tagger_data(n: int):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 16, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(n)]


def _tagger_optimizers(model: Tagger):
    return {"emb": torch.optim.SGD(model.emb.parameters(), lr=0.5, momentum=0.9),
            "head": torch.optim.AdamW(model.head.parameters(), lr=1e-2)}


AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def canonical_two_optimizers(precision: str, accum: int, data, *, max_norm: float, inf_in: str | None = None,
                             inf_at: int | None = None):
    """The hand-written loop: one GradScaler, unscale_ each, clip what steps, scaler.step each."""
    model = Tagger()
    opts = _tagger_optimizers(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=precision == "fp16")
    history = []
    for i, (ids, y) in enumerate(data):
        with torch.autocast("cpu", dtype=AUTOCAST.get(precision, torch.float32), enabled=precision != "fp32"):
            logits = model(ids)
        loss = F.cross_entropy(logits.float(), y)
        scaler.scale(loss / accum if accum > 1 else loss).backward()
        if (i + 1) % accum:
            continue
        if inf_at == (i + 1) // accum:
            next(opts[inf_in].param_groups[0]["params"].__iter__()).grad.fill_(INF)
        for opt in opts.values():
            scaler.unscale_(opt)
        bad = {n for n, o in opts.items()
               if not all(torch.isfinite(p.grad).all() for p in o.param_groups[0]["params"])}
        steppers = [p for n, o in opts.items() if n not in bad for p in o.param_groups[0]["params"]]
        if steppers:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if any(p is q for q in steppers)], max_norm)
        for opt in opts.values():
            scaler.step(opt)
        scaler.update()
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        history.append((sorted(bad), scaler.get_scale()))
    return model, history


def guarded_two_optimizers(precision: str, accum: int, data, *, max_norm: float, inf_in: str | None = None,
                           inf_at: int | None = None, head_first: bool = False):
    model = Tagger()
    opts = _tagger_optimizers(model)
    if head_first:  # the optimizers named in another order than their parameters stand in the model
        opts = dict(reversed(opts.items()))
    guard = Guard(model, opts, precision=precision, max_norm=max_norm, accumulation_steps=accum,
                  scaler=dict(init_scale=2.0**10))
    records = []
    for i, (ids, y) in enumerate(data):
        with guard.autocast():
            logits = model(ids)
        guard.backward(F.cross_entropy(logits.float(), y))
        if (i + 1) % accum == 0 and inf_at == (i + 1) // accum:  # the group is about to close
            next(iter(opts[inf_in].param_groups[0]["params"])).grad.fill_(INF)
        if (record := guard.step()) is not None:
            records.append(record)
    return model, guard, records


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("head_first", [False, True])
def test_two_optimizers_over_one_model_are_bit_for_bit_the_canonical_loop(precision, accum, head_first):
    data = _tagger_data(6 * accum)
    ref, history = canonical_two_optimizers(precision, accum, data, max_norm=0.3)
    model, guard, records = guarded_two_optimizers(precision, accum, data, max_norm=0.3, head_first=head_first)
    assert_same(model, ref)
    assert [float(r.scaler_scale) for r in records] == [scale for _, scale in history]
    assert not any(r.skipped for r in records) and guard.applied == {"emb": 6, "head": 6}
    # the norm reported is the global one over both optimizers' parameters, clipped to 0.3
    norms = [(float(r.grad_l2_pre_clip), float(r.grad_l2_post_clip)) for r in records]
    assert any(pre > 0.3 for pre, _ in norms)
    assert all(post == pytest.approx(min(pre, 0.3), rel=1e-5) for pre, post in norms)


@pytest.mark.parametrize("accum", [1, 2])
def test_an_overflow_in_one_optimizer_skips_it_alone_and_clips_the_rest_by_their_own_norm(accum):
    data = _tagger_data(5 * accum)
    ref, history = canonical_two_optimizers("fp16", accum, data, max_norm=0.3, inf_in="emb", inf_at=3)
    model, guard, records = guarded_two_optimizers("fp16", accum, data, max_norm=0.3, inf_in="emb", inf_at=3)
    assert_same(model, ref)
    assert [h[0] for h in history] == [[], [], ["emb"], [], []]
    assert [float(r.scaler_scale) for r in records] == [scale for _, scale in history]
    third = records[2]
    assert isinstance(third, SkipLog) and third.reason == "non_finite_grad"
    assert third.skipped_optimizers == ("emb",) and third.optimizers == ("emb", "head")
    assert float(third.grad_l2_pre_clip) == INF  # the honest global norm: something overflowed
    assert 0 < float(third.grad_l2_post_clip) <= 0.3  # the head's update, clipped by its own norm
    assert guard.applied == {"emb": 4, "head": 5} and guard.updates == 4
    assert float(records[1].scaler_scale) / float(third.scaler_scale) == 2.0  # one back-off


def test_a_non_finite_loss_skips_every_optimizer_it_would_have_stepped():
    model = Tagger()
    opts = _tagger_optimizers(model)
    guard = Guard(model, opts, precision="bf16", max_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    ids, y = _tagger_data(1)[0]
    with guard.autocast():
        logits = model(ids)
    guard.backward(F.cross_entropy(logits.float(), y), logits.float().sum() * float("nan"))  # a second loss is nan
    record = guard.step()
    assert record.reason == "non_finite_loss" and record.skipped_optimizers == ("emb", "head")
    assert record.grad_l2_pre_clip is None and record.grad_l2_post_clip is None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()) and guard.applied == {"emb": 0, "head": 0}


# ------------------------------------------------------- a GAN: two models, alternating steps


def _gan():
    torch.manual_seed(11)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999))
    return gen, disc, opt_g, opt_d


def _gan_data(n: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 2, generator=g) * 0.5 + 2.0, torch.randn(16, 4, generator=g),
             torch.randn(16, 4, generator=g)) for _ in range(n)]


def _d_loss(disc, real, fake):
    real_logit, fake_logit = disc(real), disc(fake)
    return (F.binary_cross_entropy_with_logits(real_logit.float(), torch.ones_like(real_logit, dtype=torch.float32))
            + F.binary_cross_entropy_with_logits(fake_logit.float(), torch.zeros_like(fake_logit, dtype=torch.float32)))


def _g_loss(disc, fake):
    logit = disc(fake)
    return F.binary_cross_entropy_with_logits(logit.float(), torch.ones_like(logit, dtype=torch.float32))


def canonical_gan(data, *, inf_at: int, max_norm: float = 1.0):
    """The GradScaler GAN recipe: one scaler, zero_grad before each backward, update after each step."""
    gen, disc, opt_g, opt_d = _gan()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scales = []
    for i, (real, z_d, z_g) in enumerate(data):
        for opt, model, loss_of in ((opt_d, disc, lambda: _d_loss(disc, real, gen(z_d).detach())),
                                    (opt_g, gen, lambda: _g_loss(disc, gen(z_g)))):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of()
            scaler.scale(loss).backward()
            if model is gen and i == inf_at:
                gen[2].weight.grad.fill_(INF)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return gen, disc, opt_g, scales


def test_a_gan_skips_only_the_overflowing_optimizer_bit_for_bit_the_gradscaler_recipe():
    data = _gan_data(5)
    ref_gen, ref_disc, ref_opt_g, scales = canonical_gan(data, inf_at=2)

    gen, disc, opt_g, opt_d = _gan()
    sched_g = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda n: 1.0 / (1 + n))
    sched_d = torch.optim.lr_scheduler.LambdaLR(opt_d, lambda n: 1.0 / (1 + n))
    guard = Guard({"generator": gen, "discriminator": disc}, {"discriminator": opt_d, "generator": opt_g},
                  precision="fp16", max_norm=1.0, scaler=dict(init_scale=2.0**8), scheduler=[sched_g, sched_d])
    records = []
    for i, (real, z_d, z_g) in enumerate(data):
        with guard.autocast():
            d_loss = _d_loss(disc, real, gen(z_d).detach())
        guard.backward(d_loss)
        records.append(guard.step("discriminator"))
        with guard.autocast():
            g_loss = _g_loss(disc, gen(z_g))  # also leaves gradients in the discriminator: dropped
        guard.backward(g_loss)
        if i == 2:
            gen[2].weight.grad.fill_(INF)
        records.append(guard.step(opt_g))  # an optimizer object names itself

    # (the control has no schedules, so parameters differ; the next test compares them without)
    assert [float(r.scaler_scale) for r in records] == scales
    assert [r.optimizers for r in records] == [("discriminator",), ("generator",)] * 5
    assert [r.skipped_optimizers for r in records] == [()] * 5 + [("generator",)] + [()] * 4
    assert records[5].step == 6 and records[5].reason == "non_finite_grad"
    assert guard.applied == {"discriminator": 5, "generator": 4}
    # each scheduler held on its own optimizer's skip only
    assert sched_d.last_epoch == 5 and sched_g.last_epoch == 4
    assert opt_g.state[gen[0].weight]["step"] == 4 and opt_d.state[disc[0].weight]["step"] == 5


def test_a_gan_without_schedules_equals_the_recipe_bit_for_bit():
    data = _gan_data(5)
    ref_gen, ref_disc, ref_opt_g, scales = canonical_gan(data, inf_at=2)
    gen, disc, opt_g, opt_d = _gan()
    guard = Guard([gen, disc], {"discriminator": opt_d, "generator": opt_g}, precision="fp16", max_norm=1.0,
                  scaler=dict(init_scale=2.0**8))
    for i, (real, z_d, z_g) in enumerate(data):
        with guard.autocast():
            d_loss = _d_loss(disc, real, gen(z_d).detach())
        guard.backward(d_loss)
        guard.step("discriminator")
        with guard.autocast():
            g_loss = _g_loss(disc, gen(z_g))
        guard.backward(g_loss)
        if i == 2:
            gen[2].weight.grad.fill_(INF)
        guard.step("generator")
    assert_same(gen, ref_gen)
    assert_same(disc, ref_disc)
    assert guard.scaler.get_scale() == scales[-1]


def test_the_csv_names_the_optimizers_stepped_and_skipped(tmp_path):
    gen, disc, opt_g, opt_d = _gan()
    guard = Guard([gen, disc], {"d": opt_d, "g": opt_g}, precision="bf16", max_norm=None)
    assert guard.record_columns == ("optimizers", "skipped_optimizers")
    sink = CsvSink(tmp_path / "steps.csv", extra_columns=guard.record_columns)
    real, z, _ = _gan_data(1)[0]
    with guard.autocast():
        loss = _d_loss(disc, real, gen(z).detach())
    guard.backward(loss)
    sink.write(guard.step("d"))
    with guard.autocast():
        loss = _g_loss(disc, gen(z))
    guard.backward(loss)
    gen[0].bias.grad.fill_(float("nan"))
    sink.write(guard.step("g"))
    sink.close()
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert [(r["optimizers"], r["skipped"], r["skipped_optimizers"]) for r in rows] == [("d", "0", ""), ("g", "1", "g")]


def test_a_csv_without_the_optimizer_columns_refuses_a_record_of_several(tmp_path):
    # without extra_columns=guard.record_columns a partial skip was a row "skipped=1" with a post-clip
    # norm (the applied optimizer's), which optimizer skipped unsaid
    gen, disc, opt_g, opt_d = _gan()
    guard = Guard([gen, disc], {"d": opt_d, "g": opt_g}, precision="bf16", max_norm=None)
    sink = CsvSink(tmp_path / "steps.csv")
    real, z, _ = _gan_data(1)[0]
    with guard.autocast():
        loss = _d_loss(disc, real, gen(z).detach())
    guard.backward(loss)
    with pytest.raises(ValueError, match=r"a record of a guard over several optimizers \(this step's: d\) needs the "
                                         r"columns saying which skipped: CsvSink\(path, extra_columns=guard.record_columns\)"):
        sink.write(guard.step("d"))
    sink.close()
    assert (tmp_path / "steps.csv").read_text().count("\n") == 1  # the header alone


def test_one_optimizer_keeps_the_eight_columns_and_no_labels():
    model = nn.Linear(2, 1)
    guard = Guard(model, [torch.optim.SGD(model.parameters(), lr=0.1)], precision="fp32")
    assert guard.record_columns == () and guard.optimizer is guard.optimizers["0"]
    guard.backward(model(torch.ones(1, 2)).sum())
    record = guard.step()
    assert isinstance(record, StepLog) and record.optimizers == () and guard.applied == {"0": 1}


# ----------------------------------------------------------------------------- misuse, state


def _two():
    model = Tagger()
    return model, Guard(model, _tagger_optimizers(model), precision="fp32", max_norm=None, accumulation_steps=2)


def _backward(model, guard):
    ids, y = _tagger_data(1)[0]
    with guard.autocast():
        loss = F.cross_entropy(model(ids), y)
    guard.backward(loss)


def test_stepping_other_optimizers_inside_a_group_raises():
    model, guard = _two()
    _backward(model, guard)
    assert guard.step("emb") is None
    _backward(model, guard)
    with pytest.raises(RuntimeError, match=r"names optimizers \['head'\] inside a group begun with \['emb'\]"):
        guard.step("head")
    assert guard.step("emb") is not None  # the same names close it


def test_an_unknown_optimizer_name_raises_naming_the_known_ones():
    model, guard = _two()
    _backward(model, guard)
    with pytest.raises(ValueError, match=r"'decoder' is not one of this guard's optimizers \['emb', 'head'\]"):
        guard.step("decoder")
    with pytest.raises(ValueError, match="'SGD' is not one of"):
        guard.step(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))


def test_a_parameter_in_two_optimizers_is_refused_naming_it():
    model = Tagger()
    with pytest.raises(ValueError, match=r"^parameter 'emb.weight' is in optimizers 'a' and 'b'; its gradient "
                                         r"would be unscaled twice"):
        Guard(model, {"a": torch.optim.SGD(model.parameters(), lr=0.1),
                      "b": torch.optim.SGD(model.emb.parameters(), lr=0.1)})


def test_refused_up_front_one_line_each():
    model = Tagger()
    opts = _tagger_optimizers(model)
    with pytest.raises(ValueError, match="^optimizer 'head' is a list, not an optimizer"):
        Guard(model, {"emb": opts["emb"], "head": [opts["head"]]})
    with pytest.raises(ValueError, match="^sync_free takes one optimizer"):
        Guard(model, opts, precision="fp32", sync_free=True)
    other = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="^scheduler LambdaLR drives none of the guard's optimizers"):
        Guard(model, opts, precision="fp32", scheduler=torch.optim.lr_scheduler.LambdaLR(other, lambda n: 1.0))
    with pytest.raises(ValueError, match=r"^scheduler 'tail' names no optimizer; the optimizers are \['emb', 'head'\]"):
        Guard(model, opts, precision="fp32", scheduler={"tail": object()})
    with pytest.raises(ValueError, match="^model must be an nn.Module or a list/dict of them, got str"):
        Guard([model, "disc"], opts, precision="fp32")
    from ampguard import AmpTrainState
    with pytest.raises(ValueError, match="^AmpTrainState calls model\\(inputs\\): pass one module"):
        AmpTrainState([model], opts, F.cross_entropy, precision="fp32")


def test_the_optimizers_the_guard_read_cannot_be_swapped_or_added_to():
    # the dict was the guard's own and writable: an optimizer put in it later was half known to the
    # step (no counter, no parameters read), one swapped in was stepped with the old one's checks
    model = Tagger()
    opts = _tagger_optimizers(model)
    guard = Guard(model, opts, precision="fp32")
    for optimizers in (guard.optimizers, guard.optimizer):
        with pytest.raises(TypeError):
            optimizers["tail"] = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    assert dict(guard.optimizers) == opts
    opts.pop("head")  # the dict passed in stays the caller's: the guard holds a copy of it
    assert list(guard.optimizers) == ["emb", "head"]


def test_state_dict_keeps_each_optimizers_count_and_refuses_other_optimizers():
    model, guard = _two()
    for _ in range(2):
        _backward(model, guard)
        guard.step("emb")
    state = guard.state_dict()
    assert state["applied"] == {"emb": 1, "head": 0} and state["updates"] == 1

    model2, resumed = _two()
    resumed.load_state_dict(state)
    assert resumed.applied == {"emb": 1, "head": 0} and resumed.steps == 1

    single = nn.Linear(2, 1)
    one = Guard(single, torch.optim.SGD(single.parameters(), lr=0.1), precision="fp32", accumulation_steps=2)
    with pytest.raises(ValueError, match=r"saved with optimizers \['emb', 'head'\], this step has \['optimizer'\]"):
        one.load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with optimizers \['optimizer'\], this step has \['emb', 'head'\]"):
        resumed.load_state_dict(one.state_dict())


def test_each_optimizers_norm_comes_from_the_one_pass_over_the_gradients():
    # the global norm's per-parameter norms give each optimizer's own (its skip detector): one
    # foreach norm a step, not one more per optimizer; a culprit is still found alone
    class Count(torch.overrides.TorchFunctionMode):
        passes = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch._foreach_norm:
                Count.passes += 1
            return func(*args, **(kwargs or {}))

    first, second = nn.Linear(3, 3), nn.Linear(3, 1)
    guard = Guard([first, second], {"first": torch.optim.SGD(first.parameters(), lr=0.1),
                                    "second": torch.optim.SGD(second.parameters(), lr=0.1)}, precision="fp32")
    second.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    guard.backward(second(first(torch.ones(2, 3))).sum())
    with Count():
        record = guard.step()
    assert Count.passes == 1
    assert record.skipped and record.skipped_optimizers == ("second",)


def test_the_records_scale_follows_a_found_inf_that_unscale_recorded_for_an_unstepped_or_cleaned_optimizer():
    """update() backs off for every found-inf flag unscale_ recorded, not only for the step's
    skips: an optimizer unscaled (guard.unscale_()) but not stepped, whose gradient overflowed;
    and the step skips an optimizer whose gradients a hook cleaned after unscale_ found them
    non-finite (GradScaler.step skips on what unscale_ found; the guard applied the clamped
    gradients, a record "applied" beside a backed-off scale). The record's scale (told on the
    host from the step's one read) is the scaler's all the same."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    guard = Guard([gen, disc], {"gen": torch.optim.SGD(gen.parameters(), lr=0.1),
                                "disc": torch.optim.SGD(disc.parameters(), lr=0.1)},
                  precision="fp16", scaler=dict(init_scale=512.0))
    with guard.autocast():
        loss = disc(gen(torch.ones(1, 2))).sum()
    guard.backward(loss)
    disc.weight.grad[0, 0] = float("inf")
    guard.unscale_()
    record = guard.step("gen")
    assert not record.skipped and guard.scaler.get_scale() == 256.0
    assert record.values()["scaler_scale"] == 256.0

    model = nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=dict(init_scale=512.0))
    with guard.autocast():
        loss = model(torch.ones(1, 2)).sum()
    guard.backward(loss)
    model.weight.grad[0, 0] = float("inf")
    guard.unscale_()
    for p in model.parameters():  # (a framework hook's clean-up after unscale_)
        p.grad.nan_to_num_(0.0, 0.0, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    record = guard.step()
    assert (record.skipped, record.reason, guard.scaler.get_scale()) == (True, "non_finite_grad", 256.0)
    assert record.values()["scaler_scale"] == 256.0 and record.values()["grad_l2_pre_clip"] == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
