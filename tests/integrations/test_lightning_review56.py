"""Review 56c F3: ``AmpGuardPlugin.records`` kept the step's records as they were made, three tensors
each (the loss and the two norms) though the sinks and the monitor had read their values: 30,000
device allocations at the default ``keep_records``. It keeps host copies: the same values, floats."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_lightning import Digits, fit, rows

L = pytest.importorskip("lightning")

from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.records import format_number  # noqa: E402


def test_the_plugins_records_hold_the_values_the_csv_got_and_no_tensor(tmp_path):
    path = tmp_path / "steps.csv"
    plugin = AmpGuardPlugin("bf16-mixed", max_norm=0.5, csv=path)
    fit(Digits(faults=["nan_loss@2", "inf_grad@4"]), plugin, steps=5)
    records = list(plugin.records)
    assert [(r.step, r.reason) for r in records] == [(1, None), (2, "non_finite_loss"), (3, None),
                                                     (4, "non_finite_grad"), (5, None)]
    held = [(r.step, f.name) for r in records for f in dataclasses.fields(r)
            if isinstance(getattr(r, f.name), torch.Tensor)]
    assert held == []  # (the loss and both norms of every record were tensors)
    numbers = ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale")
    for record, row in zip(records, rows(path), strict=True):
        values = record.values()
        assert all(type(values[n]) is float or values[n] is None for n in numbers), values
        assert [repr(getattr(record, n)) for n in numbers] == [repr(values[n]) for n in numbers]  # the fields are them
        assert [format_number(values[n]) for n in numbers] == [row[n] for n in numbers]  # the CSV's, bit for bit
