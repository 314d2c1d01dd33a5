"""Hostile and careless input to ``ampguard train`` and ``demo`` (issue 16): every refusal is one
line ``ampguard: error: ...`` on stderr, exit 2, no traceback and the working folder exactly as it
was (``snapshot``); what used to hang runs under a deadline and fails instead. A disk that fills
up while the run writes (``ulimit -f`` in a subprocess) is a clean stop: one line, exit
``ExitCode.DISK_FULL`` (74), the run intact up to the step it names.
"""

from __future__ import annotations

import csv
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm

import torch
from helpers import deadline, ok, one_error_line, only_line, run_events

from ampguard.errors import ExitCode

LINEAR = ["--set", "task.name=linear", "--set", "device=cpu", "--set", "precision=fp32"]
SHORT = [*LINEAR, "--set", "steps=3", "--set", "eval.enabled=false"]


def refused(result: tuple[int, str, str]) -> str:
    """The single error line of a refusal (exit 2, no traceback, nothing on stdout)."""
    line = one_error_line(result)
    out = result[1]
    assert "run folder" not in out, out
    return line


# ---------------------------------------------------------------------------- 1. hangs


@pytest.mark.parametrize("batch", [1498, 2000])
def test_a_digits_batch_larger_than_the_training_set_is_refused_at_once(cli, unchanged, batch):
    check = unchanged()
    with deadline(60):
        line = refused(cli("train", "--set", "task.name=digits", "--set", f"task.batch_size={batch}",
                           "--set", "device=cpu"))
    assert "task.batch_size" in line and str(batch) in line and "1,497" in line
    check()


def test_a_charlm_context_longer_than_its_text_is_refused(cli, unchanged):
    check = unchanged()
    with deadline(60):
        line = refused(cli("train", "--set", "task.name=charlm", "--set", "task.block_size=1000000",
                           "--set", "task.n_layer=1", "--set", "task.n_embd=8", "--set", "task.n_head=1",
                           "--set", "device=cpu"))
    assert "task.block_size" in line
    check()


EMPTY_STREAM = '''
import torch
from ampguard.tasks import Task

def build(config):  # a Task whose stream ends before its first batch
    return Task("empty", torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, batches=lambda: iter(()))
'''


def test_a_task_stream_that_yields_no_batch_is_refused_before_anything_is_written(cli, unchanged, tmp_path):
    (tmp_path / "empty.py").write_text(EMPTY_STREAM)
    check = unchanged()
    with deadline(60):
        line = refused(cli("train", *SHORT, "--set", "task.factory=empty.py:build"))
    assert line == "ampguard: error: task.factory empty.py:build: the data yielded no batches"
    check()


# ---------------------------------------------------------------------------- 2. a factory that does not fit

FACTORIES = '''
import torch
from torch import nn
from torch.nn import functional as F

def data():
    return [(torch.ones(4, 3), torch.zeros(4, 1))]

def wrong_width(config):
    return nn.Linear(2, 1), data(), F.mse_loss

def per_example_loss(config):
    return nn.Linear(3, 1), data(), lambda out, y: ((out - y) ** 2).squeeze(1)

def no_parameters(config):
    return nn.Identity(), [(torch.ones(4, 3), torch.zeros(4, 3))], F.mse_loss

def frozen(config):
    return nn.Linear(3, 1).requires_grad_(False), data(), F.mse_loss

def detached_loss(config):
    return nn.Linear(3, 1), data(), lambda out, y: F.mse_loss(out, y).detach()

def loss_raises(config):
    return nn.Linear(3, 1), data(), lambda out, y: F.cross_entropy(out, y.long().squeeze(1) + 5)

def on_meta(config):
    with torch.device("meta"):
        model = nn.Linear(3, 1)
    return model, data(), F.mse_loss

class Lengths(nn.Module):  # sequences of any length: a sum over them
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x.sum(1, keepdim=True) * self.w

def variable_lengths(config):
    return Lengths(), [(torch.ones(4, 2), torch.ones(4, 1)), (torch.ones(4, 3), torch.ones(4, 1))], F.mse_loss
'''


