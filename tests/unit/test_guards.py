"""The guards' decisions (``ampguard.guards``): Continue / Rollback / Stop, typed by ``kind``.

``Guards.check`` is fed hand-made records through a real :class:`RunMonitor`; ``Rollbacks.apply``
runs over a :class:`CheckpointManager` of fake parts (and a real :class:`DataStream` where the
batches themselves are the subject).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ampguard import guards as g
from ampguard.checkpointer import (
    CONFIG, DATA, MODEL, OPTIMIZER, RNG, ROLLBACK_PARTS, ROLLBACKS, SCHEDULER, STATE, STEP, CheckpointManager,
)
from ampguard.config import validate
from ampguard.data import DataStream
from ampguard.errors import ExitCode
from ampguard.events import EventLog
from ampguard.faults import FaultInjector
from ampguard.guards import Continue, Guards, Rollback, Rollbacks, Stop
from ampguard.monitor import FAIL_SCALE_COLLAPSE, FAIL_SKIP_RATE, LossSpikeDetector, RunMonitor
from ampguard.records import SkipLog, StepLog
from ampguard.tasks import build_task


def clean(step: int, loss: float = 1.0, scale: float = 1.0) -> StepLog:
    return StepLog(step, lr=torch.tensor(0.1), loss=torch.tensor(loss), grad_l2_pre_clip=torch.tensor(0.5),
                   grad_l2_post_clip=torch.tensor(0.5), scaler_scale=torch.tensor(scale))


def skip(step: int, reason: str = "non_finite_grad", scale: float = 1.0) -> SkipLog:
    loss = float("nan") if reason == "non_finite_loss" else 1.0
    return SkipLog(step, lr=torch.tensor(0.1), loss=torch.tensor(loss), grad_l2_pre_clip=None,
                   grad_l2_post_clip=None, scaler_scale=torch.tensor(scale), reason=reason)


def monitor_for(config: Any, scaler_enabled: bool = False, **kwargs: Any) -> RunMonitor:
    m = config.monitor
    return RunMonitor(window=m.window, fail_rate=m.fail_rate, fail_after=m.fail_after, scaler_enabled=scaler_enabled,
                      min_steps=0, **kwargs)


def feed(guards: Guards, monitor: RunMonitor, records: list, diagnosis: str | None = None) -> list:
    decisions = []
    for record in records:
        monitor.observe(record)
        decisions.append(guards.check(record, diagnosis))
    return decisions


GUARDED = {"monitor": {"window": 10, "fail_rate": 0.3, "fail_after": 3}}


# ---------------------------------------------------------------------------- Guards.check


def test_clean_steps_continue():
    config = validate(GUARDED)
    monitor = monitor_for(config)
    decisions = feed(Guards(config, monitor), monitor, [clean(s) for s in range(1, 21)])
    assert decisions == [g.CONTINUE] * 20 and all(isinstance(d, Continue) for d in decisions)


def test_a_few_skips_under_the_fail_rate_continue():
    config = validate(GUARDED)
    monitor = monitor_for(config)
    records = [skip(s) if s in (4, 12) else clean(s) for s in range(1, 21)]
    assert set(feed(Guards(config, monitor), monitor, records)) == {g.CONTINUE}


def test_the_skip_rate_guard_stops_when_it_fails_not_a_step_earlier():
    config = validate(GUARDED)
    monitor = monitor_for(config)
    guards = Guards(config, monitor)
    # rates 1/6, 2/7 (not above 0.3), 3/8, 4/9, 5/10: the third step above the fail rate is step 10
    decisions = feed(guards, monitor, [clean(s) for s in range(1, 6)] + [skip(s) for s in range(6, 10)])
    assert decisions == [g.CONTINUE] * 9
    stop = feed(guards, monitor, [skip(10)])[0]
    assert isinstance(stop, Stop)
    assert stop.exit_code == ExitCode.GUARD and stop.kind == FAIL_SKIP_RATE == monitor.failed.cause
    assert stop.why.startswith("stopped by the guard at step 10: ") and monitor.failed.message in stop.why


def test_a_scale_collapse_stops_with_the_monitors_cause():
    config = validate({"precision": "fp16", "monitor": {"fail_on_scale_collapse": True, "fail_after": 2}})
    monitor = monitor_for(config, scaler_enabled=True, init_scale=4.0, min_scale=1.0, fail_on_scale_collapse=True)
    decisions = feed(Guards(config, monitor), monitor,
                     [skip(1, scale=2.0), skip(2, scale=1.0), skip(3, scale=1.0)])
    assert decisions[:2] == [g.CONTINUE, g.CONTINUE]
    assert isinstance(decisions[2], Stop) and decisions[2].kind == FAIL_SCALE_COLLAPSE
    assert decisions[2].exit_code == ExitCode.GUARD


@pytest.mark.parametrize(("fail_after", "first_clean"), [(3, 5), (1, 5), (2, 0)])
def test_the_skip_guard_trigger_rolls_back_to_before_the_first_bad_step(fail_after, first_clean):
    config = validate({"monitor": {"window": 10, "fail_rate": 0.1, "fail_after": fail_after},
                       "rollback": {"triggers": ["skip_guard"]}, "checkpoint": {"every": 5}})
    monitor = monitor_for(config)
    guards = Guards(config, monitor)
    records = [clean(s) for s in range(1, first_clean + 1)]
    records += [skip(s) for s in range(first_clean + 1, first_clean + 11)]
    decisions = feed(guards, monitor, records)
    fail_at = first_clean + fail_after  # every skip lifts the rate above 0.1
    assert decisions[: fail_at - 1] == [g.CONTINUE] * (fail_at - 1)
    rollback = decisions[fail_at - 1]
    assert isinstance(rollback, Rollback) and rollback.kind == g.SKIP_GUARD
    assert rollback.first_bad_step == fail_at - fail_after + 1 == first_clean + 1
    assert rollback.why.startswith("skip-rate guard: ")


def test_a_scale_collapse_is_a_stop_even_with_the_skip_guard_trigger():
    config = validate({"precision": "fp16", "rollback": {"triggers": ["skip_guard"]}, "checkpoint": {"every": 5},
                       "monitor": {"fail_rate": 0.99, "fail_after": 2, "fail_on_scale_collapse": True}})
    monitor = monitor_for(config, scaler_enabled=True, init_scale=2.0, min_scale=1.0, fail_on_scale_collapse=True)
    decisions = feed(Guards(config, monitor), monitor, [clean(1, scale=2.0), skip(2), skip(3)])
    assert isinstance(decisions[-1], Stop) and decisions[-1].kind == FAIL_SCALE_COLLAPSE


def test_the_skip_guard_without_its_trigger_stops_even_with_the_loss_spike_trigger():
    config = validate({**GUARDED, "rollback": {"triggers": ["loss_spike"]}, "checkpoint": {"every": 5}})
    monitor = monitor_for(config)
    guards = Guards(config, monitor, LossSpikeDetector(config.rollback.window, config.rollback.z))
    decisions = feed(guards, monitor, [skip(s) for s in range(1, 4)])
    assert isinstance(decisions[-1], Stop) and decisions[-1].kind == FAIL_SKIP_RATE


SPIKE = {"rollback": {"triggers": ["loss_spike"], "window": 4, "z": 3.0}, "checkpoint": {"every": 5}}


def spike_guards(**extra: Any) -> tuple[Guards, RunMonitor, LossSpikeDetector]:
    config = validate({**SPIKE, **extra})
    monitor = monitor_for(config)
    spikes = LossSpikeDetector(config.rollback.window, config.rollback.z)
    return Guards(config, monitor, spikes), monitor, spikes


def test_a_loss_spike_after_a_full_window_of_steady_losses_rolls_back_to_before_it():
    guards, monitor, _ = spike_guards()
    decisions = feed(guards, monitor, [clean(s, loss=2.0) for s in range(1, 5)] + [clean(5, loss=40.0)])
    assert decisions[:4] == [g.CONTINUE] * 4
    rollback = decisions[4]
    assert isinstance(rollback, Rollback) and rollback.kind == g.LOSS_SPIKE and rollback.first_bad_step == 5
    assert rollback.why == "loss spike (40 > mean + 3 std)"


def test_a_loss_spike_on_the_step_the_skip_rate_guard_fails_does_not_hide_the_stop():
    # the rollback for the spike would restart the monitor's windows and forget the failure
    guards, monitor, _ = spike_guards(monitor={"window": 10, "fail_rate": 0.3, "fail_after": 3})
    records = [clean(s, loss=2.0) for s in range(1, 5)] + [skip(s) for s in (5, 6, 7)] + [clean(8, loss=40.0)]
    decisions = feed(guards, monitor, records)
    assert decisions[:7] == [g.CONTINUE] * 7
    assert monitor.failed is not None and monitor.failed.step == 8  # rates .33, .43, .375 above 0.3
    assert isinstance(decisions[7], Stop) and decisions[7].kind == FAIL_SKIP_RATE


def test_a_spike_before_the_window_is_full_is_not_judged():
    guards, monitor, _ = spike_guards()
    decisions = feed(guards, monitor, [clean(s, loss=2.0) for s in range(1, 4)] + [clean(4, loss=1e6)])
    assert decisions == [g.CONTINUE] * 4


def test_a_skipped_step_is_never_a_loss_spike_and_does_not_enter_the_window():
    guards, monitor, spikes = spike_guards()
    feed(guards, monitor, [clean(s, loss=2.0) for s in range(1, 5)])
    before = spikes.state_dict()
    assert feed(guards, monitor, [skip(5, "non_finite_loss"), skip(6, "non_finite_grad")]) == [g.CONTINUE] * 2
    assert spikes.state_dict() == before
    assert isinstance(feed(guards, monitor, [clean(7, loss=3.0)])[0], Rollback)


def test_strict_mode_stops_at_the_first_skip_with_the_diagnosis():
    config = validate({"diagnose": {"strict": True}})
    monitor = monitor_for(config)
    guards = Guards(config, monitor)
    assert feed(guards, monitor, [clean(1), clean(2)], "unused") == [g.CONTINUE] * 2
    finding = "step 3 (non_finite_grad): first non-finite value in fc1.weight.grad"
    stop = feed(guards, monitor, [skip(3)], finding)[0]
    assert isinstance(stop, Stop) and stop.kind == g.STRICT and stop.exit_code == ExitCode.GUARD
    assert stop.why == f"strict mode: non-finite gradient at step 3: {finding}"
    stop = feed(guards, monitor, [skip(4, "non_finite_loss")], "the loss")[0]
    assert stop.why == "strict mode: non-finite loss at step 4: the loss"


def test_strict_mode_wins_over_the_skip_guard_trigger():
    config = validate({"diagnose": {"strict": True}, "monitor": {"fail_rate": 0.1, "fail_after": 1},
                       "rollback": {"triggers": ["skip_guard"]}, "checkpoint": {"every": 5}})
    monitor = monitor_for(config)
    decision = feed(Guards(config, monitor), monitor, [skip(1)], "why")[0]
    assert isinstance(decision, Stop) and decision.kind == g.STRICT


# ---------------------------------------------------------------------------- Rollbacks.apply


class Part:
    """A fake part: ``value`` is its state; ``loads`` counts its restores."""

    def __init__(self, value: Any) -> None:
        self.value, self.loads = value, 0

    def state_dict(self) -> Any:
        return {"value": self.value}

    def load_state_dict(self, state: Any) -> None:
        self.value, self.loads = state["value"], self.loads + 1


class FakeStep:
    """Stands in for AmpTrainState: step and update counters, a scaler value, monitors' state, an
    optimizer and (a test may set one) a scheduler."""

    def __init__(self) -> None:
        self.steps, self.updates, self.scale, self.loaded = 0, 0, 1024.0, None
        self.optimizer, self.scheduler = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), None
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)  # (no loss scaler: nothing for the monitor)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.steps, "updates": self.updates, "scaler": self.scale,
                "monitors": {"run": {"steps": self.steps}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state
        self.steps, self.updates, self.scale = state["step"], state["updates"], state["scaler"]


class FakeData:
    """Stands in for DataStream: a position, seek, and a count of restores."""

    def __init__(self) -> None:
        self.position, self.loads, self.seeks = 0, 0, []

    def seek(self, position: int) -> None:
        self.position = position
        self.seeks.append(position)

    def state_dict(self) -> int:
        return self.position

    def load_state_dict(self, position: int) -> None:
        self.loads += 1
        self.seek(position)


class World:
    """Fake parts under a real CheckpointManager, and a Rollbacks over them."""

    def __init__(self, folder: Path, data: Any = None, **rollback: Any) -> None:
        rollback.setdefault("skip_batches", 3)
        self.config = validate({"rollback": {"triggers": ["loss_spike"], "window": 2, **rollback},
                                "checkpoint": {"every": 5}, "monitor": {"fail_rate": 0.5, "fail_after": 1}})
        self.step = FakeStep()
        self.data = data if data is not None else FakeData()
        self.parts = {MODEL: Part("w0"), OPTIMIZER: Part("m0"), SCHEDULER: Part("s0"), RNG: Part("r0")}
        self.manager = CheckpointManager(folder, {**self.parts, STATE: self.step, DATA: self.data}, keep=10,
                                         meta=lambda: {STEP: self.step.steps, CONFIG: {}})
        self.monitor = RunMonitor(window=5, fail_rate=0.5, fail_after=1, scaler_enabled=False, min_steps=0)
        self.spikes = LossSpikeDetector(2, 3.0)
        self.lines: list[str] = []
        self.rollbacks = Rollbacks(self.config, self.manager, self.step, self.data, self.monitor, self.spikes,
                                   EventLog(None, self.lines.append))
        self.manager.parts[ROLLBACKS] = self.rollbacks

    def advance(self, step: int, batches_per_step: int = 2) -> None:
        """Train on to ``step``: every part changes, the data moves on."""
        self.step.steps, self.step.scale = step, 1024.0 / step
        for name, part in self.parts.items():
            part.value = f"{name}@{step}"
        self.data.seek(step * batches_per_step)

    def save_at(self, step: int) -> None:
        self.advance(step)
        self.manager.save(step)


def test_a_rollback_restores_the_training_state_keeps_the_step_and_seeks_past_the_bad_data(tmp_path):
    w = World(tmp_path)
    w.save_at(10)
    w.advance(14)
    w.rollbacks.log = ["step 3: an earlier rollback"]  # not in the checkpoint: a rollback must keep it
    w.monitor.observe(skip(14))
    w.spikes.check(1.0)
    w.spikes.check(1.0)
    assert w.monitor.failed is not None and w.spikes.check(100.0)

    decision = w.rollbacks.apply(Rollback(12, "loss spike (100 > mean + 3 std)", g.LOSS_SPIKE))
    assert decision == g.CONTINUE
    assert {name: p.value for name, p in w.parts.items()} == {MODEL: "model@10", OPTIMIZER: "optimizer@10",
                                                             SCHEDULER: "scheduler@10", RNG: "rng@10"}
    assert w.step.scale == 1024.0 / 10  # the scaler goes back ...
    assert w.step.steps == 14 and w.step.loaded["step"] == 14  # ... the step counter does not
    assert w.step.loaded["monitors"] == {}  # the monitors' history goes on (not reloaded from the checkpoint)
    # not restored: sought to checkpoint + skip_batches (20 + 3), but never back onto the triggering
    # step's batches (26, 27): the stream goes on at 28
    assert w.data.loads == 0 and w.data.position == 28
    assert w.rollbacks.log[0] == "step 3: an earlier rollback" and len(w.rollbacks.log) == 2
    assert w.rollbacks.log[1].startswith("step 14: loss spike (100 > mean + 3 std): rolled back to step-00000010.pt")
    assert len(w.lines) == 1
    assert w.lines[0] == ("ROLLBACK 14 loss spike (100 > mean + 3 std): rolled back to step-00000010.pt (step 10); "
                          "the data goes on at position 28, 8 batches past the checkpoint (at 20)")
    assert w.monitor.failed is None  # the windows restart ...
    # ... but the spike detector's, full, judges on: this checkpoint kept none (it was blind until it
    # filled again, and the spikes in that time joined it: review 51j)
    assert w.spikes.check(100.0) is True


def test_a_rollback_restores_exactly_the_rollback_parts(tmp_path):
    w = World(tmp_path)
    w.save_at(10)
    w.advance(12)
    restored: list[str] = []
    manager_restore = w.manager.restore

    def spy(loaded, parts=None):
        restored.extend(parts)
        return manager_restore(loaded, parts)

    w.manager.restore = spy
    assert w.rollbacks.apply(Rollback(12, "why", g.LOSS_SPIKE)) == g.CONTINUE
    assert tuple(restored) == ROLLBACK_PARTS == (MODEL, OPTIMIZER, SCHEDULER, STATE, RNG)
    assert DATA not in restored and ROLLBACKS not in restored


@pytest.mark.parametrize(("first_bad", "expected"), [(16, 15), (15, 10), (11, 10)])
def test_a_rollback_goes_to_the_newest_checkpoint_strictly_before_the_first_bad_step(tmp_path, first_bad, expected):
    w = World(tmp_path, skip_batches=0)
    w.save_at(10)
    w.save_at(15)
    w.advance(17)
    assert w.rollbacks.apply(Rollback(first_bad, "why", g.SKIP_GUARD)) == g.CONTINUE
    assert w.parts[MODEL].value == f"model@{expected}"
    assert w.data.position == 17 * 2 and w.step.steps == 17  # skip_batches 0: on from the trigger, not back


def test_no_checkpoint_before_the_bad_step_stops_and_restores_nothing(tmp_path):
    w = World(tmp_path)
    w.save_at(10)
    w.advance(12)
    decision = w.rollbacks.apply(Rollback(10, "skip-rate guard: too many skips", g.SKIP_GUARD))
    assert isinstance(decision, Stop) and decision.kind == g.NO_CHECKPOINT and decision.exit_code == ExitCode.GUARD
    assert decision.why.startswith("stopped at step 12: skip-rate guard: too many skips; cannot roll back: ")
    assert "before step 10" in decision.why
    assert w.parts[MODEL].value == "model@12" and w.parts[MODEL].loads == 0 and w.data.position == 24
    assert w.rollbacks.log == [] and w.lines == []


def test_no_checkpoint_at_all_stops(tmp_path):
    w = World(tmp_path / "empty")
    w.advance(3)
    decision = w.rollbacks.apply(Rollback(3, "why", g.LOSS_SPIKE))
    assert isinstance(decision, Stop) and decision.kind == g.NO_CHECKPOINT


@pytest.mark.parametrize("allowed", [0, 1, 2])
def test_after_rollback_max_rollbacks_the_next_one_stops(tmp_path, allowed):
    w = World(tmp_path, max=allowed)
    w.save_at(10)
    for n in range(allowed):
        w.advance(12 + n)
        assert w.rollbacks.apply(Rollback(12, "why", g.LOSS_SPIKE)) == g.CONTINUE
    w.advance(20)
    decision = w.rollbacks.apply(Rollback(12, "loss spike", g.LOSS_SPIKE))
    assert isinstance(decision, Stop) and decision.kind == g.ROLLBACKS_USED_UP and decision.exit_code == ExitCode.GUARD
    from ampguard.guards import _used_up

    assert decision.why == f"stopped at step 20: loss spike; {_used_up(allowed)}{g.UNSAVED}" and decision.unsaved
    assert w.parts[MODEL].value == "model@20" and len(w.rollbacks.log) == allowed and len(w.lines) == allowed


def test_the_rollback_log_is_a_checkpointed_part(tmp_path):
    w = World(tmp_path)
    w.save_at(10)
    w.advance(12)
    w.rollbacks.apply(Rollback(12, "why", g.LOSS_SPIKE))
    w.save_at(20)
    other = World(tmp_path)
    other.manager.restore(other.manager.load())
    assert other.rollbacks.log == w.rollbacks.log and len(other.rollbacks.log) == 1
    assert other.rollbacks.state_dict() is not other.rollbacks.log  # a copy, not the live list


@pytest.mark.parametrize("skip_batches, resumes_at", [
    (8, 16),  # checkpoint at data position 8 + skip 8: past the trigger's batch (13)
    (2, 14),  # 8 + 2 = 10 would train on batch 13 again and trigger again: the stream goes on at 14
])
def test_after_a_rollback_the_stream_goes_on_past_the_checkpoint_plus_skip_and_the_triggering_batch(
        tmp_path, skip_batches, resumes_at):
    task = build_task(validate({"task": {"name": "linear", "batch_size": 2}}))
    reference = DataStream(task, FaultInjector([]), torch.device("cpu"))
    expected = [reference.next(first_step=1) for _ in range(30)]

    data = DataStream(task, FaultInjector([]), torch.device("cpu"))
    w = World(tmp_path, data=data, skip_batches=skip_batches)
    for _ in range(8):
        data.next(first_step=1)
    w.step.steps = 4
    w.manager.save(4)  # data position 8
    for _ in range(6):  # batches 8..13; the trigger's is 13
        data.next(first_step=5)
    w.step.steps = 7
    assert w.rollbacks.apply(Rollback(6, "why", g.LOSS_SPIKE)) == g.CONTINUE
    assert data.position == resumes_at
    x, y = data.next(first_step=8)
    assert torch.equal(x, expected[resumes_at][0]) and torch.equal(y, expected[resumes_at][1])
    assert data.position == resumes_at + 1
    if skip_batches == 2:
        assert "the data goes on at position 14, 6 batches past the checkpoint (at 8)" in w.rollbacks.log[-1]


# ---------------------------------------------------------------------------- under torchrun: ranks agree (issue 16)


class OtherRank:
    """Stands in for ``distributed.all_gather`` in a world of 2: this process is rank 0, and rank 1
    answers each call with the next of ``answers``."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)

    def __call__(self, obj: Any) -> list[Any]:
        return [obj, self.answers.pop(0)]


