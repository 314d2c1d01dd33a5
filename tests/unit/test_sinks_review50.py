"""Review 50b: what the sinks write, every reader of the file can read back. A loop counting its
steps from 0 wrote rows its own reader (report, a resume) then refused; the JSON lines sink took
a step twice and a step going back, which the CSV refuses; TensorBoard took step 0 twice; and an
optimizer named with a line break split a CSV row in two, ';' made two names of one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import HAS_TENSORBOARD

from ampguard import Guard
from ampguard.records import StepLog
from ampguard.sinks import CsvSink, JsonlSink, TensorBoardSink


def _row(step) -> StepLog:
    return StepLog(step, lr=0.1, loss=1.0, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


def _sinks(tmp_path):
    made = [CsvSink(tmp_path / "s.csv"), JsonlSink(tmp_path / "s.jsonl")]
    if HAS_TENSORBOARD:
        made.append(TensorBoardSink(tmp_path / "tb"))
    return made


@pytest.mark.parametrize("step", [0, -3, True, 1.5, "2"])
def test_a_step_that_is_not_a_whole_number_from_1_is_refused_by_every_sink_and_nothing_is_written(tmp_path, step):
    for sink in _sinks(tmp_path):
        with pytest.raises(ValueError, match=rf"step {step!r} is not a whole number >= 1"):
            sink.write(_row(step))
        sink.write(_row(np.int64(1)))  # (a numpy integer is a whole number)
        sink.close()
    assert (tmp_path / "s.csv").read_text().splitlines()[1].startswith("1,")
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 1


def test_the_json_lines_sink_refuses_a_step_written_again_or_going_back_as_the_csv_does(tmp_path):
    sink = JsonlSink(tmp_path / "s.jsonl")
    sink.write(_row(5))
    for step in (5, 2):
        with pytest.raises(ValueError, match=rf"JsonlSink .*: step {step} after step 5: each record's step must follow"):
            sink.write(_row(step))
    sink.write_event({"step": 5, "event": "checkpoint"})  # (events share a step: not step records)
    sink.write(_row(6))
    sink.close()
    # appended after a resume from step 6: the next record must come after it
    again = JsonlSink(tmp_path / "s.jsonl", append=True, keep_through=6)
    with pytest.raises(ValueError, match="step 6 after step 6"):
        again.write(_row(6))
    again.write(_row(7))
    again.close()
    assert [line.count('"step": ') for line in (tmp_path / "s.jsonl").read_text().splitlines()] == [1, 1, 1, 1]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard not installed")
def test_tensorboard_refuses_step_0_written_twice_by_refusing_step_0(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    with pytest.raises(ValueError, match="step 0 is not a whole number >= 1"):
        sink.write(_row(0))
    sink.write(_row(1))
    with pytest.raises(ValueError, match="step 1 after step 1"):
        sink.write(_row(1))
    sink.close()


@pytest.mark.parametrize("name", ["gen\ndisc", "a;b", "", "tab\there"])
def test_an_optimizer_name_no_csv_cell_can_hold_is_refused_when_the_guard_is_made(name):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"optimizer name .* cannot name a record's cells"):
        Guard(model, {name: torch.optim.SGD(model.parameters(), lr=0.1)}, precision="fp32")
    Guard(model, {"gen.1 (adam)": torch.optim.SGD(model.parameters(), lr=0.1)}, precision="fp32")
