"""Headroom telemetry and the per-parameter gradient norms of a skipped step (ampguard.headroom),
on real models through the real guarded step: an overflow announced before it happens, underflow
seen (and cured by the loss scale), hooks only where they belong, host reads only where promised,
the CSV's resume rules."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import HostReads

from ampguard.errors import InputError
from ampguard.headroom import (FORMATS, HEADROOM_COLUMNS, Headroom, HeadroomCsv, SkipGradNorms, headroom_bits,
                               read_headroom_csv)
from ampguard.records import StepLog
from ampguard.step import AmpTrainState


def test_the_format_table_holds_fp16_bf16_and_both_fp8_formats():
    assert FORMATS["fp16"].max == 65504.0 and FORMATS["fp16"].tiny == 2.0**-14
    assert FORMATS["bf16"].max == pytest.approx(3.3895e38, rel=1e-4) and FORMATS["bf16"].tiny == 2.0**-126
    assert FORMATS["fp8_e4m3"].max == 448.0 and FORMATS["fp8_e4m3"].tiny == 2.0**-6
    assert FORMATS["fp8_e5m2"].max == 57344.0 and FORMATS["fp8_e5m2"].tiny == 2.0**-14
    assert headroom_bits(448.0 / 16, FORMATS["fp8_e4m3"]) == 4.0
    assert headroom_bits(57344.0, FORMATS["fp8_e5m2"]) == 0.0


def _ramp_model() -> nn.Module:
    """``fc1`` then a LayerNorm: only fc1's output grows with its weight; what follows stays put."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(2, 8), norm=nn.LayerNorm(8), fc2=nn.Linear(8, 1)))


def test_a_layer_growing_to_overflow_fp16_is_announced_before_the_first_skip_and_named():
    model = _ramp_model()
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.functional.mse_loss,
                          precision="fp16", scaler={"init_scale": 1.0})
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0, scaled_grads=True)
    with torch.no_grad():
        model.fc1.weight.mul_(16.0)  # a head start: fewer (slow, fp16 on a CPU) steps to the overflow
    x, y = torch.ones(4, 2), torch.zeros(4, 1)
    alerts, first_skip, fc1_bits = [], None, []
    for step in range(1, 40):
        with torch.no_grad():
            model.fc1.weight.mul_(2.0)  # one doubling a step: one bit of headroom lost a step
        with headroom.measuring(step):
            record = state.step(x, y)
        alerts += [e for e in headroom.observe(record) if e.kind == "headroom_alert"]
        fc1_bits.append(next(r.headroom_bits for r in headroom.read(step) if (r.module, r.tensor) == ("fc1", "output")))
        if record.skipped:
            first_skip = step
            break
    assert first_skip is not None and first_skip > 6
    assert alerts, "no headroom alert before the overflow"
    first = alerts[0]
    assert first.data["module"] == "fc1" and first.data["tensor"] == "output" and "fc1" in first.message
    assert first.step <= first_skip - 3  # k = 3 steps of warning at one bit a step and alert_bits 4
    assert all(e.data["module"] == "fc1" for e in alerts)  # the layers after the norm never come close
    drops = [a - b for a, b in zip(fc1_bits[:-2], fc1_bits[1:-1])]
    assert all(d == pytest.approx(1.0, abs=0.05) for d in drops[3:])  # one bit a step, as the weight doubles


def _underflow_share(init_scale: float) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4)))
    tiny_loss = lambda out, y: nn.functional.mse_loss(out, y) * 1e-3  # noqa: E731 - grads ~1e-5: below fp16's normals
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.0), tiny_loss, precision="fp16",
                          scaler={"init_scale": init_scale})
    headroom = Headroom(model, "fp16", every=1, alert_bits=0.0, scaled_grads=True)
    with headroom.measuring(1):
        state.step(torch.randn(16, 4), torch.randn(16, 4))
    grad = next(r for r in headroom.read(1) if r.tensor == "grad")
    assert grad.module == "fc" and math.isfinite(grad.headroom_bits)
    return grad.underflow_share


def test_gradients_that_underflow_fp16_show_their_share_and_the_loss_scale_lifts_them_out():
    assert _underflow_share(init_scale=1.0) > 0.9  # unscaled: subnormal (or flushed) in fp16
    assert _underflow_share(init_scale=2.0**16) == 0.0  # what the loss scale is for


def test_hooks_live_only_during_a_measured_step_even_when_it_fails():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    headroom = Headroom(model, "bf16", every=3, alert_bits=4.0)
    hooked = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    with headroom.measuring(2):
        assert hooked() == 0  # not a measured step: nothing installed
        model(torch.ones(1, 2)).sum().backward()
    assert headroom.read(2) == []
    with pytest.raises(RuntimeError, match="boom"), headroom.measuring(3):
        assert hooked() == 2
        raise RuntimeError("boom")
    assert hooked() == 0


def test_an_unmeasured_applied_step_adds_no_host_read_and_a_skipped_one_reads_once():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
                          precision="bf16")
    headroom, norms = Headroom(model, "bf16", every=10, alert_bits=4.0), SkipGradNorms(model).attach(state)
    x, y = torch.ones(4, 2), torch.zeros(4, 1)
    with HostReads() as bare:
        state.step(x, y)
    with HostReads() as watched:
        with norms.capturing(), headroom.measuring(2):
            record = state.step(x, y)
        assert headroom.observe(record) == [] and norms.after(record) is None
    assert watched.count == bare.count == 1  # the step's own skip decision, nothing more
    with HostReads() as skipped:
        with norms.capturing():
            record = state.step(torch.full((4, 2), float("inf")), y)
        event = norms.after(record)
    assert record.skipped and event is not None and skipped.count == bare.count + 1