def test_the_first_skip_diagnosis_names_the_rank_where_the_value_was_born(monkeypatch):
    from ampguard import distributed
    from ampguard.locate import Diagnosis, Finding
    from ampguard.step import AmpTrainState

    model = torch.nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                          precision="bf16")
    born = Diagnosis(Finding("loss", op="injected_loss", kind="nan", precision="bf16"),
                     Finding("loss", op="injected_loss", kind="nan", precision="fp32"), "data/model")
    monkeypatch.setattr(distributed, "all_gather", OtherRank((born, None)))  # (its finding; its replay did not fail)
    lines: list[str] = []
    diagnosis = g.FirstSkipDiagnosis(state, model, EventLog(None, lines.append))
    diagnosis.capture((torch.ones(4, 2), torch.zeros(4, 1)))  # rank 0's own share is clean
    found = diagnosis.after(skip(3, "non_finite_loss"))
    assert found == ("step 3 (non_finite_loss) on rank 1: first nan under bf16: in the loss (injected_loss). "
                     "FP32 replay is not finite either: a data or model problem, not a precision one")
    assert lines == [f"DIAGNOSIS 3 {found}"]


def test_a_diagnosis_that_no_rank_can_place_says_so(monkeypatch):
    from ampguard import distributed
    from ampguard.locate import Diagnosis, Finding
    from ampguard.step import AmpTrainState

    model = torch.nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                          precision="bf16")
    monkeypatch.setattr(distributed, "all_gather",
                        OtherRank((Diagnosis(Finding("none", precision="bf16"), None, "none"), None)))
    diagnosis = g.FirstSkipDiagnosis(state, model)
    diagnosis.capture((torch.ones(4, 2), torch.zeros(4, 1)))
    assert diagnosis.after(skip(2)) == ("step 2 (non_finite_grad): no non-finite value in forward, loss or backward "
                                        "under bf16 on any of the 2 ranks")


