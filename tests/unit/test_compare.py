"""``ampguard.compare`` on hand-made run folders: what it reads, what it refuses, the table's cells
and the overlay plot. Whole runs through the CLI are in ``tests/e2e/test_compare_cli.py``."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from helpers import png_size

from ampguard import compare
from ampguard.config import dump_config, validate
from ampguard.errors import InputError
from ampguard.report import replay
from ampguard.sinks import read_steps_csv
from ampguard.sinks import CSV_COLUMNS

HEADER = ",".join(CSV_COLUMNS)


def make_run(root: Path, name: str, rows: list[str], *, config: dict | None = None, extra: list[str] = (),
             ended: str = "finished") -> Path:
    """A run folder as `ampguard train` leaves it: config.yaml, steps.csv (rows after the header), RUN.md."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(dump_config(validate(config or {"precision": "fp16"})), encoding="utf-8")
    (folder / "steps.csv").write_text("\n".join([",".join([HEADER, *extra]), *rows]) + "\n", encoding="utf-8")
    (folder / "RUN.md").write_text(f"# Run {name}\n\n**{ended}**\n\n## Set-up\n\n| | |\n|---|---|\n", encoding="utf-8")
    (folder / "events.jsonl").write_text("", encoding="utf-8")
    return folder


def clean(step: int, pre: float = 2.0, loss: float = 0.5, scale: float = 65536.0, extra: str = "") -> str:
    post = min(pre, 1.0)
    return f"{step},0.1,{pre!r},{post!r},{loss!r},0,,{scale!r}" + extra


def skip(step: int, scale: float, reason: str = "non_finite_grad", extra: str = "") -> str:
    pre, loss = ("inf", "0.5") if reason == "non_finite_grad" else ("", "nan")
    return f"{step},0.1,{pre},,{loss},1,{reason},{scale!r}" + extra


# ---------------------------------------------------------------------------- reading a run


def test_a_run_is_read_as_report_reads_it(tmp_path):
    rows = [clean(1), clean(2, pre=0.5), skip(3, 32768.0), clean(4, pre=3.0, loss=0.25, scale=32768.0)]
    folder = make_run(tmp_path, "a", rows, config={"precision": "fp16", "max_norm": 1.0,
                                                   "monitor": {"window": 2, "min_steps": 0}}, ended="finished: 4 steps")
    run = compare.load_run(folder)
    ref = replay(read_steps_csv(folder / "steps.csv"), window=2, min_steps=0, max_norm=1.0)
    m = run.monitor
    assert (run.name, run.ended, run.config.precision) == ("a", "finished: 4 steps", "fp16")
    assert (m.steps, m.updates, dict(m.skips), m.clipped) == (4, 3, {"non_finite_grad": 1}, 2)
    assert (m.max_skip_rate, m.best_loss) == (ref.max_skip_rate, ref.best_loss) == (0.5, 0.25)
    assert m.scale_verdict == "stable"  # one halving from init_scale 65536


def test_held_out_metrics_come_from_the_extra_columns_best_by_their_direction(tmp_path):
    rows = [clean(1, extra=",0.9,0.5"), clean(2, extra=",,"), clean(3, extra=",0.7,0.8"), clean(4, extra=",0.8,0.6")]
    run = compare.load_run(make_run(tmp_path, "a", rows, extra=["val_loss", "val_accuracy"]))
    assert run.monitor.eval_last == {"val_loss": 0.8, "val_accuracy": 0.6}
    assert run.monitor.eval_best == {"val_loss": 0.7, "val_accuracy": 0.8}  # lower loss, higher accuracy
    cells = dict(compare.table_rows(run))
    assert cells["val_loss final / best"] == "0.8 / 0.7" and cells["val_accuracy final / best"] == "0.6 / 0.8"