@pytest.mark.parametrize("name,expected", [
    ("wrong_width", "the model's forward pass on the first batch failed: RuntimeError: mat1 and mat2 shapes cannot "
                    "be multiplied (4x3 and 2x1)"),
    ("per_example_loss", "loss_fn must return a scalar (a 0-dim tensor, e.g. .mean()); it returned shape (4,)"),
    ("no_parameters", "the model (Identity) has no parameters: there is nothing to train"),
    ("frozen", "none of the model's 4 parameters requires a gradient (all frozen): there is nothing to train"),
    ("detached_loss", "the loss does not depend on the model's trainable parameters"),
    ("loss_raises", "loss_fn failed on the model's output for the first batch: IndexError: Target 5 is out of bounds."),
    ("on_meta", "the model's parameter weight is on the meta device (not made yet): materialise it"),
])
def test_a_factory_that_does_not_fit_its_model_is_one_line_naming_it(cli, unchanged, tmp_path, name, expected):
    (tmp_path / "factories.py").write_text(FACTORIES)
    check = unchanged()
    line = refused(cli("train", *SHORT, "--set", f"task.factory=factories.py:{name}"))
    assert line.startswith(f"ampguard: error: task.factory factories.py:{name}: {expected}"), line
    check()


@pytest.mark.parametrize("verb, name, expected", [
    (["locate"], "wrong_width", "ampguard: error: locate: task factory: the model or the loss failed on step 1's "
                                "batch: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 2x1)"),
    (["validate", "--train-steps", "2", "--out", "v"], "per_example_loss",
     "ampguard: error: validate --train-steps: task factories.py:{name}: loss_fn must return a scalar (a 0-dim "
     "tensor, e.g. .mean()); it returned shape (4,)"),
])
def test_what_train_refuses_is_one_line_in_locate_and_validate_too(cli, unchanged, tmp_path, verb, name, expected):
    # a traceback there, whose exit 1 read as "a non-finite value found" or as REJECTED
    (tmp_path / "factories.py").write_text(FACTORIES)
    check = unchanged()
    assert refused(cli(*verb, *LINEAR[2:], "--set", f"task.factory=factories.py:{name}")) == expected.format(name=name)
    check()


def test_batches_of_varying_lengths_train_and_validate_asks_for_a_held_out_set(cli, tmp_path):
    # the default held-out set concatenated the first batches: a traceback for sequences of any length
    (tmp_path / "factories.py").write_text(FACTORIES)
    code, out, err = cli("train", *SHORT, "--set", "task.factory=factories.py:variable_lengths",
                         "--set", "log.plot=false")  # (its report.png is not what is tested: ~1 s of drawing)
    assert code == 0, err
    line = refused(cli("validate", "--set", "task.factory=factories.py:variable_lengths", "--out", "v"))
    assert line == "ampguard: error: validate: task factory has no held-out set (a factory can return 'held_out')"


# ---------------------------------------------------------------------------- 4. accepted without checking


@pytest.mark.parametrize("verb", [["train", *SHORT], ["demo", "--steps", "3", "--device", "cpu"]])
def test_a_fault_for_a_rank_the_run_does_not_have_is_refused(cli, unchanged, verb):
    check = unchanged()
    line = refused(cli(*verb, "--inject", "nan_loss@40@rank3"))
    assert line == ("ampguard: error: inject: fault 'nan_loss@40@rank3' targets rank 3, but this run has 1 process "
                    "(rank 0 only; torchrun --nproc_per_node sets more)")
    check()


@pytest.mark.parametrize("verb", [["train", *SHORT], ["demo", "--steps", "3", "--device", "cpu"]])
def test_fail_after_without_a_fail_rate_is_refused(cli, unchanged, verb):
    check = unchanged()
    line = refused(cli(*verb, "--fail-after", "5"))
    assert line.startswith("ampguard: error: --fail-after needs a fail rate: add --fail-skip-rate")
    check()


@pytest.mark.parametrize("rate", [["--fail-skip-rate", "0.5"], ["--set", "monitor.fail_rate=0.5"],
                                  ["--set", "monitor.fail_on_scale_collapse=true"]])
def test_fail_after_with_a_fail_rate_is_taken(cli, rate):
    code, out, err = cli("train", *SHORT, "--fail-after", "5", *rate, "--print-config")
    assert code == 0, err
    assert "fail_after: 5" in out


# ---------------------------------------------------------------------------- 3. disk full


