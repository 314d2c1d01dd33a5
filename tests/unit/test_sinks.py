"""Sinks (docs/design.md §3): the per-step CSV and the console lines; the JSON lines and
TensorBoard on a resume."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time

import pytest
import torch

from helpers import HAS_TENSORBOARD, read_rows

from ampguard import ConsoleSink, CsvSink, Sink, SkipLog, StepLog
from ampguard.errors import InputError
from ampguard.records import format_number
from ampguard.files import DiskFull, disk_full_error
from ampguard.sinks import CSV_COLUMNS, JsonlSink, Sinks, TensorBoardSink, csv_row

HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale"
INF, NAN = float("inf"), float("nan")


def applied(step, loss=0.5, pre=2.0, post=1.0, scale=1024.0, lr=0.1):
    t = torch.tensor
    return StepLog(step=step, lr=lr, loss=t(loss), grad_l2_pre_clip=t(pre), grad_l2_post_clip=t(post),
                   scaler_scale=t(scale))


def skipped(step, reason="non_finite_grad", pre=INF, loss=0.7, scale=512.0, lr=0.1):
    return SkipLog(step=step, lr=lr, loss=torch.tensor(loss),
                   grad_l2_pre_clip=None if pre is None else torch.tensor(pre),
                   grad_l2_post_clip=None, scaler_scale=torch.tensor(scale), reason=reason)


# ---------------------------------------------------------------------------- CSV


def test_columns_are_the_contract():
    assert ",".join(CSV_COLUMNS) == HEADER


def test_csv_header_rows_and_cells(tmp_path):
    path = tmp_path / "steps.csv"
    sink = CsvSink(path)
    assert isinstance(sink, Sink)
    sink.write(applied(1, loss=0.25, pre=3.0, post=1.0, lr=0.125))
    sink.write(skipped(2, pre=INF))
    sink.write(skipped(3, reason="non_finite_loss", pre=None, loss=NAN))
    sink.write(applied(4, loss=-INF, pre=NAN, post=NAN))
    sink.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == HEADER
    assert len(lines) == 5
    rows = read_rows(path)
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert [r["skipped"] for r in rows] == ["0", "1", "1", "0"]
    assert [r["skip_reason"] for r in rows] == ["", "non_finite_grad", "non_finite_loss", ""]
    assert float(rows[0]["lr"]) == 0.125 and float(rows[0]["loss"]) == 0.25
    assert float(rows[0]["grad_l2_pre_clip"]) == 3.0 and float(rows[0]["grad_l2_post_clip"]) == 1.0
    assert float(rows[0]["scaler_scale"]) == 1024.0
    assert (rows[1]["grad_l2_pre_clip"], rows[1]["grad_l2_post_clip"]) == ("inf", "")
    assert (rows[2]["grad_l2_pre_clip"], rows[2]["grad_l2_post_clip"], rows[2]["loss"]) == ("", "", "nan")
    assert (rows[3]["loss"], rows[3]["grad_l2_pre_clip"]) == ("-inf", "nan")
    assert float(rows[1]["scaler_scale"]) == 512.0


def test_a_sink_handed_none_says_why_and_writes_nothing(tmp_path):
    # guard.step() returns None inside an accumulation group; `log.write(guard.step())` was an
    # AttributeError deep inside the row's formatting (or, in the writer thread, later)
    from ampguard.sinks import BackgroundSink

    csv_sink, jsonl = CsvSink(tmp_path / "s.csv"), JsonlSink(tmp_path / "s.jsonl")
    background = BackgroundSink(CsvSink(tmp_path / "b.csv"))
    for sink in (csv_sink, jsonl, ConsoleSink(), background, Sinks(csv_sink, ConsoleSink())):
        with pytest.raises(TypeError, match=r"guard.step\(\) returns None for a micro-batch inside an accumulation"):
            sink.write(None)
    for sink in (csv_sink, jsonl, background):
        sink.close()
    assert (tmp_path / "s.csv").read_text().splitlines() == [",".join(CSV_COLUMNS)]
    assert (tmp_path / "b.csv").read_text().splitlines() == [",".join(CSV_COLUMNS)]
    assert (tmp_path / "s.jsonl").read_text() == ""


def test_a_sink_never_writes_through_a_link_to_nothing(tmp_path):
    # appending through a dangling link creates its target, wherever it points (a demo --csv made
    # a file under /etc that way); a link to an existing file is that file, as before
    target = tmp_path / "elsewhere" / "made.csv"
    (tmp_path / "link.csv").symlink_to(target)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "elsewhere" / "made.jsonl")
    with pytest.raises(InputError, match=r"link\.csv is a symbolic link to nothing \(.*made\.csv\); refusing"):
        CsvSink(tmp_path / "link.csv")
    with pytest.raises(InputError, match=r"link\.jsonl is a symbolic link to nothing"):
        JsonlSink(tmp_path / "link.jsonl")
    assert not (tmp_path / "elsewhere").exists()


def test_csv_numbers_round_trip(tmp_path):
    path = tmp_path / "steps.csv"
    value = torch.tensor(0.1, dtype=torch.float32)  # not exactly 0.1: the float32 value must survive
    with_tensors = StepLog(step=1, lr=3e-4, loss=value, grad_l2_pre_clip=torch.tensor(1e-30),
                           grad_l2_post_clip=torch.tensor(123456.789), scaler_scale=torch.tensor(2.0**16))
    sink = CsvSink(path)
    sink.write(with_tensors)
    sink.close()
    (row,) = read_rows(path)
    assert float(row["loss"]) == float(value)
    assert float(row["lr"]) == 3e-4
    assert float(row["grad_l2_pre_clip"]) == float(torch.tensor(1e-30))
    assert float(row["scaler_scale"]) == 65536.0


@pytest.mark.parametrize(("x", "text"), [(None, ""), (INF, "inf"), (-INF, "-inf"), (NAN, "nan"), (0.1, "0.1"),
                                         (2.0, "2.0")])
def test_format_number(x, text):
    assert format_number(x) == text


def test_csv_rows_are_readable_before_close(tmp_path):
    path = tmp_path / "live.csv"
    sink = CsvSink(path)
    try:
        with open(path, newline="", encoding="utf-8") as reader:  # a second handle, as `tail -f` would
            assert reader.read() == HEADER + "\n"
            sink.write(applied(1))
            assert reader.read().startswith("1,")
        assert [r["step"] for r in read_rows(path)] == ["1"]
        sink.write(skipped(2))
        rows = read_rows(path)
        assert [r["step"] for r in rows] == ["1", "2"] and rows[1]["skipped"] == "1"
    finally:
        sink.close()


def test_csv_refuses_to_overwrite(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text("precious\n", encoding="utf-8")
    with pytest.raises(InputError, match="steps.csv"):
        CsvSink(path)
    assert path.read_text(encoding="utf-8") == "precious\n"


def test_csv_append_continues_without_a_second_header(tmp_path):
    path = tmp_path / "steps.csv"
    first = CsvSink(path)
    first.write(applied(1))
    first.write(skipped(2))
    first.close()
    second = CsvSink(path, append=True)
    second.write(applied(3))
    second.close()
    text = path.read_text(encoding="utf-8")
    assert text.count("step,lr") == 1 and text.startswith(HEADER + "\n")
    assert [r["step"] for r in read_rows(path)] == ["1", "2", "3"]


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_append_alone_cuts_a_torn_last_line_instead_of_finishing_it(tmp_path, kind):
    # A kill mid-write leaves a last line without its newline; append=True (no keep_through) wrote
    # the next record onto it: a CSV row of 12 cells that report refused, a JSON line no parser reads
    from ampguard.errors import AmpguardWarning

    path = tmp_path / f"steps.{kind}"
    sink_type = CsvSink if kind == "csv" else JsonlSink
    with sink_type(path) as sink:
        for step in (1, 2, 3):
            sink.write(applied(step))
    whole = path.read_bytes()
    path.write_bytes(whole[:-20])  # step 3's line torn
    with pytest.warns(AmpguardWarning, match=r"its last line was torn \(\d+ bytes without a newline"):
        sink = sink_type(path, append=True)
    sink.write(applied(3))  # the loop writes step 3 again (its line was lost)
    sink.write(applied(4))
    sink.close()
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and path.read_bytes().startswith(whole[:whole.rindex(b"\n", 0, len(whole) - 1)])
    if kind == "csv":
        assert [r["step"] for r in read_rows(path)] == ["1", "2", "3", "4"]
        assert all(len(line.split(",")) == len(CSV_COLUMNS) for line in text.splitlines())
    else:
        assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3, 4]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file that ends with its newline: nothing said, nothing cut
        sink_type(path, append=True).close()
    assert path.read_text(encoding="utf-8") == text


def test_a_torn_line_is_said_by_the_rank_whose_file_it_is(tmp_path, monkeypatch):
    # A sink's file is the process's that holds it (a loop of yours may give rank 1 its own steps.csv):
    # under torchrun the line about it is that rank's, labelled (a RankWarning), not rank 0's to say,
    # which left it unsaid on rank 1 and its file cut back without a word
    from ampguard.errors import RankWarning

    path = tmp_path / "steps_rank1.csv"
    with CsvSink(path) as sink:
        sink.write(applied(1))
    path.write_bytes(path.read_bytes()[:-5])
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # (rank 1 of 2, as torchrun starts it)
    with pytest.warns(RankWarning, match=r"^rank 1: .*steps_rank1\.csv: its last line was torn"):
        CsvSink(path, append=True).close()


def test_append_alone_finishes_a_header_whose_newline_was_never_written(tmp_path):
    # (review: the cut of a torn last line emptied a file that held the header alone, and no header
    # was written again: the next row stood where the header should be)
    path = tmp_path / "steps.csv"
    path.write_text(HEADER, encoding="utf-8")
    with CsvSink(path, append=True) as sink:
        sink.write(applied(1))
    assert [r["step"] for r in read_rows(path)] == ["1"] and path.read_text(encoding="utf-8").startswith(HEADER + "\n")
    path.write_text(HEADER, encoding="utf-8")  # a resume from step 0 keeps the header, whole
    with CsvSink(path, append=True, keep_through=0) as sink:
        sink.write(applied(1))
    assert [r["step"] for r in read_rows(path)] == ["1"]


def test_a_resume_reads_a_blank_line_as_report_does(tmp_path):
    # report and append took a CSV ending in a blank line (an editor's); a resume refused it ("0 cells")
    path = tmp_path / "steps.csv"
    with CsvSink(path) as sink:
        for step in (1, 2, 3):
            sink.write(applied(step))
    path.write_text(path.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    kept = CsvSink.kept_rows(path, len(CSV_COLUMNS), 2, first=1)
    assert kept.decode().splitlines()[1:] == path.read_text(encoding="utf-8").splitlines()[1:3]
    with CsvSink(path, append=True, keep_through=3) as sink:
        sink.write(applied(4))
    assert [r["step"] for r in read_rows(path)] == ["1", "2", "3", "4"]


def test_csv_append_to_a_new_file_writes_the_header(tmp_path):
    path = tmp_path / "new.csv"
    sink = CsvSink(path, append=True)
    sink.write(applied(1))
    sink.close()
    assert path.read_text(encoding="utf-8").splitlines()[0] == HEADER


@pytest.mark.parametrize(
    ("existing", "extra"),
    [
        ("step,loss\n1,0.5\n", ()),  # a different file altogether
        (HEADER + ",tokens_per_s\n1,0.1,1,1,1,0,,1,9\n", ()),  # written with an extra column
        (HEADER + "\n1,0.1,1,1,1,0,,1\n", ("tokens_per_s",)),  # this run has one more column
    ],
)
def test_csv_append_refuses_a_mismatched_header(tmp_path, existing, extra):
    path = tmp_path / "steps.csv"
    path.write_text(existing, encoding="utf-8")
    with pytest.raises(InputError):
        CsvSink(path, extra_columns=extra, append=True)
    assert path.read_text(encoding="utf-8") == existing


def test_extra_columns_come_after_the_fixed_eight(tmp_path):
    path = tmp_path / "steps.csv"
    sink = CsvSink(path, extra_columns=("tokens_per_s", "mem_gb"))
    sink.write(applied(1), {"tokens_per_s": 1500.5})
    sink.write(applied(2), {"tokens_per_s": INF, "mem_gb": 1.25})
    sink.close()
    header = path.read_text(encoding="utf-8").splitlines()[0]
    assert header == HEADER + ",tokens_per_s,mem_gb"
    rows = read_rows(path)
    assert (rows[0]["tokens_per_s"], rows[0]["mem_gb"]) == ("1500.5", "")
    assert (rows[1]["tokens_per_s"], rows[1]["mem_gb"]) == ("inf", "1.25")


@pytest.mark.parametrize("declared", [(), ("val_loss",)])
def test_a_value_no_column_holds_is_refused_not_dropped(tmp_path, declared):
    # write(record, {"val_acc": 0.93}) wrote the value nowhere (and a misspelled key left the
    # declared column empty), while the same sink refused a duplicate step in one line
    path = tmp_path / "steps.csv"
    sink = CsvSink(path, extra_columns=declared)
    sink.write(applied(1), {"val_loss": 0.5} if declared else None)
    written = path.read_bytes()
    with pytest.raises(ValueError, match=r"'val_acc' not among its columns \((val_loss|no extra column declared)\): "
                                         r"declare each up front"):
        sink.write(applied(2), {"val_acc": 0.93})
    assert path.read_bytes() == written and sink.rows == 1  # nothing half-written
    sink.write(applied(2))  # the sink goes on
    sink.close()
    assert [r["step"] for r in read_rows(path)] == ["1", "2"]


def test_csv_creates_missing_folders(tmp_path):
    path = tmp_path / "a" / "b" / "steps.csv"
    CsvSink(path).close()
    assert path.read_text(encoding="utf-8") == HEADER + "\n"


# ---------------------------------------------------------------------------- console

STEP_LINE = re.compile(r"^STEP (\d+) loss=(\S+) pre=(\S+) post=(\S+) scale=(\S+) lr=(\S+)$")
SKIP_LINE = re.compile(r"^SKIP (\d+) .* reason=(non_finite_grad|non_finite_loss)$")


def test_console_step_line_format():
    lines = []
    ConsoleSink(print_fn=lines.append).write(applied(7, loss=0.25, pre=3.0, post=1.0, scale=1024.0, lr=0.125))
    (line,) = lines
    match = STEP_LINE.match(line)
    assert match, line
    step, loss, pre, post, scale, lr = match.groups()
    assert int(step) == 7
    assert [float(v) for v in (loss, pre, post, scale, lr)] == [0.25, 3.0, 1.0, 1024.0, 0.125]


def test_console_skip_line_format():
    lines = []
    sink = ConsoleSink(print_fn=lines.append)
    sink.write(skipped(5, pre=INF, scale=512.0))
    sink.write(skipped(6, reason="non_finite_loss", pre=None, loss=NAN))
    assert SKIP_LINE.match(lines[0]).groups() == ("5", "non_finite_grad")
    assert SKIP_LINE.match(lines[1]).groups() == ("6", "non_finite_loss")
    assert "pre=inf" in lines[0] and "scale=512" in lines[0]
    assert "loss=nan" in lines[1]


def test_console_every_respected_but_skips_always_printed():
    lines = []
    sink = ConsoleSink(every=3, print_fn=lines.append)
    for step in range(1, 11):
        sink.write(skipped(step) if step in (5, 7) else applied(step))
    assert [int(line.split()[1]) for line in lines] == [3, 5, 6, 7, 9]
    assert [line.split()[0] for line in lines] == ["STEP", "SKIP", "STEP", "SKIP", "STEP"]


def test_console_default_prints_to_stdout(capsys):
    ConsoleSink().write(applied(1))
    out = capsys.readouterr().out
    assert STEP_LINE.match(out.strip())


def test_sinks_fan_out(tmp_path):
    lines = []
    path = tmp_path / "steps.csv"
    out = Sinks(CsvSink(path), ConsoleSink(print_fn=lines.append))
    out.write(applied(1))
    out.write(skipped(2))
    out.close()
    assert len(read_rows(path)) == 2 and len(lines) == 2


def test_record_values_reads_tensors_once_as_floats():
    record = applied(1, loss=0.5, pre=2.0, post=1.0, scale=8.0, lr=0.1)
    values = record.values()
    assert values == {"lr": 0.1, "loss": 0.5, "grad_l2_pre_clip": 2.0, "grad_l2_post_clip": 1.0, "scaler_scale": 8.0}
    assert all(isinstance(v, float) for v in values.values())
    assert record.values() is values  # cached: several sinks pay once
    assert skipped(2, pre=None).values()["grad_l2_pre_clip"] is None
    assert math.isinf(skipped(3).values()["grad_l2_pre_clip"])


# ---------------------------------------------------------------------------- a full disk (issue 16)


class FullAfter:
    """A text file that takes ``room`` more characters, then fails as a full disk does."""

    def __init__(self, real, room: int, errno_: int) -> None:
        self.real, self.room, self.errno = real, room, errno_

    def write(self, text: str) -> int:
        if len(text) > self.room:
            raise OSError(self.errno, os.strerror(self.errno))
        self.room -= len(text)
        return self.real.write(text)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EDQUOT])
def test_a_csv_row_that_finds_no_room_is_disk_full_naming_the_file(tmp_path, code):
    sink = CsvSink(tmp_path / "steps.csv")
    sink.write(applied(1))
    sink._file = FullAfter(sink._file, room=0, errno_=code)
    with pytest.raises(DiskFull) as caught:
        sink.write(applied(2))
    assert caught.value.path == tmp_path / "steps.csv" and caught.value.error.errno == code
    assert sink.rows == 1


def test_another_write_error_is_not_disk_full(tmp_path):
    sink = CsvSink(tmp_path / "steps.csv")
    sink._file = FullAfter(sink._file, room=0, errno_=errno.EIO)
    with pytest.raises(OSError) as caught:
        sink.write(applied(1))
    assert not isinstance(caught.value, DiskFull) and disk_full_error(caught.value) is None


def test_sinks_drop_a_full_sink_keep_the_others_and_remember_the_first_failure(tmp_path):
    lines: list[str] = []
    csv_sink = CsvSink(tmp_path / "steps.csv")
    jsonl = JsonlSink(tmp_path / "steps.jsonl")
    sinks = Sinks(csv_sink, jsonl, ConsoleSink(print_fn=lines.append))
    sinks.write(applied(1))
    csv_sink._file = FullAfter(csv_sink._file, room=0, errno_=errno.ENOSPC)
    sinks.write(applied(2))
    sinks.write(applied(3))
    assert sinks.failed is not None and sinks.failed.path == tmp_path / "steps.csv"
    assert sinks.failed.through == 1  # the records are complete up to the step before
    assert csv_sink not in sinks.sinks and len(lines) == 3
    sinks.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (tmp_path / "steps.csv").read_text().splitlines()[1:] == [csv_row_line(applied(1))]


def csv_row_line(record) -> str:
    row = csv_row(record)
    return ",".join(row[c] for c in CSV_COLUMNS)


def test_a_torch_save_that_found_no_room_is_disk_full():
    try:
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    except RuntimeError as err:
        assert disk_full_error(err).errno == errno.EFBIG


# ---------------------------------------------------------------------------- JSON lines and TensorBoard on a resume


def jsonl_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_jsonl_resume_drops_the_lines_after_the_checkpoint_step(tmp_path):
    path = tmp_path / "steps.jsonl"
    first = JsonlSink(path)
    for step in range(1, 6):
        first.write(applied(step, loss=1.0))
    first.close()
    JsonlSink(path, append=True).close()  # append alone (events.jsonl) keeps every line
    assert jsonl_steps(path) == [1, 2, 3, 4, 5]
    before = path.read_bytes().splitlines(keepends=True)

    resumed = JsonlSink(path, append=True, keep_through=3)  # resumed from step 3's checkpoint
    resumed.write(applied(4, loss=2.0))
    resumed.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert jsonl_steps(path) == [1, 2, 3, 4]  # no duplicate step
    assert lines[:3] == before[:3] and json.loads(lines[3])["loss"] == 2.0  # step 4 is the resumed run's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]  # no temporary file left


def test_jsonl_resume_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2):
        sink.write(applied(step))
    sink.close()
    with path.open("ab") as f:
        f.write(b'{"step": 3, "lr": 0.1, "lo')  # a write that found the disk full
    resumed = JsonlSink(path, append=True, keep_through=5)
    resumed.write(applied(3))
    resumed.close()
    assert jsonl_steps(path) == [1, 2, 3]


def test_jsonl_resume_keeps_the_records_after_an_event_of_yours_up_to_its_step(tmp_path):
    # review 52d: the cut stopped at the first line that was no step record (an event written with
    # write_event, no step), so a resume from step 8 dropped steps 6-8 after an event at 5: a hole
    path = tmp_path / "steps.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 11):
        sink.write(applied(step))
        if step == 5:
            sink.write_event({"event": "lr_drop"})
    sink.close()
    resumed = JsonlSink(path, append=True, keep_through=8)
    for step in (9, 10):
        resumed.write(applied(step))
    resumed.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("step", line.get("event")) for line in lines] == [1, 2, 3, 4, 5, "lr_drop", 6, 7, 8, 9, 10]


@pytest.mark.parametrize("existing", [
    '{"event": "run_start"}\n{"step": 1}\n',  # JSON lines, but not step records
    HEADER + "\n1,0.1,1,1,1,0,,1\n",  # a CSV
    '{"step": 1, "lr": 0.1, "lo',  # a torn first line (as CsvSink refuses a torn header)
    '[1, 2]\n',
])
def test_jsonl_resume_refuses_a_file_that_is_no_step_log_and_leaves_it(tmp_path, existing):
    path = tmp_path / "steps.jsonl"
    path.write_text(existing, encoding="utf-8")
    with pytest.raises(InputError, match="first line is not a step record") as caught:
        JsonlSink(path, append=True, keep_through=0)
    assert "\n" not in str(caught.value)
    assert path.read_text(encoding="utf-8") == existing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.jsonl"]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardSink(tmp_path)
    for step in range(1, 7):
        first.write(applied(step, loss=1.0))
    first.close()
    # Event files are read in name order: the second the writer opened, then the pid and a
    # counter that is not zero-padded. A resume (a new process) opens its file seconds later at
    # least; here, in one process, wait for the next second so the order is the same.
    time.sleep(1.05 - time.time() % 1)
    resumed = TensorBoardSink(tmp_path, keep_through=3)
    for step in (4, 5):
        resumed.write(applied(step, loss=2.0))
    resumed.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]  # step 6 and the first run's 4, 5 purged
    assert [e.step for e in events.Scalars("train/skipped")] == [1, 2, 3, 4, 5]


def test_a_json_log_that_begins_again_keeps_its_events_with_their_records(tmp_path):
    # events of your own between the records (lines without a step): before, the cut stopped at
    # the first such line, so step 2's record after it was lost from both files
    path = tmp_path / "steps.jsonl"
    sink = JsonlSink(path)
    sink.write(applied(1, loss=1.0))
    sink.write_event({"event": "note", "at": "before 2"})
    sink.write(applied(2, loss=1.0))
    sink.write(applied(3, loss=1.0))
    sink.write_event({"event": "note", "at": "before 4"})
    sink.write(applied(4, loss=1.0))
    assert sink.begin_again(2) == "steps.jsonl's 2 rows after it moved to steps.attempt-1.jsonl"
    sink.write(applied(3, loss=2.0))
    sink.close()
    lines = lambda name: [(r.get("step"), r.get("loss", r.get("at"))) for r in map(json.loads, (tmp_path / name).read_text().splitlines())]  # noqa: E731
    assert lines("steps.jsonl") == [(1, 1.0), (None, "before 2"), (2, 1.0), (3, 2.0)]
    assert lines("steps.attempt-1.jsonl") == [(3, 1.0), (None, "before 4"), (4, 1.0)]


def test_a_loop_that_begins_again_sets_the_steps_after_it_aside_in_each_file(tmp_path):
    # a Hugging Face auto_find_batch_size retry, in one process: the steps after the one the loop
    # began again from are the abandoned attempt's; each file then holds the new attempt's once
    sinks = [CsvSink(tmp_path / "steps.csv"), JsonlSink(tmp_path / "steps.jsonl"),
             *([TensorBoardSink(tmp_path / "tb")] if HAS_TENSORBOARD else [])]
    for sink in sinks:
        for step in (1, 2, 3):
            sink.write(applied(step, loss=1.0))
    assert [sink.begin_again(3) for sink in sinks] == [None] * len(sinks)  # (nothing after step 3)
    said = [sink.begin_again(1) for sink in sinks]
    assert said[:2] == ["steps.csv's 2 rows after it moved to steps.attempt-1.csv",
                        "steps.jsonl's 2 rows after it moved to steps.attempt-1.jsonl"]
    assert said[2:] == ["TensorBoard drops the abandoned attempt's steps 2-3 (a restart marker at step 2)"][:len(said) - 2]
    for sink in sinks:
        for step in (2, 3, 4):  # (CsvSink refused step 2 after step 3 before: each row's step follows the last)
            sink.write(applied(step, loss=2.0))
        assert sink.begin_again(4) is None
        sink.close()
    lines = lambda name: [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / name).read_text().splitlines())]  # noqa: E731
    assert lines("steps.jsonl") == [(1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)]
    assert lines("steps.attempt-1.jsonl") == [(2, 1.0), (3, 1.0)]
    rows = lambda name: [(int(r["step"]), float(r["loss"])) for r in read_rows(tmp_path / name)]  # noqa: E731
    assert rows("steps.csv") == lines("steps.jsonl") and rows("steps.attempt-1.csv") == lines("steps.attempt-1.jsonl")
    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)]


def test_keep_through_must_be_a_step(tmp_path):
    # keep_through=-5 kept no row: every row of the CSV was cut
    path = tmp_path / "s.csv"
    path.write_text(",".join(CSV_COLUMNS) + "\n1,0.1,1.0,1.0,0.5,0,,1.0\n")
    for bad in (-5, "1", 1.5):
        with pytest.raises(ValueError, match=r"^keep_through must be a step >= 0, got"):
            CsvSink(path, append=True, keep_through=bad)
    assert path.read_text().count("\n") == 2


@pytest.mark.parametrize("cell", ["g\x0c", "g\x0b", "g\x85", "g\u2028"])
def test_a_resume_keeps_a_row_report_reads_whatever_line_breaks_python_knows_it_holds(tmp_path, cell):
    # the kept rows were read back with str.splitlines, which breaks at a form feed, NEL or U+2028
    # where the file's reader (csv, newline="") does not: a row report reads was "5 cells, the
    # header has 8", and the resume refused it (a text cell: an optimizer's name)
    from ampguard.sinks import CSV_COLUMNS, read_steps_csv

    path = tmp_path / "steps.csv"
    path.write_text(",".join(CSV_COLUMNS) + f",optimizers\n1,0.1,2.0,1.0,0.5,0,,1.0,{cell}\n2,0.1,2.0,1.0,0.5,0,,1.0,g\n",
                    encoding="utf-8", newline="")
    assert [r.step for r in read_steps_csv(path)] == [1, 2]  # what report reads
    assert CsvSink.kept_rows(path, len(CSV_COLUMNS) + 1, 2, first=1) == path.read_bytes()


def test_a_csv_refuses_a_step_that_does_not_follow_the_last_one(tmp_path):
    # docs/design.md §3: a resumed run appends "without duplicate steps"; through the API a resume
    # that forgot keep_through, or a record written twice, wrote steps 3, 4, 3, 4 unsaid
    from ampguard.records import StepLog

    def log(step):
        return StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)

    path = tmp_path / "steps.csv"
    sink = CsvSink(path)
    sink.write(log(1))
    with pytest.raises(ValueError, match=r"steps.csv: step 1 after step 1: each row's step must follow the one before"):
        sink.write(log(1))
    sink.write(log(2))
    sink.close()
    resumed = CsvSink(path, append=True)  # (no keep_through: the file's last row is step 2)
    with pytest.raises(ValueError, match="step 2 after step 2"):
        resumed.write(log(2))
    resumed.write(log(3))
    resumed.close()
    again = CsvSink(path, append=True, keep_through=1)  # a resume from step 1's checkpoint: 2 and 3 dropped
    again.write(log(2))
    again.close()
    assert [line.split(",")[0] for line in path.read_text().splitlines()] == ["step", "1", "2"]


def test_a_text_cell_with_a_line_break_is_refused_so_every_row_stays_one_line(tmp_path):
    # review 33d: the csv module quoted it over two lines, and CsvSink's own resume (and report)
    # then refused the file it had written; a comma or a quote is still text the csv module keeps
    from ampguard.records import StepLog

    def record(step):
        return StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0)

    path = tmp_path / "steps.csv"
    sink = CsvSink(path, extra_columns=["note"])
    sink.write(record(1), {"note": 'a, "quoted" note'})
    for text in ("line1\nline2", "x\ry", "bell\x07"):
        with pytest.raises(ValueError, match=r"column 'note''s text .* holds a line break or a control character"):
            sink.write(record(2), {"note": text})
    sink.write(record(2), {"note": None})
    sink.close()
    CsvSink(path, extra_columns=["note"], append=True, keep_through=2).close()  # (its own resume reads it)
    assert path.read_text(encoding="utf-8").count("\n") == 3


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_refuses_what_the_csv_refuses_and_logs_the_extras_that_are_numbers(tmp_path):
    # review 36e: it took a step twice, a step going back and a write after close(), and a text
    # extra raised from add_scalar halfway through a step (some of its scalars written)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    sink.write(applied(1, loss=1.0), {"phase": "warm-up", "flag": True, "val_loss": 0.5, "acc": None})
    sink.write(applied(2, loss=1.0))
    for step in (2, 1):
        with pytest.raises(ValueError, match=rf"^TensorBoardSink \(.*\): step {step} after step 2: each step must"):
            sink.write(applied(step, loss=9.0))
    sink.close()
    with pytest.raises(ValueError, match=r"^TensorBoardSink \(.*\) is closed: nothing more can be written to it$"):
        sink.write(applied(3, loss=9.0))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("train/val_loss")] == [(1, 0.5)]
    assert not {"train/phase", "train/flag", "train/acc"} & set(events.Tags()["scalars"])


def test_a_background_sink_nobody_closed_writes_its_queue_at_exit(tmp_path):
    # review 36e: its writer is a daemon thread: a loop that crashed (or ended) without close() lost
    # every row still queued, with a slow inner sink all of them. (The script is forked warm,
    # tests/warm.py, which ends it as the interpreter does, non-daemon threads then atexit's
    # functions, without a fresh interpreter's ~2 s of imports.)
    import sys

    import warm

    script = tmp_path / "crash.py"
    script.write_text(
        "import sys, time\n"
        "sys.path[:0] = [sys.argv[2]]\n"
        "from ampguard import StepLog\n"
        "from ampguard.sinks import BackgroundSink, CsvSink\n"
        "class Slow(CsvSink):\n"
        "    def write(self, record, extra=None):\n"
        "        time.sleep(0.02)\n"
        "        super().write(record, extra)\n"
        "sink = BackgroundSink(Slow(sys.argv[1]))\n"
        "for step in range(1, 21):\n"
        "    sink.write(StepLog(step, lr=0.1, loss=1.0, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0))\n"
        "raise RuntimeError('the loop crashed')\n")
    done = warm.run([sys.executable, str(script), str(tmp_path / "steps.csv"),
                     os.path.dirname(os.path.dirname(__import__("ampguard").__file__))],
                    capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "the loop crashed" in done.stderr
    assert [row["step"] for row in read_rows(tmp_path / "steps.csv")] == [str(s) for s in range(1, 21)]


def test_a_background_sink_refuses_a_write_after_close_and_every_write_after_its_writer_failed(tmp_path):
    # review 36e: a write after close() was queued to a thread that had ended (silently dropped,
    # then a hang once the queue was full); after the writer's error was raised once, the writes
    # after it went through: steps 1, 2, 5, 6 in the CSV, a hole its docstring says cannot be
    from ampguard.sinks import BackgroundSink

    with BackgroundSink(CsvSink(tmp_path / "a.csv"), max_pending=2) as sink:
        sink.write(applied(1, loss=1.0))
    for _ in range(3):  # (the third blocked for good)
        with pytest.raises(ValueError, match="^BackgroundSink is closed: nothing more can be written to it$"):
            sink.write(applied(2, loss=1.0))
    sink.close()  # (a second close: nothing)

    class FailsAt3(CsvSink):
        def write(self, record, extra=None):
            if record.step == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(record, extra)

    sink = BackgroundSink(FailsAt3(tmp_path / "b.csv"))
    for step in (1, 2, 3):
        sink.write(applied(step, loss=1.0))
    while sink._failed is None:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):
        sink.write(applied(4, loss=1.0))
    for step in (5, 6):
        with pytest.raises(ValueError, match=r"^BackgroundSink: its writer failed \(.*No space left.*\): nothing more"):
            sink.write(applied(step, loss=1.0))
    sink.close()
    assert [row["step"] for row in read_rows(tmp_path / "b.csv")] == ["1", "2"]


def test_rows_that_end_early_name_the_line_past_them_that_is_not_the_next_step(tmp_path):
    # (review 48c: a row whose step was edited to 99999999999999999999999 read "its rows end at step 4"
    # with no word of the line that broke them)
    path, header = tmp_path / "steps.csv", ",".join(CSV_COLUMNS)
    rows = [f"{s},0.1,1,1,0.5,0,,1" for s in (1, 2, 3, 4, 99999999999999999999999, 6)]
    path.write_text(header + "\n" + "\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"its rows end at step 4 \(line 6 holds step 99999999999999999999999\), "
                                         r"the checkpoint is at step 6 \(rows missing\)"):
        CsvSink.kept_rows(path, len(CSV_COLUMNS), 6, first=1)
    path.write_text(header + "\n" + "\n".join(rows[:4]) + "\n", encoding="utf-8")  # (the tail lost: no line named)
    with pytest.raises(InputError, match=r"its rows end at step 4, the checkpoint"):
        CsvSink.kept_rows(path, len(CSV_COLUMNS), 6, first=1)


def test_an_integer_extra_is_written_as_its_digits_and_read_back_exactly(tmp_path):
    # an int extra (tokens seen, an epoch) was written as a float, 1024.0, exact only to 2**53:
    # 2**60 + 1 came back 2**60; a float's text, a bool's and a missing value's are as they were
    import numpy as np

    from ampguard.sinks import metric_number, metric_values, read_steps_and_columns

    path = tmp_path / "steps.csv"
    names = ["tokens", "epoch", "np_count", "t_count", "val_loss", "t_loss", "flag", "gone", "phase"]
    sink = CsvSink(path, extra_columns=names)
    ints = {"tokens": 2**60 + 1, "epoch": 1024, "np_count": np.int64(-3), "t_count": torch.tensor(7)}
    floats = {"val_loss": 0.1, "t_loss": torch.tensor(0.25), "flag": True, "gone": None}
    sink.write(applied(1), {**ints, **floats})  # numbers only (the join without the csv module)
    sink.write(applied(2), {**ints, **floats, "phase": "warm-up"})  # with text (through the csv module)
    sink.close()
    rows = read_rows(path)
    for row in rows:
        assert [row[k] for k in names[:8]] == ["1152921504606846977", "1024", "-3", "7", "0.1", "0.25", "1.0", ""]
    assert csv_row(applied(1), ints)["tokens"] == "1152921504606846977"
    _, extra = read_steps_and_columns(path)
    back = metric_values(extra[0], "line 2")
    assert back == {"tokens": 2**60 + 1, "epoch": 1024, "np_count": -3, "t_count": 7, "val_loss": 0.1,
                    "t_loss": 0.25, "flag": 1.0}
    assert [type(back[k]) for k in ("tokens", "val_loss")] == [int, float]
    assert metric_values({"old": "1024.0"}, "line 2") == {"old": 1024.0}  # (an older run's text reads as before)
    assert [metric_number(v) for v in (2**60 + 1, np.int64(3), torch.tensor(5))] == [2**60 + 1, 3, 5]
