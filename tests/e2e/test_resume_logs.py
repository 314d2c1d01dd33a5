"""Resume and the run's other step logs: ``steps.jsonl`` is cut back to the checkpoint's step as
``steps.csv`` is, and TensorBoard's steps after it are purged, so neither holds the abandoned
future's steps next to the resumed run's.

Runs go through ``ampguard.cli.main`` in-process (``helpers.ag``; the plot is stubbed out), on
the linear task, a few steps each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import helpers
from helpers import HAS_TENSORBOARD, ag, ok, read_rows

from ampguard.errors import InputError

RUN = ["--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=8", "--set", "checkpoint.every=4",
       "--set", "log.every=1000"]


def jsonl_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()]


def scramble_lines_after(path: Path, step: int) -> None:
    """Rewrite the lines after ``step`` with a wrong loss: a resume must replace them, not keep them."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["step"] > step:
            record["loss"] = 12345.0
        out.append(json.dumps(record) + "\n")
    path.write_text("".join(out), encoding="utf-8")


def test_resume_cuts_steps_jsonl_back_to_the_checkpoint_step(tmp_path):
    ok(helpers.train(tmp_path, "r", *RUN, "--set", "log.jsonl=true"))
    run = tmp_path / "r"
    uninterrupted = (run / "steps.jsonl").read_bytes()
    assert jsonl_steps(run / "steps.jsonl") == list(range(1, 9))

    (run / "checkpoints" / "step-00000008.pt").unlink()  # the future after step 4 is abandoned
    scramble_lines_after(run / "steps.jsonl", 4)
    assert "RESUME 4" in ok(ag("train", "--resume", run))

    assert jsonl_steps(run / "steps.jsonl") == list(range(1, 9))  # no duplicate steps
    assert [int(r["step"]) for r in read_rows(run / "steps.csv")] == list(range(1, 9))
    # the resume is bit-for-bit the uninterrupted run: its lines for steps 5..8 replaced the old ones
    assert (run / "steps.jsonl").read_bytes() == uninterrupted
    assert not list(run.glob(".steps.jsonl.tmp*"))


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_resume_purges_tensorboard_steps_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ok(helpers.train(tmp_path, "r", *RUN, "--set", "log.tensorboard=true"))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    # Event files are read in name order, which starts with the second the writer opened: the
    # resume, in this same process, opens its file in a later second, as a new process would.
    time.sleep(1.05 - time.time() % 1)
    assert "RESUME 4" in ok(ag("train", "--resume", run))

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    assert len(list((run / "tensorboard").glob("events.out.tfevents*"))) == 2  # both runs' files are kept


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_a_resume_with_the_logs_turned_off_still_cuts_back_their_abandoned_steps(tmp_path):
    # (review 48a's follow-up: log.jsonl or log.tensorboard off on a resume left steps 5-8 of the
    # abandoned timeline beside the resumed run's, which a reader took for the run's own)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ok(helpers.train(tmp_path, "r", *RUN, "--set", "log.jsonl=true", "--set", "log.tensorboard=true"))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    time.sleep(1.05 - time.time() % 1)  # (as above: the purge's event file opens in a later second)
    assert "RESUME 4" in ok(ag("train", "--resume", run, "--set", "log.jsonl=false", "--set", "log.tensorboard=false"))

    assert jsonl_steps(run / "steps.jsonl") == [1, 2, 3, 4]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in read_rows(run / "steps.csv")] == list(range(1, 9))


