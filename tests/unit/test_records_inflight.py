"""InFlight: records read back behind the step, in order, never more than ``lag`` behind."""

from __future__ import annotations

import pytest
import torch

from ampguard.records import LAG, InFlight, PendingStep, Prefetch, StepLog


def _record(step: int) -> StepLog:
    return StepLog(step, lr=0.1, loss=torch.tensor(float(step)), grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0,
                   scaler_scale=1.0)


class Copies:
    """Prefetches whose copies land when the test says so (a fake device)."""

    def __init__(self, monkeypatch):
        self.landed: set[int] = set()
        self.waited: list[int] = []
        copies = self

        def prefetch(record):
            def wait():
                copies.waited.append(record.step)
                return record.values()

            return Prefetch(wait, lambda: record.step in copies.landed)

        monkeypatch.setattr(StepLog, "prefetch", prefetch)


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_a_record_is_never_more_than_lag_steps_behind(monkeypatch, lag):
    copies = Copies(monkeypatch)  # none lands by itself: every record waits until it is lag behind
    flight = InFlight(lag=lag)
    handled = []
    for step in range(1, 11):
        flight.add(_record(step), None)
        handled += [r.step for r, _ in flight.ready()]
        assert len(flight) <= lag and step - len(flight) == len(handled)
    assert handled == list(range(1, 11 - lag))
    assert [r.step for r, _ in flight.drain()] == list(range(11 - lag, 11)) and len(flight) == 0
    assert copies.waited == list(range(1, 11))  # each waited for once, in order


def test_landed_records_come_back_at_once_in_order_and_an_unlanded_one_holds_the_later(monkeypatch):
    copies = Copies(monkeypatch)
    flight = InFlight(lag=3)
    flight.add(_record(1), "m1")
    flight.add(_record(2), None)
    copies.landed |= {2}  # step 2 landed first: it still waits for step 1
    assert list(flight.ready()) == []
    copies.landed |= {1}
    assert [(r.step, extra) for r, extra in flight.ready()] == [(1, "m1"), (2, None)]


def test_lag_zero_reads_each_record_on_the_spot():
    flight = InFlight(lag=0)
    record = _record(1)
    flight.add(record, None)
    assert [r.step for r, _ in flight.ready()] == [1] and record._host is not None


def test_the_default_lag_is_two():
    assert InFlight().lag == LAG == 2


def test_a_packed_record_reads_back_with_one_copy_and_its_views():
    packed = torch.tensor([0.1, 2.0, float("inf"), float("nan"), 512.0, 0.0])
    lr, loss, pre, post, scale, mark = packed.unbind()
    record = PendingStep(3, lr=lr, loss=loss, grad_l2_pre_clip=pre, grad_l2_post_clip=post, scaler_scale=scale,
                         loss_mark=mark, packed=packed)
    values = record.prefetch()()
    assert values["grad_l2_post_clip"] is None and values["scaler_scale"] == 512.0  # a skip has no post-clip norm
    assert record.skipped and record.reason == "non_finite_grad"
    assert values["lr"] == pytest.approx(0.1)
