"""From a config to objects (``ampguard.build``): clipping, the LR schedule, the guarded step, the optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampguard.build import (
    EXACT_ONLY, fast_path,
    build_monitor, build_spike_detector, build_state, check_forward, clip_threshold, initial_scale, lr_multiplier,
    make_optimizer, precision_of, resolve_device,
)
from ampguard.config import validate
from ampguard.errors import InputError
from ampguard.monitor import LossSpikeDetector
from ampguard.precision import DEFAULT_MIN_SCALE

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- clipping


@pytest.mark.parametrize(("max_norm", "expected"), [
    (None, None), (0.0, None), (0, None), (-1.0, None), (-1e-12, None), (1e-12, 1e-12), (1.0, 1.0), (5, 5),
])
def test_clip_threshold(max_norm, expected):
    assert clip_threshold(max_norm) == expected


def test_the_step_and_the_monitor_see_the_same_clip_threshold():
    for max_norm, expected in ((0.0, None), (2.5, 2.5)):
        config = validate({"max_norm": max_norm})
        assert build_state(config, nn.Linear(2, 1), nn.functional.mse_loss, CPU).max_norm == expected
        assert build_monitor(config, scaler_enabled=False).max_norm == expected


# ---------------------------------------------------------------------------- the LR schedule


def schedule(steps: int, warmup: int = 0, decay: str = "cosine", floor: float = 0.1):
    return lr_multiplier(validate({"steps": steps, "schedule": {"warmup": warmup, "decay": decay,
                                                                "min_lr_ratio": floor}}))


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_is_linear_up_to_one(decay):
    f = schedule(20, warmup=4, decay=decay)
    assert [f(u) for u in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0  # the first update after warmup runs at the peak


@pytest.mark.parametrize("decay", ["cosine", "linear"])
@pytest.mark.parametrize(("steps", "warmup", "floor"), [(11, 2, 0.1), (100, 0, 0.0), (50, 10, 0.5), (2, 0, 0.2)])
def test_decay_runs_from_one_after_warmup_to_the_floor_at_the_last_step(decay, steps, warmup, floor):
    f = schedule(steps, warmup=warmup, decay=decay, floor=floor)
    assert f(warmup) == 1.0
    assert math.isclose(f(steps - 1), floor, abs_tol=1e-12)
    assert math.isclose(f(steps + 50), floor, abs_tol=1e-12)  # past the end (steps raised on resume): stays there
    values = [f(u) for u in range(warmup, steps)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # never rises


def test_linear_and_cosine_midpoints():
    lin, cos = schedule(11, decay="linear"), schedule(11, decay="cosine")
    assert math.isclose(lin(5), 0.1 + 0.9 * 0.5) and math.isclose(cos(5), 0.1 + 0.9 * 0.5)
    assert math.isclose(lin(2), 0.1 + 0.9 * 0.8)
    assert math.isclose(cos(2), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))


def test_constant_stays_at_one_after_warmup():
    f = schedule(10, warmup=3, decay="constant", floor=0.0)
    assert [f(u) for u in range(3, 12)] == [1.0] * 9


def test_a_floor_of_one_is_flat():
    f = schedule(10, decay="cosine", floor=1.0)
    assert [f(u) for u in range(10)] == [1.0] * 10


def test_the_scheduler_starts_at_the_first_warmup_factor():
    config = validate({"optimizer": {"lr": 0.4}, "steps": 20, "schedule": {"warmup": 4}})
    state = build_state(config, nn.Linear(2, 1), nn.functional.mse_loss, CPU)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert state.scheduler.get_last_lr() == [pytest.approx(0.1)]


# ---------------------------------------------------------------------------- the guarded step


def test_build_state_takes_precision_accumulation_and_the_fp16_scaler_from_the_config():
    config = validate({
        "precision": "fp16", "accumulation_steps": 3, "scheduler_on_skip": "step", "max_norm": 0.7,
        "scaler": {"init_scale": 256.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7},
    })
    model = nn.Linear(3, 1)
    state = build_state(config, model, nn.functional.mse_loss, CPU)
    assert state.model is model and state.loss_fn is nn.functional.mse_loss and state.device == CPU
    assert state.precision.name == "fp16" and state.precision.device_type == "cpu"
    assert state.accumulation_steps == 3 and state.max_norm == 0.7 and state.scheduler_on_skip == "step"
    scaler = state.scaler
    assert scaler.is_enabled() and scaler.get_scale() == 256.0
    assert scaler.get_growth_factor() == 4.0 and scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7
    assert initial_scale(config, CPU) == 256.0


def test_build_state_gives_the_scaler_the_configs_floor():
    config = validate({"precision": "fp16", "scaler": {"init_scale": 256.0, "min_scale": 4.0}})
    state = build_state(config, nn.Linear(3, 1), nn.functional.mse_loss, CPU)
    assert state.scaler.get_min_scale() == 4.0 != DEFAULT_MIN_SCALE


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_build_state_without_fp16_has_a_disabled_scaler(precision):
    config = validate({"precision": precision, "scaler": {"init_scale": 256.0}})
    state = build_state(config, nn.Linear(3, 1), nn.functional.mse_loss, CPU)
    assert state.precision.name == precision and not state.scaler.is_enabled()
    assert initial_scale(config, CPU) == 1.0
    assert build_monitor(config, state.scaler.is_enabled()).scaler_enabled is False


def test_fp16_with_the_scaler_turned_off():
    config = validate({"precision": "fp16", "scaler": {"enabled": False, "init_scale": 256.0}})
    state = build_state(config, nn.Linear(3, 1), nn.functional.mse_loss, CPU)
    assert not state.scaler.is_enabled() and initial_scale(config, CPU) == 1.0
    assert precision_of(config, CPU).uses_scaler  # the precision would scale; the config said no


def test_build_state_steps_with_accumulation_from_the_config():
    config = validate({"precision": "fp32", "accumulation_steps": 2})
    state = build_state(config, nn.Linear(3, 1), nn.functional.mse_loss, CPU)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    assert state.step(x, y) is None and state.mid_group
    record = state.step(x, y)
    assert record is not None and record.step == 1 and not state.mid_group


def test_build_monitor_and_spike_detector_from_the_config():
    config = validate({"monitor": {"window": 30, "alert_rate": 0.2, "fail_rate": 0.4, "fail_after": 6,
                                   "fail_on_scale_collapse": True},
                       "scaler": {"min_scale": 2.0}})
    m = build_monitor(config, scaler_enabled=True)
    assert (m.window, m.alert_rate, m.fail_rate, m.fail_after) == (30, 0.2, 0.4, 6)
    assert m.fail_on_scale_collapse and m.min_scale == 2.0 and m.scaler_enabled
    assert build_spike_detector(config) is None
    spikes = build_spike_detector(validate({"rollback": {"triggers": ["loss_spike"], "window": 5, "z": 2.0},
                                            "checkpoint": {"every": 10}}))
    assert isinstance(spikes, LossSpikeDetector) and spikes.z == 2.0 and spikes._sum.size == 5


# ---------------------------------------------------------------------------- optimizer, device


def test_make_optimizer_sgd_takes_momentum_and_weight_decay():
    config = validate({"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.8, "weight_decay": 0.01}})
    model = nn.Linear(3, 2)
    opt = make_optimizer(config, model)
    assert type(opt) is torch.optim.SGD
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.05, 0.8, 0.01)
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]


def test_make_optimizer_adamw_takes_betas_eps_and_weight_decay():
    config = validate({"optimizer": {"name": "adamw", "lr": 0.002, "betas": [0.8, 0.9], "eps": 1e-6,
                                     "weight_decay": 0.1}})
    opt = make_optimizer(config, nn.Linear(3, 2))
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (0.002, (0.8, 0.9), 1e-6, 0.1)


def test_resolve_device_cpu_and_auto():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resolve_device_cuda_without_cuda_is_bad_input():
    with pytest.raises(InputError) as err:
        resolve_device("cuda")
    assert "\n" not in str(err.value) and "cuda" in str(err.value)


# ---------------------------------------------------------------------------- refusing a model up front (issue 16)


def test_build_state_refuses_a_model_without_parameters_or_with_all_frozen():
    config = validate({"precision": "bf16"})
    with pytest.raises(InputError, match=r"^the model \(Flatten\) has no parameters: there is nothing to train$"):
        build_state(config, nn.Flatten(), nn.functional.mse_loss, CPU)
    with pytest.raises(InputError, match=r"^none of the model's 3 parameters requires a gradient"):
        build_state(config, nn.Linear(2, 1).requires_grad_(False), nn.functional.mse_loss, CPU)


def test_build_state_turns_the_steps_value_error_into_one_input_error_line():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1).to("meta"))  # parameters on two devices
    with pytest.raises(InputError) as caught:
        build_state(validate({"precision": "bf16"}), model, nn.functional.mse_loss, CPU)
    message = str(caught.value)
    assert message.startswith("cannot build the training step: ") and "\n" not in message
    assert "one device" in message


class Noisy(nn.Module):
    """Dropout draws from the global RNG, BatchNorm updates its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def test_check_forward_leaves_no_trace_in_rngs_buffers_or_gradients():
    import random

    import numpy as np

    torch.manual_seed(0)
    model = Noisy()
    model.net[0].weight.grad = torch.ones_like(model.net[0].weight)
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def read():  # a data pipeline that draws from every global RNG
        random.random(), np.random.rand(), torch.rand(1)
        return torch.randn(16, 4), torch.randn(16, 1)

    state = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    check_forward(model, nn.functional.mse_loss, read, precision_of(validate({"precision": "bf16"}), CPU), "task t")
    assert torch.equal(torch.get_rng_state(), state[0]) and random.getstate() == state[1]
    assert (np.random.get_state()[1] == state[2]).all()
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert torch.equal(model.net[0].weight.grad, torch.ones_like(model.net[0].weight))
    assert model.net[3].weight.grad is None and model.training