def test_a_column_of_text_a_user_sink_wrote_is_no_metric_and_not_refused(tmp_path):
    # review_28b: CsvSink(extra_columns=["phase"]) writes text cells, report reads the file, and
    # compare refused it ("column phase holds 'warmup', not a number", no line named)
    rows = [clean(1, extra=",warmup,0.9"), clean(2, extra=",,0.7"), clean(3, extra=",main,")]
    run = compare.load_run(make_run(tmp_path, "a", rows, extra=["phase", "val_loss"]))
    assert run.monitor.eval_last == {"val_loss": 0.7} and run.monitor.eval_best == {"val_loss": 0.7}
    assert not any("phase" in key for key, _ in compare.table_rows(run))
    # a column of numbers with text in one cell (a metric spoiled, or text that reads as a number in
    # places: a commit SHA '2113e02'; review 46e): left out, and said, naming the cell
    rows = [clean(1, extra=",0.9"), clean(2, extra=",n/a")]
    run = compare.load_run(make_run(tmp_path, "b", rows, extra=["val_loss"]))
    assert run.monitor.eval_last == {} and any(
        "column val_loss holds numbers and text (its first text 'n/a', at step 2; 1 of 2 cells numbers)"
        in note for note in run.notes), run.notes


def test_the_optimizer_label_columns_are_not_metrics(tmp_path):
    rows = [clean(1, extra=",d;g,"), skip(2, 32768.0, extra=",d;g,g")]
    run = compare.load_run(make_run(tmp_path, "gan", rows, extra=["optimizers", "skipped_optimizers"]))
    assert run.monitor.eval_last == {}


@pytest.mark.parametrize("missing,what", [("steps.csv", "per-step CSV"), ("RUN.md", "run card"),
                                          ("config.yaml", "config")])
def test_a_folder_without_one_of_its_files_is_refused_naming_it(tmp_path, missing, what):
    folder = make_run(tmp_path, "a", [clean(1)])
    (folder / missing).unlink()
    with pytest.raises(InputError) as err:
        compare.load_run(folder)
    assert str(err.value).startswith(f"compare: {folder} has no {what} {missing}; is it a run folder?")
    assert "\n" not in str(err.value)


def test_a_missing_folder_a_file_and_an_empty_csv_are_refused(tmp_path):
    with pytest.raises(InputError, match="^compare: no such folder .*nope$"):
        compare.load_run(tmp_path / "nope")
    folder = make_run(tmp_path, "a", [clean(1)])
    with pytest.raises(InputError, match=r"^compare: .*steps\.csv is not a folder$"):
        compare.load_run(folder / "steps.csv")
    empty = make_run(tmp_path, "empty", [])
    (empty / "steps.csv").write_text(HEADER + "\n")
    with pytest.raises(InputError, match="has no steps, nothing to compare"):
        compare.load_run(empty)
    bad_config = make_run(tmp_path, "bad-config", [clean(1)])
    (bad_config / "config.yaml").write_text("steps: many\n")
    with pytest.raises(InputError, match=r"^compare: .*bad-config/config\.yaml: config: steps: "):
        compare.load_run(bad_config)
    broken = make_run(tmp_path, "broken", ["1,0.1,x,1.0,0.5,0,,1.0"])
    with pytest.raises(InputError, match="column grad_l2_pre_clip holds 'x', not a number"):
        compare.load_run(broken)


def test_fewer_than_two_runs_and_a_run_given_twice_are_refused(tmp_path, monkeypatch):
    a = make_run(tmp_path, "a", [clean(1)])
    monkeypatch.chdir(tmp_path)
    for paths, message in (([], "needs at least two run folders, got 0"),
                           ([a], "needs at least two run folders, got 1"),
                           ([a, a], f"{a} is given twice"), ([a, "a"], f"a is given twice (as {a})")):
        with pytest.raises(InputError) as err:
            compare.load_runs(paths)
        assert str(err.value) == f"compare: {message}"


def test_runs_sharing_a_folder_name_are_named_by_their_path(tmp_path):
    a = make_run(tmp_path / "x", "run", [clean(1)])
    b = make_run(tmp_path / "y", "run", [clean(1)])
    c = make_run(tmp_path, "other", [clean(1)])
    assert [r.name for r in compare.load_runs([a, b, c])] == [str(a), str(b), "other"]