@pytest.mark.parametrize("kind", ["no step log", "a link"])
def test_a_resume_with_log_jsonl_off_leaves_a_steps_jsonl_it_cannot_cut_back_and_says_so(tmp_path, kind):
    # (review 48e: the run neither writes nor reads it: no step log in its place refused the resume,
    # "cannot append"; a link to another run's had that run's file cut)
    ok(helpers.train(tmp_path, "r", *RUN, "--set", "log.jsonl=true"))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    if kind == "no step log":
        (run / "steps.jsonl").write_text("not a step record\n", encoding="utf-8")
    else:
        other = tmp_path / "other.jsonl"
        other.write_bytes((run / "steps.jsonl").read_bytes())
        (run / "steps.jsonl").unlink()
        (run / "steps.jsonl").symlink_to(other)
    helpers.resumed_leaving_as_is(run, "steps.jsonl", "log.jsonl=false")


@pytest.mark.parametrize("spoiled", ["steps.jsonl", "headroom.csv"])
def test_a_resume_refused_for_one_log_cuts_none_of_them(tmp_path, snapshot, spoiled):
    # every log a resume appends to is checked before any is cut: a foreign steps.jsonl (or
    # headroom.csv) was refused only after steps.csv had lost the rows after the checkpoint
    ok(helpers.train(tmp_path, "r", *RUN, "--set", "log.jsonl=true", "--set", "monitor.headroom.every=2"))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    (run / spoiled).write_text("not this run's log\n", encoding="utf-8")
    before = snapshot(run)
    line = helpers.one_error_line(ag("train", "--resume", run))
    assert spoiled in line and "cannot append" in line
    assert snapshot(run) == before


@pytest.mark.parametrize("spoil", ["not utf-8", "a folder"])
def test_a_resume_refuses_a_log_it_cannot_read_with_one_line(tmp_path, snapshot, spoil):
    # a non-UTF-8 steps.csv / a headroom.csv that is a folder ended the resume with a traceback
    ok(helpers.train(tmp_path, "r", *RUN, "--set", "monitor.headroom.every=2"))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    if spoil == "not utf-8":
        (run / "steps.csv").write_bytes(b"\xff\xfe step,lr\n")
        name = "steps.csv"
    else:
        (run / "headroom.csv").unlink()
        (run / "headroom.csv").mkdir()
        name = "headroom.csv"
    before = snapshot(run)
    line = helpers.one_error_line(ag("train", "--resume", run))
    assert name in line and "cannot append" in line
    assert snapshot(run) == before


def test_a_resume_whose_sinks_do_not_open_keeps_the_old_config_yaml(tmp_path, snapshot, monkeypatch):
    # config.yaml (the resume's --set changes) was rewritten before the sinks opened: a tracker
    # that refused at its open (a store that went away after the up-front check) left the folder
    # holding a config the run never trained with
    ok(helpers.train(tmp_path, "r", *RUN))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    before = snapshot(run)

    def refuse(*args, **kwargs):
        raise InputError("log.mlflow: cannot open the tracking store (gone)")

    monkeypatch.setattr("ampguard.build.build_trackers", refuse)
    line = helpers.one_error_line(ag("train", "--resume", run, "--set", "steps=12"))
    assert "gone" in line
    assert snapshot(run) == before
    monkeypatch.undo()
    assert "RESUME 4" in ok(ag("train", "--resume", run, "--set", "steps=12"))
    assert "steps: 12" in (run / "config.yaml").read_text(encoding="utf-8")


def test_a_bad_row_in_the_kept_part_of_the_last_log_opened_cuts_none_of_them(tmp_path, snapshot):
    # headroom.csv opens last: a bad row in the part a resume keeps was found after steps.csv and
    # steps.jsonl had been cut back to the checkpoint's step
    ok(helpers.train(tmp_path, "r", *RUN, "--set", "log.jsonl=true", "--set", "monitor.headroom.every=2"))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    lines = (run / "headroom.csv").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].rstrip(b"\n") + b",x\n"  # step 2's first row, kept by a resume from step 4: a cell too many
    (run / "headroom.csv").write_bytes(b"".join(lines))
    before = snapshot(run)
    line = helpers.one_error_line(ag("train", "--resume", run))
    assert "headroom.csv line 2: 7 cells, the header has 6" in line
    assert snapshot(run) == before