def test_skipped_step_norms_name_the_non_finite_gradient_in_backward_order_learned_at_the_first_step():
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 3), b=nn.Linear(3, 3), c=nn.Linear(3, 1)))
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
                          precision="fp32", accumulation_steps=2)
    poison = {"on": False}
    model.b.weight.register_hook(lambda g: g.fill_(float("nan")) if poison["on"] else None)
    norms = SkipGradNorms(model).attach(state)
    x, y = torch.ones(2, 3), torch.zeros(2, 1)
    with norms.capturing():
        state.step(x, y)
        record = state.step(x, y)
    assert not record.skipped and norms.after(record) is None
    with norms.capturing():  # backward's order is known after the first step: no hooks any more
        assert not model.a.weight._post_accumulate_grad_hooks
        state.step(x, y)
        poison["on"] = True  # the group's second micro-batch
        record = state.step(x, y)
    event = norms.after(record)
    assert record.skipped and event["step"] == 2 and event["reason"] == "non_finite_grad"
    order = list(event["norms"])  # backward finishes the last layer's gradients first
    assert set(order[:2]) == {"c.weight", "c.bias"} and set(order[2:4]) == {"b.weight", "b.bias"}
    assert set(order[4:]) == {"a.weight", "a.bias"}
    assert event["non_finite"] == ["b.weight"] and "b.weight" in event["message"]
    assert math.isnan(event["norms"]["b.weight"]) and math.isfinite(event["norms"]["c.weight"])


def _events_of_outputs(headroom: Headroom, model: nn.Module, weights: list[float]) -> list[list[str]]:
    """The events of one measured forward a step, ``fc``'s output (its weight x 1) at each weight."""
    kinds = []
    for step, weight in enumerate(weights, start=1):
        model.fc.weight.data.fill_(weight)
        with headroom.measuring(step):
            model(torch.ones(1, 1))
        kinds.append([e.kind for e in headroom.observe_step(step)])
    return kinds


def test_alert_once_per_episode_clear_when_back_and_the_state_round_trips():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 1, bias=False)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    kinds = _events_of_outputs(headroom, model, [1.0, 8000.0, 9000.0, 1.0, 8000.0])
    assert kinds == [[], ["headroom_alert"], [], ["headroom_clear"], ["headroom_alert"]]
    again = Headroom(model, "fp16", every=1, alert_bits=4.0)
    again.load_state_dict(headroom.state_dict())
    with again.measuring(6):
        model(torch.ones(1, 1))
    assert again.observe_step(6) == []  # still the same episode after a resume


def _rows_at(headroom: Headroom, model: nn.Module, step: int) -> None:
    with headroom.measuring(step):
        model(torch.ones(1, 1))


def test_headroom_csv_appends_on_resume_without_duplicates_and_never_overwrites(tmp_path):
    model = nn.Linear(1, 1)
    headroom = Headroom(model, "bf16", every=1, alert_bits=4.0)
    path = tmp_path / "headroom.csv"
    log = lambda step: StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0,  # noqa: E731
                               scaler_scale=1.0)
    sink = HeadroomCsv(path, headroom)
    for step in (1, 2, 3):
        _rows_at(headroom, model, step)
        sink.write(log(step))
        assert [r.step for r in read_headroom_csv(path)][-1] == step  # flushed when written
    sink.close()
    with pytest.raises(InputError, match="refusing to overwrite"):
        HeadroomCsv(path, headroom)
    sink = HeadroomCsv(path, headroom, append=True, keep_through=2)  # resumed from step 2
    for step in (3, 4):
        _rows_at(headroom, model, step)
        sink.write(log(step))
    sink.close()
    assert [r.step for r in read_headroom_csv(path)] == [1, 1, 2, 2, 3, 3, 4, 4]  # (input, output)
    assert path.read_text().count(",".join(HEADROOM_COLUMNS)) == 1
    path.write_text("step,lr\n1,0.1\n")
    with pytest.raises(InputError, match="header does not match"):
        HeadroomCsv(path, headroom, append=True, keep_through=1)


def test_grad_norms_switched_off_install_nothing_and_report_nothing():
    model = nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, precision="fp32")
    norms = SkipGradNorms(model, enabled=False).attach(state)
    assert state.skip_hooks == []
    with norms.capturing():
        assert not model.weight._post_accumulate_grad_hooks
        record = state.step(torch.full((4, 2), float("nan")), torch.zeros(4, 1))
    assert record.skipped and norms.after(record) is None


def test_a_skip_at_the_very_first_step_is_reported_in_the_order_seen_so_far():
    # the skip hook runs inside the first step, while the order is still being learned
    model = nn.Sequential(OrderedDict(a=nn.Linear(3, 3), b=nn.Linear(3, 1)))
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
                          precision="fp32")
    model.a.weight.register_hook(lambda g: g.fill_(float("nan")))
    norms = SkipGradNorms(model).attach(state)
    with norms.capturing():
        record = state.step(torch.ones(2, 3), torch.zeros(2, 1))
    event = norms.after(record)
    assert record.skipped and event["non_finite"] == ["a.weight"]
    assert list(event["norms"])[:2] in (["b.bias", "b.weight"], ["b.weight", "b.bias"])  # the last layer first
    assert list(event["norms"]) == norms.order and set(norms.order[2:]) == {"a.weight", "a.bias"}