# ---------------------------------------------------------------------------- the table


def test_the_table_has_a_column_per_run_and_a_dash_for_a_metric_a_run_lacks(tmp_path):
    a = make_run(tmp_path, "fp16-clip", [clean(1, extra=",0.5"), skip(2, 32768.0, extra=",")], extra=["val_loss"])
    b = make_run(tmp_path, "bf16-noclip", [clean(1, pre=2.0, scale=1.0), skip(2, 1.0, reason="non_finite_loss")],
                 config={"precision": "bf16", "max_norm": 0})
    lines = compare.format_table(compare.load_runs([a, b])).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["", "fp16-clip", "bf16-noclip"]
    assert set(lines[1]) == {"|", "-"}
    table = {row[0]: row[1:] for row in cells[2:]}
    assert table["precision"] == ["fp16", "bf16"]
    assert table["max_norm"] == ["1", "off"]
    assert table["steps / updates"] == ["2 / 1", "2 / 1"]
    assert table["skips"] == ["1 (non_finite_grad=1)", "1 (non_finite_loss=1)"]
    assert table["max rolling skip rate"] == ["0.5000", "0.5000"]
    assert table["clip rate"] == ["0.500", "n/a"]
    assert table["scale health"] == ["stable (final 32768)", "none (no loss scaler)"]
    assert table["loss final / best"] == ["0.5 / 0.5", "0.5 / 0.5"]  # final: the last applied step's, not the NaN skip
    assert table["val_loss final / best"] == ["0.5 / 0.5", "-"]  # the bf16 run has no val_loss column
    assert len({len(line) for line in lines}) == 1  # padded: the columns line up


# ---------------------------------------------------------------------------- --out and the plot


def test_an_existing_out_file_is_refused_before_anything_is_read(tmp_path, capsys):
    old = tmp_path / "old.png"
    old.write_bytes(b"someone's picture")
    with pytest.raises(InputError, match=r"--out .*old\.png exists and is not a PNG; refusing to overwrite it"):
        compare.run([tmp_path / "nope1", tmp_path / "nope2"], out=old)  # --out is checked first
    assert old.read_bytes() == b"someone's picture"
    assert capsys.readouterr().out == ""


def test_a_dangling_link_at_out_is_refused_too(tmp_path):
    link = tmp_path / "link.png"
    os.symlink(tmp_path / "nowhere.png", link)
    with pytest.raises(InputError, match="is a symbolic link; refusing to overwrite it"):
        compare.run([tmp_path / "nope1", tmp_path / "nope2"], out=link)
    assert not (tmp_path / "nowhere.png").exists()


def test_the_overlay_plot_is_a_new_png_and_nothing_else_is_written(tmp_path, capsys):
    a = make_run(tmp_path, "a", [clean(1), skip(2, 32768.0), clean(3, scale=32768.0)])
    b = make_run(tmp_path, "b", [clean(1, pre=5.0, scale=1.0), clean(2, scale=1.0), clean(3, scale=1.0)],
                 config={"precision": "bf16"})
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out = tmp_path / "cmp.png"
    assert compare.run([a, b], out=out) == 0
    assert png_size(out) == (1200, 1100)
    assert capsys.readouterr().out.splitlines()[-1] == f"plot: {out}"
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != out}
    assert after == before  # the run folders untouched, no partial file left behind


def test_a_file_that_appears_at_out_while_drawing_is_not_replaced(tmp_path, monkeypatch):
    a = make_run(tmp_path, "a", [clean(1)])
    b = make_run(tmp_path, "b", [clean(1)])
    out = tmp_path / "cmp.png"
    runs = compare.load_runs([a, b])
    import matplotlib.figure

    savefig = matplotlib.figure.Figure.savefig

    def savefig_then_someone_writes(self, *args, **kwargs):
        savefig(self, *args, **kwargs)
        out.write_bytes(b"theirs")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig_then_someone_writes)
    with pytest.raises(InputError, match="refusing to overwrite it"):  # (it is no PNG either way)
        compare.plot_overlay(runs, out)
    assert out.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "cmp.png"]


