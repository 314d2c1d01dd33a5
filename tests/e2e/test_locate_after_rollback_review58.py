"""Review 58d, finding 1: ``locate --step N`` replays the batches the run trained step N on.

A rollback seeks the data on past the batches that triggered it (``rollback.skip_batches``), so
after one the step's batches are no longer at ``(N - 1) x accumulation_steps``: locate read them
from there and diagnosed batches no step of the run trained on (a clean verdict, exit 0, for the
step it was asked about). It now starts from the checkpoint's data position, and from a rollback
between the checkpoint and the step by the rollback event's ``data_position``.

The run: ``linear`` in fp32 (the replay's loss is the CSV's, to float32's rounding), two micro-batches a
step, a checkpoint every 4 steps, a loss spike injected at step 7 that rolls back to step 4's
checkpoint; the data goes on at 4 x 2 + 20 = 28, not at 14.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import one_error_line, read_rows, run_events

RUN = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "accumulation_steps=2",
       "--set", "log.plot=false"]


def _rolled_back_at_7(cli, tmp_path, every: int) -> Path:
    """The run above, a checkpoint every ``every`` steps, all kept: its folder, its one rollback checked."""
    code, _, err = cli("train", *RUN, "--set", "steps=9", "--set", f"checkpoint.every={every}",
                       "--set", "checkpoint.keep=9", "--set", "rollback.triggers=[loss_spike]",
                       "--set", "rollback.window=4", "--set", "log.name=r", "--inject", "spike@7")
    assert code == 0, err
    run = tmp_path / "runs" / "r"
    [rollback] = [e for e in run_events(run) if e["event"] == "rollback"]
    assert (rollback["step"], rollback["checkpoint"]) == (7, f"step-{6 // every * every:08d}.pt")
    return run


@pytest.fixture
def rolled_back(cli, tmp_path):
    return _rolled_back_at_7(cli, tmp_path, every=4)


def _replayed_loss(cli, run, step, checkpoint):
    code, out, err = cli("locate", run / "config.yaml", "--step", step, "--checkpoint",
                         run / "checkpoints" / checkpoint, "--json")
    assert code == 0, err
    return json.loads(out)["amp"]["loss"]


def _csv_loss(run, step):
    # (the step's loss over its two micro-batches, summed in another order than the replay's: to float32's last bits;
    # another batch is off by far more)
    return pytest.approx(float(read_rows(run / "steps.csv")[step - 1]["loss"]), rel=1e-6, abs=0)


def test_locate_after_a_rollback_replays_the_batches_the_step_trained_on(cli, rolled_back):
    # step 9 read at 30 on the weights of step 8's checkpoint, saved after the rollback: its data position
    assert _replayed_loss(cli, rolled_back, 9, "step-00000008.pt") == _csv_loss(rolled_back, 9)
    # step 8 read at 28 on the weights of step 4's checkpoint (the rollback put them back): the rollback event's
    [rollback] = [e for e in run_events(rolled_back) if e["event"] == "rollback"]
    assert rollback["data_position"] == 28
    assert _replayed_loss(cli, rolled_back, 8, "step-00000004.pt") == _csv_loss(rolled_back, 8)
    # the triggering step itself read its batches (at 12) before the rollback moved the data on
    assert _replayed_loss(cli, rolled_back, 7, "step-00000004.pt") == _csv_loss(rolled_back, 7)


def test_a_rollback_event_without_a_data_position_is_refused_not_guessed(cli, rolled_back):
    events = rolled_back / "events.jsonl"  # (a run from before the event held one)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    events.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "data_position"}) + "\n" for e in lines))
    refused = cli("locate", rolled_back / "config.yaml", "--step", 8, "--checkpoint",
                  rolled_back / "checkpoints" / "step-00000004.pt")
    assert one_error_line(refused) == (
        "ampguard: error: locate: the run rolled back at step 7, after the checkpoint's step 4 and before step 8, and "
        "its events.jsonl does not say where the data went on from there: pass a --checkpoint saved after step 7 and "
        "before step 8 (its data position is the run's)")
    # a checkpoint saved after the rollback holds the position
    assert _replayed_loss(cli, rolled_back, 9, "step-00000008.pt") == _csv_loss(rolled_back, 9)


def test_a_checkpoint_a_resume_set_aside_replays_its_own_timeline_or_is_refused(cli, tmp_path):
    # review 58l: from checkpoints/abandoned-*/ the kept timeline's rollbacks were used, not the set-aside one's
    run = _rolled_back_at_7(cli, tmp_path, every=2)
    code, _, err = cli("train", "--resume", run / "checkpoints" / "step-00000004.pt")  # (the same faults: step 7 again)
    assert code == 0, err
    [aside] = (run / "checkpoints").glob("abandoned-*")
    assert (aside / "step-00000006.pt").is_file() and (aside / "step-00000008.pt").is_file()
    # no rollback between step 8 and step 9 in any timeline: the checkpoint's own position holds
    code, out, err = cli("locate", run / "config.yaml", "--step", 9, "--checkpoint", aside / "step-00000008.pt", "--json")
    assert code == 0, err
    assert json.loads(out)["amp"]["loss"] == _csv_loss(run, 9)  # (the resumed timeline trained step 9 alike)
    # a rollback at step 7 between step 6 and step 8: where the set-aside timeline read step 8 is not in the kept events
    refused = cli("locate", run / "config.yaml", "--step", 8, "--checkpoint", aside / "step-00000006.pt")
    assert one_error_line(refused).startswith(
        f"ampguard: error: locate: step-00000006.pt is in checkpoints/{aside.name}/, set aside by a resume, and the run "
        "rolled back at step 7 between its step 6 and step 8")