class _CountNorms(torch.overrides.TorchFunctionMode):
    """Counts the passes over the gradients a step makes for norms: a foreach norm over them
    all, or the per-gradient norms the event would take itself (``vector_norm`` in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.passes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._foreach_norm or (func is torch.linalg.vector_norm and (kwargs or {}).get("dtype")):
            self.passes += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sync_free", [False, True])
def test_the_skip_norms_are_the_ones_the_global_norm_took(sync_free):
    # one pass over the gradients a step: the global norm's per-parameter norms are the event's
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    lr = torch.tensor(0.1) if sync_free else 0.1
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=sync_free or None)
    state = AmpTrainState(model, opt, nn.functional.mse_loss, precision="bf16", sync_free=sync_free,
                          **({"lr_schedule": lambda updates: torch.ones(())} if sync_free else {}))
    _ = model[1].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
    norms = SkipGradNorms(model).attach(state)
    with norms.capturing():
        state.step(torch.ones(4, 2), torch.zeros(4, 1))  # learns backward's order
    with _CountNorms() as count:
        record = state.step(torch.ones(4, 2), torch.zeros(4, 1))
    event = norms.after(record)
    assert count.passes == 1
    assert record.skipped and event["non_finite"] == ["1.weight"]
    grads = {n: p.grad for n, p in model.named_parameters()}  # dropped by the step: None
    assert all(g is None for g in grads.values())
    assert [math.isfinite(v) for v in event["norms"].values()] == [n != "1.weight" for n in event["norms"]]


# ---------------------------------------------------------------------------- what the alert judges


def test_a_weight_gradient_summed_over_the_batch_is_measured_and_alerts_where_the_output_gradient_does_not():
    # a Linear's weight gradient sums over the batch: 64 rows of 100 make it 6400, 3.4 bits from
    # fp16's max, while the gradient flowing into its output is 1.0 (16 bits): only the
    # parameter's gradient tells the layer is close
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 1, bias=False)))
    model.fc.weight.data.fill_(1.0)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.full((64, 1), 100.0)).sum().backward()
    rows = {r.tensor: r for r in headroom.read(1)}
    assert rows["grad"].amax == 1.0 and rows["param_grad"].amax == 6400.0
    (alert,) = headroom.observe_step(1)
    assert alert.data["tensor"] == "param_grad" and "fc param_grad headroom 3.4 bits" in alert.message


def _scaled_step(headroom: Headroom, model: nn.Module, step: int, weight: float, scale: float) -> list:
    """One measured step whose backward carries the loss scale ``scale`` (as GradScaler's does)."""
    model.fc.weight.data.fill_(weight)
    with headroom.measuring(step):
        (model(torch.ones(1, 1)).sum() * scale).backward()
    model.zero_grad()
    return [e.kind for e in headroom.observe_step(step)]


def test_under_a_loss_scale_the_gradients_alert_on_their_unscaled_headroom():
    # the scaled gradient near (or past) fp16's max is the scaler's search, one skip; what warns
    # is the unscaled gradient close to the max, which no scale can fit. The scale is read with
    # the rows (a device tensor: no host read of its own)
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 1, bias=False)))
    scale = torch.tensor(2.0**15)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0, loss_scale=lambda: scale.clone())
    assert _scaled_step(headroom, model, 1, 1.0, 2.0**15) == []  # the scaled gradient 32768: 1 bit, no alert
    assert _scaled_step(headroom, model, 2, 1.0, 2.0**17) == []  # overflowed (inf) at 2**15: unknown, no alert
    scale.fill_(8.0)
    events = _scaled_step(headroom, model, 3, 1.0, 1e6)  # overflowed at a scale of 8: unscaled > 8188
    assert events == ["headroom_alert"]
    scale.fill_(2.0**15)
    assert _scaled_step(headroom, model, 4, 1.0, 2.0**15) == ["headroom_clear"]
    scale.fill_(2.0)
    model.fc.weight.data.fill_(1 / 1000)
    with headroom.measuring(5):  # input 1000, output 1; the weight's gradient 8000 unscaled (3 bits), 16000 scaled
        (model(torch.full((8, 1), 1000.0)).sum() * 2.0).backward()
    (alert,) = headroom.observe_step(5)
    assert alert.data["tensor"] == "param_grad"
    assert alert.data["judged_bits"] == pytest.approx(math.log2(65504 / 8000), abs=1e-3)
    assert "without the loss scale" in alert.message and "8000 unscaled, 1.6e+04 at loss scale 2" in alert.message


def test_an_alert_clears_only_a_bit_above_the_threshold_so_a_value_at_it_alerts_once():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 1, bias=False)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    # 65504 / 2**4 = 4094: 4500 is below the threshold, 3500 above it but within the 1-bit margin
    kinds = _events_of_outputs(headroom, model, [4500.0, 3500.0, 4500.0, 3500.0, 1000.0])
    assert kinds == [["headroom_alert"], [], [], [], ["headroom_clear"]]


def test_no_hook_outlives_a_measured_step_even_on_a_tensor_that_outlives_it():
    class Query(nn.Module):  # returns its own parameter: the output tensor lives on after the step
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.ones(2))

        def forward(self) -> torch.Tensor:
            return self.q

    model = Query()
    headroom = Headroom(model, "bf16", every=1, alert_bits=4.0)
    for step in range(1, 4):
        with headroom.measuring(step):
            model().sum().backward()
        headroom.read(step)
    assert not model.q._backward_hooks
    model().sum().backward()  # an unmeasured step: nothing measured, nothing kept
    assert headroom._stats == {}


def test_a_saved_alert_state_that_is_not_a_list_of_distinct_names_is_refused_naming_the_field():
    headroom = Headroom(nn.Linear(1, 1), "fp16", every=1, alert_bits=4.0)
    for bad in ("fc", ["fc", "fc"], [1], None):
        with pytest.raises(ValueError, match=r"^headroom\.alerting is .*, expected a list of distinct module names"):
            headroom.check_state({"alerting": bad}, "headroom.")
        with pytest.raises(ValueError):
            headroom.load_state_dict({"alerting": bad})
    with pytest.raises(ValueError, match="expected a mapping"):
        headroom.check_state([], "headroom.")


def test_a_torn_first_row_is_dropped_like_a_torn_last_one(tmp_path):
    path = tmp_path / "headroom.csv"
    path.write_text(",".join(HEADROOM_COLUMNS) + "\n1,(root),out", encoding="utf-8")
    assert read_headroom_csv(path) == []
    path.write_text(",".join(HEADROOM_COLUMNS) + "\n1,(root),out\n2,(root),output,1.0,16.0,0.0\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 2 is not a headroom row"):
        read_headroom_csv(path)


