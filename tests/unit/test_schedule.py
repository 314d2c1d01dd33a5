"""The LR schedule on the host and on the device, and the DeviceLambdaLR that either path resumes from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampguard.config import validate
from ampguard.schedule import DeviceLambdaLR, device_multiplier, lr_multiplier


@pytest.mark.parametrize("decay", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_the_device_table_is_the_host_schedule_in_float32(decay, warmup):
    config = validate({"steps": 40, "schedule": {"warmup": warmup, "decay": decay, "min_lr_ratio": 0.2}})
    host, device = lr_multiplier(config), device_multiplier(config)
    counts = torch.arange(0, 46, dtype=torch.float32)  # past the last step too: the table's last entry
    got = torch.stack([device(c) for c in counts])
    want = torch.tensor([host(min(int(c), 40)) for c in counts], dtype=torch.float64).to(torch.float32)
    assert torch.equal(got, want)
    assert got.dtype == torch.float32 and got.shape == (46,)


def test_the_count_is_read_on_its_own_device_and_never_indexed_by_python():
    config = validate({"steps": 10, "schedule": {"warmup": 2}})
    factor = device_multiplier(config)
    applied = torch.tensor(1.0)
    assert factor(applied).shape == () and factor(applied).item() == pytest.approx(1.0)
    assert factor(torch.tensor(-3.0)).item() == pytest.approx(0.5)  # clamped at the first entry
    assert factor(torch.tensor(1.0, dtype=torch.float64)).item() == factor(applied).item()  # a count of any float dtype


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW(nn.Linear(2, 1).parameters(), lr=0.1)


def test_a_device_schedules_state_is_a_lambdalr_state_at_the_applied_count():
    config = validate({"steps": 10, "schedule": {"warmup": 4}})
    device = DeviceLambdaLR(_optimizer(), lr_multiplier(config), device_multiplier(config))
    device.applied = torch.tensor(3.0)
    host = torch.optim.lr_scheduler.LambdaLR(_optimizer(), lr_multiplier(config))
    for _ in range(3):
        host.optimizer.step()
        host.step()
    saved, reference = device.state_dict(), host.state_dict()
    assert set(saved) == set(reference) and "device_factor" not in saved and "applied" not in saved
    assert saved["last_epoch"] == reference["last_epoch"] == 3
    assert saved["base_lrs"] == reference["base_lrs"] == [0.1]
    assert saved["_last_lr"] == pytest.approx(reference["_last_lr"])


def test_each_loads_the_others_state():
    config = validate({"steps": 10, "schedule": {"warmup": 4}})
    device = DeviceLambdaLR(_optimizer(), lr_multiplier(config), device_multiplier(config))
    applied = device.applied = torch.tensor(0.0)
    host = torch.optim.lr_scheduler.LambdaLR(_optimizer(), lr_multiplier(config))
    for _ in range(5):
        host.optimizer.step()
        host.step()
    device.load_state_dict(host.state_dict())
    assert device.last_epoch == 5 and device.applied is applied and callable(device.device_factor)
    device.applied.fill_(7.0)
    host2 = torch.optim.lr_scheduler.LambdaLR(_optimizer(), lr_multiplier(config))
    host2.load_state_dict(device.state_dict())
    assert host2.last_epoch == 7


@pytest.mark.parametrize("decay", ["cosine", "linear"])
@pytest.mark.parametrize("steps, warmup", [(5, 4), (6, 5), (2, 1)])
def test_the_last_step_runs_at_the_floor_also_when_it_is_the_only_one_after_the_warm_up(decay, steps, warmup):
    # review_session26: steps=5, warmup=4 ran its last step at the peak, not at min_lr_ratio
    config = validate({"steps": steps, "schedule": {"warmup": warmup, "decay": decay, "min_lr_ratio": 0.1}})
    factors = [lr_multiplier(config)(u) for u in range(steps)]
    assert factors[warmup - 1] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert device_multiplier(config)(torch.tensor(steps - 1)).item() == pytest.approx(0.1)


def test_a_warm_up_longer_than_the_run_is_said(tmp_path):
    from ampguard.config import validate as load
    from ampguard.errors import AmpguardWarning
    from ampguard.train import run

    config = load({"task": {"name": "linear"}, "steps": 3, "precision": "fp32", "device": "cpu",
                   "schedule": {"warmup": 4}})
    with pytest.warns(AmpguardWarning, match=r"^schedule\.warmup 4 > steps 3: the learning rate never reaches "
                                             r"optimizer\.lr \(at most 0\.75 of it\)$"):
        run(config, console_every=1, print_fn=lambda line: None)
    import warnings

    with warnings.catch_warnings():  # (warmup == steps: its last step runs at the peak, nothing to say)
        warnings.simplefilter("error", AmpguardWarning)
        run(load({**config.model_dump(mode="json"), "steps": 4}), console_every=1, print_fn=lambda line: None)


@pytest.mark.parametrize("on_skip", ["hold", "step"])
def test_a_run_with_skips_ends_as_many_updates_short_of_the_floor_as_it_skipped(tmp_path, on_skip):
    # review 54c: the README said the LR reaches min_lr_ratio x lr "at the last step"; a skip holds the
    # schedule (counted in applied updates), so a run with k skips ends at update steps - 1 - k, above
    # the floor (what the README says now); scheduler_on_skip=step counts the skips and ends at it
    import csv

    from ampguard.run_folder import RunPaths
    from ampguard.train import run

    config = validate({"task": {"name": "linear"}, "steps": 8, "precision": "fp32", "device": "cpu",
                       "scheduler_on_skip": on_skip, "inject": ["nan_loss@3", "inf_grad@5"]})
    run(config, outputs=lambda: RunPaths(csv=tmp_path / "steps.csv"), console_every=10**6, print_fn=lambda line: None)
    with (tmp_path / "steps.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["skipped"] for r in rows].count("1") == 2
    skips = 2 if on_skip == "hold" else 0
    assert float(rows[-1]["lr"]) == pytest.approx(config.optimizer.lr * lr_multiplier(config)(config.steps - 1 - skips))
    assert (float(rows[-1]["lr"]) > config.optimizer.lr * 0.1 * 1.01) == (on_skip == "hold")
