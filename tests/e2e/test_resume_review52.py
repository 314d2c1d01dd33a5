"""Review 52a: a resume whose task now draws other batches at the checkpoint's position (an older
ampguard's built-in task whose sampling changed since; a factory whose data changed) went on
from the checkpoint on other batches than the run, unsaid. A checkpoint keeps a hash of the next
batch where the stream seeks cheaply (``batches_from``), and a resume compares it."""

from __future__ import annotations

import torch

from helpers import one_error_line

from ampguard import checkpointer as ck
from ampguard.checkpointer import DATA_NEXT

PASSES = '''

def passes(batch):  # data: one pass of 8 batches; batches_from(start): the passes from micro-batch start on
    def data():
        for i in range(8):
            yield batch(i)

    def batches_from(start):
        i = start
        while True:
            yield batch(i % 8)
            i += 1

    return data, batches_from
'''

FACTORY = '''
import torch
from torch import nn

SEED = {seed}


def batch(i):
    g = torch.Generator().manual_seed(SEED * 1000 + i)
    return torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)


def build(config):
    data, batches_from = passes(batch)
    return {{"model": nn.Linear(4, 1), "data": data, "loss_fn": nn.functional.mse_loss, "batches_from": batches_from}}
''' + PASSES


def test_a_resume_whose_data_now_draws_other_batches_at_its_position_is_refused(cli, tmp_path):
    factory = tmp_path / "f.py"
    factory.write_text(FACTORY.format(seed=1), encoding="utf-8")
    run = ["--set", f"task.factory={factory}:build", "--set", "device=cpu", "--set", "precision=fp32",
           "--set", "steps=4", "--set", "checkpoint.every=2", "--set", "log.name=r", "--set", "log.plot=false"]
    code, out, err = cli("train", *run)
    assert code == 0, err
    checkpoint = tmp_path / "runs" / "r" / "checkpoints" / "step-00000002.pt"
    assert len(torch.load(checkpoint, weights_only=True)[DATA_NEXT]) == 64
    code, out, err = cli("train", "--resume", str(checkpoint))  # (the same data: it resumes)
    assert code == 0, err
    csv_before = (tmp_path / "runs" / "r" / "steps.csv").read_bytes()
    factory.write_text(FACTORY.format(seed=2), encoding="utf-8")  # (the data changed since)
    line = one_error_line(cli("train", "--resume", str(checkpoint)))
    assert line == (f"ampguard: error: {checkpoint}: the data's batch at its position (micro-batch 2, counted from 0) "
                    "is not the one the run saved it before: the task draws its batches otherwise now (another "
                    "ampguard's built-in task, or a factory's data or batches_from changed), and a resume would train "
                    "on other batches than the run; resume with what wrote it, or start a new run"), line
    assert (tmp_path / "runs" / "r" / "steps.csv").read_bytes() == csv_before  # (nothing cut)


def test_a_resume_of_a_finished_run_keeps_the_throughput_its_card_said(cli, tmp_path):
    # review 52a: the process that rewrites a finished run's card trains no step; its throughput row read
    # "not measured", the first process's figure gone
    run = ["--set", "task.name=linear", "--set", "device=cpu", "--set", "precision=fp32", "--set", "steps=6",
           "--set", "log.name=t", "--set", "log.plot=false"]
    assert cli("train", *run)[0] == 0
    card = tmp_path / "runs" / "t" / "RUN.md"
    [before] = [line for line in card.read_text().splitlines() if line.startswith("| throughput |")]
    assert "not measured" not in before
    for _ in range(2):  # (and again: the note is not added twice)
        assert cli("train", "--resume", str(tmp_path / "runs" / "t"))[0] == 0
        [after] = [line for line in card.read_text().splitlines() if line.startswith("| throughput |")]
        assert after == before[:-2] + " (an earlier part's: this process trained fewer than two steps) |", after


