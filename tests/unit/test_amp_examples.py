"""PyTorch's "Automatic Mixed Precision examples" page (``notes/amp_examples.rst``), recipe by
recipe, written with ``Guard`` in a loop of one's own, each beside the stock recipe run with the
same seed: weights bit for bit (``torch.equal``), the scale after every step, the learning rate.

Typical use, clipping and accumulation are the guard's own bit-for-bit tests
(``test_step.py``); several models, losses and optimizers are ``test_guard_multi.py``'s
(without autocast) and here as the page writes it. Here the ones no test ran (review 61a): the
gradient penalty (``torch.autograd.grad`` of the scaled loss, ``create_graph=True``), custom
autograd functions under ``torch.amp.custom_fwd`` / ``custom_bwd`` and an autocast-disabled
region, ``nn.DataParallel`` (on a CPU it runs the module itself), and a plain ``GradScaler``
handed over whose ``scale()`` the penalty's line keeps. Tiny models, a few steps each.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import Guard

PRECISIONS = ["fp16", "bf16", "fp32"]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _autocast(precision: str) -> torch.autocast:
    """The stock recipe's autocast (disabled under fp32, as ``enabled=args.amp`` leaves it)."""
    return torch.autocast("cpu", dtype=_DTYPES.get(precision, torch.bfloat16), enabled=precision != "fp32")


def _scaler(precision: str, **settings: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=precision == "fp16", **settings)


def _guard(model: nn.Module, opt: torch.optim.Optimizer, precision: str, **kwargs) -> Guard:
    """The stock recipe's settings: no clip; the scaler's, under fp16."""
    settings = kwargs.pop("scaler", {"init_scale": 2.0**10})
    return Guard(model, opt, precision=precision, max_norm=None, scaler=settings if precision == "fp16" else None,
                 **kwargs)


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _stock_steps(forward, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, precision: str, data) -> None:
    """The page's typical loop over ``data``: zero_grad, autocast forward and loss, scaled backward,
    ``scaler.step``, ``scaler.update``."""
    for x, y in data:
        opt.zero_grad()
        with _autocast(precision):
            loss = F.mse_loss(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _guarded_steps(forward, guard: Guard, data) -> torch.Tensor:
    """The same loop with the guard's verbs, every step applied; the last step's output."""
    for x, y in data:
        with guard.autocast():
            out = forward(x)
            loss = F.mse_loss(out, y)
        guard.backward(loss)
        assert not guard.step().skipped
    return out


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------------------- gradient penalty


def _penalty(grads: list[torch.Tensor]) -> torch.Tensor:
    grad_norm = 0  # (the page's own accumulation, op for op)
    for grad in grads:
        grad_norm = grad_norm + grad.pow(2).sum()
    return grad_norm.sqrt()


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))


def _stock_penalty(precision: str, data, **settings: float):
    model, opt = _mlp()
    scaler, scheduler, scales = _scaler(precision, **settings), _schedule(opt), []
    for x, y in data:
        opt.zero_grad()
        with _autocast(precision):
            loss = F.mse_loss(model(x), y)
        scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grads = [g * inv_scale for g in scaled_grads]
        with _autocast(precision):
            loss = loss + _penalty(grads)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()  # (every iteration, as the page's loops: scheduler_on_skip="step")
        scales.append(scaler.get_scale())
    return model, scales, scheduler.get_last_lr()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # (a skipped first step)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_gradient_penalty_is_the_stock_recipe_bit_for_bit_through_overflows(precision):
    # README's lines: the penalty from torch.autograd.grad(guard.scaler.scale(loss), ...) unscaled by
    # 1 / guard.scaler.get_scale(). Under fp16 at 2**18 the penalty's own gradients overflow first (the
    # loss it makes is inf: non_finite_loss), then the backward's (non_finite_grad), then the steps apply
    data = _data(6)
    settings = {"init_scale": 2.0**18, "growth_interval": 2}
    stock, stock_scales, stock_lr = _stock_penalty(precision, data, **settings)
    model, opt = _mlp()
    scheduler = _schedule(opt)
    guard = _guard(model, opt, precision, scaler=settings, scheduler=scheduler, scheduler_on_skip="step")
    scales, reasons = [], []
    for x, y in data:
        with guard.autocast():
            loss = F.mse_loss(model(x), y)
        scaled_grads = torch.autograd.grad(guard.scaler.scale(loss), model.parameters(), create_graph=True)
        inv_scale = 1.0 / guard.scaler.get_scale()  # 1.0 under bf16 and fp32 (no loss scaler)
        grads = [g * inv_scale for g in scaled_grads]
        with guard.autocast():
            loss = loss + _penalty(grads)
        guard.backward(loss)
        record = guard.step()
        scales.append(guard.scaler.get_scale())
        reasons.append(record.reason if record.skipped else None)
    assert _equal(stock, model)
    assert scales == stock_scales and scheduler.get_last_lr() == stock_lr
    if precision == "fp16":
        assert reasons == ["non_finite_loss", "non_finite_loss", "non_finite_grad", None, "non_finite_grad", None]
    else:
        assert reasons == [None] * 6