def test_a_rollback_goes_ahead_only_when_every_rank_loaded_the_checkpoint(tmp_path, monkeypatch):
    from ampguard import distributed

    w = World(tmp_path)
    w.save_at(10)
    w.advance(14)
    # rank 1 could not read it: its name is None and its problem the first error
    monkeypatch.setattr(distributed, "all_gather", OtherRank((None, "no loadable checkpoint before step 12 in ckpts")))
    decision = w.rollbacks.apply(Rollback(12, "loss spike", g.LOSS_SPIKE))
    assert isinstance(decision, Stop) and decision.kind == g.NO_CHECKPOINT and decision.exit_code == ExitCode.GUARD
    assert decision.why == ("stopped at step 14: loss spike; cannot roll back: no loadable checkpoint before step 12 "
                            "in ckpts" + g.UNSAVED)
    assert {name: p.value for name, p in w.parts.items()}[MODEL] == "model@14"  # nothing restored on this rank
    assert w.rollbacks.log == []


def test_a_rollback_stops_when_the_ranks_found_different_checkpoints(tmp_path, monkeypatch):
    from ampguard import distributed

    w = World(tmp_path)
    w.save_at(10)
    w.advance(14)
    monkeypatch.setattr(distributed, "all_gather", OtherRank(("step-00000005.pt", None)))
    decision = w.rollbacks.apply(Rollback(12, "loss spike", g.LOSS_SPIKE))
    assert isinstance(decision, Stop) and decision.kind == g.NO_CHECKPOINT
    assert decision.why.endswith("the ranks found different checkpoints (step-00000010.pt, step-00000005.pt)"
                                 + g.UNSAVED)
    assert w.parts[MODEL].value == "model@14"