def test_an_eval_setting_the_task_does_not_read_is_said_by_the_run_not_its_resume(cli, tmp_path):
    run = ["--set", "task.name=linear", "--set", "device=cpu", "--set", "precision=fp32", "--set", "steps=4",
           "--set", "checkpoint.every=2", "--set", "eval.batches=3", "--set", "log.name=e", "--set", "log.plot=false"]
    code, out, err = cli("train", *run)
    line = "task linear does not read eval.batches (charlm's number of held-out batches): ignored"
    assert code == 0 and err.count(line) == 1, err
    code, out, err = cli("train", "--resume", str(tmp_path / "runs" / "e" / "checkpoints" / "step-00000002.pt"))
    assert code == 0 and line not in err, err
    # (one a resume gives is said by it: review 52l, it was a POLICY line as if it took effect)
    code, out, err = cli("train", "--resume", str(tmp_path / "runs" / "e"), "--set", "steps=6", "--set", "eval.batches=5")
    assert code == 0 and err.count(line) == 1, err


OBJECTS = '''
import torch
from torch import nn


class Features:  # a batch's inputs as a plain object: its repr names its address
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Features) and torch.equal(self.x, other.x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, f):
        return self.lin(f.x)


def batch(i):
    g = torch.Generator().manual_seed(i)
    return Features(torch.randn(4, 4, generator=g)), torch.randn(4, 1, generator=g)


def build(config):
    data, batches_from = passes(batch)

    def one_pass(start):  # (the run's batches exactly: none after its last)
        yield from (batch(i) for i in range(start, 8))

    return {"model": Model(), "data": data, "loss_fn": nn.functional.mse_loss,
            "batches_from": one_pass if config.task.options.get("one_pass") else batches_from,
            "held_out": [batch(99)]}
''' + PASSES


def test_a_batch_of_plain_objects_resumes_and_a_stream_of_exactly_the_runs_batches_finishes(cli, tmp_path):
    # review 52j: a leaf hashed by its repr (an object's address) refused the same data's resume; the
    # final save hashed the batch after the run's last, which a batches_from of exactly the run's batches
    # does not have: a traceback, exit 1, no card
    (tmp_path / "objects.py").write_text(OBJECTS, encoding="utf-8")
    run = ["--set", f"task.factory={tmp_path / 'objects.py'}:build", "--set", "device=cpu", "--set", "precision=fp32",
           "--set", "steps=8", "--set", "checkpoint.every=4", "--set", "log.plot=false", "--set", "eval.enabled=false"]
    code, out, err = cli("train", *run, "--set", "log.name=o")
    assert code == 0, err
    code, out, err = cli("train", "--resume", str(tmp_path / "runs" / "o" / "checkpoints" / "step-00000004.pt"))
    assert code == 0, err
    code, out, err = cli("train", *run, "--set", "log.name=p", "--set", "task.options.one_pass=true")
    assert code == 0 and (tmp_path / "runs" / "p" / "RUN.md").is_file(), err


PERSISTENT = '''
import itertools
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

g = torch.Generator().manual_seed(5)
X, Y = torch.arange(48.0).reshape(12, 4) / 48, torch.randn(12, 1, generator=g)


def build(config):
    loader = DataLoader(TensorDataset(X, Y), batch_size=3, num_workers=1, persistent_workers=True)

    def batches_from(start):  # (data's own loader: its iter() is the run's iterator started over)
        def passes():
            while True:
                yield from loader
        return itertools.islice(passes(), start, None)

    return {"model": nn.Linear(4, 1), "data": loader, "loss_fn": nn.functional.mse_loss, "batches_from": batches_from}
'''


def test_checkpoints_leave_a_run_reading_a_persistent_workers_loader_as_without_them(cli, tmp_path):
    # review 52l: a checkpoint's look at the next batch (data_next) through batches_from started the run's own
    # persistent-workers iterator over: the run skipped a batch at each checkpoint, unsaid
    (tmp_path / "pw.py").write_text(PERSISTENT, encoding="utf-8")
    run = ["--set", f"task.factory={tmp_path / 'pw.py'}:build", "--set", "device=cpu", "--set", "precision=fp32",
           "--set", "steps=6", "--set", "log.plot=false", "--set", "eval.enabled=false"]
    assert cli("train", *run, "--set", "log.name=ck", "--set", "checkpoint.every=2")[0] == 0
    assert cli("train", *run, "--set", "log.name=no", "--set", "checkpoint.enabled=false")[0] == 0
    rows = {name: [line.split(",")[:5] for line in (tmp_path / "runs" / name / "steps.csv").read_text().splitlines()]
            for name in ("ck", "no")}
    assert rows["ck"] == rows["no"]
    assert ck.DATA_NEXT not in torch.load(tmp_path / "runs" / "ck" / "checkpoints" / "step-00000002.pt",
                                          weights_only=True)
