"""Review 38, whole runs of ``ampguard train`` with a factory (the parts built directly:
``tests/unit/test_tasks_review38.py``): the training does not depend on when it evaluates; a
metric that is no number mid-run ends the run as a ``None`` from ``evaluate`` does; bad data the
start-up reads (a one-shot iterable, the meta device, no examples, a batch the model cannot take
among the first four) is one line, exit 2, nothing written; a Task's stream that ends mid-run
is one line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from helpers import one_error_line, write

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

RUN = ["--set", "device=cpu", "--set", "precision=fp32", "--set", "checkpoint.enabled=false", "--set", "log.plot=false",
       "--set", "log.every=1000"]

FACTORIES = """
import itertools

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


def dropout_and_plain_loader(config):  # review 38: evaluate iterates a plain DataLoader (a draw of torch's RNG)
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 3, generator=g), torch.randn(96, 1, generator=g)
    train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=16, shuffle=True,
                       generator=torch.Generator().manual_seed(config.seed))
    val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=16)

    def evaluate(m, device):
        return {"val_loss": float(sum(F.mse_loss(m(a), b) for a, b in val)) / len(val)}
    return {"model": model, "data": train, "loss_fn": F.mse_loss, "evaluate": evaluate, "metrics": ["val_loss"]}


def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]


def later(value):  # evaluate returns a number twice (the start-up's check, step 2), then value
    calls = itertools.count()

    def build(config):
        return {"model": nn.Linear(3, 1), "data": data(), "loss_fn": F.mse_loss, "metrics": ["val_loss"],
                "evaluate": lambda m, d: {"val_loss": 1.0} if next(calls) < 2 else value}
    return build


string_later = later({"val_loss": "abc"})
none_later = later(None)


class Stored(IterableDataset):
    def __init__(self):
        self.it = iter([(torch.randn(3), torch.randn(1)) for _ in range(64)])

    def __iter__(self):
        return self.it


def one_shot(config):  # 16 batches: longer than the start-up's read
    return nn.Linear(3, 1), DataLoader(Stored(), batch_size=4), F.mse_loss


def meta(config):
    return nn.Linear(3, 1), [(torch.randn(4, 3, device="meta"), torch.randn(4, 1, device="meta"))], F.mse_loss


def no_examples(config):
    return nn.Linear(3, 1), [(torch.empty(0, 3), torch.empty(0, 1))], F.mse_loss


def wider_second(config):  # its second batch has 5 features: the model takes 3
    return nn.Linear(3, 1), [data()[0], (torch.randn(4, 5), torch.randn(4, 1)), data()[2]], F.mse_loss


def task_of_five(config):  # a Task whose stream ends after 5 batches
    from ampguard.tasks import Task
    batches = [data()[0]] * 5
    return Task("mine", nn.Linear(3, 1), F.mse_loss, batches=lambda: iter(batches))
"""


def factory(tmp_path: Path, fn: str) -> list[str]:
    write(tmp_path / "f38.py", FACTORIES)
    return ["--set", f"task.factory=f38.py:{fn}"]


def training_columns(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row[:8] for row in csv.reader(f)]  # (the fixed eight: not val_loss)


def test_the_training_is_the_same_whether_it_evaluates_every_step_every_third_or_never(cli, tmp_path):
    # review 38: evaluations mid-run were not under rng_kept(): each one drew a plain DataLoader's
    # seed from torch's generator, and the dropout masks of every later step moved with eval.every
    runs = {}
    for name, setting in (("every1", "eval.every=1"), ("every3", "eval.every=3"), ("off", "eval.enabled=false")):
        code, out, err = cli("train", *RUN, *factory(tmp_path, "dropout_and_plain_loader"), "--set", "steps=8",
                             "--set", setting, "--set", f"log.name={name}")
        assert code == 0, err
        runs[name] = training_columns(tmp_path / "runs" / name / "steps.csv")
    assert len(runs["off"]) == 9 and len({row[4] for row in runs["off"][1:]}) > 1  # (8 steps, the losses move)
    assert runs["every1"] == runs["off"] and runs["every3"] == runs["off"]


def card_end(tmp_path: Path, name: str) -> str:
    return next(line for line in (tmp_path / "runs" / name / "RUN.md").read_text().splitlines()
                if line.startswith("| ended |"))


def test_a_metric_that_is_no_number_mid_run_ends_the_run_as_a_none_does(cli, tmp_path):
    # it was float()'s traceback (exit 1); a None from evaluate was one line, exit 2, a card saying so
    ends = {}
    for fn in ("string_later", "none_later"):
        result = cli("train", *RUN, *factory(tmp_path, fn), "--set", "steps=6", "--set", "eval.every=2",
                     "--set", f"log.name={fn}")
        ends[fn] = (one_error_line(result), card_end(tmp_path, fn))
    line, card = ends["string_later"]
    assert line == ("ampguard: error: task.factory: evaluate() returned a str for metric 'val_loss' ('abc'), "
                    "not a number")
    none_line, none_card = ends["none_later"]
    assert none_line.startswith("ampguard: error: task.factory: evaluate() returned a NoneType, not a mapping")
    said = line.removeprefix("ampguard: error: ")
    assert card == none_card.replace(none_line.removeprefix("ampguard: error: "), said)  # (the same card: crashed
    assert f"InputError: {said}" in card                                                 # after the same step)


@pytest.mark.parametrize("fn,said", [
    ("meta", "data's batch 0 (counted from 0) holds a tensor on the meta device"),
    ("no_examples", "data's batch 0 (counted from 0) holds no examples: its inputs' first dimension is 0"),
    ("wider_second", "the model's forward pass on the second batch failed: RuntimeError: mat1 and mat2 shapes cannot "
                     "be multiplied (4x5 and 3x1)"),
])
def test_bad_data_the_start_up_reads_is_one_line_and_nothing_is_written(cli, unchanged, tmp_path, fn, said):
    args = factory(tmp_path, fn)
    check = unchanged()
    line = one_error_line(cli("train", *RUN, *args, "--set", "steps=20", "--set", "log.name=x"))
    assert line.startswith(f"ampguard: error: task.factory f38.py:{fn}: {said}"), line
    check()  # (no run folder: the run was refused, not crashed mid-way)


def test_a_task_stream_that_ends_mid_run_is_bad_data_in_one_line(cli, tmp_path):
    # a factory's Task of five batches: a bare StopIteration at step 6 (data.py), a traceback
    line = one_error_line(cli("train", *RUN, *factory(tmp_path, "task_of_five"), "--set", "steps=8",
                              "--set", "log.name=x"))
    assert line.startswith("ampguard: error: bad data at step 6: ValueError: the data ended after 5 micro-batches: a "
                           "Task's batches() must be endless"), line
