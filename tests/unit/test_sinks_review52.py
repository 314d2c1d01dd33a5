"""Review 52d: an extra named like the record's own value overwrote it in the JSON lines and in
TensorBoard (the CSV refuses it); the JSON lines sink refused a NumPy or tensor extra every other
sink takes; ``ConsoleSink(every=0)`` failed at its first write."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import HAS_TENSORBOARD

from ampguard.records import StepLog
from ampguard.sinks import ConsoleSink, CsvSink, JsonlSink, TensorBoardSink


def _row(step: int) -> StepLog:
    return StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


@pytest.mark.parametrize("name", ["loss", "lr", "step", "skipped", "skip_reason"])
def test_an_extra_named_like_the_records_own_value_is_refused_by_every_file_sink(tmp_path, name):
    made = [CsvSink(tmp_path / "s.csv", extra_columns=["val_loss"]), JsonlSink(tmp_path / "s.jsonl")]
    if HAS_TENSORBOARD:
        made.append(TensorBoardSink(tmp_path / "tb"))
    for sink in made:
        with pytest.raises(ValueError, match=rf"'{name}' is a (fixed column|field of the record): its value is the "
                                             r"record's \(guard.step\(\)'s\)"):
            sink.write(_row(1), {name: 9.0})
        sink.write(_row(1), {"val_loss": 2.0})  # (nothing of the refused write kept: step 1 is still free)
        sink.close()
    (line,) = [json.loads(text) for text in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert (line["step"], line["loss"], line["val_loss"]) == (1, 0.5, 2.0)


def test_the_json_lines_sink_takes_numpy_and_tensor_extras_as_numbers(tmp_path):
    sink = JsonlSink(tmp_path / "s.jsonl")
    sink.write(_row(1), {"a": np.float32(0.25), "b": np.int64(3), "c": torch.tensor(0.5), "d": torch.tensor([7]),
                         "note": "warm-up", "flag": True, "none": None, "n": 4})
    sink.close()
    line = json.loads((tmp_path / "s.jsonl").read_text())
    assert [line[k] for k in ("a", "b", "c", "d", "note", "flag", "none", "n")] == [0.25, 3, 0.5, 7.0, "warm-up", True,
                                                                                       None, 4]


def test_the_json_lines_sink_refuses_an_extra_of_several_values_naming_it_and_writes_nothing(tmp_path):
    # review 52i: a raw TypeError ("not JSON serializable") that named no extra; a bool tensor and a
    # NumPy bool failed so too, and an int tensor was written as 3.0
    sink = JsonlSink(tmp_path / "s.jsonl")
    with pytest.raises(ValueError, match=r"extra 'hist' is a Tensor of 3 values: a row holds one value a column"):
        sink.write(_row(1), {"hist": torch.ones(3)})
    from fractions import Fraction

    sink.write(_row(1), {"flag": torch.tensor(True), "np_flag": np.bool_(False), "count": torch.tensor(3),
                         "half": Fraction(1, 2)})  # (review 52l: a Fraction, which the CSV takes, was refused)
    sink.close()
    line = json.loads((tmp_path / "s.jsonl").read_text())
    assert (line["flag"], line["np_flag"], line["count"], line["half"]) == (True, False, 3, 0.5)


def test_a_fraction_past_a_floats_range_is_refused_naming_the_extra(tmp_path):
    from fractions import Fraction

    sink = JsonlSink(tmp_path / "s.jsonl")
    with pytest.raises(ValueError, match=r"extra 'huge' is .*, past a float's range"):  # (review 52n: OverflowError)
        sink.write(_row(1), {"huge": Fraction(10 ** 400)})
    sink.close()


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_console_sink_refuses_an_every_that_is_no_whole_number_from_1(every):
    with pytest.raises(ValueError, match=r"ConsoleSink: every must be a whole number >= 1"):
        ConsoleSink(every=every)
    lines = []
    ConsoleSink(every=np.int64(2), print_fn=lines.append).write(_row(2))
    assert lines == ["STEP 2 loss=0.5 pre=1 post=1 scale=1 lr=0.1"]