def test_losses_spanning_the_float_range_are_drawn_on_a_symmetric_log_axis(tmp_path):
    # review #8: losses of -1e308 and 1e308 (an edited CSV) made matplotlib's tick locator raise in
    # savefig: a traceback and exit 1. The loss panel now goes symmetric log; the plot is drawn.
    a = make_run(tmp_path, "a", [clean(1), clean(2)])
    b = make_run(tmp_path, "b", [clean(1, loss=1.7976931348623157e308), clean(2, loss=1.0),
                                 clean(3, loss=-1.7976931348623157e308)])
    out = tmp_path / "cmp.png"
    assert compare.plot_overlay(compare.load_runs([a, b]), out) == out
    assert png_size(out) == (1200, 1100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "cmp.png"]


def test_values_matplotlib_cannot_lay_out_are_one_input_error_and_no_file(tmp_path, monkeypatch):
    import matplotlib.figure

    a = make_run(tmp_path, "a", [clean(1)])
    b = make_run(tmp_path, "b", [clean(1)])
    runs = compare.load_runs([a, b])

    def cannot_lay_out(self, *args, **kwargs):  # what the tick locator raised on a span over the float max
        raise ValueError("arange: cannot compute length")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cannot_lay_out)
    out = tmp_path / "cmp.png"
    with pytest.raises(InputError) as err:
        compare.plot_overlay(runs, out)
    assert str(err.value) == (f"compare: --out {out}: cannot draw these runs' values (a steps.csv value too large "
                              "to plot, such as losses of -1e308 and 1e308?): ValueError: arange: cannot compute length")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("n", [4, 12])
def test_many_runs_get_distinct_colours_and_one_legend_beside_the_panels(tmp_path, monkeypatch, n):
    # 12 runs: tab10 gave runs 1 and 11 one colour, and each panel's legend (two entries a run in
    # the norm panel) covered its curves; the title listed every name
    import matplotlib.figure

    folders = [make_run(tmp_path, f"run{i:02d}", [clean(1, loss=1.0 + i), skip(2, 32768.0)],
                        config={"precision": "fp16", "max_norm": 1.0}) for i in range(n)]
    drawn = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        drawn.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    out = compare.plot_overlay(compare.load_runs(folders), tmp_path / "cmp.png")
    assert png_size(out) == (1200, 1100)
    (fig,) = drawn
    loss_panel = fig.axes[0]
    colours = [line.get_color() for line in loss_panel.get_lines() if line.get_marker() in ("None", None, "")]
    assert len(colours) == n and len({tuple(c) for c in colours}) == n
    panel_legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    if n <= compare.FEW_RUNS:
        assert len(panel_legends) == 4 and not fig.legends
        assert fig._suptitle.get_text() == "ampguard compare: " + ", ".join(f"run{i:02d}" for i in range(n))
    else:
        assert panel_legends == [] and len(fig.legends) == 1
        assert [t.get_text() for t in fig.legends[0].get_texts()] == [f"run{i:02d}" for i in range(n)]
        assert fig._suptitle.get_text() == f"ampguard compare: {n} runs"


def _drawn(monkeypatch) -> list:
    """The figures saved from now on (savefig still writes each)."""
    import matplotlib.figure

    drawn, savefig = [], matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        drawn.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return drawn


def _data_lines(ax) -> list:
    """A panel's curves (the x marks and the dashed limits left out)."""
    return [line for line in ax.get_lines() if line.get_marker() != "x" and line.get_linestyle() not in ("--", ":")]


