"""Review 54o: the run loop's own work outside ``Guard.step`` (~100 us a step on a tiny model,
issue 15). Cuts that keep every behaviour: a step with nothing to hook enters no generator
context managers; the skip and clip windows' 0/1 flags are summed without big integers (the
window's total still exact); a CSV row of numbers is joined directly, its bytes the csv module's;
``random``'s state as ``random.getstate()`` gave it is put back without rebuilding it; with no fault
configured the loss and the data are the task's own, not wrapped."""

from __future__ import annotations

import csv
import io
import math
import random

import pytest
import torch

from ampguard.checkpoint import set_rng_state
from ampguard.config import validate
from ampguard.data import DataStream
from ampguard.faults import FaultInjector
from ampguard.monitor import RollingWindow
from ampguard.records import SkipLog, StepLog
from ampguard.run_folder import RunPaths
from ampguard.sinks import CSV_COLUMNS, CsvSink
from ampguard.tasks import build_task
from ampguard.trainer import Trainer

# ---------------------------------------------------------------------------- the rolling windows


@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_window_of_flags_and_other_values_sums_exactly(size):
    rng = random.Random(size)
    w, pushed = RollingWindow(size), []
    for i in range(200):
        value = rng.choice([0.0, 1.0, 1.0, -0.0, 0.1, 1e-300, 3e300, -2.5, 1 + 2**-52])
        w.push(value)
        pushed.append(value)
        assert w.total == math.fsum(pushed[-size:]), (i, pushed[-size:])
        if i == 100:  # a window loaded from a state continues identically
            again = RollingWindow(size)
            again.load_state_dict(w.state_dict())
            w = again


def test_a_window_of_flags_alone_counts_them_without_big_integers():
    # (review 54o: each push of a 0/1 flag took a 1075-bit integer's sum and division, ~0.8 us; two a step)
    w = RollingWindow(4)
    for flag in (1.0, 0.0, 1.0, 1.0, 0.0, 1.0):
        w.push(flag)
    assert (w.total, w._sum) == (3.0, 0)
    w.push(0.5)
    assert w.total == 2.5
    with pytest.raises(ValueError):  # a NaN is refused, the window as it was
        w.push(float("nan"))
    assert (w.total, w.count) == (2.5, 7)


# ---------------------------------------------------------------------------- the CSV rows


def csv_module_rows(rows):
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    return out.getvalue()


def test_rows_with_and_without_metrics_are_the_bytes_the_csv_module_writes(tmp_path):
    path = tmp_path / "steps.csv"
    sink = CsvSink(path, extra_columns=["val_loss", "note"])
    logs = [StepLog(s, lr=0.1, loss=0.5 * s, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0)
            for s in (1, 2, 3, 4, 5, 6)]
    logs.append(SkipLog(7, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
                        scaler_scale=0.5, reason="non_finite_loss"))
    extras = [None, {}, {"val_loss": 0.25}, {"val_loss": float("inf"), "note": None}, {"val_loss": 3},
              {"note": 'a, "quoted" note'}, {"val_loss": float("nan"), "note": ""}]
    expected = [list(CSV_COLUMNS) + ["val_loss", "note"]]
    for log, extra in zip(logs, extras):
        sink.write(log, extra)
        v = log.values()
        cells = {**(extra or {})}
        expected.append([str(log.step)] + [("" if v[k] is None else repr(float(v[k]))) for k in
                                           ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss")]
                        + ["1" if log.skipped else "0", log.reason or "", repr(float(v["scaler_scale"]))]
                        + [c if isinstance(c := cells.get(k), str) else ("" if c is None else
                                                                        str(c) if isinstance(c, int) else repr(float(c)))
                           for k in ("val_loss", "note")])  # (an int extra as its digits: session 60c)
    sink.close()
    assert path.read_text() == csv_module_rows(expected)
    assert '"a, ""quoted"" note"' in path.read_text()  # (text is quoted: it took the csv module's path)


def test_the_optimizers_names_in_label_columns_are_quoted_as_the_csv_module_quotes_them(tmp_path):
    path = tmp_path / "steps.csv"
    sink = CsvSink(path, extra_columns=["optimizers", "skipped_optimizers"])
    sink.write(StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0,
                       optimizers=("g,1", 'd"2'), skipped_optimizers=()))
    sink.close()
    assert path.read_text().splitlines()[1] == '1,0.1,2.0,1.0,0.5,0,,1.0,"g,1;d""2",'


# ---------------------------------------------------------------------------- random's state


def test_randoms_state_is_put_back_as_getstate_gave_it_and_as_a_file_holds_it():
    version, words, gauss = random.getstate()
    expected = [random.random() for _ in range(3)]
    for form in ((version, words, gauss), [version, list(words), gauss], (version, list(words), gauss)):
        set_rng_state({"torch": torch.get_rng_state(), "random": form})
        assert [random.random() for _ in range(3)] == expected


# ---------------------------------------------------------------------------- the trainer


def trainer_of(tmp_path, **settings):
    config = validate({"task": {"name": "linear"}, "steps": 6, "precision": "fp32", "device": "cpu",
                       "eval": {"enabled": False}, "checkpoint": {"enabled": False},
                       "log": {"dir": str(tmp_path / "runs"), "name": "a", "plot": False}, **settings})
    return Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=10**6, stats_every=None,
                   print_fn=lambda line: None, progress=False, resume=None)


def test_a_step_with_nothing_to_hook_enters_no_context_manager_of_its_own(tmp_path):
    trainer = trainer_of(tmp_path, monitor={"headroom": {"every": 3}})
    trainer._open()
    try:
        shared, measured = [], []
        for _ in range(6):
            shared.append(trainer.watching() is trainer.watching())  # (the one do-nothing context, each time)
            with trainer.watching() as nothing:
                assert nothing is None
                trainer.train_step()
            measured.append(trainer.headroom._step)
        # step 1 learns backward's order (the skip's gradient norms), steps 3 and 6 are measured: their hooks ran
        assert shared == [False, True, False, True, True, False]
        assert trainer.grad_norms.order == [name for name, _ in reversed(list(trainer.task.model.named_parameters()))]
        assert measured[2:] == [3, 3, 3, 6] and measured[0] == measured[1] != 3
    finally:
        trainer.sinks.close()
        trainer.events.close()


def test_without_faults_the_loss_and_the_data_are_the_tasks_own(tmp_path):
    plain = trainer_of(tmp_path / "plain")
    assert plain.state.loss_fn is plain.task.loss_fn
    faulted = trainer_of(tmp_path / "faulted", inject=["nan_loss@2"])
    assert faulted.state.loss_fn is not faulted.task.loss_fn
    assert int(faulted.run().exit_code) == 0
    rows = list(csv.DictReader(faulted.paths.csv.open()))
    assert [r["skip_reason"] for r in rows] == ["", "non_finite_loss", "", "", "", ""]
    task = build_task(validate({"task": {"name": "linear"}}))
    data = DataStream(task, FaultInjector([]), torch.device("cpu"))
    for expected in task.stream(0):
        assert all(torch.equal(a, b) for a, b in zip(data.next(first_step=1), expected))
        if data.position == 3:
            break
