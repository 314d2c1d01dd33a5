"""The LR schedule on the host and on the device, and the DeviceLambdaLR that either path resumes from."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from torch import nn

from ampguard.config import validate
from ampguard.schedule import TABLE_CHUNK, DeviceLambdaLR, device_multiplier, factor_table, lr_multiplier


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


def _loop_table(config) -> torch.Tensor:
    """The device table as it was built before review 55b: the host function at every count."""
    host = lr_multiplier(config)
    return torch.tensor([host(u) for u in range(config.steps + 1)], dtype=torch.float64).to(torch.float32)


@pytest.mark.parametrize(("steps", "warmup", "decay", "floor"), [
    (200_000, 1000, "cosine", 0.1), (200_000, 0, "cosine", 0.0), (123_457, 7, "cosine", 1 / 3),
    (99_991, 7, "linear", 0.0), (50_000, 0, "linear", 0.2), (5_000, 5_000, "cosine", 0.1),
    (5_000, 9_000, "linear", 0.1), (5_000, 3, "constant", 0.1), (1, 0, "cosine", 0.1), (2, 1, "linear", 0.0)])
def test_the_vectorised_table_is_the_python_loops_bit_for_bit(steps, warmup, decay, floor):
    # review 55b: the table was a Python loop over every count (40 s, 1.15 GB at 20M steps); now
    # torch's float64 operations in the host function's order, chunk by chunk; entries a 1-ulp
    # difference in cos could round otherwise are the host function's own
    config = validate({"steps": steps, "schedule": {"warmup": warmup, "decay": decay, "min_lr_ratio": floor}})
    loop = _loop_table(config)
    for chunk in (TABLE_CHUNK, 4093):  # (chunk edges inside the warm-up and the decay)
        table = factor_table(config, chunk=chunk)
        assert table.dtype == torch.float32 and table.shape == (steps + 1,)
        assert torch.equal(table.view(torch.int32), loop.view(torch.int32))


def test_an_entry_the_table_is_unsure_of_is_the_host_functions(monkeypatch):
    # (torch's cos and the C library's may differ by an ulp, which on this CPU moves no float32
    # entry of the configs above: with every entry unsure, each is the host function's own)
    from ampguard import schedule

    config = validate({"steps": 3000, "schedule": {"warmup": 30, "decay": "cosine", "min_lr_ratio": 0.0}})
    monkeypatch.setattr(schedule, "_CLOSE", 1.0)
    assert torch.equal(factor_table(config, chunk=1000).view(torch.int32), _loop_table(config).view(torch.int32))


def test_a_table_past_2_24_counts_is_built_without_a_python_loop_and_looked_up_exactly():
    # review 55b: float32 positions put the lookup at 2**24 two entries off, and a float32 count
    # stopped there; the loop held every factor as a Python float (~0.5 GB here, ~55 GB at 10**9)
    steps = 2**24 + 4096
    config = validate({"steps": steps, "schedule": {"warmup": 100, "decay": "linear"}})
    tracemalloc.start()  # (Python's own allocations: a list of floats shows, torch's buffers do not)
    try:
        factor = device_multiplier(config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**22
    host = lr_multiplier(config)
    counts = [*range(2**24 - 3, 2**24 + 4), steps - 2, steps - 1, steps, steps + 9, 2**40, 0, 99, 100, -5]
    got = [factor(torch.tensor(u)).item() for u in counts]
    assert got == [torch.tensor(host(max(u, 0)), dtype=torch.float64).float().item() for u in counts]
    assert len(set(got[:7])) == 7  # (the schedule moves at every count there: an entry off would show)


def test_the_count_is_read_on_its_own_device_and_never_indexed_by_python():
    config = validate({"steps": 10, "schedule": {"warmup": 2}})
    factor = device_multiplier(config)
    applied = torch.tensor(1.0)
    assert factor(applied).shape == () and factor(applied).item() == pytest.approx(1.0)
    assert factor(torch.tensor(-3.0)).item() == pytest.approx(0.5)  # clamped at the first entry
    assert factor(torch.tensor(1.0, dtype=torch.float64)).item() == factor(applied).item()  # a count of any float dtype
    assert factor(torch.tensor(1)).item() == factor(applied).item()  # the step's int64 count


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
