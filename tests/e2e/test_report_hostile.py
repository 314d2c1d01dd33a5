"""What ``ampguard report`` (and a resume) reads back, against hostile files (review of the
observability code): a task metric named like a fixed CSV column is refused before anything is
written; a header that names a column twice, a step like ``1_000`` are one line, exit 2; a torn
last line (a row a kill or a full disk cut short) is left out instead of refusing the run, and
a full disk leaves no torn row behind at all; losses and learning rates out to +-1e308 and a
negative first loss scale are plotted; a run folder's plot keeps the run's title; a resume that
meets a line it cannot read past the CSV's first 8 KB is one line and cuts nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
import warm

import helpers
from helpers import marked, ok, one_error_line, png_size, read_rows, someones_png

from ampguard.errors import ExitCode
from ampguard.sinks import CSV_COLUMNS

HEADER = ",".join(CSV_COLUMNS)
LINEAR = ["--set", "task.name=linear", "--set", "device=cpu", "--set", "precision=fp32"]


def csv_text(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def refused(cli, target: str) -> str:
    code, out, err = cli("report", target)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


# ---------------------------------------------------------------------------- a metric named like a column


FACTORY = """
import torch
from torch import nn

def build(config):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x.sum(1, keepdim=True)
    loss_fn = nn.MSELoss()

    def evaluate(model, device):
        with torch.no_grad():
            return {{"{metric}": float(loss_fn(model(x.to(device)), y.to(device))) + 1000.0}}

    return {{"model": nn.Linear(4, 1), "data": [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)],
            "loss_fn": loss_fn, "evaluate": evaluate, "metrics": ("{metric}",)}}