def test_a_run_of_one_step_is_drawn_with_a_dot_on_every_panel(tmp_path, monkeypatch):
    # a line through one point draws nothing: report.png of a 1-step run (a run killed after its
    # first step) had axes and legends and no data, and compare drew it nowhere
    from ampguard.report import plot_run

    one = make_run(tmp_path, "one", [clean(1)])
    drawn = _drawn(monkeypatch)
    plot_run(one / "steps.csv", tmp_path / "report.png")
    compare.plot_overlay(compare.load_runs([one, make_run(tmp_path, "two", [clean(1), clean(2)])]), tmp_path / "c.png")
    report, overlay = drawn
    for ax in report.axes[:5] + overlay.axes:
        lines = _data_lines(ax)
        assert lines and all(len(line.get_xdata()) > 1 or line.get_marker() == "o" for line in lines), ax.get_title()
    assert all(tick == int(tick) for tick in report.axes[-1].get_xticks())  # (whole steps: 0.96, 1.04 were ticks)


def test_a_run_with_no_finite_loss_leaves_the_others_loss_axis_logarithmic(tmp_path, monkeypatch):
    # a run whose every step skipped (no finite loss) switched the shared loss panel to linear:
    # beside a run spiking to 1e16, every other run's loss lay flat on 0
    runs = [make_run(tmp_path, "clean", [clean(1, loss=0.5), clean(2, loss=0.4)]),
            make_run(tmp_path, "spike", [clean(1, loss=0.5), clean(2, loss=1e16)]),
            make_run(tmp_path, "allnan", [skip(1, 65536.0, "non_finite_loss"), skip(2, 32768.0, "non_finite_loss")])]
    drawn = _drawn(monkeypatch)
    compare.plot_overlay(compare.load_runs(runs), tmp_path / "c.png")
    (overlay,) = drawn
    assert overlay.axes[0].get_yscale() == "log"


def test_compare_and_report_say_what_reading_a_runs_csv_left_out(tmp_path, capsys):
    # compare dropped a torn last line without the note report gives (its card said 30 steps beside
    # 29 rows), and neither said a row was missing (report: "steps=30 updates=20 skips=9")
    from ampguard import report

    torn = make_run(tmp_path, "torn", [clean(1), clean(2)])
    with (torn / "steps.csv").open("a") as f:
        f.write("3,0.1,2.0")
    gap = make_run(tmp_path, "gap", [clean(1), clean(2), clean(4), skip(5, 32768.0), clean(9)])
    assert compare.run([torn, gap]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: the last line of {torn / 'steps.csv'} is torn (no newline: a write cut short), left out: "
                     "'3,0.1,2.0'",
                     f"note: {gap / 'steps.csv'} has no row for 4 of its steps (3, 6-8): its figures are of the 5 rows "
                     "it has (a rate over the run's steps counts the missing ones as neither skipped nor clipped)"]
    assert report.run(gap, plot=False) == 0
    assert notes[1] in capsys.readouterr().out.splitlines()
    (gap / "events.jsonl").unlink()  # (a folder copied without it: no policy change, no rollback known)
    assert report.run(gap, plot=False) == 0
    assert (f"note: {gap} has no events.jsonl: replayed as if no setting changed on resume and no rollback "
            "happened") in capsys.readouterr().out.splitlines()


def test_compare_and_report_note_values_a_run_can_hold_but_no_guard_writes(tmp_path, capsys):
    # review 33e: a negative LR, an infinite scale, an applied norm above max_norm, an accuracy of 70
    # were read without a word (the max_norm: 1, then 4 from step 5, as a resume changed it)
    from ampguard import report

    rows = [clean(1), clean(2).replace(",0.1,", ",-5.0,", 1), clean(3, scale=float("inf")),
            "4,0.1,5.0,3.0,0.5,0,,65536.0", "5,0.1,5.0,3.0,0.5,0,,65536.0", "6,0.1,5.0,5.0,0.5,0,,65536.0"]
    odd = make_run(tmp_path, "odd", [f"{row},{acc}" for row, acc in zip(rows, ["", "", "0.5", "", "70", ""])],
                   config={"precision": "fp16", "max_norm": 4.0}, extra=["val_accuracy"])
    (odd / "events.jsonl").write_text('{"step": 4, "event": "policy_change", "key": "max_norm", "old": 1.0, '
                                      '"new": 4.0}\n', encoding="utf-8")
    plain = make_run(tmp_path, "plain", [clean(1), clean(2)])
    expected = [f"note: {odd / 'steps.csv'} has 1 row with a learning rate below 0 or not finite (step 2: -5.0): "
                "read as written",
                f"note: {odd / 'steps.csv'} has 1 row with an infinite loss scale, which ampguard's scaler never grows "
                "to (step 3): read as written",
                f"note: {odd / 'steps.csv'} has 2 applied steps whose post-clip norm is above the max_norm it ran "
                "under (step 4: 3.0 > 1, the first of 2): read as written",
                f"note: {odd / 'steps.csv'} has 1 row whose val_accuracy is outside [0, 1] (step 5: 70; a "
                "percentage?): read as written"]
    assert compare.run([odd, plain]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")] == expected
    assert report.run(odd, plot=False) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")] == expected
    assert compare.run([plain, make_run(tmp_path, "plain2", [clean(1)])]) == 0  # (a clean run: not a word)
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]