@pytest.mark.parametrize(("loss_fn", "read", "expected"), [
    (lambda out, y: out.sum().item(), None, "task t: loss_fn must return a scalar tensor; it returned a float"),
    (lambda out, y: (out > 0).sum(), None, "task t: loss_fn must return a real floating-point tensor; it returned torch.int64"),
    (nn.functional.mse_loss, lambda: next(iter(())), "task t: the data yielded no batches"),
    (nn.functional.mse_loss, lambda: 1 / 0, "task t: reading the first batch failed: ZeroDivisionError: division by zero"),
    (nn.functional.mse_loss, lambda: (torch.ones(2, 4), torch.ones(2, 1), "extra"),
     "task t: reading the first batch failed: ValueError: too many values to unpack (expected 2)"),
])
def test_check_forward_refusals_are_one_line_naming_who(loss_fn, read, expected):
    read = read or (lambda: (torch.ones(2, 4), torch.ones(2, 1)))
    with pytest.raises(InputError) as caught:
        check_forward(nn.Linear(4, 1), loss_fn, read, precision_of(validate({}), CPU), "task t")
    assert str(caught.value) == expected


def _raise(err: BaseException):
    def raising(*args: object) -> None:
        raise err

    return raising


@pytest.mark.parametrize(("loss_fn", "read", "expected"), [
    (_raise(ValueError("x" * 1000)), None,
     "task t: loss_fn failed on the model's output for the first batch: ValueError: " + "x" * 120 + "..." + "x" * 65),
    (nn.functional.mse_loss, _raise(SystemExit(object())), "task t: reading the first batch failed: SystemExit: a object"),
])
def test_what_the_users_code_raised_is_said_as_errors_raised_says_it(loss_fn, read, expected):
    # the first line uncut (a tensor's repr in a shape error runs to kilobytes), and a SystemExit
    # of an object as its repr: as a factory's or evaluate()'s error is said
    read = read or (lambda: (torch.ones(2, 4), torch.ones(2, 1)))
    with pytest.raises(InputError) as caught:
        check_forward(nn.Linear(4, 1), loss_fn, read, precision_of(validate({}), CPU), "task t")
    assert str(caught.value) == expected