# ---------------------------------------------------------------------------- issue item 11


def test_a_held_out_regression_rolls_back_to_before_the_previous_evaluation():
    config = validate({"rollback": {"triggers": ["val_regression"], "val_regression": 0.2},
                       "checkpoint": {"every": 5}, "eval": {"every": 5}})
    monitor = RunMonitor(scaler_enabled=False)
    guards = Guards(config, monitor, metrics=("val_loss", "val_accuracy"))
    for step, value in ((5, 2.0), (10, 1.0), (15, 1.2)):  # 1.2 = best + 0.2 x 1: not beyond
        monitor.observe(clean(step))
        monitor.observe_eval({"val_loss": value})
        assert guards.check(clean(step), None, {"val_loss": value}) == g.CONTINUE
    monitor.observe(clean(16))
    assert guards.check(clean(16), None, None) == g.CONTINUE  # no evaluation at this step: nothing judged
    monitor.observe(clean(20))
    monitor.observe_eval({"val_loss": 1.21})
    decision = guards.check(clean(20), None, {"val_loss": 1.21})
    assert isinstance(decision, Rollback) and decision.kind == g.VAL_REGRESSION
    assert decision.first_bad_step == 16  # the checkpoint at 15 (judged fine at its evaluation) is the newest allowed
    assert "val_loss 1.21 > best 1 + 0.2 x 1" in decision.why