def test_runs_of_different_tasks_are_named_and_noted(tmp_path, capsys):
    # review 33e: a charlm run and a digits run stood side by side with no word of their tasks
    char = make_run(tmp_path, "char", [clean(1)])
    digits = make_run(tmp_path, "digits", [clean(1)], config={"precision": "fp16", "task": {"name": "digits"}})
    gpt = make_run(tmp_path, "gpt", [clean(1)], config={"precision": "fp16", "task": {"preset": "gpt2-small"}})
    assert compare.run([char, digits, gpt]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("note: ")] == [
        "note: these runs trained different tasks (charlm, digits, charlm gpt2-small): their losses and held-out "
        "metrics are not comparable"]
    assert [[cell.strip() for cell in line.split("|")[1:-1]] for line in out if line.startswith("| task")] == [
        ["task", "charlm", "digits", "charlm gpt2-small"]]
    assert compare.run([char, make_run(tmp_path, "char2", [clean(1)])]) == 0
    assert "note:" not in capsys.readouterr().out


def test_a_finished_short_runs_end_alert_survives_a_torn_last_line_and_a_missing_config(tmp_path, capsys):
    # review 33e: the card of a 30-step run that skipped every step counts its end's ALERT; report
    # and compare counted 0 once its last line was torn (the rows no longer reached steps=30), and
    # report 0 without config.yaml (it took the default config's steps)
    from ampguard import report

    rows = [skip(step, 1.0, "non_finite_loss") for step in range(1, 31)]
    run = make_run(tmp_path, "short", rows, config={"precision": "fp32", "steps": 30},
                   ended="finished: 30 steps")
    other = make_run(tmp_path, "other", [clean(1)], config={"precision": "fp32", "steps": 1}, ended="finished: 1 step")
    with (run / "steps.csv").open("r+") as f:
        text = f.read()
        f.seek(0), f.truncate(), f.write(text.rstrip("\n"))  # (the last row torn: no newline)
    assert compare.load_runs([run, other])[0].monitor.alert_episodes == 1
    assert report.run(run, plot=False) == 0
    assert "alert episodes 1," in capsys.readouterr().out
    (run / "config.yaml").unlink()
    assert report.run(run, plot=False) == 0
    assert "alert episodes 1," in capsys.readouterr().out


def test_skipped_steps_before_the_first_finite_loss_are_marked_and_a_run_without_one_says_so(tmp_path, monkeypatch):
    # the x of a skip sat at the last finite loss: a NaN at step 1 had none, so no x; a run whose
    # every loss was NaN showed nothing at all on the loss panel, as if it had no data
    nan_first = make_run(tmp_path, "nan1", [skip(1, 65536.0, "non_finite_loss"), clean(2, loss=0.4), clean(3, loss=0.3)])
    all_nan = make_run(tmp_path, "allnan", [skip(1, 65536.0, "non_finite_loss"), skip(2, 32768.0, "non_finite_loss")])
    drawn = _drawn(monkeypatch)
    compare.plot_overlay(compare.load_runs([nan_first, all_nan]), tmp_path / "c.png")
    (overlay,) = drawn
    marks = [line for line in overlay.axes[0].get_lines() if line.get_marker() == "x"]
    assert [(list(m.get_xdata()), list(m.get_ydata())) for m in marks] == [([1], [0.4])]
    assert [t.get_text() for t in overlay.axes[0].get_legend().get_texts()] == ["nan1", "allnan (no finite loss)"]


