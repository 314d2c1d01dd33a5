"""Held-out evaluation during a run (``ampguard.evaluation.Evaluator``): when it is due, how it
runs, and how a factory's ``evaluate()`` is checked before any file exists."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from ampguard.config import validate
from ampguard.errors import InputError
from ampguard.evaluation import Evaluator
from ampguard.precision import Precision
from ampguard.tasks import Task

CPU = torch.device("cpu")


def make_task(evaluate: Any = None, metrics: tuple[str, ...] = ("val_loss",)) -> Task:
    if evaluate is None:
        def evaluate(model, device):
            return {"val_loss": torch.tensor(0.25)}
    return Task("factory", nn.Linear(2, 1), nn.functional.mse_loss, batches=lambda: iter(()), evaluate=evaluate,
                metrics=metrics, mode="regression")


def evaluator(task: Task | None = None, *, steps: int = 10, every: int = 4, enabled: bool = True) -> Evaluator:
    config = validate({"steps": steps, "eval": {"every": every, "enabled": enabled}})
    return Evaluator(task or make_task(), Precision("fp32", "cpu"), CPU, config)


# ---------------------------------------------------------------------------- due


def test_due_every_n_steps_and_at_the_last_step():
    ev = evaluator(steps=10, every=4)
    assert [s for s in range(1, 11) if ev.due(s)] == [4, 8, 10]


def test_the_last_step_is_due_once_even_when_it_is_a_multiple():
    ev = evaluator(steps=8, every=4)
    assert [s for s in range(1, 9) if ev.due(s)] == [4, 8]


def test_every_zero_means_only_the_last_step():
    ev = evaluator(steps=5, every=0)
    assert [s for s in range(1, 6) if ev.due(s)] == [5]


def test_every_larger_than_the_run_means_only_the_last_step():
    ev = evaluator(steps=3, every=100)
    assert [s for s in range(1, 4) if ev.due(s)] == [3]


def test_every_one_is_every_step():
    ev = evaluator(steps=4, every=1)
    assert all(ev.due(s) for s in range(1, 5))


# ---------------------------------------------------------------------------- disabled


def test_eval_disabled_is_never_due_and_declares_no_metrics():
    calls = []
    ev = evaluator(make_task(lambda m, d: calls.append(1) or {"val_loss": 0.0}), steps=10, every=1, enabled=False)
    assert not ev.enabled and ev.metrics == ()
    assert not any(ev.due(s) for s in range(1, 12))
    assert ev() == {}
    ev.check()  # nothing to check: evaluate() is not called
    assert calls == []


def test_a_task_without_evaluate_is_disabled():
    task = Task("toy", nn.Linear(2, 1), nn.functional.mse_loss, batches=lambda: iter(()), metrics=("val_loss",))
    ev = evaluator(task)
    assert not ev.enabled and ev.metrics == () and not ev.due(10) and ev() == {}


# ---------------------------------------------------------------------------- running it


def test_it_returns_floats_in_eval_mode_without_grad_then_trains_on():
    seen = {}

    def evaluate(model, device):
        seen.update(training=model.training, grad=torch.is_grad_enabled(), device=device)
        return {"val_loss": torch.tensor(0.5)}

    task = make_task(evaluate)
    ev = evaluator(task)
    assert ev.metrics == ("val_loss",)
    assert ev() == {"val_loss": 0.5} and type(ev()["val_loss"]) is float
    assert seen == {"training": False, "grad": False, "device": CPU}
    assert task.model.training


def test_a_metric_evaluate_did_not_declare_later_is_left_out_with_one_warning():
    # checked at start-up only: a later call's extra name went to the CSV, which (refusing a value
    # no column holds) would stop the run mid-way; before that it was dropped there unsaid
    calls = []

    def evaluate(model, device):
        calls.append(1)
        return {"val_loss": 0.5, **({"val_acc": 0.9} if len(calls) > 1 else {})}

    ev = evaluator(make_task(evaluate))
    assert ev() == {"val_loss": 0.5}
    with pytest.warns(UserWarning, match=r"evaluate\(\) returned \['val_acc'\], not among its declared metrics"):
        assert ev() == {"val_loss": 0.5}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ev() == {"val_loss": 0.5}  # (said once)


def test_the_model_trains_on_even_when_evaluate_raises():
    def evaluate(model, device):
        raise RuntimeError("held-out file missing")

    task = make_task(evaluate)
    with pytest.raises(RuntimeError):
        evaluator(task)()
    assert task.model.training


# ---------------------------------------------------------------------------- check


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_check_passes_for_the_declared_metrics():
    evaluator(make_task(lambda m, d: {"val_loss": 1.0, "acc": 0.5}, metrics=("val_loss", "acc"))).check()
    evaluator(make_task(lambda m, d: {}, metrics=("val_loss",))).check()  # a subset is fine


def test_check_turns_a_raising_evaluate_into_one_input_error_line():
    def evaluate(model, device):
        return {"val_loss": 1 / 0}

    with pytest.raises(InputError) as err:
        evaluator(make_task(evaluate)).check()
    assert one_line(err) == "task.factory: evaluate() raised ZeroDivisionError: division by zero"


def test_check_says_the_first_line_of_a_multi_line_error():
    # a load_state_dict error in evaluate() lists the keys on the lines below: the refusal was
    # three lines long
    def evaluate(model, device):
        nn.Linear(2, 1).load_state_dict({"bogus": torch.zeros(1)})

    with pytest.raises(InputError) as err:
        evaluator(make_task(evaluate)).check()
    assert one_line(err) == ("task.factory: evaluate() raised RuntimeError: Error(s) in loading state_dict for "
                             "Linear:")


def test_check_catches_a_generator_exit_and_lets_a_wrapped_ctrl_c_through():
    def closed(model, device):
        raise GeneratorExit("closed")

    with pytest.raises(InputError) as err:
        evaluator(make_task(closed)).check()
    assert one_line(err) == "task.factory: evaluate() raised GeneratorExit: closed"

    def interrupted(model, device):  # a Ctrl-C Python wrapped on its way out of a class body
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as cause:
            raise RuntimeError("Error calling __set_name__") from cause

    with pytest.raises(RuntimeError, match="__set_name__"):
        evaluator(make_task(interrupted)).check()


def test_check_catches_a_system_exit_too():
    def evaluate(model, device):
        sys.exit("no GPU here")

    with pytest.raises(InputError) as err:
        evaluator(make_task(evaluate)).check()
    assert one_line(err) == "task.factory: evaluate() raised SystemExit: no GPU here"


def test_check_refuses_names_the_task_did_not_declare():
    task = make_task(lambda m, d: {"val_loss": 1.0, "accuracy": 0.9}, metrics=("val_loss",))
    with pytest.raises(InputError) as err:
        evaluator(task).check()
    assert one_line(err) == ("task.factory: evaluate() returned ['accuracy', 'val_loss'], but metrics declares "
                             "['val_loss']")


def test_check_refuses_values_that_are_not_numbers():
    task = make_task(lambda m, d: {"val_loss": "low"})
    with pytest.raises(InputError) as err:
        evaluator(task).check()
    assert one_line(err) == "task.factory: evaluate() returned a str for metric 'val_loss' ('low'), not a number"


def test_an_integer_metric_stays_an_int_for_the_csv_to_write_exactly():
    # evaluate()'s tokens seen or epoch was made a float (1024.0 in steps.csv, 2**60 + 1 rounded)
    import numpy as np

    from ampguard.evaluation import metric_number

    got = [metric_number("m", v) for v in (2**60 + 1, np.int64(-3), torch.tensor(7), 0.5, torch.tensor(0.25), True)]
    assert got == [2**60 + 1, -3, 7, 0.5, 0.25, 1.0]
    assert [type(v) for v in got] == [int, int, int, float, float, float]