DISK_RUN = [*LINEAR, "--set", "log.every=1000", "--set", "eval.enabled=false", "--set", "log.dir=runs"]
DISK_CASES = {
    # name: (file-size limit in bytes, extra arguments)
    "csv": (2000, ["--set", "steps=200", "--set", "checkpoint.enabled=false"]),
    "checkpoint": (6000, ["--set", "steps=20", "--set", "checkpoint.every=5"]),
    # (TensorBoard's event file, written from its own thread, is the first to reach the limit: review 52d)
    "tensorboard": (3000, ["--set", "steps=200", "--set", "checkpoint.enabled=false", "--set", "log.tensorboard=true"]),
}


@pytest.fixture(scope="module")
def disk_full_runs(tmp_path_factory):
    """Every case of :data:`DISK_CASES` run side by side in a subprocess under ``ulimit -f``:
    {name: (exit code, stdout, stderr, run folder)}."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # (one thread, no bars: the suite's, conftest.py)
    started = {}
    for name, (limit, extra) in DISK_CASES.items():
        cwd = tmp_path_factory.mktemp(f"disk-{name}")
        proc = warm.Popen([sys.executable, "-m", "ampguard", "train", *DISK_RUN, "--set", f"log.name={name}",
                           *extra], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, file_size=limit)
        started[name] = (proc, cwd)
    results = {}
    for name, (proc, cwd) in started.items():
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the {name} run under ulimit -f hangs\n{err[-2000:]}")
        results[name] = (proc.returncode, out, err, cwd / "runs" / name)
    return results


def _steps(csv_path: Path) -> list[int]:
    """The step of every complete row (a torn last line is what a resume drops)."""
    text = csv_path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [int(row["step"]) for row in csv.DictReader(complete.splitlines())]


def test_a_full_disk_while_writing_the_csv_stops_cleanly_with_one_line(disk_full_runs):
    code, out, err, run = disk_full_runs["csv"]
    assert code == ExitCode.DISK_FULL == 74, (code, err)
    line = only_line(err)
    steps = _steps(run / "steps.csv")
    n = steps[-1]
    assert steps == list(range(1, n + 1)) and 5 < n < 200
    assert line == (f"ampguard: error: disk full while writing runs/csv/steps.csv; the run is intact up to step {n} "
                    "(its records; no checkpoint to resume from; File too large)")
    assert "ended: disk full while writing runs/csv/steps.csv" in out
    # it stopped at the step whose row found no room: nothing more was written
    assert f"steps={n + 1} " in out
    assert not (run / "RUN.md").exists() and not (run / "report.png").exists()
    assert '"run_end"' not in (run / "events.jsonl").read_text()


def test_a_full_disk_under_tensorboards_event_file_is_the_same_clean_stop(disk_full_runs):
    # review 52d: TensorBoard's writer thread raised a raw OSError at the next write (a crash, exit 1)
    # and again at the sinks' close in the loop's finally, which replaced it: two tracebacks, no run_end
    code, out, err, run = disk_full_runs["tensorboard"]
    assert code == ExitCode.DISK_FULL, (code, err)
    line = only_line(err)  # (nor TensorBoard's thread's traceback)
    n = _steps(run / "steps.csv")[-1]  # (the step whose TensorBoard write found no room: its CSV row came first)
    assert line == (f"ampguard: error: disk full while writing runs/tensorboard/tensorboard; the run is intact up to "
                    f"step {n - 1} (its records; no checkpoint to resume from; File too large)"), line
    assert 1 < n < 200 and "ended: disk full while writing runs/tensorboard/tensorboard" in out


def test_a_sink_failing_as_it_closes_is_the_runs_crash_with_its_card(cli, monkeypatch):
    # review 52d: a sink's close raising in the loop's finally replaced the run's end: no run card,
    # no run_end, and the sinks after it (the tracker runs) left open
    from ampguard.sinks import CsvSink, JsonlSink

    closed = []
    monkeypatch.setattr(CsvSink, "close", lambda self: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    monkeypatch.setattr(JsonlSink, "close", lambda self, _close=JsonlSink.close: (closed.append(self), _close(self))[1])
    with pytest.raises(OSError, match="Input/output error"):  # (log.plot false: no plot read; ~0.5 s of matplotlib)
        cli("train", *SHORT, "--set", "log.dir=runs", "--set", "log.name=c", "--set", "log.jsonl=true",
            "--set", "log.plot=false")
    run = Path("runs/c")
    assert closed  # (the JSON lines sink closed though the CSV's before it failed)
    card = (run / "RUN.md").read_text()
    assert "crashed after step 3: OSError: [Errno 5] Input/output error" in card
    assert [e["event"] for e in run_events(run)][-1] == "run_end"


def _second_ctrl_c() -> None:
    raise KeyboardInterrupt  # (a second Ctrl-C mid-step)


def _first_ctrl_c() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGINT)  # (the run's handler: a stop at this step's end)


@pytest.mark.parametrize("interrupt, saved", [(_second_ctrl_c, False), (_first_ctrl_c, True)])
def test_a_sink_failing_as_it_closes_after_an_interrupt_leaves_it_an_interrupt(cli, monkeypatch, interrupt, saved):
    # reviews 52i, 52l: the close's failure turned the interrupt (130) into a crash (1): "crashed" on the card,
    # and after a first Ctrl-C no checkpoint of the stop
    from ampguard.sinks import CsvSink
    from ampguard.step import AmpTrainState

    real_step = AmpTrainState.step

    def step(self, *batch):
        if self.steps == 1:
            interrupt()
        return real_step(self, *batch)

    monkeypatch.setattr(AmpTrainState, "step", step)
    monkeypatch.setattr(CsvSink, "close", lambda self: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    code, out, err = cli("train", *SHORT, "--set", "log.dir=runs", "--set", "log.name=i",
                         "--set", "log.plot=false")  # (no plot read: ~0.5 s of matplotlib saved)
    assert code == ExitCode.INTERRUPTED, (code, err)
    assert "a sink failed as it closed: OSError: [Errno 5] Input/output error" in err, err
    assert "interrupted" in (Path("runs/i") / "RUN.md").read_text()
    assert (Path("runs/i") / "checkpoints" / "step-00000002.pt").is_file() is saved


def test_a_sink_failing_as_it_closes_is_said_at_every_run_of_a_process(tmp_path, monkeypatch):
    # review 58f: a run's own line through warnings.warn was said once a process (the text, the category and the
    # line the same): a notebook's second run whose sink failed alike closed without a word
    import warnings

    from ampguard.config import validate
    from ampguard.sinks import CsvSink
    from ampguard.step import AmpTrainState
    from ampguard.train import train

    real_step = AmpTrainState.step

    def step(self, *batch):
        if self.steps == 1:
            _first_ctrl_c()  # (a stop: the close's failure is said, not the run's crash)
        return real_step(self, *batch)

    monkeypatch.setattr(AmpTrainState, "step", step)
    monkeypatch.setattr(CsvSink, "close", lambda self: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    codes = []
    with warnings.catch_warnings(record=True) as said:  # (the API in a notebook: `ampguard train` resets the
        warnings.simplefilter("default")                # filters at each call; Python's default: once a line)
        for i in range(2):
            codes.append(train(validate({"task": {"name": "linear"}, "steps": 3, "precision": "fp32", "device": "cpu",
                                         "log": {"dir": str(tmp_path / "runs"), "name": f"r{i}", "plot": False},
                                         "checkpoint": {"enabled": False}})))
    assert codes == [ExitCode.INTERRUPTED] * 2
    assert [str(w.message) for w in said if "a sink failed" in str(w.message)] == \
        ["a sink failed as it closed: OSError: [Errno 5] Input/output error"] * 2


def test_a_full_disk_while_saving_a_checkpoint_leaves_no_partial_file(disk_full_runs):
    code, out, err, run = disk_full_runs["checkpoint"]
    assert code == ExitCode.DISK_FULL, (code, err)
    line = only_line(err)
    assert line.startswith("ampguard: error: disk full while writing runs/checkpoint/checkpoints/step-00000005.pt; "
                           "the run is intact up to step 6 (its records; no checkpoint to resume from; "), line
    assert list((run / "checkpoints").iterdir()) == []  # no temporary file left behind
    assert _steps(run / "steps.csv") == list(range(1, 7))  # the failed save is seen at the next step's end
    assert not (run / "RUN.md").exists()


def _no_space(after: int):
    """A ``write`` that fails with ENOSPC from its ``after + 1``-th call on (a disk that fills up)."""
    calls = {"n": 0}

    def fail(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, "No space left on device")

    return fail


def test_after_a_full_disk_the_line_names_the_last_checkpoint_and_resume_continues_from_it(cli, monkeypatch, tmp_path):
    from ampguard import sinks
    from ampguard.files import writing

    real_write = sinks.CsvSink.write
    fail = _no_space(after=4)

    def write(self, record, extra=None):
        with writing(self.path):
            fail()
        real_write(self, record, extra)

    monkeypatch.setattr(sinks.CsvSink, "write", write)
    code, out, err = cli("train", *LINEAR, "--set", "steps=8", "--set", "checkpoint.every=2", "--set", "log.dir=runs",
                         "--set", "log.name=x", "--set", "log.plot=false")  # (no plot looked at; the resume keeps it)
    assert code == ExitCode.DISK_FULL, err
    assert only_line(err) == (
        "ampguard: error: disk full while writing runs/x/steps.csv; the run is intact up to step 4 "
        "(checkpoints/step-00000004.pt: --resume runs/x continues from there; No space left on device)")
    run = tmp_path / "runs" / "x"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002.pt", "step-00000004.pt"]
    assert _steps(run / "steps.csv") == [1, 2, 3, 4] and not (run / "RUN.md").exists()
    # the disk has room again: the hint works, and the records go on from step 5
    monkeypatch.setattr(sinks.CsvSink, "write", real_write)
    code, out, err = cli("train", "--resume", "runs/x")
    assert code == 0, err
    assert _steps(run / "steps.csv") == list(range(1, 9)) and (run / "RUN.md").exists()


def test_a_full_disk_while_writing_the_run_card_is_the_same_clean_stop(cli, monkeypatch, tmp_path):
    from ampguard import report

    def write_run_card(path, config, result):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(report, "write_run_card", write_run_card)
    code, out, err = cli("train", *SHORT, "--set", "checkpoint.every=2", "--set", "log.dir=runs", "--set", "log.name=y",
                         "--set", "log.plot=false")  # (the plot, drawn before the card, is not what is tested)
    assert code == ExitCode.DISK_FULL, err
    assert only_line(err) == (
        "ampguard: error: disk full while writing runs/y/RUN.md; the run is intact up to step 3 "
        "(checkpoints/step-00000003.pt: --resume runs/y continues from there; No space left on device)")


# ---------------------------------------------------------------------------- data that fails mid-run

FAILING_DATA = '''
import torch
from torch import nn


def build(config):
    def data():
        g = torch.Generator().manual_seed(0)
        for i in range(100):
            if i == 5:
                raise OSError("cannot read shard 5")
            yield torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)

    return nn.Linear(4, 1), data, nn.functional.mse_loss
'''


def test_data_that_fails_mid_run_stops_it_with_exit_2_and_keeps_the_steps_before(cli, tmp_path):
    # reading batch 6 raised: a traceback (the user's error) that left no run card, and no
    # checkpoint of the five steps that were fine
    (tmp_path / "failing.py").write_text(FAILING_DATA, encoding="utf-8")
    code, out, err = cli("train", "--set", f"task.factory={tmp_path / 'failing.py'}:build", "--set", "device=cpu",
                         "--set", "precision=fp32", "--set", "steps=10", "--set", "checkpoint.every=2",
                         "--set", "log.name=f", "--set", "log.plot=false")  # (its report.png is not looked at)
    line = one_error_line((code, out, err))
    run = tmp_path / "runs" / "f"
    assert line == ("ampguard: error: bad data at step 6: OSError: cannot read shard 5; the run is intact up to "
                    "step 5 (checkpoints/step-00000005.pt: --resume continues from there once the data is fixed)")
    assert "ended: bad data at step 6" in out
    with open(run / "steps.csv", newline="", encoding="utf-8") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1", "2", "3", "4", "5"]
    assert "| ended | bad data at step 6: OSError: cannot read shard 5 |" in (run / "RUN.md").read_text(encoding="utf-8")
    assert (run / "checkpoints" / "step-00000005.pt").is_file()


EMPTY_LATER = '''
import torch
from torch import nn


def build(config):
    def data():
        g = torch.Generator().manual_seed(1)
        for i in range(8):
            n = 0 if i == 5 else 2
            yield torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    return nn.Linear(4, 1), data, nn.functional.mse_loss
'''


def test_a_micro_batch_with_no_examples_mid_run_is_bad_data_not_an_overflow(cli, tmp_path):
    # review 52h: refused at start-up among the first four batches, the same batch later was a skip
    # (non_finite_loss) that threw its group's other micro-batch away and counted toward the skip-rate
    # guards: a data bug read as an AMP overflow
    (tmp_path / "empty.py").write_text(EMPTY_LATER, encoding="utf-8")
    code, out, err = cli("train", "--set", f"task.factory={tmp_path / 'empty.py'}:build", "--set", "device=cpu",
                         "--set", "precision=fp32", "--set", "steps=4", "--set", "accumulation_steps=2",
                         "--set", "checkpoint.every=1", "--set", "log.name=e", "--set", "log.plot=false")
    line = one_error_line((code, out, err))
    assert line == ("ampguard: error: bad data at step 3: the data's micro-batch 5 (counted from 0) holds no examples: "
                    "its inputs' first dimension is 0 (every step on it would be skipped as a non-finite loss); the run "
                    "is intact up to step 2 (checkpoints/step-00000002.pt: --resume continues from there once the data "
                    "is fixed)"), line
    with open(tmp_path / "runs" / "e" / "steps.csv", newline="", encoding="utf-8") as f:
        assert [(r["step"], r["skipped"]) for r in csv.DictReader(f)] == [("1", "0"), ("2", "0")]


FAILING_INSIDE_A_GROUP = '''
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

BROKEN = Path(__file__).with_name("broken")  # (the shard to fail at; the data is fixed once it is gone)


def build(config):
    fail_at = int(BROKEN.read_text()) if BROKEN.exists() else None

    def data():
        g = torch.Generator().manual_seed(0)
        for i in range(200):
            if i == fail_at:
                raise OSError(f"cannot read shard {i}")
            x = torch.randn(4, 4, generator=g) + DRAW  # (drawn from the run's RNGs too)
            yield x, torch.randn(4, 1, generator=g)

    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 1))
    return model, data, nn.functional.mse_loss
'''


@pytest.mark.parametrize("draw", ["torch.rand(1).item()", "float(np.random.rand()) + random.random()"],
                         ids=["torch", "numpy-and-random"])
def test_data_that_fails_inside_a_group_keeps_the_last_closed_step_and_a_resume_goes_on_as_if_it_never_failed(
        cli, tmp_path, draw):
    # review 50a: with accumulation and checkpoint.every 0, a failure at a group's second micro-batch ended
    # "intact up to step 4 (no checkpoint)": a save refuses a half-read group, and every trained step was lost.
    # review 53h: the group's start keeps NumPy's and random's states for a factory's data, raw, at less cost
    (tmp_path / "inside.py").write_text(FAILING_INSIDE_A_GROUP.replace("DRAW", draw), encoding="utf-8")
    common = ["--set", f"task.factory={tmp_path / 'inside.py'}:build", "--set", "device=cpu", "--set", "precision=fp32",
              "--set", "accumulation_steps=3", "--set", "log.plot=false"]
    ok(cli("train", *common, "--set", "steps=8", "--set", "log.name=whole"))
    (tmp_path / "broken").write_text("13")  # the 2nd micro-batch of step 5
    line = one_error_line(cli("train", *common, "--set", "steps=8", "--set", "log.name=cut"))
    assert line == ("ampguard: error: bad data at step 5: OSError: cannot read shard 13; the run is intact up to "
                    "step 4 (checkpoints/step-00000004.pt: --resume continues from there once the data is fixed)")
    # the data fixed, the resume reads the group again, with the RNG draws and the BatchNorm statistics it began with
    (tmp_path / "broken").unlink()
    ok(cli("train", "--resume", tmp_path / "runs" / "cut"))
    whole, cut = (tmp_path / "runs" / name / "steps.csv" for name in ("whole", "cut"))
    assert cut.read_text() == whole.read_text()
    saved = [torch.load(tmp_path / "runs" / name / "checkpoints" / "step-00000008.pt", weights_only=True)["model"]
             for name in ("whole", "cut")]
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


CRASHING_FACTORY = '''
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Fixed(nn.Module):  # assumes batches of 4: the epoch's short last batch (18 = 4 x 4 + 2) breaks it
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 1)

    def forward(self, x):
        return self.l(x.view(4, 2))


class Exits(nn.Linear):  # calls sys.exit(0) on the forward after its limit
    calls, limit = 0, 3

    def forward(self, x):
        Exits.calls += 1
        if Exits.calls > Exits.limit:
            sys.exit(0)
        return super().forward(x)


class Raises(torch.autograd.Function):  # an identity whose third backward raises (an out-of-memory in a backward)
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Raises.calls += 1
        if Raises.calls == 3:
            raise RuntimeError("out of memory in the backward (a stand-in)")
        return grad


class BackwardFails(nn.Linear):
    def forward(self, x):
        return Raises.apply(super().forward(x))


def data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(18, 2, generator=g), torch.randn(18, 1, generator=g)), batch_size=4)


def short_batch(config):
    return Fixed(), data(), nn.functional.mse_loss


def exits(config):  # validate: its fourth forward
    Exits.calls, Exits.limit = 0, 3
    return Exits(2, 1), data(), nn.functional.mse_loss


def exits_training(config):  # train: step 3's forward (the start-up's check puts the first four batches through)
    Exits.calls, Exits.limit = 0, 6
    return Exits(2, 1), data(), nn.functional.mse_loss


def backward_fails(config):
    Raises.calls = 0
    return BackwardFails(2, 1), data(), nn.functional.mse_loss
'''


def test_a_model_that_crashes_mid_run_leaves_a_whole_folder_and_its_traceback(tmp_path, monkeypatch):
    """A model that breaks on the epoch's short last batch: a traceback and exit 1 (a crash is not
    bad input), but the run folder held no run card, no run_end, no plot. Now the card says where
    and why it crashed, the checkpoints before it stand, and then the traceback. A sys.exit(0) in
    the model passed through as the run's own exit 0 (success) with a half folder: now a crash."""
    from ampguard.cli import main

    (tmp_path / "crashing.py").write_text(CRASHING_FACTORY, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    base = ["--set", "precision=bf16", "--set", "eval.enabled=false", "--set", "log.every=1000"]
    with pytest.raises(RuntimeError, match=r"shape '\[4, 2\]' is invalid"):
        main(["train", "--set", "task.factory=crashing.py:short_batch", "--set", "steps=8", "--set",
              "checkpoint.every=2", "--set", "log.name=short", *base])
    run = tmp_path / "runs" / "short"
    card = (run / "RUN.md").read_text(encoding="utf-8")
    assert "**crashed after step 4: RuntimeError: shape '[4, 2]' is invalid for input of size 4**" in card
    assert (run / "checkpoints" / "step-00000004.pt").is_file() and (run / "report.png").is_file()
    assert '"event": "run_end"' in (run / "events.jsonl").read_text(encoding="utf-8")

    with pytest.raises(RuntimeError, match=r"the task.s model or loss called sys.exit\(0\) at step 3"):
        main(["train", "--set", "task.factory=crashing.py:exits_training", "--set", "steps=8", "--set", "log.name=exits", *base,
              "--set", "log.plot=false"])  # (the short_batch run above shows the crash's plot; ~1 s saved)
    assert "**crashed after step 2: RuntimeError: the task's model or loss called sys.exit(0) at step 3**" in (
        tmp_path / "runs" / "exits" / "RUN.md").read_text(encoding="utf-8")
    # review 53e: the guard's note for a user's own loop ("Guard.backward() raised: ...; the next
    # guard.backward() begins a new step") ended the traceback of a run that has no next step and
    # whose user never called the guard (a Guard in a loop of one's own keeps it: test_guard_failures)
    with pytest.raises(RuntimeError, match="out of memory in the backward") as crashed:
        main(["train", "--set", "task.factory=crashing.py:backward_fails", "--set", "steps=8", "--set", "log.name=bw",
              *base, "--set", "log.plot=false"])
    assert "guard.backward()" not in "".join(getattr(crashed.value, "__notes__", [])), crashed.value.__notes__
    assert "**crashed after step 2: RuntimeError: out of memory in the backward (a stand-in)**" in (
        tmp_path / "runs" / "bw" / "RUN.md").read_text(encoding="utf-8")
    # validate: the model exiting (here under fp16, after FP32 ran) fails that precision in the report;
    # it exited 0 with no report, a model never judged
    code = main(["validate", "--set", "task.factory=crashing.py:exits", "--out", "v"])
    assert code == ExitCode.REJECTED
    assert "raised SystemExit: 0" in (tmp_path / "v" / "validation.md").read_text(encoding="utf-8")