def test_the_heatmap_draws_a_gradient_as_the_alert_judges_it_and_an_overflow_dark_red():
    # review_frontier13: a healthy fp16 run (no skip, no ALERT) had its gradient rows painted
    # orange to dark red (their headroom with the loss scale in it), and an overflowed cell (-inf)
    # was drawn grey, the colour of "no data"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from ampguard.headroom import HeadroomRow
    from ampguard.report import headroom_panel

    rows = [HeadroomRow(s, "fc", t, 1.0, b, 0.0) for s, t, b in [
        (1, "output", 10.0), (1, "grad", 1.0), (2, "output", -math.inf), (2, "grad", 1.0)]]
    fig, ax = plt.subplots()
    try:
        scales = {1: 2.0**16, 2: 1.0}
        mesh = headroom_panel(fig, ax, rows, alert_bits=4.0, scale_at=scales.get)
        colour = mesh.to_rgba(mesh.get_array())
        value = mesh.get_array()
        assert value[1, 0] == 17.0 and value[1, 1] == 1.0  # 1 bit at scale 2**16 is 17 without it
        assert tuple(colour[0, 1]) == to_rgba("darkred")  # the forward overflow at step 2
        assert colour[1, 0][1] > colour[1, 0][0] and colour[1, 1][0] > colour[1, 1][1]  # green, then red
    finally:
        plt.close(fig)


def test_the_heatmap_ends_where_the_run_did():
    # measured every 10 steps on a 20-step run, the last column ran to step 25 and took the step
    # axis (shared by every panel of report.png) five steps past the run's end
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ampguard.headroom import HeadroomRow
    from ampguard.report import headroom_panel

    rows = [HeadroomRow(s, "fc", "output", 1.0, 8.0, 0.0) for s in (1, 11)]  # (measured at 1, 11, ...)
    fig, ax = plt.subplots()
    try:
        edges = headroom_panel(fig, ax, rows, run_steps=(1, 14)).get_coordinates()[0, :, 0]
        assert list(edges) == [0.5, 6.0, 14.5]  # (not -4 and 16: half a step past the run's first and last)
        edges = headroom_panel(fig, ax, rows, run_steps=(1, 40)).get_coordinates()[0, :, 0]
        assert list(edges) == [0.5, 6.0, 16.0]  # a run longer than its last measure: the column's own width
    finally:
        plt.close(fig)


def test_a_tied_parameter_is_measured_once_under_its_first_module():
    # charlm ties head.weight to tok.weight: both modules hooked it, and both rows showed the
    # same total gradient (twice the device work)
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            return self.dec(torch.relu(self.enc(x)))

    model = Tied()
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.randn(2, 4)).sum().backward()
    param_rows = [r.module for r in headroom.read(1) if r.tensor == "param_grad"]
    assert param_rows == ["enc"]
    expected = headroom_bits(model.enc.weight.grad.abs().max().item(), FORMATS["fp16"])
    assert next(r.headroom_bits for r in headroom.read(1) if r.tensor == "param_grad") == pytest.approx(expected)


def test_an_fp32_run_measures_its_headroom_against_fp16_unless_told_otherwise():
    # review_frontier13: against fp32 itself (126+ bits everywhere) a reference run could never warn
    from ampguard.build import build_headroom
    from ampguard.config import validate
    from ampguard.precision import GuardedGradScaler

    off = GuardedGradScaler("cpu", enabled=False)
    auto = build_headroom(validate({"precision": "fp32", "monitor": {"headroom": {"every": 1}}}), nn.Linear(2, 1), off)
    named = build_headroom(validate({"precision": "fp32", "monitor": {"headroom": {"every": 1, "format": "fp32"}}}),
                           nn.Linear(2, 1), off)
    assert (auto.format.name, named.format.name) == ("fp16", "fp32")


# ---------------------------------------------------------------------------- the matmul probe
# review_session26: an attention's logits q @ k.T overflow fp16 first in a transformer, and the
# softmax after them squashes them: every module's output kept 9-13 bits of headroom while the
# logits were 0.17 bits from 65504, and no ALERT came before the overflow (nor at it)


