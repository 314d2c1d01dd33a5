"""Sinks against hostile names and files (review of the observability code): a metric or extra
column named like a fixed CSV column is refused in one line (by ``CsvSink`` and by
``task.factory``); a row that a full disk cuts short is taken back out of the file; a resume's
cut of steps.csv refuses a line it cannot read (past the first 8 KB too) before it changes the file.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from helpers import file_size_limit, in_fork

from ampguard import CsvSink, StepLog
from ampguard.config import load_config
from ampguard.errors import InputError
from ampguard.files import DiskFull
from ampguard.records import LABEL_COLUMNS
from ampguard.sinks import CSV_COLUMNS, JsonlSink, check_column_names
from ampguard.tasks.factory import build_from_factory

HEADER = ",".join(CSV_COLUMNS)


def applied(step: int) -> StepLog:
    return StepLog(step=step, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


# ---------------------------------------------------------------------------- column names


@pytest.mark.parametrize("extra, named", [
    (["loss"], "'loss'"), (["val_loss", "step"], "'step'"), (["skipped"], "'skipped'"),
    (["val_loss", "val_loss"], "'val_loss' is named twice"), ([""], "'' is empty"),
])
def test_csv_sink_refuses_an_extra_column_that_would_shadow_or_repeat_one_and_writes_nothing(tmp_path, extra, named):
    # a second "loss" column was written, and the report read the metric as the training loss
    path = tmp_path / "steps.csv"
    with pytest.raises(InputError) as caught:
        CsvSink(path, extra_columns=extra)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("CsvSink: extra column ") and named in message
    assert not path.exists()


def test_csv_sink_still_takes_metrics_and_the_optimizer_label_columns(tmp_path):
    sink = CsvSink(tmp_path / "steps.csv", extra_columns=["val_loss", *LABEL_COLUMNS])
    sink.write(applied(1), {"val_loss": 0.25})
    sink.close()
    header = (tmp_path / "steps.csv").read_text().splitlines()[0]
    assert header == HEADER + ",val_loss," + ",".join(LABEL_COLUMNS)


def test_check_column_names_refuses_what_is_not_a_name():
    with pytest.raises(InputError, match=r"x 3 is a int, not a name"):
        check_column_names(["a", 3], "x")


def write_factory(folder: Path, metrics: str) -> Path:
    path = folder / "fac.py"
    path.write_text(textwrap.dedent(f"""\
        import torch
        def build(config):
            x = torch.ones(4, 2)
            return {{"model": torch.nn.Linear(2, 1), "data": [(x, torch.zeros(4, 1))],
                     "loss_fn": torch.nn.functional.mse_loss,
                     "evaluate": lambda model, device: {{}}, "metrics": {metrics}}}
        """))
    return path


@pytest.mark.parametrize("metrics, named", [
    ('("loss",)', "metric 'loss' is one of the CSV's fixed columns"),
    ('"step"', "metric 'step' is one of the CSV's fixed columns"),
    ('("val", "skip_reason")', "metric 'skip_reason'"),
    ('("optimizers",)', "metric 'optimizers'"),  # a label column (records.LABEL_COLUMNS)
    ('("val", "val")', "metric 'val' is named twice"),
    ('("",)', "metric '' is empty"),
    # a line break split the CSV's header: the run itself could not be resumed ("line 2: 1 cells")
    ('("val\\nloss",)', "metric 'val\\nloss' holds a control character or a line break"),
])
def test_a_factory_metric_named_like_a_csv_column_is_refused_in_one_line(tmp_path, metrics, named):
    path = write_factory(tmp_path, metrics)
    with pytest.raises(InputError) as caught:
        build_from_factory(load_config(None, [f"task.factory={path}:build"]))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"task.factory {path}:build: ") and named in message


def test_a_metric_name_with_a_non_breaking_space_or_a_joiner_is_a_name():
    # only control characters and line breaks are refused: a printable-looking name is not
    assert check_column_names(["val\xa0loss", "a\u200db"], "task metric") == ("val\xa0loss", "a\u200db")


def test_a_factory_with_good_metric_names_builds(tmp_path):
    path = write_factory(tmp_path, '("val_loss", "val_accuracy")')
    task = build_from_factory(load_config(None, [f"task.factory={path}:build"]))
    assert task.metrics == ("val_loss", "val_accuracy")


# ---------------------------------------------------------------------------- a row cut short by a full disk


def _write_until_full(kind: str, path: Path) -> str:
    """Steps 1-9 written to a new sink at ``path`` until the disk is full: the rows written and why."""
    sink = CsvSink(path) if kind == "csv" else JsonlSink(path)
    written = 0
    try:
        for step in range(1, 10):
            sink.write(StepLog(step=step, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0,
                               scaler_scale=1.0))
            written += 1
    except DiskFull as full:
        return f"{written} {full.error.strerror}"
    return f"{written} (no full disk)"


def expected_lines(kind: str, tmp_path: Path) -> list[bytes]:
    """The lines the sink writes for steps 1..9 (without a size limit), each with its newline."""
    path = tmp_path / f"free.{kind}"
    sink = CsvSink(path) if kind == "csv" else JsonlSink(path)
    for step in range(1, 10):
        sink.write(applied(step))
    sink.close()
    return path.read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_row_a_full_disk_cuts_short_is_taken_back_out_of_the_file(tmp_path, kind):
    # the first write took what fitted, the next one failed: half a row stayed in steps.csv
    lines = expected_lines(kind, tmp_path)
    whole = 3 if kind == "csv" else 2  # the header (csv) and the complete rows that fit
    limit = sum(map(len, lines[:whole])) + len(lines[whole]) // 2  # the limit falls inside the next row
    path = tmp_path / f"full.{kind}"
    code, said = in_fork(lambda: _write_until_full(kind, path), preexec=file_size_limit(limit))
    assert code == 0, said
    assert said.split()[0] == str(whole - (kind == "csv")), said  # rows written before the full disk
    assert path.read_bytes() == b"".join(lines[:whole])  # every row whole, nothing of the cut one


@pytest.mark.parametrize("before", [None, b""])
def test_a_csv_whose_header_finds_no_room_is_not_left_behind_empty(tmp_path, before):
    # a demo --csv on a full disk left a 0-byte file, which the next run refused as "already exists";
    # an empty file that was there before (the user's) stays
    path = tmp_path / "steps.csv"
    if before is not None:
        path.write_bytes(before)

    def open_sink() -> str:
        try:
            CsvSink(path)
        except DiskFull as full:
            return f"refused: {full.error.strerror}"
        return "opened"

    code, said = in_fork(open_sink, preexec=file_size_limit(10))  # (the header is ~90 bytes)
    assert code == 0 and said.startswith("refused:"), said
    assert path.exists() == (before is not None)
    if before is not None:
        assert path.read_bytes() == before


# ---------------------------------------------------------------------------- a resume's cut of steps.csv


def big_csv(path: Path, rows: int = 200) -> bytes:
    lines = [HEADER + ",val_loss\n"] + [f"{s},0.0029995295815229465,{s}.3017874956130981,0.9999992847442627,"
                                         f"1.333611011505127,0,,65536.0,\n" for s in range(1, rows + 1)]
    data = "".join(lines).encode()
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("spoil, said", [
    (lambda line: line.replace(b".", b"\xff.", 1), "not UTF-8 text"),  # a bad byte in a number
    (lambda line: b"\xc2\xb2" + line[line.index(b","):], "step '\u00b2' is not a step number"),  # '²'.isdigit()
    (lambda line: line.replace(b",", b";", 2), "cells, the header has 9"),
])
def test_a_resume_refuses_a_line_it_cannot_read_past_the_first_8_kb_and_cuts_nothing(tmp_path, spoil, said):
    # the whole file was decoded at once (UnicodeDecodeError) and int() took what isdigit() passed
    # ('²': ValueError): a traceback, past the first 8 KB that the header check reads
    path = tmp_path / "steps.csv"
    lines = big_csv(path).splitlines(keepends=True)
    lines[140] = spoil(lines[140])  # step 140, line 141
    path.write_bytes(b"".join(lines))
    assert sum(map(len, lines[:140])) > 8192
    before = path.read_bytes()
    with pytest.raises(InputError) as caught:
        CsvSink(path, extra_columns=["val_loss"], append=True, keep_through=150)
    message = str(caught.value)
    assert "\n" not in message and f"{path} line 141: " in message and said in message, message
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp*"))


def test_a_resume_cuts_a_spoiled_line_after_the_checkpoint_step_with_the_abandoned_rows(tmp_path):
    path = tmp_path / "steps.csv"
    lines = big_csv(path).splitlines(keepends=True)
    lines[180] = lines[180].replace(b".", b"\xff.", 1)
    lines[-1] = lines[-1][:-9]  # and a torn last line
    path.write_bytes(b"".join(lines))
    sink = CsvSink(path, extra_columns=["val_loss"], append=True, keep_through=150)
    sink.write(applied(151), {"val_loss": None})
    sink.close()
    data = path.read_bytes()
    assert data.startswith(b"".join(lines[:151])) and data.count(b"\n") == 152 and data.endswith(b"\n")
    assert data.splitlines()[-1].startswith(b"151,")


def test_a_resume_keeps_every_row_up_to_the_step_and_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "steps.csv"
    data = big_csv(path, rows=20)
    path.write_bytes(data[:-7])  # row 20 torn
    CsvSink(path, extra_columns=["val_loss"], append=True, keep_through=100).close()
    assert path.read_bytes() == b"".join(data.splitlines(keepends=True)[:20])  # header + rows 1..19


def test_csv_rows_still_go_out_whole_in_one_write(tmp_path):
    sink = CsvSink(tmp_path / "steps.csv")
    for step in (1, 2):
        sink.write(applied(step))
    sink.close()
    assert (tmp_path / "steps.csv").read_text().splitlines()[1:] == ["1,0.1,2.0,1.0,0.5,0,,1.0",
                                                                     "2,0.1,2.0,1.0,0.5,0,,1.0"]


def test_applied_record_with_tensors_is_written_as_floats(tmp_path):
    sink = CsvSink(tmp_path / "steps.csv")
    t = torch.tensor
    sink.write(StepLog(step=1, lr=0.1, loss=t(0.5), grad_l2_pre_clip=t(2.0), grad_l2_post_clip=t(1.0),
                       scaler_scale=t(1.0)))
    sink.close()
    assert (tmp_path / "steps.csv").read_text().splitlines()[1] == "1,0.1,2.0,1.0,0.5,0,,1.0"