def test_a_non_finite_first_evaluation_rolls_back_to_before_step_1_and_without_a_checkpoint_stops(tmp_path):
    # the first evaluation has no best to regress from, but a NaN there is judged all the same: its
    # rollback target is before step 1 (train saves step 0 for it); with no checkpoint that old the
    # run stops (exit 3) rather than train on from a state no evaluation vouched for
    config = validate({"rollback": {"triggers": ["val_regression"]}, "checkpoint": {"every": 5}, "eval": {"every": 5}})
    monitor = RunMonitor(scaler_enabled=False)
    guards = Guards(config, monitor, metrics=("val_loss",))
    for step in range(1, 6):
        monitor.observe(clean(step))
    monitor.observe_eval({"val_loss": float("nan")})
    decision = guards.check(clean(5), None, {"val_loss": float("nan")})
    assert isinstance(decision, Rollback) and decision.kind == g.VAL_REGRESSION
    assert decision.first_bad_step == 1 and decision.why == "held-out regression at step 5 (val_loss nan is not finite)"

    w = World(tmp_path)  # checkpoints at step 5 and later only: none before step 1
    w.save_at(5)
    stop = w.rollbacks.apply(decision)
    assert isinstance(stop, Stop) and stop.kind == g.NO_CHECKPOINT and stop.exit_code == 3