def test_a_non_finite_loss_or_norm_is_a_gap_in_the_overlays_line_not_a_segment_over_it(tmp_path, monkeypatch):
    # compare drew the loss and the pre-clip norm from step 1 straight to step 4 over steps 2-3
    # (an inf norm, a NaN loss): a finite value there to the eye (review 61c)
    run = make_run(tmp_path, "gaps", [clean(1), skip(2, 32768.0), skip(3, 16384.0, "non_finite_loss"), clean(4)])
    drawn = _drawn(monkeypatch)
    compare.plot_overlay(compare.load_runs([run, make_run(tmp_path, "flat", [clean(1), clean(2)])]), tmp_path / "c.png")
    (overlay,) = drawn
    (loss, _), (norm, _) = _data_lines(overlay.axes[0]), _data_lines(overlay.axes[1])
    assert [None if math.isnan(y) else y for y in loss.get_ydata()] == [0.5, 0.5, None, 0.5]
    assert [None if math.isnan(y) else y for y in norm.get_ydata()] == [2.0, None, None, 2.0]
    assert list(norm.get_xdata()) == [1, 2, 3, 4] and norm.get_markevery() == [0, 3]  # (each alone: a dot)


def test_thresholds_a_resume_changed_are_drawn_and_tabled_as_each_step_ran_under_them(tmp_path, monkeypatch, capsys):
    # report and compare drew the last value across the whole run (max_norm 0.5 over steps that
    # ran under 1: norms above the line looked unclipped) and the table gave it alone
    import json

    from ampguard import report

    run = make_run(tmp_path, "pol", [clean(step) for step in range(1, 9)],
                   config={"precision": "fp16", "max_norm": 0.5, "monitor": {"alert_rate": 0.1}})
    changes = [{"step": 4, "event": "policy_change", "key": "max_norm", "old": 1.0, "new": 0.5},
               {"step": 4, "event": "policy_change", "key": "monitor.alert_rate", "old": 0.05, "new": 0.1}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in changes), encoding="utf-8")
    drawn = _drawn(monkeypatch)
    assert report.run(run) == 0
    other = make_run(tmp_path, "flat", [clean(step) for step in range(1, 9)])
    runs = compare.load_runs([run, other])
    compare.plot_overlay(runs, tmp_path / "c.png")
    assert dict(compare.table_rows(runs[0]))["max_norm"] == "1, 0.5 from step 5"
    assert dict(compare.table_rows(runs[1]))["max_norm"] == "1"

    def limit(ax, label):
        (line,) = [line for line in ax.get_lines() if line.get_label().startswith(label)]
        return line.get_label(), [float(y) for y in line.get_ydata()]

    drawn_report, overlay = drawn
    assert limit(drawn_report.axes[1], "max_norm") == ("max_norm = 1, 0.5 from step 5", [1.0] * 4 + [0.5] * 4)
    assert limit(drawn_report.axes[4], "alert_rate") == ("alert_rate = 0.05, 0.1 from step 5", [0.05] * 4 + [0.1] * 4)
    assert limit(overlay.axes[1], "pol: max_norm") == ("pol: max_norm = 1, 0.5 from step 5", [1.0] * 4 + [0.5] * 4)
    # --max-norm draws the one line given; --alert-rate judges (and draws) the whole run at its value
    assert report.run(run, max_norm=2.0, alert_rate=0.2) == 0
    assert limit(drawn[2].axes[1], "max_norm")[0] == "max_norm = 2"
    assert limit(drawn[2].axes[4], "alert_rate")[0] == "alert_rate = 0.2"