def test_a_plain_gradscaler_handed_over_names_the_penalty_way_and_follows_it():
    # the penalty's torch.autograd.grad(scaler.scale(loss), ...) kept with the scaler handed over was
    # told only "give guard.backward the loss as it is", which the loop already did
    model, opt = _mlp()
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = Guard(model, opt, precision="fp16", max_norm=None, scaler=plain)
    x, y = _data(1)[0]
    with guard.autocast():
        loss = F.mse_loss(model(x), y)
    with pytest.raises(RuntimeError, match=r"a gradient penalty's torch\.autograd\.grad\(scaler\.scale\(loss\), "
                                           r"params, create_graph=True\) scales with guard\.scaler\.scale\(loss\) "
                                           r"and unscales by 1 / guard\.scaler\.get_scale\(\)"):
        torch.autograd.grad(plain.scale(loss), model.parameters(), create_graph=True)
    scaled_grads = torch.autograd.grad(guard.scaler.scale(loss), model.parameters(), create_graph=True)
    assert plain.get_scale() == guard.scaler.get_scale() == 2.0**10  # (the plain one follows the guard's)
    grads = [g * (1.0 / plain.get_scale()) for g in scaled_grads]
    with guard.autocast():
        loss = loss + _penalty(grads)
    guard.backward(loss)
    assert not guard.step().skipped


# ------------------------------------------------------------------ custom autograd functions


class _MM(torch.autograd.Function):
    """The page's ``MyMM``: ``custom_fwd`` without a cast, its backward under the forward's autocast state."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class _FloatMM(_MM):
    """The page's ``MyFloat32Func`` shape: ``cast_inputs=torch.float32``, autocast off inside (the backward, ``_MM``'s)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.v = nn.Parameter(torch.randn(8, 1) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _MM.apply(self.fc(x), self.w.to(self.fc(x).dtype)).tanh()
        with torch.autocast("cpu", enabled=False):  # the page's "functions that need a particular dtype"
            h = h.float() + 0.5
        return _FloatMM.apply(h, self.v)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_custom_autograd_functions_under_the_guards_autocast_are_the_stock_recipe_bit_for_bit(precision):
    data = _data(3)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = _Custom()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    stock, opt = fresh()
    scaler = _scaler(precision, init_scale=2.0**10)
    _stock_steps(stock, opt, scaler, precision, data)
    model, opt = fresh()
    guard = _guard(model, opt, precision)
    out = _guarded_steps(model, guard, data)
    assert out.dtype == torch.float32  # (cast_inputs=float32: the function ran in float32 under autocast)
    assert _equal(stock, model) and guard.scaler.get_scale() == scaler.get_scale()


# ------------------------------------------------------------------- DataParallel, several models


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_dataparallel_model_is_the_stock_recipe_bit_for_bit(precision):
    # the page's "DataParallel in a single process" (autocast around the wrapped model's forward); on a
    # CPU, DataParallel runs the module itself: the guard takes the wrapped model, its names "module."
    data = _data(3)
    stock, opt = _mlp()
    scaler = _scaler(precision, init_scale=2.0**10)
    _stock_steps(nn.DataParallel(stock), opt, scaler, precision, data)
    model, opt = _mlp()
    wrapped = nn.DataParallel(model)
    guard = _guard(wrapped, opt, precision)
    _guarded_steps(wrapped, guard, data)
    assert _equal(stock, model) and guard.scaler.get_scale() == scaler.get_scale()
    if precision != "fp32":
        low = str(_DTYPES[precision]).removeprefix("torch.")
        assert guard.autocast_dtypes == dict.fromkeys(["module.0", "module.1", "module.2"], low)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_several_models_losses_and_optimizers_as_the_page_writes_them_bit_for_bit(precision):
    # one scaler, two losses over a shared graph (retain_graph), scaler.unscale_(optimizer0) to look at
    # its gradients, each optimizer stepped, one update(): guard.backward(loss0, loss1),
    # guard.unscale_("0"), guard.step()
    data = _data(3)

    def fresh():
        torch.manual_seed(0)
        m0, m1 = nn.Linear(4, 1), nn.Linear(4, 1)
        return m0, m1, torch.optim.SGD(m0.parameters(), lr=0.1), torch.optim.SGD(m1.parameters(), lr=0.1)

    def losses(m0, m1, x, y):
        out0, out1 = m0(x), m1(x)
        return F.mse_loss(2 * out0 + 3 * out1, y), F.mse_loss(3 * out0 - 5 * out1, y)

    s0, s1, o0, o1 = fresh()
    scaler, scales = _scaler(precision, init_scale=2.0**10), []
    for x, y in data:
        o0.zero_grad()
        o1.zero_grad()
        with _autocast(precision):
            loss0, loss1 = losses(s0, s1, x, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(o0)
        scaler.step(o0)
        scaler.step(o1)
        scaler.update()
        scales.append(scaler.get_scale())
    m0, m1, q0, q1 = fresh()
    guard = _guard([m0, m1], [q0, q1], precision)
    for x, y in data:
        with guard.autocast():
            loss0, loss1 = losses(m0, m1, x, y)
        guard.backward(loss0, loss1)
        guard.unscale_("0")
        guard.step()
        scales.append(guard.scaler.get_scale())
    assert _equal(s0, m0) and _equal(s1, m1)
    assert scales[3:] == scales[:3]  # (fp16: [1024, 512, 256], steps 2 and 3 overflow in both loops alike)