def test_an_accuracy_regresses_downwards():
    config = validate({"rollback": {"triggers": ["val_regression"], "val_metric": "val_accuracy"},
                       "checkpoint": {"every": 5}, "eval": {"every": 5}})
    monitor = RunMonitor(scaler_enabled=False)
    guards = Guards(config, monitor, metrics=("val_loss", "val_accuracy"))
    monitor.observe_eval({"val_accuracy": 0.9})
    assert guards.val_regression(0.85) is None
    monitor.observe_eval({"val_accuracy": 0.5})
    assert guards.val_regression(0.5) == "val_accuracy 0.5 < best 0.9 - 0.1 x 0.9"


def test_after_a_rollback_the_monitors_updates_are_the_checkpoints(tmp_path):
    # the run card's "updates applied" comes from the monitor: the updates after the checkpoint are undone
    w = World(tmp_path)
    w.step.updates = 9
    w.save_at(10)
    w.advance(14)
    for step in range(1, 15):
        w.monitor.observe(clean(step))
    w.step.updates = 13
    assert w.monitor.updates == 14
    assert w.rollbacks.apply(Rollback(12, "why", g.LOSS_SPIKE)) == g.CONTINUE
    assert w.step.updates == 9 and w.monitor.updates == 9
    w.monitor.observe(clean(15))
    assert w.monitor.updates == 10