def test_report_window_re_judges_the_skip_rate_alerts_not_the_scale_health(tmp_path, capsys):
    # --window judged the scale's health over its window too: a run whose scale fell 3 octaves
    # read "collapsing" on its card and "stable" at --window 5, with only the alerts said re-judged
    from ampguard import report

    rows = [clean(1), skip(2, 32768.0), skip(3, 16384.0), skip(4, 8192.0)]
    run = make_run(tmp_path, "fell", rows + [clean(step, scale=8192.0) for step in range(5, 15)],
                   config={"precision": "fp16", "monitor": {"window": 50}})
    verdicts = []
    for window in (None, 5):
        assert report.run(run, plot=False, window=window) == 0
        verdicts += [line.rsplit("scale ", 1)[1] for line in capsys.readouterr().out.splitlines()
                     if line.startswith("max rolling skip rate")]
    assert verdicts == ["collapsing", "collapsing"]


def test_report_of_a_run_folder_without_its_card_says_the_run_did_not_end(tmp_path, capsys):
    from ampguard import report

    run = make_run(tmp_path, "killed", [clean(1), clean(2)])
    assert report.run(run, plot=False) == 0
    assert "no run card" not in capsys.readouterr().out
    (run / "RUN.md").unlink()  # (a kill leaves no card; the card is written at the run's end, whatever it was)
    assert report.run(run, plot=False) == 0
    out = capsys.readouterr().out
    assert (f"note: {run} has no run card RUN.md and no process is writing it: the run did not end (killed, its "
            "machine went down, or its disk filled up)\n") in out  # (no checkpoint: no word of a resume)
    assert "ended:" not in out
    # a run that ended (its run_end logged) whose card could not be written: said as that
    (run / "events.jsonl").write_text('{"step": 2, "event": "run_end", "message": "finished: 2 steps"}\n')
    assert report.run(run, plot=False) == 0
    assert (f"note: {run} has no run card RUN.md: the run ended (finished: 2 steps), its card not written\n"
            in capsys.readouterr().out)


def test_the_table_gives_a_runs_headroom_alerts_from_its_card_and_a_dash_where_a_card_has_none(tmp_path):
    warned = make_run(tmp_path, "warned", [clean(1)])
    with (warned / "RUN.md").open("a", encoding="utf-8") as card:
        card.write("| headroom alerts | 1 (step 1: fc output 3.0 bits) |\n")
    table = compare.format_table(compare.load_runs([warned, make_run(tmp_path, "quiet", [clean(1)])]))
    [row] = [line for line in table.splitlines() if line.startswith("| headroom alerts")]
    assert [cell.strip() for cell in row.strip("|").split("|")] == ["headroom alerts", "1 (step 1: fc output 3.0 bits)",
                                                                   "-"]


def test_a_run_name_with_a_bar_or_a_newline_keeps_the_table_whole(tmp_path):
    # review 53b: train takes log.name='lr|3e-3', and a copied folder's name may hold a newline: the
    # header row got a column too many, or was split over two lines
    runs = [make_run(tmp_path, name, [clean(1)]) for name in ("lr|0.1", "clip\n1")]
    lines = compare.format_table(compare.load_runs(runs)).splitlines()
    assert len(lines) == 2 + len(compare.table_rows(compare.load_run(runs[0])))
    header = [cell.strip() for cell in re.split(r"(?<!\\)\|", lines[0].strip()[1:-1])]
    assert header == ["", "lr\\|0.1", "clip\\n1"]
    assert len({len(line) for line in lines}) == 1


@pytest.mark.parametrize("call", ["run", "load_runs"])
def test_one_run_folder_given_as_a_str_or_a_path_is_refused_as_one(tmp_path, monkeypatch, call):
    # review 53b: a str is a sequence: "runs/a" was read as the run folders r, u, n, ...
    make_run(tmp_path / "runs", "a", [clean(1)])
    monkeypatch.chdir(tmp_path)
    for given in ("runs/a", Path("runs/a")):
        with pytest.raises(InputError) as err:
            getattr(compare, call)(given)
        assert str(err.value) == "compare: needs at least two run folders, got one: runs/a"
