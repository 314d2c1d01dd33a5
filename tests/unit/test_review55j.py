"""Review 55b (finding 2), fixed in 55j: the end of a long run and a resume of one read the whole
steps.csv into Python objects. A million rows took 1.2 GB and over a minute for the end-of-run
plot, and the run card was written only after it (an OOM kill while plotting left no card); a
resume's check of the CSV held 825 MiB before its first step. The card is now written before the
plot, the plot streams the CSV into compact arrays and draws a bounded number of points a line
(each run of points' lowest and highest: a lone spike stays), and the resume's check streams the
file, holding no row."""

from __future__ import annotations

import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch

from helpers import card_table

from ampguard import report
from ampguard.config import validate
from ampguard.errors import AmpguardWarning, ExitCode
from ampguard.run_folder import RunPaths, RunResult
from ampguard.sinks import CSV_COLUMNS, CsvSink, read_steps_csv

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py


def write_steps(path: Path, n: int, *, spike: int | None = None, skip: int | None = None) -> Path:
    """A steps.csv of ``n`` applied steps (a loss of 0.5 +- a little), one with a loss of 1000 at
    ``spike``, one skipped at ``skip``."""
    lines = [",".join(CSV_COLUMNS)]
    for s in range(1, n + 1):
        if s == skip:
            lines.append(f"{s},0.001,inf,,0.5,1,non_finite_grad,32768.0")
        else:
            loss = 1000.0 if s == spike else 0.5 + (s % 7) / 100
            lines.append(f"{s},0.001,{1.5 + (s % 5) / 10},1.0,{loss},0,,65536.0")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ended_run(folder: Path) -> RunResult:
    return RunResult(ExitCode.OK, report.replay(read_steps_csv(folder / "steps.csv"), init_scale=65536.0),
                     RunPaths.existing(folder), "finished: 3 steps", torch.device("cpu"))


# ---------------------------------------------------------------------------- the run card before the plot


def test_the_run_card_is_written_before_the_plot_and_says_a_plot_that_never_finished(tmp_path, monkeypatch):
    write_steps(tmp_path / "steps.csv", 3)
    seen = {}

    def killed(csv_path, png_path, **kw):  # (what a kill inside the plot leaves: no except runs)
        seen["card"] = (tmp_path / "RUN.md").read_text(encoding="utf-8")
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "plot_run", killed)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(validate({}), ended_run(tmp_path))
    card = card_table((tmp_path / "RUN.md").read_text(encoding="utf-8"))
    assert seen["card"] == (tmp_path / "RUN.md").read_text(encoding="utf-8")
    assert card["plot"] == report.PLOT_BEING_DRAWN and card["per-step CSV"] == "`steps.csv`"
    assert not (tmp_path / "report.png").exists()


def test_a_plot_that_fails_is_said_on_the_card_and_one_drawn_is_named(tmp_path, monkeypatch):
    write_steps(tmp_path / "steps.csv", 3)
    real = report.plot_run

    def fails(csv_path, png_path, **kw):
        raise MemoryError("no room for the figure")

    monkeypatch.setattr(report, "plot_run", fails)
    with pytest.warns(AmpguardWarning) as said:  # (review 56m: a warning, on stderr, not a bare line on stdout)
        report.write_report(validate({}), ended_run(tmp_path))
    assert [str(w.message) for w in said] == [f"could not draw {tmp_path / 'report.png'}: no room for the figure"]
    assert card_table((tmp_path / "RUN.md").read_text(encoding="utf-8"))["plot"] == \
        "not drawn: no room for the figure (`ampguard report` draws it)"
    monkeypatch.setattr(report, "plot_run", real)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpguardWarning)  # (drawn: nothing to say)
        report.write_report(validate({}), ended_run(tmp_path))  # (drawn: the card as it always was)
    assert card_table((tmp_path / "RUN.md").read_text(encoding="utf-8"))["plot"] == "`report.png`"
    assert (tmp_path / "report.png").is_file()


# ---------------------------------------------------------------------------- the plot of a long run