@pytest.mark.parametrize("lr_factor, stale, expected", [
    (0.5, True, 0.003 * 0.5),  # a resume's LR change newer than the checkpoint, and the factor
    (0.5, False, 0.003 * 0.5),  # the factor alone
    (1.0, True, 0.003),  # the LR change alone: no lr in the message
])
def test_a_rollback_sets_the_lr_in_one_call(tmp_path, monkeypatch, lr_factor, stale, expected):
    # restoring settings after a rollback is one path (checkpointer.apply_policy_changes): the LR
    # is set once, to optimizer.lr x lr_factor ** n, however many reasons there are to set it
    from ampguard import checkpointer as ck

    w = World(tmp_path, lr_factor=lr_factor)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # the checkpoint's LR
    w.step.optimizer, w.step.scheduler = optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0)
    w.save_at(10)
    w.advance(14)
    if stale:  # resumed at step 12 with the config's LR (0.003): after the checkpoint, so re-applied
        w.rollbacks.policy = [{"key": "optimizer.lr", "old": 0.1, "new": 0.003, "step": 12}]
    calls: list[float] = []
    real = ck.set_base_lr

    def counted(scheduler: Any, lr: float) -> None:
        calls.append(lr)
        real(scheduler, lr)

    monkeypatch.setattr(ck, "set_base_lr", counted)
    monkeypatch.setattr(g, "set_base_lr", counted, raising=False)  # wherever the rollback might call it
    assert w.rollbacks.apply(Rollback(12, "loss spike", g.LOSS_SPIKE)) == g.CONTINUE
    assert calls == [pytest.approx(expected)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    assert w.step.scheduler.base_lrs == [pytest.approx(expected)]
    mentioned = f"; lr {expected:.4g} (rollback.lr_factor {lr_factor:g})"
    assert (mentioned in w.lines[0]) == (lr_factor != 1.0)
    assert ("lr_factor" in w.rollbacks.log[0]) == (lr_factor != 1.0)


def test_the_checkpoint_kept_beside_rollback_evidence_never_writes_through_another_file(tmp_path):
    # review_tests14 #1 (B10): a name already taken by a hard link to an older checkpoint was copied
    # into, so the older checkpoint itself took the new weights
    import os

    (tmp_path / "rollback").mkdir()
    older, newer = tmp_path / "step-00000005.pt", tmp_path / "step-00000010.pt"
    older.write_bytes(b"OLD WEIGHTS")
    newer.write_bytes(b"NEW WEIGHTS")
    os.link(older, tmp_path / "rollback" / "step-15.checkpoint.pt")  # (an earlier pass over step 15)
    kept = g._keep_base(tmp_path / "rollback" / "step-15.pt", newer)
    assert kept is not None and kept.read_bytes() == b"NEW WEIGHTS"
    assert older.read_bytes() == b"OLD WEIGHTS"


def test_a_kill_while_the_evidence_checkpoint_is_copied_leaves_no_file_by_its_name(tmp_path, monkeypatch):
    # the copy (where the file system takes no hard link) went to the final name: a kill mid-copy
    # left a truncated step-N.checkpoint.pt for `locate --checkpoint` to choke on
    import os
    import shutil

    (tmp_path / "rollback").mkdir()
    checkpoint = tmp_path / "step-00000010.pt"
    checkpoint.write_bytes(b"W" * 1000)

    def no_link(*args):
        raise OSError(1, "Operation not permitted")

    def killed_halfway(source, target):
        Path(target).write_bytes(Path(source).read_bytes()[:500])
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "copyfile", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        g._keep_base(tmp_path / "rollback" / "step-15.pt", checkpoint)
    assert sorted(p.name for p in (tmp_path / "rollback").iterdir()) == []
    monkeypatch.undo()
    kept = g._keep_base(tmp_path / "rollback" / "step-15.pt", checkpoint)  # (then: linked, whole)
    assert kept is not None and kept.read_bytes() == b"W" * 1000