class _Attention(nn.Module):
    """Single-head attention with no parameters of its own: its logits are no module's output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.q(x) @ self.k(x).transpose(-2, -1)
        return torch.softmax(logits, dim=-1) @ self.v(x)


def _attention_model(gain: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(attn=_Attention(4), head=nn.Linear(4, 1)))
    with torch.no_grad():
        for lin in (model.attn.q, model.attn.k):
            lin.weight.copy_(torch.eye(4) * gain)
    return model


def test_an_attentions_logits_near_overflow_alert_where_every_module_output_is_far_from_it():
    model, x = _attention_model(gain=40.0), torch.full((1, 3, 4), 1.0)
    headroom = Headroom(model, "fp16", every=1, alert_bits=3.0)
    with headroom.measuring(1):
        model(x).sum().backward()
    rows = {(r.module, r.tensor): r for r in headroom.read(1)}
    logits = (model.attn.q(x) @ model.attn.k(x).transpose(-2, -1)).abs().max().item()  # 4 * 40 * 40
    assert rows[("attn", "matmul")].amax == logits == 6400.0
    assert rows[("attn", "matmul")].headroom_bits == pytest.approx(math.log2(65504 / 6400))
    assert all(r.headroom_bits > 9 for key, r in rows.items() if key != ("attn", "matmul"))
    assert headroom.observe_step(1) == []  # 3.36 bits: above the line
    headroom = Headroom(model, "fp16", every=1, alert_bits=3.0)
    with headroom.measuring(1):
        model(x * 2).sum().backward()  # (4 x the logits: 1.36 bits)
    events = headroom.observe_step(1)
    assert [(e.data["module"], e.data["tensor"]) for e in events] == [("attn", "matmul")]
    assert "attn matmul headroom 1.4 bits < alert_bits 3 (amax 2.56e+04, fp16 max 65504)" in events[0].message


class _SdpaAttention(nn.Module):
    """Multi-head attention through ``F.scaled_dot_product_attention``: its logits never leave the call."""

    def __init__(self, width: int, heads: int, kv_heads: int | None = None, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads or heads, causal
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * width * self.kv_heads // heads, bias=False)

    def split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, c = x.shape
        return x.view(b, t, heads, c // heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.kv(x).chunk(2, dim=-1)
        q, k, v = self.split(self.q(x), self.heads), self.split(k, self.kv_heads), self.split(v, self.kv_heads)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                             enable_gqa=self.kv_heads != self.heads)
        return y.transpose(1, 2).flatten(2)


def _sdpa_logits_by_hand(model: _SdpaAttention, x: torch.Tensor) -> torch.Tensor:
    k, _ = model.kv(x).chunk(2, dim=-1)
    q, k = model.split(model.q(x), model.heads), model.split(k, model.kv_heads)
    k = k.repeat_interleave(model.heads // model.kv_heads, dim=1)
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if model.causal:
        logits = logits.masked_fill(~torch.ones(x.size(1), x.size(1), dtype=torch.bool).tril(), 0)
    return logits


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_the_logits_inside_a_scaled_dot_product_attention_are_its_modules_matmul_row(kv_heads):
    # (the main job's model computes its attention so: before, no logits of it were ever measured)
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(attn=_SdpaAttention(8, heads=2, kv_heads=kv_heads), head=nn.Linear(8, 1)))
    x = torch.randn(2, 5, 8) * 30
    plain = model(x)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        probed = model(x)
        probed.sum().backward()
    assert torch.equal(probed, plain)  # (the call's own result, untouched)
    rows = {(r.module, r.tensor): r for r in headroom.read(1)}
    by_hand = _sdpa_logits_by_hand(model.attn, x).abs().max().item()
    assert rows[("attn", "matmul")].amax == pytest.approx(by_hand, rel=1e-5)
    assert not any(p.grad is None for p in model.parameters())


def test_a_causal_attentions_masked_logits_are_not_measured_and_its_overflow_is_an_alert():
    # queries shrink and keys grow along the sequence (q_i = 5 - i, k_j = j, times c in each of 4
    # dims): the largest product, q_1 . k_4, is one a causal mask hides; the largest used, q_2 . k_2
    # or q_3 . k_3, is 6/16 of it
    model = nn.Sequential(OrderedDict(attn=_SdpaAttention(4, heads=1), head=nn.Linear(4, 1)))
    with torch.no_grad():
        model.attn.q.weight.copy_(torch.tensor([[1.0, 0, 0, 0]]).expand(4, 4))
        model.attn.kv.weight.copy_(torch.cat([torch.tensor([[0, 1.0, 0, 0]]).expand(4, 4), torch.eye(4)]))
    i = torch.arange(1.0, 5.0)
    x = torch.stack([5 - i, i, torch.zeros(4), torch.zeros(4)], dim=-1).unsqueeze(0) * 50
    headroom = Headroom(model, "fp16", every=1, alert_bits=0.5)
    with headroom.measuring(1):
        model(x).sum().backward()
    row = next(r for r in headroom.read(1) if r.tensor == "matmul")
    assert row.amax == pytest.approx(4 * 6 * 50 * 50 / 2)  # (30000: the masked q_1 . k_4 is 80000)
    assert headroom.observe_step(1) == []  # (1.1 bits)
    headroom = Headroom(model, "fp16", every=1, alert_bits=0.5)
    with headroom.measuring(1):
        model(x * 2).sum().backward()  # (4x: 120000, past fp16's 65504)
    events = headroom.observe_step(1)
    assert [(e.data["module"], e.data["tensor"]) for e in events] == [("attn", "matmul")]
    assert next(r for r in headroom.read(1) if r.tensor == "matmul").headroom_bits < 0


def test_logits_under_autocast_are_computed_in_autocasts_dtype_as_the_call_ran():
    # fp16 autocast: a logit past 65504 is inf in the half product (what a math kernel computes)
    model = nn.Sequential(OrderedDict(attn=_SdpaAttention(4, heads=1, causal=False), head=nn.Linear(4, 1)))
    with torch.no_grad():
        model.attn.q.weight.copy_(torch.eye(4))
        model.attn.kv.weight.copy_(torch.cat([torch.eye(4), torch.eye(4)]))
    headroom = Headroom(model, "fp16", every=1, alert_bits=2.0)
    with headroom.measuring(1), torch.autocast("cpu", dtype=torch.float16):
        model(torch.full((1, 2, 4), 200.0))  # (each logit 4 * 200 * 200 / 2 = 80000)
    row = next(r for r in headroom.read(1) if r.tensor == "matmul")
    assert row.amax == math.inf and row.headroom_bits == -math.inf


def _mha_logits_by_hand(mha: nn.MultiheadAttention, x: torch.Tensor, kv: torch.Tensor,
                        hidden: torch.Tensor | None = None) -> torch.Tensor:
    # (batch first; the packed or separate projections; hidden: (length, source) True = not attended)
    e, h = mha.embed_dim, mha.num_heads
    if mha._qkv_same_embed_dim:
        w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e:2 * e]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    b = mha.in_proj_bias
    q = torch.nn.functional.linear(x, w_q, None if b is None else b[:e])
    k = torch.nn.functional.linear(kv, w_k, None if b is None else b[e:2 * e])
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.transpose(0, 1).expand(k.size(0), 1, e)], dim=1)
    split = lambda t: t.view(t.size(0), t.size(1), h, e // h).transpose(1, 2)  # noqa: E731
    logits = split(q) @ split(k).transpose(-2, -1) / math.sqrt(e // h)
    if hidden is not None:
        logits = logits.masked_fill(torch.nn.functional.pad(hidden, (0, logits.size(-1) - hidden.size(-1))), 0)
    return logits


@pytest.mark.parametrize("need_weights", [True, False])
def test_the_logits_inside_a_multihead_attention_are_its_matmul_row_its_causal_mask_left_out(need_weights):
    # nn.TransformerEncoderLayer's way: a float causal mask (-inf above the diagonal), batch first;
    # with need_weights=False the call runs SDPA inside, with it a bmm: unseen either way before
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    model = nn.Sequential(OrderedDict(attn=mha))
    x = torch.randn(2, 5, 8) * 20
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    hidden = torch.ones(5, 5, dtype=torch.bool).triu(1)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        out, _ = mha(x, x, x, attn_mask=causal, need_weights=need_weights)
        out.sum().backward()
    row = next(r for r in headroom.read(1) if r.tensor == "matmul")
    with torch.no_grad():
        by_hand = _mha_logits_by_hand(mha, x, x, hidden).abs().max().item()
        unmasked = _mha_logits_by_hand(mha, x, x).abs().max().item()
    assert by_hand != unmasked  # (the mask hides this batch's largest logit: the test can tell)
    assert row.module == "attn" and row.amax == pytest.approx(by_hand, rel=1e-5)


def test_a_multihead_attentions_separate_projections_bias_k_and_padding_are_read_as_the_call_reads_them():
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(8, 2, kdim=4, vdim=4, add_bias_kv=True, batch_first=True)
    model = nn.Sequential(OrderedDict(attn=mha))
    x, kv = torch.randn(2, 3, 8) * 10, torch.randn(2, 4, 4) * 10
    kv[0, 3] *= 10  # (a padded key far larger than the rest: its logits must not count)
    padding = torch.tensor([[False, False, True, True], [False, False, False, False]])
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        out, _ = mha(x, kv, kv, key_padding_mask=padding)
        out.sum().backward()
    with torch.no_grad():
        logits = _mha_logits_by_hand(mha, x, kv)
        padded = torch.nn.functional.pad(padding, (0, 1)).view(2, 1, 1, 5)  # (bias_k's key: never padded)
        by_hand = logits.masked_fill(padded, 0).abs().max().item()
    assert by_hand < logits.abs().max().item() / 2
    row = next(r for r in headroom.read(1) if r.tensor == "matmul")
    assert row.amax == pytest.approx(by_hand, rel=1e-5)


def test_a_long_contexts_logits_come_in_blocks_of_query_rows_each_within_the_budget_and_equal_to_the_whole():
    # review_27d #1: one head's (L, S) matrix was built whole however long the context (801 MiB more
    # on a measured step at 6144 tokens); the causal mask too
    from ampguard.headroom import attention_logits

    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 37, 8), torch.randn(1, 2, 37, 8)
    padding = torch.rand(1, 1, 37, 37) > 0.3  # (a boolean mask: True attended)
    for kwargs in ({"is_causal": True}, {}):
        args = (q, k, k) if kwargs else (q, k, k, padding)
        whole = list(attention_logits(args, kwargs))
        parts = list(attention_logits(args, kwargs, chunk=100))
        assert len(whole) == 1 and len(parts) > 2 and all(p.numel() <= 100 for p in parts)
        assert torch.allclose(torch.cat([p.reshape(-1) for p in parts]), whole[0].reshape(-1), atol=1e-6)
    # (only the entries the mask keeps: a hidden one is no logit, in the amax or in the underflow count)
    causal = torch.ones(37, 37, dtype=torch.bool).tril()
    expected = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_select(causal)
    assert torch.allclose(list(attention_logits((q, k, k), {"is_causal": True}))[0], expected, atol=1e-5)
    assert expected.numel() == 2 * 37 * 38 // 2


def test_a_negative_sdpa_scale_is_measured_not_a_crash_of_the_measured_step():
    # review_27d #2: SDPA takes scale=-0.5; the probe's sqrt of it raised "math domain error" mid-forward
    class Negative(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=-0.5)

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(attn=Negative()))
    x = torch.randn(1, 3, 4)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(x).sum().backward()
    row = next(r for r in headroom.read(1) if r.tensor == "matmul")
    q = model.attn.q(x).detach()
    assert row.amax == pytest.approx((q @ q.transpose(-2, -1) * 0.5).abs().max().item(), rel=1e-5)


def test_the_main_jobs_blocks_have_their_attention_logits_measured():
    from ampguard.tasks.charlm import Block

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(block=Block(n_embd=8, n_head=2)))
    headroom = Headroom(model, "bf16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.randn(1, 6, 8)).sum().backward()
    assert [r.module for r in headroom.read(1) if r.tensor == "matmul"] == ["block"]


def test_a_linears_own_product_is_its_output_not_a_matmul_row_and_the_probe_leaves_nothing_behind():
    from torch.nn.modules import module as torch_module
    from torch.overrides import _get_current_function_mode_stack

    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    headroom = Headroom(model, "bf16", every=1, alert_bits=4.0)
    pre, post = len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)
    with pytest.raises(RuntimeError, match="boom"), headroom.measuring(1):
        model(torch.ones(2, 2)).sum().backward()
        assert _get_current_function_mode_stack()  # (the probe, for the measured step)
        raise RuntimeError("boom")
    assert (len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)) == (pre, post)
    assert not _get_current_function_mode_stack()
    assert {r.tensor for r in headroom.read(1)} == {"input", "output", "grad", "param_grad"}


class _GatedMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def test_a_gated_product_between_modules_is_measured_as_the_next_ones_input_and_alerts_before_it_overflows():
    # review_28c: silu(w1 x) * w3 x is no module's output and no matmul: with every output
    # 8 bits from fp16's max, the product overflowed at the next step with no warning before it
    model = nn.Sequential(OrderedDict(mlp=_GatedMLP(2)))
    with torch.no_grad():
        for lin in (model.mlp.w1, model.mlp.w3):
            lin.weight.fill_(100.0), lin.bias.zero_()
        model.mlp.w2.weight.fill_(1e-6)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.ones(1, 2)).sum().backward()  # w1, w3: 200 each; the product about 4e4
    rows = {(r.module, r.tensor): r for r in headroom.read(1)}
    assert rows[("mlp.w1", "output")].headroom_bits > 8 and rows[("mlp.w2", "output")].headroom_bits > 8
    assert rows[("mlp.w2", "input")].amax == pytest.approx(200 * F.silu(torch.tensor(200.0)).item())
    assert ("mlp.w1", "input") in rows and ("mlp.w3", "input") not in rows  # (x once: its first module's)
    (alert,) = headroom.observe_step(1)
    assert (alert.data["module"], alert.data["tensor"]) == ("mlp.w2", "input")


def test_an_input_that_is_a_measured_modules_output_is_not_measured_again():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    headroom = Headroom(model, "bf16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.ones(2, 2)).sum().backward()
    assert [r.module for r in headroom.read(1) if r.tensor == "input"] == ["0", "3"]  # (x; ReLU's output)


def test_a_matmul_is_the_innermost_modules_and_a_gradient_scale_does_not_touch_it():
    # nested: the logits belong to attn (inside block), not to block; the fp16 loss scale is in the
    # gradients only, so a matmul row is judged as an output is
    from ampguard.headroom import HeadroomRow, judged_bits

    block = nn.Sequential(OrderedDict(attn=_Attention(4)))
    model = nn.Sequential(OrderedDict(block=block, head=nn.Linear(4, 1)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.randn(2, 3, 4)).sum().backward()
    assert [r.module for r in headroom.read(1) if r.tensor == "matmul"] == ["block.attn"]
    assert judged_bits(HeadroomRow(1, "block.attn", "matmul", 1.0, 3.0, 0.0), 1024.0, 4.0) == 3.0


@pytest.mark.parametrize("every", [1, 2])
def test_a_compiled_model_is_measured_eagerly_on_its_measured_steps_whatever_ran_before(every):
    # review_28c: with every >= 2 the graph compiled at step 1 without the hooks kept running
    # without them on the measured steps (dynamo does not recompile for a hook added later):
    # only param_grad rows, and an activation overflowed with no alert before it
    from torch._dynamo.utils import counters

    model, x = _attention_model(gain=40.0), torch.full((1, 3, 4), 1.0)
    model.compile(backend="eager")
    headroom = Headroom(model, "fp16", every=every, alert_bits=3.0)
    counters.clear()
    for step in (1, 2, 3, 4):
        with headroom.measuring(step):
            model(x).sum().backward()
    rows = {(r.module, r.tensor): r for r in headroom.read(4)}
    assert set(rows) == {(m, t) for m in ("attn.q", "attn.k", "attn.v", "head") for t in ("output", "grad", "param_grad")} | {
        ("attn", "matmul"), ("attn.q", "input"), ("head", "input")}  # (x is attn.q's input: not k's, v's again)
    assert rows[("attn", "matmul")].amax == 6400.0 and rows[("attn.q", "output")].amax == 40.0
    assert counters["stats"]["unique_graphs"] <= 1  # (the measured steps compile nothing)


def test_a_product_outside_every_module_is_nobodys_even_after_a_checkpoints_recompute_stopped_early():
    # review_session26: a non-reentrant checkpoint's recompute stops early by raising, which left names
    # on the probe's stack; the loss's `out @ out.T` (outside any module) then went to the last one left,
    # an nn.Linear that never makes a matmul row
    from torch.utils.checkpoint import checkpoint

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(OrderedDict(attn=_Attention(4), mlp=nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))))
            self.head = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=False))

    torch.manual_seed(0)
    model = Model()
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        for _ in range(2):
            out = model(torch.randn(2, 3, 4))
            (out @ out.transpose(-2, -1)).mean().backward()  # (a matmul in the loss: no module's)
    assert [r.module for r in headroom.read(1) if r.tensor == "matmul"] == ["block.attn"]


def test_a_sparse_product_in_a_forward_is_left_alone_not_a_crash_of_the_measured_step():
    class Graph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.adj = torch.eye(5).to_sparse()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.mm(self.adj, x)).sum() + torch.mm(self.adj, self.adj).to_dense().sum()

    model = Graph()
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.randn(5, 4)).backward()  # (sparse @ sparse: its product is sparse, not measured)
    assert [r.module for r in headroom.read(1) if r.tensor == "matmul"] == ["(root)"]  # (sparse @ dense is strided)


def test_a_linear_subclass_with_a_forward_of_its_own_keeps_its_inner_products_measured():
    # review_session26: products inside every nn.Linear were set aside (torchao's Float8Linear's mm is its
    # output), which hid a LoRA-style subclass's low-rank product near fp16's maximum
    class Lora(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.a = nn.Parameter(torch.full((2, 2), 100.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + (x @ self.a.T) * 0.0

    model = nn.Sequential(Lora(), nn.Linear(2, 1))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.full((1, 2), 100.0)).sum().backward()
    assert [(r.module, r.amax) for r in headroom.read(1) if r.tensor == "matmul"] == [("0", 20000.0)]


def test_attention_outside_every_module_is_not_computed_again(monkeypatch):
    # review_27d nit: an SDPA in the loss (no module's forward) had its logits computed, then dropped
    from ampguard import headroom as headroom_module

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setitem(headroom_module._ATTENTIONS, sdpa,
                        lambda args, kwargs: calls.append(1) or headroom_module.attention_logits(args, kwargs))
    model = nn.Sequential(OrderedDict(attn=_SdpaAttention(8, heads=2), head=nn.Linear(8, 1)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        out = model(torch.randn(2, 5, 8))
        q = out.unsqueeze(1)
        sdpa(q, q, q).sum().backward()  # (in the loss: outside every module)
    assert calls == [1]  # (the module's own call only)
    assert [r.module for r in headroom.read(1) if r.tensor == "matmul"] == ["attn"]


def test_a_masked_attentions_underflow_share_counts_only_the_logits_it_keeps():
    # review_27d nit: the entries a causal mask hides were zeros in the count, about halving the share
    model = nn.Sequential(OrderedDict(attn=_SdpaAttention(4, heads=1), head=nn.Linear(4, 1)))
    with torch.no_grad():
        model.attn.q.weight.copy_(torch.eye(4) * 1e-3)
        model.attn.kv.weight.copy_(torch.cat([torch.eye(4) * 1e-3, torch.eye(4)]))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.ones(1, 6, 4)).sum().backward()  # (every kept logit 4e-6 / 2: below fp16's smallest normal)
    row = next(r for r in headroom.read(1) if r.tensor == "matmul")
    assert row.underflow_share == 1.0 and row.amax == pytest.approx(2e-6)


def test_a_sparse_gradient_is_measured_by_its_values_not_a_crash_of_the_measured_step():
    # review 36f: an nn.Embedding(sparse=True)'s gradient reached (a > 0) on a sparse tensor: a
    # NotImplementedError traceback at the first measured step, hours into a run at every: 100
    model = nn.Sequential(OrderedDict(emb=nn.Embedding(10, 4, sparse=True), fc=nn.Linear(4, 1)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.tensor([1, 2, 2])).sum().mul(3000.0).backward()
    rows = {(r.module, r.tensor): r for r in headroom.read(1)}
    grad = model.emb.weight.grad.coalesce().values().abs().amax().item()
    assert rows[("emb", "param_grad")].amax == grad  # (token 2's two rows summed, as the dense gradient)


def test_a_nan_beside_an_overflow_does_not_hide_it_and_a_row_of_nans_says_nothing():
    # review 36f: softmax(inf) is NaN; amax over a row holding both read nan, a row never judged:
    # the logits that overflowed were never announced
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 2, bias=False)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    model.fc.weight.data.copy_(torch.tensor([[math.inf], [math.nan]]))
    with headroom.measuring(1):
        model(torch.ones(1, 1))
    (row,) = [r for r in headroom.read(1) if r.tensor == "output"]
    assert (row.amax, row.headroom_bits) == (math.inf, -math.inf)
    assert [e.kind for e in headroom.observe_step(1)] == ["headroom_alert"]
    model.fc.weight.data.fill_(math.nan)  # (NaN alone: downstream of an overflow named elsewhere, or bad data)
    with headroom.measuring(2):
        model(torch.ones(1, 1))
    (row,) = [r for r in headroom.read(2) if r.tensor == "output"]
    assert math.isnan(row.amax) and math.isnan(row.headroom_bits)


def test_an_output_changed_in_place_before_the_next_module_is_measured_again_as_its_input():
    # review 36f: fc1's output was measured, then h.mul_(16) made it 16x larger before fc2 read it:
    # fc2's input was taken for the same tensor already measured (a ResNet's out += identity)
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)

        def forward(self, x):
            return self.fc2(self.fc1(x).mul_(16))

    model = InPlace()
    model.fc1.weight.data.fill_(2000.0)
    model.fc2.weight.data.fill_(1.0)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1), torch.no_grad():
        model(torch.ones(1, 1))
    rows = {(r.module, r.tensor): r.amax for r in headroom.read(1)}
    assert rows[("fc1", "output")] == 2000.0 and rows[("fc2", "input")] == 32000.0


def test_a_gradient_is_judged_with_the_help_the_scaler_can_give_down_to_its_floor():
    # review 36f: a scaled gradient was judged as if the scale could come down to 1; with
    # scaler.min_scale 4096 it cannot: 48 of 60 steps skipped, no headroom alert
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 1, bias=False)))
    scale = torch.tensor(8192.0)
    floored = Headroom(model, "fp16", every=1, alert_bits=4.0, loss_scale=lambda: scale.clone(), scale_floor=4096.0)
    free = Headroom(model, "fp16", every=1, alert_bits=4.0, loss_scale=lambda: scale.clone())
    # the scaled gradient 16384 (2 bits): one halving left above the floor (3 bits), 13 without one
    assert _scaled_step(floored, model, 1, 2.0, 8192.0) == ["headroom_alert"]
    assert _scaled_step(free, model, 1, 2.0, 8192.0) == []


def test_a_roots_output_that_is_its_heads_is_one_row_not_two_alerts():
    # review 36f: a root with a parameter of its own is a measured module too; its output, the head's
    # tensor itself, was a second row (and a second alert at the head's overflow)
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(()))
            self.head = nn.Linear(1, 1, bias=False)

        def forward(self, x):
            return self.head(x * self.gain)

    model = Scaled()
    model.head.weight.data.fill_(60000.0)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.ones(1, 1)).sum().backward()
    rows = [(r.module, r.tensor) for r in headroom.read(1)]
    assert ("head", "output") in rows and ("(root)", "output") not in rows and ("(root)", "param_grad") in rows
    alerts = {(e.data["module"], e.data["tensor"]) for e in headroom.observe_step(1) if e.kind == "headroom_alert"}
    assert alerts == {("head", "output"), ("(root)", "param_grad")}  # (the gain's gradient is 60000 too)


def test_an_inference_mode_forward_and_a_sparse_gradient_of_padding_alone_are_measured_not_crashes():
    # review 36h: an inference tensor has no version counter (reading it raised in a measured step:
    # a teacher's pass under inference_mode); a batch of padding_idx alone left a sparse gradient
    # with no values (amax of nothing raised)
    model = nn.Sequential(OrderedDict(emb=nn.Embedding(10, 4, sparse=True, padding_idx=0), fc=nn.Linear(4, 1)))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        with torch.inference_mode():
            model(torch.tensor([1, 2]))
        model(torch.tensor([0, 0])).sum().backward()
    rows = {(r.module, r.tensor) for r in headroom.read(1)}
    assert ("fc", "output") in rows and ("emb", "param_grad") not in rows


def test_attention_logits_that_overflow_alert_though_the_softmax_after_them_makes_the_next_product_nan():
    # review 61f: a module's `matmul` row is the largest over its products (and micro-batches); the
    # logits' inf beside `softmax(inf) @ v`'s NaN read nan (amax let the NaN win), a row that says
    # nothing: an attention whose logits had overflowed fp16 was never announced (every: 100
    # measured only steps where it was so), though `_add` keeps inf beside NaN within one product
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(2, 2, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            return torch.softmax(q @ q.transpose(-2, -1), dim=-1) @ x  # logits 2 * 200**2: inf in fp16

    model = Attention().half()
    with torch.no_grad():
        model.q.weight.copy_(torch.eye(2))
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0)
    with headroom.measuring(1):
        model(torch.full((1, 2, 2), 200.0, dtype=torch.float16))
    matmul = [r for r in headroom.read(1) if r.tensor == "matmul"]
    assert [(r.module, r.amax, r.headroom_bits) for r in matmul] == [("(root)", math.inf, -math.inf)]
    assert [(e.kind, e.data["module"], e.data["tensor"]) for e in headroom.observe_step(1)] == [
        ("headroom_alert", "(root)", "matmul")]