def test_check_forward_passes_a_scalar_of_one_element():
    check_forward(nn.Linear(4, 1), lambda out, y: ((out - y) ** 2).mean().reshape(1),
                  lambda: (torch.ones(2, 4), torch.ones(2, 1)), precision_of(validate({}), CPU), "task t")


# ---------------------------------------------------------------------------- fast_path (config fast)


_BLOCKING = {"diagnose.first_skip": {"diagnose": {"first_skip": True}},
             "diagnose.strict": {"diagnose": {"strict": True}},
             "monitor.headroom": {"monitor": {"headroom": {"every": 5}}},
             "rollback.triggers": {"rollback": {"triggers": ["loss_spike"]}, "checkpoint": {"every": 5}},
             "scheduler_on_skip: step": {"scheduler_on_skip": "step"}}


def test_every_exact_only_setting_is_listed_here():
    assert [name for name, _ in EXACT_ONLY] == list(_BLOCKING)


@pytest.mark.parametrize("name", list(_BLOCKING))
def test_a_setting_that_needs_the_host_keeps_the_exact_path_and_refuses_fast_true(name):
    on, why = fast_path(validate(_BLOCKING[name]), torch.device("cuda"))
    assert not on and why == f"exact path: {name} needs each step decided at the host"
    with pytest.raises(InputError, match=f"fast: true cannot serve {name}"):
        fast_path(validate({**_BLOCKING[name], "fast": True}), torch.device("cpu"))


