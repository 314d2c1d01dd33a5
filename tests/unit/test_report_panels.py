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
    assert list(lines["loss (mean of the step's micro-batches)"].get_xdata()) == [1, 2, 4]  # (nan left out)
    assert list(lines["pre-clip global L2 norm"].get_xdata()) == [1, 4]  # inf and empty left out
    assert list(lines["max_norm = 1"].get_ydata()) == [1.0, 1.0]
    assert list(lines["log2(scale)"].get_ydata()) == [math.log2(v) for v in (65536.0, 32768.0, 16384.0, 16384.0)]
    assert list(lines["learning rate (param group 0)"].get_ydata()) == [0.1, 0.1, 0.1, 0.05]
    assert list(lines["rolling skip rate (window 10)"].get_ydata()) == [0.0, 0.5, 2 / 3, 0.5]
    assert list(lines["alert_rate = 0.05"].get_ydata()) == [0.05, 0.05]
    assert list(lines["fail_rate = 0.5"].get_ydata()) == [0.5, 0.5]


def test_every_skip_is_marked_on_every_panel_by_its_reason(drawn):
    _, axes = drawn
    for i, ax in enumerate(axes):
        marks = {tuple(c.get_segments()[0][0][:1]): c.get_label() for c in ax.collections}
        assert sorted(x for (x,) in marks) == [2.0, 3.0]
        if i == 0:  # (the legend's labels on the first panel)
            assert sorted(marks.values()) == ["skipped: non_finite_grad (1)", "skipped: non_finite_loss (1)"]