"""


@pytest.mark.parametrize("metric", ["loss", "step", "skipped"])
def test_a_factory_metric_named_like_a_csv_column_is_refused_before_the_run_folder_is_made(tmp_path, snapshot,
                                                                                            metric):
    # the CSV got two "loss" columns; report, steps.jsonl and TensorBoard took the held-out value for
    # the training loss (a metric "step" or "skipped" made report refuse the run)
    factory = tmp_path / "fac.py"
    factory.write_text(FACTORY.format(metric=metric), encoding="utf-8")
    before = snapshot(tmp_path)
    line = one_error_line(helpers.train(tmp_path / "runs", "fac", "--set", f"task.factory={factory}:build",
                                        *LINEAR, "--set", "steps=4", "--set", "eval.every=2",
                                        "--set", "log.jsonl=true"))
    assert f"metric '{metric}' is one of the CSV's fixed columns" in line, line
    assert snapshot(tmp_path) == before


def test_a_factory_metric_with_its_own_name_is_a_column_of_its_own(tmp_path):
    factory = tmp_path / "fac.py"
    factory.write_text(FACTORY.format(metric="held_out_loss"), encoding="utf-8")
    ok(helpers.train(tmp_path, "fac", "--set", f"task.factory={factory}:build", *LINEAR, "--set", "steps=4",
                     "--set", "eval.every=2"))
    rows = read_rows(tmp_path / "fac" / "steps.csv")
    assert float(rows[1]["held_out_loss"]) > 1000 > float(rows[1]["loss"])


def test_report_refuses_a_header_that_names_a_column_twice(cli, tmp_path, snapshot):
    # the last "loss" column won: the report read the metric as the training loss
    (tmp_path / "two.csv").write_text(csv_text(HEADER + ",loss", "1,0.1,2.0,1.0,0.5,0,,1.0,1000.5"))
    before = snapshot(tmp_path)
    line = refused(cli, "two.csv")
    assert line.startswith("ampguard: error: two.csv: ") and "'loss' more than once" in line, line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("step", ["1_000", " 7", "+7", "-3", "\u0662"])  # the last: ARABIC-INDIC DIGIT TWO
def test_report_refuses_a_step_that_int_would_take_but_is_no_whole_number_in_ascii(cli, tmp_path, step):
    (tmp_path / "s.csv").write_text(csv_text(HEADER, f"{step},0.1,2.0,1.0,0.5,0,,1.0"), encoding="utf-8")
    line = refused(cli, "s.csv")
    assert f"line 2: step {step!r} is not a step number (a whole number from 1)" in line, line


def test_report_refuses_a_step_past_int64_in_one_line_and_writes_nothing(cli, tmp_path, snapshot):
    # review 58c F3: the plot keeps steps as int64, and a step past 2**63 - 1 was an OverflowError's
    # traceback (exit 1); the last one that fits is read
    last, row = 2**63 - 1, ",0.1,2.0,1.0,0.5,0,,1.0"
    (tmp_path / "s.csv").write_text(csv_text(HEADER, f"{last - 1}{row}", f"{last}{row}", f"{last + 1}{row}"),
                                    encoding="utf-8")
    before = snapshot(tmp_path)
    line = refused(cli, "s.csv")
    assert line == f"ampguard: error: s.csv line 4: step {last + 1} is past the last step number ({last})", line
    assert snapshot(tmp_path) == before
    (tmp_path / "t.csv").write_text(csv_text(HEADER, f"{last - 1}{row}", f"{last}{row}"), encoding="utf-8")
    assert f"summary: steps={last} updates=2 " in ok(cli("report", "t.csv", "--no-plot"))


@pytest.mark.parametrize("cell", ["1_000", " 1.5", "1.5 ", "\u0661.\u0665"])  # the last: ARABIC-INDIC 1.5
def test_report_refuses_a_number_cell_float_would_take_but_no_writer_writes(cli, tmp_path, cell):
    (tmp_path / "s.csv").write_text(csv_text(HEADER, f"1,0.1,2.0,1.0,{cell},0,,1.0"), encoding="utf-8")
    line = refused(cli, "s.csv")
    assert f"line 2: column loss holds {cell!r}, not a number" in line, line


@pytest.mark.parametrize("column", ["grad_l2_pre_clip", "grad_l2_post_clip"])
def test_report_refuses_a_negative_norm_and_reads_a_non_finite_one(cli, tmp_path, column):
    cells = {"grad_l2_pre_clip": "2.0", "grad_l2_post_clip": "1.0"}
    (tmp_path / "s.csv").write_text(csv_text(HEADER, "1,0.1,{grad_l2_pre_clip},{grad_l2_post_clip},0.5,0,,1.0".format(
        **{**cells, column: "-2.0"})), encoding="utf-8")
    line = refused(cli, "s.csv")
    assert f"line 2: {column} -2.0 is no norm (one is >= 0, or non-finite)" in line, line
    (tmp_path / "n.csv").write_text(csv_text(HEADER, "1,0.1,nan,,nan,1,non_finite_loss,1.0",
                                             "2,0.1,inf,,0.5,1,non_finite_grad,1.0"), encoding="utf-8")
    code, out, err = cli("report", "n.csv", "--no-plot")
    assert code == 0 and "summary: steps=2 " in out, (out, err)


@pytest.mark.parametrize("row, said", [
    ("1,0.1,2.0,1.0,nan,0,,1.0", "loss nan on a step not skipped (a non-finite loss is always skipped)"),
    ("1,0.1,inf,1.0,0.5,0,,1.0", "grad_l2_pre_clip inf on a step not skipped (a non-finite gradient norm is always "
                                 "skipped)"),
    ("1,0.1,2.0,3.0,0.5,0,,1.0", "grad_l2_post_clip 3.0 is above grad_l2_pre_clip 2.0 (clipping only shrinks a norm)"),
], ids=["applied-nan-loss", "applied-inf-norm", "post-above-pre"])
def test_report_refuses_a_row_no_run_can_write(cli, tmp_path, row, said):
    # review 33e: an applied step with a NaN loss (report's final loss: nan) and a post-clip norm
    # above the pre-clip one were read silently, while a negative norm was refused
    (tmp_path / "s.csv").write_text(csv_text(HEADER, "2,0.1,2.0,1.0,0.5,0,,1.0".replace("2,", "1,", 1),
                                             row.replace("1,", "2,", 1)), encoding="utf-8")
    line = refused(cli, "s.csv")
    assert line.endswith(f"s.csv line 3: {said}"), line


# ---------------------------------------------------------------------------- torn last lines, a full disk


@pytest.mark.parametrize("tail", ["2,0.1,2.0,1.", "2,0.1,2.0,1.0,0.5,0,,655"])  # the second: 8 cells, cut in a number
def test_report_leaves_out_a_torn_last_line_and_says_so(cli, tmp_path, tail):
    (tmp_path / "t.csv").write_text(f"{HEADER}\n1,0.1,2.0,1.0,0.5,0,,65536.0\n{tail}", encoding="utf-8")
    code, out, err = cli("report", "t.csv")
    assert code == 0, err
    assert "note: the last line of t.csv is torn" in out, out
    assert "summary: steps=1 updates=1 skips=0 (none) final_scale=65536 " in out, out  # not 655
    assert png_size(tmp_path / "t.png") == (1200, 1400)


def test_report_of_a_csv_killed_in_its_first_row_says_the_row_is_torn(cli, tmp_path, snapshot):
    # the kill edge at the first row: "no steps recorded" alone did not say a row was there, cut short
    (tmp_path / "t.csv").write_text(f"{HEADER}\n1,0.1,2.0,1.", encoding="utf-8")
    before = snapshot(tmp_path)
    line = refused(cli, "t.csv")
    assert line == "ampguard: error: t.csv: no steps recorded (its one row is torn, a write cut short: '1,0.1,2.0,1.'), " \
                   "nothing to report"
    assert snapshot(tmp_path) == before


def test_report_reads_a_last_line_that_ends_in_a_newline_as_a_row(cli, tmp_path):
    (tmp_path / "t.csv").write_text(csv_text(HEADER, "1,0.1,2.0,1.0,0.5,0,,65536.0", "2,0.1,2.0,1.0,0.5,0,,655"))
    code, out, err = cli("report", "t.csv", "--no-plot")  # (the summary is the point)
    assert code == 0 and "torn" not in out and "summary: steps=2 " in out and "final_scale=655 " in out, out


def test_report_reads_a_csv_that_ends_in_a_blank_line(cli, tmp_path):
    # an editor's last newline: "line 3: 0 cells, the header has 8", exit 2
    (tmp_path / "t.csv").write_text(csv_text(HEADER, "1,0.1,2.0,1.0,0.5,0,,65536.0", "2,0.1,2.0,1.0,0.5,0,,655") + "\n")
    code, out, err = cli("report", "t.csv", "--no-plot")
    assert code == 0 and "summary: steps=2 " in out and "final_scale=655 " in out, (out, err)


@pytest.mark.parametrize(("first", "scale"), [(False, "-1"), (False, "nan"), (False, "-inf"), (True, "-1.0")])
def test_report_refuses_a_scale_no_scaler_has(cli, tmp_path, snapshot, first, scale):
    # it read -1 as a scale at its floor ("final_scale=-1 ... scale collapsing"); a negative first
    # scale was taken as the run's init_scale (a ValueError, exit 1, before it was passed over).
    # 0 stays a record: a plain GradScaler's scale that underflowed
    scales = [scale, "1024.0"] if first else ["1024.0", scale]
    (tmp_path / "s.csv").write_text(csv_text(HEADER, *(f"{n},0.1,2.0,1.0,0.5,0,,{x}" for n, x in enumerate(scales, 1))))
    before = snapshot(tmp_path)
    line = refused(cli, "s.csv")
    assert f"line {2 if first else 3}: scaler_scale {scale} is no loss scale (one is >= 0)" in line, line
    assert snapshot(tmp_path) == before  # no plot drawn


def test_a_full_disk_leaves_no_half_row_and_report_reads_the_run(tmp_path, cli):
    # the first write took what fitted, the second raised EFBIG: steps.csv ended in half a row, and
    # report refused the run ("line 34: 3 cells, the header has 9")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # (one thread, no bars: the suite's, conftest.py)
    done = warm.run(
        [sys.executable, "-m", "ampguard", "train", *LINEAR, "--set", "steps=200", "--set", "checkpoint.enabled=false",
         "--set", "eval.enabled=false", "--set", "log.every=1000", "--set", "log.dir=runs", "--set", "log.name=full"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, file_size=3072)
    assert done.returncode == ExitCode.DISK_FULL, done.stderr
    run = tmp_path / "runs" / "full"
    data = (run / "steps.csv").read_bytes()
    assert data.endswith(b"\n") and len(data) <= 3072, data[-80:]
    n = int(re.search(r"intact up to step (\d+)", done.stderr).group(1))
    assert [int(r["step"]) for r in read_rows(run / "steps.csv")] == list(range(1, n + 1))
    code, out, err = cli("report", run, "--no-plot")  # (the summary is the point)
    assert code == 0, err
    assert f"summary: steps={n} " in out and "torn" not in out


# ---------------------------------------------------------------------------- what cannot be laid out


@pytest.mark.parametrize("rows", [
    ["1,0.1,2.0,1.0,1e308,0,,1.0", "2,0.1,2.0,1.0,-1e308,0,,1.0", "3,0.1,2.0,1.0,0.5,0,,1.0"],  # loss
    ["1,1e308,2.0,1.0,0.5,0,,1.0", "2,-1e308,2.0,1.0,0.5,0,,1.0"],  # lr
    ["1,0.1,2.0,1.0,1.7e308,0,,1.0", "2,0.1,2.0,1.0,1.6e308,0,,1.0", "3,0.1,2.0,1.0,-1.0,0,,1.0"],
], ids=["loss", "lr", "loss-near-max"])
def test_report_plots_values_out_to_the_float64_limit(cli, tmp_path, rows):
    # matplotlib's linear tick locator overflowed: "ValueError: arange: cannot compute length" (exit 1)
    (tmp_path / "h.csv").write_text(csv_text(HEADER, *rows))
    code, out, err = cli("report", "h.csv")
    assert code == 0 and err == "", (code, err)
    assert png_size(tmp_path / "h.png") == (1200, 1400)


def test_a_drawing_error_is_one_line_and_no_png(cli, tmp_path, monkeypatch, snapshot):
    def cannot(*args, **kwargs):
        raise ValueError("arange: cannot compute length")

    monkeypatch.setattr("ampguard.report._draw", cannot)
    (tmp_path / "d.csv").write_text(csv_text(HEADER, "1,0.1,2.0,1.0,0.5,0,,1.0"))
    before = snapshot(tmp_path)
    line = refused(cli, "d.csv")
    assert line == "ampguard: error: d.csv: cannot be plotted (ValueError: arange: cannot compute length)", line
    assert snapshot(tmp_path) == before


def test_report_of_a_run_folder_keeps_the_runs_title(cli, tmp_path, monkeypatch):
    # the run drew "run <name>: N steps"; report drew it again as "steps.csv: N steps"
    from matplotlib.figure import Figure

    titles: list[str] = []
    real = Figure.suptitle

    def suptitle(self, text, *args, **kwargs):
        titles.append(text)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Figure, "suptitle", suptitle)
    ok(cli("train", *LINEAR, "--set", "steps=3", "--set", "eval.enabled=false", "--set", "checkpoint.enabled=false",
           "--set", "log.dir=.", "--set", "log.name=titled"))
    assert titles == ["run titled: 3 steps, 0 skipped"]
    code, out, err = cli("report", "titled")
    assert code == 0, err
    code, out, err = cli("report", "titled/steps.csv", "--out", "bare.png")
    assert code == 0, err
    assert titles == ["run titled: 3 steps, 0 skipped"] * 2 + ["steps.csv: 3 steps, 0 skipped"]


# ---------------------------------------------------------------------------- a resume past the first 8 KB


def test_a_resume_that_meets_a_bad_line_past_8_kb_is_one_line_and_cuts_nothing(tmp_path, snapshot):
    # steps.csv was decoded whole (UnicodeDecodeError) and int() took what isdigit() passed ('²':
    # ValueError): a traceback, after the header check (the first 8 KB) had passed
    ok(helpers.train(tmp_path, "big", *LINEAR, "--set", "steps=120", "--set", "checkpoint.every=50",
                     "--set", "eval.enabled=false", "--set", "log.every=1000"))
    run = tmp_path / "big"
    (run / "checkpoints" / "step-00000120.pt").unlink()  # resume from step 100
    good = (run / "steps.csv").read_bytes()
    lines = good.splitlines(keepends=True)
    assert sum(map(len, lines[:99])) > 8192  # line 100 (step 99) starts past the first 8 KB
    for spoiled, said in ((lines[99].replace(b".", b"\xff.", 1), "not UTF-8 text"),
                          (b"\xc2\xb2" + lines[99][2:], "step '\u00b2' is not a step number")):
        (run / "steps.csv").write_bytes(b"".join(lines[:99] + [spoiled] + lines[100:]))
        before = snapshot(run)
        line = one_error_line(helpers.ag("train", "--resume", run))
        assert f"steps.csv line 100: {said}" in line, line
        assert snapshot(run) == before
    (run / "steps.csv").write_bytes(good)
    ok(helpers.ag("train", "--resume", run))
    assert (run / "steps.csv").read_bytes() == good  # the resumed run wrote steps 101..120 again, as they were


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_where_report_reads_or_writes_is_one_line_not_a_hang(cli, tmp_path):
    """A FIFO at the plot's path, or as a run folder's report.png or events.jsonl: report and
    compare opened it to read and waited for a writer for ever. Each is one line, exit 2."""
    import signal

    # (the run's own report.png is not what is tested: log.plot false, ~0.5 s of drawing)
    ok(cli("train", *LINEAR, "--set", "steps=3", "--set", "log.name=R", "--set", "log.plot=false"))
    run = tmp_path / "runs" / "R"
    os.mkfifo(tmp_path / "fifo.png")
    cases = [(("report", run / "steps.csv", "--out", "fifo.png"),
              "--out fifo.png exists and is not a regular file (a pipe, a device); refusing to write it")]
    for name in ("report.png", "events.jsonl"):
        other = tmp_path / "runs" / name.replace(".", "_")
        shutil.copytree(run, other)
        (other / name).unlink(missing_ok=True)  # (no report.png: not drawn)
        os.mkfifo(other / name)
        cases.append((("report", other), "not a regular file"))
    cases.append((("compare", run, tmp_path / "runs" / "events_jsonl"), "events.jsonl: cannot read the run's events"))

    def hang(*_):
        raise TimeoutError("waited on a named pipe")

    previous = signal.signal(signal.SIGALRM, hang)
    try:
        for argv, said in cases:
            signal.alarm(30)
            assert said in one_error_line(cli(*argv)), argv
            signal.alarm(0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_policy_change_whose_value_is_not_the_settings_kind_is_passed_over(cli, tmp_path):
    """A hand-edited events.jsonl whose max_norm change reads "2.0" (a string), or a count that
    is no whole number: report and compare ended in a TypeError traceback. Such an event is
    passed over, as a torn line is; the rest of the replay stands."""
    # (the runs' own report.png is not what is tested: log.plot false, ~1 s of drawing each)
    ok(cli("train", *LINEAR, "--set", "steps=3", "--set", "log.name=R", "--set", "log.plot=false"))
    run = tmp_path / "runs" / "R"
    before = ok(cli("report", run, "--no-plot"))  # (the summary is the point)
    deep = len((run / "events.jsonl").read_text(encoding="utf-8").splitlines()) + 5  # (the line nested too deep)
    with (run / "events.jsonl").open("a", encoding="utf-8") as f:
        f.write('{"step": 1, "event": "policy_change", "key": "max_norm", "old": 1.0, "new": "2.0"}\n')
        f.write('{"step": 1, "event": "policy_change", "key": "monitor.fail_after", "old": 100, "new": [1]}\n')
        # of the setting's kind but out of its range (fail_after 0 was a TypeError in the monitor's
        # message; alert_rate 7 judged the run by nonsense), and a line nested past the JSON
        # parser's depth (a RecursionError traceback)
        f.write('{"step": 1, "event": "policy_change", "key": "monitor.fail_after", "old": 100, "new": 0}\n')
        f.write('{"step": 1, "event": "policy_change", "key": "monitor.alert_rate", "old": 0.05, "new": 7}\n')
        f.write('{"step": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}\n")
    # (review 52c: a line that does not read is said, once; those of the wrong kind are passed over unsaid)
    assert ok(cli("report", run, "--no-plot")) == (
        f"note: {run / 'events.jsonl'} has 1 unreadable line (line {deep}): the rollbacks, resumes and policy changes "
        f"it held are not replayed\n{before}")
    ok(cli("train", *LINEAR, "--set", "steps=3", "--set", "log.name=S", "--set", "log.plot=false"))
    ok(cli("compare", run, tmp_path / "runs" / "S", "--out", tmp_path / "both.png"))


def test_report_reads_past_a_spreadsheets_byte_order_mark_and_names_a_step_0(cli, tmp_path):
    # a CSV saved again by a spreadsheet starts with a BOM ("the header is not ampguard's"); a first
    # row of step 0 read "step 0 does not follow step 0"
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + csv_text(HEADER, "1,0.1,2.0,1.0,0.5,0,,1.0").encode())
    assert "summary: steps=1 updates=1" in ok(cli("report", "bom.csv"))
    (tmp_path / "zero.csv").write_text(csv_text(HEADER, "0,0.1,2.0,1.0,0.5,0,,1.0"), encoding="utf-8")
    assert one_error_line(cli("report", "zero.csv")).endswith("zero.csv line 2: step 0, but steps count from 1")


# ---------------------------------------------------------------------------- a PNG report did not draw






def test_report_overwrites_only_a_plot_ampguard_drew(cli, tmp_path, snapshot):
    """Review 9 #2: `report --out` took any PNG for an earlier plot and replaced it: a user's
    figure, or another run's report.png. Refused now in one line, the file untouched; a plot
    ampguard drew (it carries its mark) is drawn again, and so is the reported run's own
    report.png, even one an older ampguard drew without the mark."""
    for name in ("a", "b"):  # (a's own plot is replaced below before anything reads it: not drawn, ~1 s)
        ok(cli("train", *LINEAR, "--set", "steps=3", "--set", f"log.name={name}",
               *(["--set", "log.plot=false"] if name == "a" else [])))
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    someones_png(tmp_path / "figure1.png")
    (tmp_path / "data.csv").write_bytes((a / "steps.csv").read_bytes())
    someones_png(tmp_path / "data.png")  # at a CSV's default plot path
    before = snapshot(tmp_path)
    for argv, said in (
            (("runs/a", "--out", "figure1.png"), "--out figure1.png exists and is not a plot ampguard drew"),
            (("data.csv",), "the plot data.png exists and is not a plot ampguard drew"),
            (("runs/a", "--out", "runs/b/report.png"), "--out runs/b/report.png is the plot of the run in runs/b; "
                                                       "name another file"),
            (("runs/a/steps.csv", "--out", b / "report.png"), f"--out {b / 'report.png'} is the plot of the run in")):
        code, out, err = cli("report", *argv)
        assert out == "" and one_error_line((code, out, err)).startswith(f"ampguard: error: report: {said}"), argv
    assert snapshot(tmp_path) == before  # every file as it was, nothing half-written
    assert marked(b / "report.png")  # the plot train draws carries the mark too

    shutil.copyfile(b / "report.png", tmp_path / "mine.png")  # a plot ampguard drew (b's, by train: not drawn again)
    first = (tmp_path / "mine.png").read_bytes()
    assert ok(cli("report", "runs/a", "--out", "mine.png")).splitlines()[-1] == "plot: mine.png"  # drawn again
    assert (tmp_path / "mine.png").read_bytes() != first and marked(tmp_path / "mine.png")
    old = someones_png(a / "report.png")  # the run's own plot, as an ampguard that did not mark it left it
    for argv in (("runs/a",), ("runs/a/steps.csv", "--out", "runs/a/report.png")):
        ok(cli("report", *argv))
        assert (a / "report.png").read_bytes() != old and marked(a / "report.png")
        old = someones_png(a / "report.png")
    assert not [p for p in tmp_path.rglob("*.partial")]


def test_report_given_a_plot_for_its_csv_says_so(cli, tmp_path, snapshot):
    # `ampguard report runs/a/report.png` read the PNG as the CSV: "the plot ... is the CSV itself"
    (tmp_path / "report.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    before = snapshot(tmp_path)
    assert refused(cli, "report.png") == ("ampguard: error: report.png is a plot, not a per-step CSV: give the run "
                                          "folder or its steps.csv")
    assert snapshot(tmp_path) == before


def test_report_notes_rows_past_the_runs_steps_and_a_card_it_cannot_read(cli, tmp_path):
    # review 33e: two rows added after a 3-step run's last were read as its own (its final loss one
    # of them), unsaid; a RUN.md of garbage read as "ended: unknown", unsaid (compare refuses it)
    ok(cli("train", *LINEAR, "--set", "steps=3", "--set", "eval.enabled=false", "--set", "checkpoint.enabled=false",
           "--set", "log.dir=.", "--set", "log.name=run", "--set", "log.plot=false"))
    csv = tmp_path / "run" / "steps.csv"
    last = csv.read_text(encoding="utf-8").splitlines()[-1].split(",")
    with csv.open("a", encoding="utf-8") as f:
        for step in (4, 5):
            f.write(",".join([str(step), *last[1:]]) + "\n")
    (tmp_path / "run" / "RUN.md").write_bytes(b"\xff\xfe garbage")
    code, out, err = cli("report", "run", "--no-plot")
    assert code == 0, err
    assert ("note: run/steps.csv has 2 rows past the run's 3 steps (steps 4-5: not the run's own; added by hand?): "
            "its figures count them") in out
    assert "note: run/RUN.md is no run card ampguard wrote (no line saying how the run ended)" in out