@pytest.mark.parametrize(("fast", "device", "world", "on"), [
    (None, "cuda", 1, True), (None, "cpu", 1, False), (None, "cuda", 2, False),
    (True, "cpu", 1, True), (True, "cuda", 1, True), (False, "cuda", 1, False)])
def test_which_path(fast, device, world, on):
    assert fast_path(validate({"fast": fast}), torch.device(device), world)[0] is on


def test_fast_true_under_torchrun_is_refused():
    with pytest.raises(InputError, match="fast: true runs in one process"):
        fast_path(validate({"fast": True}), torch.device("cuda"), world_size=2)


def test_the_fast_state_is_sync_free_with_a_fused_optimizer_and_device_lrs():
    config = validate({"steps": 5, "optimizer": {"name": "sgd"}})
    state = build_state(config, nn.Linear(3, 1), torch.nn.functional.mse_loss, torch.device("cpu"), fast=True)
    assert state.sync_free and state.optimizer.defaults["fused"]
    assert all(isinstance(g["lr"], torch.Tensor) for g in state.optimizer.param_groups)
    assert state.scheduler.applied is state._updates_t


def test_the_fast_paths_schedule_moves_past_2_24_updates_and_its_checkpoint_keeps_the_count():
    # review 55b: the fast path's count was float32: from 16,777,216 updates the LR stood still,
    # and the scheduler's last_epoch and the guard's updates were saved as 16,777,216
    import io

    from ampguard.schedule import lr_multiplier

    steps, start = 2**24 + 4096, 2**24 - 2
    config = validate({"steps": steps, "precision": "fp32", "schedule": {"warmup": 10, "decay": "linear"}})

    def make(fast):
        torch.manual_seed(0)
        return build_state(config, nn.Linear(4, 4), torch.nn.functional.mse_loss, torch.device("cpu"), fast=fast)

    state, host = make(True), lr_multiplier(config)
    state.steps = state.updates = start  # (what a resume from a checkpoint of that count sets)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    lrs = [state.step(x, y).values()["lr"] for _ in range(4)]
    base = state.scheduler.base_lrs[0]
    assert lrs == [torch.mul(torch.tensor(host(u), dtype=torch.float64).float(), base).item()
                   for u in range(start, start + 4)]
    assert len(set(lrs)) == 4
    buffer = io.BytesIO()
    torch.save({"state": state.state_dict(), "scheduler": state.scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert saved["state"]["updates"] == saved["scheduler"]["last_epoch"] == 2**24 + 2
    for fast in (True, False):  # either path resumes from it
        resumed = make(fast)
        resumed.load_state_dict(saved["state"])
        resumed.scheduler.load_state_dict(saved["scheduler"])
        assert resumed.updates == resumed.scheduler.last_epoch == 2**24 + 2
    assert resumed.scheduler.get_last_lr()[0] == base * host(2**24 + 2)