def test_a_long_runs_lines_are_thinned_keeping_a_lone_spike_and_skip_a_short_run_draws_every_point(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (5 points a bucket: thinned all the same; 20 a bucket read and drew 4x the rows, ~0.8 s more CPU)
    n = 5 * report.THIN_BUCKETS + 17
    rows = read_steps_csv(write_steps(tmp_path / "steps.csv", n, spike=6_345, skip=8_456))
    for drawn_rows, every in ((rows, False), (rows[:2 * report.THIN_BUCKETS], True)):
        fig, axes = plt.subplots(5, 1, sharex=True)
        try:
            report._draw(fig, axes, drawn_rows, [], max_norm=1.0, window=100, alert_rate=0.05, fail_rate=None,
                         alert_bits=None, title="run")
            [loss] = axes[0].get_lines()
            xs, ys = loss.get_xdata(), loss.get_ydata()
            pre = axes[1].get_lines()[0]
            skip_rate = axes[4].get_lines()[0]
            marks = [c for c in axes[0].collections if c.get_label().startswith("skipped")]
            if every:  # (a short run: each step's point, as before)
                assert list(xs) == [r.step for r in drawn_rows] and list(ys) == [r.loss for r in drawn_rows]
                assert len(skip_rate.get_xdata()) == len(drawn_rows) and not marks
                continue
            assert len(xs) <= 2 * report.THIN_BUCKETS + 2 and len(pre.get_xdata()) <= 2 * report.THIN_BUCKETS + 2
            assert len(skip_rate.get_xdata()) <= 2 * report.THIN_BUCKETS + 2
            assert max(ys) == 1000.0 and xs[list(ys).index(1000.0)] == 6_345  # the spike, at its step
            assert (xs[0], xs[-1]) == (1, n) and min(ys) == 0.5  # the run's ends, its lowest loss
            assert max(skip_rate.get_ydata()) == 0.01  # (the skip, 1 in the window of 100)
            [mark] = marks  # the one skip, marked where it was, counted
            assert mark.get_label() == "skipped: non_finite_grad (1)"
            assert [seg[0][0] for seg in mark.get_segments()] == [8_456]
            assert fig._suptitle.get_text().endswith(", 1 skipped")
        finally:
            plt.close(fig)


def test_many_skips_are_marked_once_a_span_each_and_counted_whole():
    import numpy as np

    marks = np.arange(1, 100_001, 2)  # (every other step of 100,000 skipped)
    drawn = report._thinned_marks(marks, 1, 100_000)
    assert len(drawn) <= 4 * report.THIN_BUCKETS and drawn[0] == 1 and set(drawn) <= set(marks)
    assert np.diff(drawn).max() <= 2 * 100_000 // (2 * report.THIN_BUCKETS) + 2  # (no span of the run left unmarked)


def test_the_plot_of_a_long_run_holds_its_columns_not_its_rows(tmp_path):
    csv_path = write_steps(tmp_path / "steps.csv", 20_000, spike=7)
    tracemalloc.start()
    try:
        report.plot_run(csv_path, tmp_path / "report.png")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the rows as Row objects and every point drawn: ~18 MB here; the columns and 4,000 points a line: ~6 MB
    assert peak < 12e6, f"{peak / 1e6:.1f} MB"
    assert (tmp_path / "report.png").is_file()


def test_columns_read_as_the_rows_do(tmp_path):
    from ampguard.sinks import StepColumns

    csv_path = write_steps(tmp_path / "steps.csv", 50, spike=3, skip=9)
    rows, columns = read_steps_csv(csv_path), StepColumns.of(read_steps_csv(csv_path))
    assert columns.steps.tolist() == [r.step for r in rows]
    assert columns.loss.tolist() == [r.loss for r in rows] and columns.skipped.tolist() == [r.skipped for r in rows]
    assert columns.grad_l2_post_clip[8] != columns.grad_l2_post_clip[8] and rows[8].grad_l2_post_clip is None
    assert report._scale_used(columns, 4.0)(10) == report._scale_used(rows, 4.0)(10) == 32768.0
    assert report._scale_used(columns, 4.0)(1) == 4.0


# ---------------------------------------------------------------------------- a resume's check


def test_a_resumes_check_of_steps_csv_holds_no_row(tmp_path):
    # (5,000 rows: under tracemalloc a row costs ~0.2 ms of CPU; held, they would be ~3x the bound)
    csv_path = write_steps(tmp_path / "steps.csv", 5_000)
    check = getattr(CsvSink, "check_kept_rows", CsvSink.kept_rows)  # (the check Trainer._check_logs makes)
    tracemalloc.start()
    try:
        check(csv_path, len(CSV_COLUMNS), 4_500, first=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1e6, f"{peak / 1e6:.1f} MB"  # (every kept line and its cells held: ~3 MB)


def test_a_resumes_cut_copies_the_kept_head_and_refuses_as_before(tmp_path):
    csv_path = write_steps(tmp_path / "steps.csv", 20_000)
    whole = csv_path.read_bytes()
    tracemalloc.start()
    try:
        CsvSink.cut_after(csv_path, len(CSV_COLUMNS), 19_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert csv_path.read_bytes() == whole[:whole.index(b"\n19001,") + 1]
    assert peak < 2e6, f"{peak / 1e6:.1f} MB"  # (the kept lines held, and joined: ~4 MB; copied a MiB at a time: <1)
    # a blank line among the kept rows: they are no longer the file's head, cut as before (the blank line gone)
    csv_path.write_bytes(b"step,lr\n1,0.1\n\n2,0.1\n3,0.1\n")
    CsvSink.cut_after(csv_path, 2, 2)
    assert csv_path.read_bytes() == b"step,lr\n1,0.1\n2,0.1\n"
    # a row that is no row before a number that is none: the first said, as when the file was read whole
    csv_path.write_text(",".join(CSV_COLUMNS) + "\n1,0.1,1,1,x,0,,1\n2,0.1,1,1,0.5,0,,1\n3,0.1\n", encoding="utf-8")
    with pytest.raises(Exception, match="line 4: 2 cells, the header has 8"):
        CsvSink.check_kept_rows(csv_path, 8, 3, first=1)
    csv_path.write_text(",".join(CSV_COLUMNS) + "\n1,0.1,1,1,x,0,,1\n2,0.1,1,1,0.5,0,,1\n", encoding="utf-8")
    with pytest.raises(Exception, match="line 2: column loss holds 'x', not a number; cannot resume from it"):
        CsvSink.check_kept_rows(csv_path, 8, 3, first=1)  # (before its rows ending early, at step 2)
