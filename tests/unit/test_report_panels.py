"""What the run plot draws, not only that a PNG came out (review_seeds14 M1, seed 000: "a long
run of skips is visible at once", the loss and scale curves): each panel's title, the max_norm
and alert lines, the scale drawn as log2 of the CSV's column, the skips marked by reason."""

from __future__ import annotations

import math

import pytest

from ampguard.report import _draw
from ampguard.sinks import CSV_COLUMNS, read_steps_csv

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROWS = ["1,0.1,2.0,1.0,0.5,0,,65536.0", "2,0.1,inf,,0.4,1,non_finite_grad,32768.0",
        "3,0.1,,,nan,1,non_finite_loss,16384.0", "4,0.05,0.5,0.5,0.3,0,,16384.0"]


@pytest.fixture
def drawn(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text("\n".join([",".join(CSV_COLUMNS), *ROWS]) + "\n", encoding="utf-8")
    fig, axes = plt.subplots(5, 1, sharex=True)
    _draw(fig, axes, read_steps_csv(path), [], max_norm=1.0, window=10, alert_rate=0.05, fail_rate=0.5,
          alert_bits=None, title="run")
    yield fig, axes
    plt.close(fig)


def test_the_five_panels_and_the_title_say_what_they_hold(drawn):
    fig, axes = drawn
    assert [ax.get_title() for ax in axes] == [
        "Loss", "Global gradient L2 norm, before and after clipping",
        "Loss scale (after each step's update; 1.0 = no scaler)", "Learning rate", "Rolling skip rate"]
    assert fig._suptitle.get_text() == "run: 4 steps, 2 skipped"


def test_the_lines_are_the_csvs_columns_and_the_thresholds(drawn):
    _, (ax_loss, ax_norm, ax_scale, ax_lr, ax_skip) = drawn
    lines = {line.get_label(): line for ax in (ax_loss, ax_norm, ax_scale, ax_lr, ax_skip) for line in ax.get_lines()}
    assert _with_gaps(lines["loss (mean of the step's micro-batches)"]) == [(1, 0.5), (2, 0.4), (3, None), (4, 0.3)]
    assert _with_gaps(lines["pre-clip global L2 norm"]) == [(1, 2.0), (2, None), (3, None), (4, 0.5)]
    assert list(lines["max_norm = 1"].get_ydata()) == [1.0, 1.0]
    assert list(lines["log2(scale)"].get_ydata()) == [math.log2(v) for v in (65536.0, 32768.0, 16384.0, 16384.0)]
    assert list(lines["learning rate (param group 0)"].get_ydata()) == [0.1, 0.1, 0.1, 0.05]
    assert list(lines["rolling skip rate (window 10)"].get_ydata()) == [0.0, 0.5, 2 / 3, 0.5]
    assert list(lines["alert_rate = 0.05"].get_ydata()) == [0.05, 0.05]
    assert list(lines["fail_rate = 0.5"].get_ydata()) == [0.5, 0.5]


def _with_gaps(line):
    return [(int(x), None if math.isnan(y) else y) for x, y in zip(line.get_xdata(), line.get_ydata())]


def test_a_non_finite_value_is_a_gap_in_its_line_and_a_lone_point_a_dot(drawn):
    """Step 2's pre-clip norm was inf, step 3's empty: the line stops there (a segment from step 1
    to step 4 read as a finite norm at the skipped steps, review 61c), and steps 1 and 4, each
    between gaps, are dots (a line through one point draws nothing)."""
    _, (ax_loss, ax_norm, *_) = drawn
    pre, post = ax_norm.get_lines()[:2]
    assert pre.get_markevery() == [0, 3] and pre.get_marker() == "o"
    assert _with_gaps(post) == [(1, 1.0), (2, None), (3, None), (4, 0.5)] and post.get_markevery() == [0, 3]
    loss = ax_loss.get_lines()[0]
    assert loss.get_markevery() == [3] and _with_gaps(loss)[2] == (3, None)  # (steps 1-2 a segment; 4 alone)


def test_every_skip_is_marked_on_every_panel_by_its_reason(drawn):
    _, axes = drawn
    for i, ax in enumerate(axes):
        marks = {tuple(c.get_segments()[0][0][:1]): c.get_label() for c in ax.collections}
        assert sorted(x for (x,) in marks) == [2.0, 3.0]
        if i == 0:  # (the legend's labels on the first panel)
            assert sorted(marks.values()) == ["skipped: non_finite_grad (1)", "skipped: non_finite_loss (1)"]




def test_the_log_panels_label_their_ticks_in_plain_text(drawn):
    from ampguard.report import _plain_log_formatter

    _, (ax_loss, ax_norm, *_) = drawn
    for ax in (ax_loss, ax_norm):
        assert ax.get_yscale() == "log"
        assert type(ax.yaxis.get_major_formatter()) is type(ax.yaxis.get_minor_formatter()) is _plain_log_formatter()

LOG_CASES = [
    ("log", 0.3, 0.9),  # (under a decade: the minor ticks labelled, "3×10⁻¹")
    ("log", 1e-3, 1e2), ("log", 1e-30, 1e30),  # (decades only; labelled every few decades)
    ("symlog", -1e308, 1e308),  # (both signs and 0, as _linear_y draws a loss near the float maximum)
]


def test_the_log_axes_label_their_ticks_as_matplotlib_does_in_plain_text():
    """log_y's labels are matplotlib's own (LogFormatterSciNotation's, at the same ticks), written
    without math text (parsed anew for every figure: ~15% of a report's time): each form matplotlib
    gives is translated, none left as "$\\mathdefault{...}$". (One figure, one draw, every case.)"""
    import warnings

    from matplotlib.ticker import LogFormatterSciNotation

    from ampguard.report import log_y, new_figure, plain_log_label

    fig, axes = new_figure(2 * len(LOG_CASES), (6.0, 12.0))
    pairs = list(zip(axes[::2], axes[1::2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (numpy's overflow notes near the float64 limit)
        for (ours, stock), (scale, low, high) in zip(pairs, LOG_CASES):
            for ax in (ours, stock):
                ax.plot([1, 2], [low, high])
            log_y(ours, "y (log)", scale)
            stock.set_yscale(scale)
            stock.set_ylim(ours.get_ylim())
        fig.canvas.draw()
        labels = [{which: ([t.get_text() for t in ours.get_yticklabels(which=which)],
                           [t.get_text() for t in stock.get_yticklabels(which=which)])
                   for which in ("major", "minor", "both")} for ours, stock in pairs]
    for (ours, stock), (scale, low, high), texts in zip(pairs, LOG_CASES, labels):
        assert type(stock.yaxis.get_major_formatter()) is LogFormatterSciNotation
        for which in ("major", "minor"):
            mine, theirs = texts[which]
            assert mine == [plain_log_label(text) for text in theirs], (scale, low, which)
            assert not any("$" in text for text in mine)
        shown = [text for text in texts["both"][0] if text]
        assert shown and all(any(c.isdigit() or c in "⁰¹²³⁴⁵⁶⁷⁸⁹" for c in text) for text in shown)
        if low == 0.3:
            assert any("×10⁻¹" in text for text in shown)
        if scale == "symlog":
            assert "0" in shown and any(text.startswith("−10") for text in shown)


def test_a_font_without_the_superscripts_keeps_math_text():
    """A notebook's or a style's font (Computer Modern, STIX) lacks the superscript glyphs the
    plain labels are written with: drawn, they were boxes; the log axes keep math text there."""
    from matplotlib.ticker import LogFormatterSciNotation

    from ampguard.report import _plain_log_formatter, log_y, new_figure, plain_labels_drawable

    fig, (plain, kept) = new_figure(2, (4.0, 4.0))
    assert plain_labels_drawable()  # (matplotlib's own DejaVu Sans)
    log_y(plain, "y (log)")
    with matplotlib.rc_context({"font.family": "cmr10"}):
        assert not plain_labels_drawable()
        log_y(kept, "y (log)")
    assert type(plain.yaxis.get_major_formatter()) is _plain_log_formatter()
    assert type(kept.yaxis.get_major_formatter()) is LogFormatterSciNotation
    assert (kept.get_yscale(), kept.get_ylabel()) == ("log", "y (log)")
