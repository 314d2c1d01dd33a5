"""Where ``report`` and ``compare`` may write a plot (review 9, finding 2): only over a PNG
ampguard drew, which carries its mark (a ``Software`` text chunk), or a run folder's own
``report.png`` when reporting that run; never over someone's picture or another run's plot.
And the clip rate ``report`` prints (finding 7): the run's, whatever ``--max-norm`` says.
Hand-made files here; whole runs through the CLI in ``tests/e2e/test_report_hostile.py`` and
``tests/e2e/test_compare_cli.py``."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from helpers import someones_png

from ampguard import __version__, compare, report
from ampguard.config import dump_config, validate
from ampguard.errors import InputError
from ampguard.sinks import CSV_COLUMNS

HEADER = ",".join(CSV_COLUMNS)
# max_norm 1: steps 1, 2, 4 clipped (post < pre), 3 skipped, 5 not clipped, 6 with clipping off (post == pre)
ROWS = ["1,0.1,2.0,1.0,0.5,0,,1.0", "2,0.1,3.0,1.0,0.4,0,,1.0", "3,0.1,,,nan,1,non_finite_loss,1.0",
        "4,0.1,1.5,1.0,0.3,0,,1.0", "5,0.1,0.5,0.5,0.3,0,,1.0", "6,0.1,0.7,0.7,0.2,0,,1.0"]




def make_run(root: Path, name: str, rows: list[str] = ROWS, config: dict | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(dump_config(validate(config or {"precision": "bf16"})), encoding="utf-8")
    (folder / "steps.csv").write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    (folder / "RUN.md").write_text(f"# Run {name}\n\n**finished: {len(rows)} steps**\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> bytes:
    """The PNG ``report.plot_run`` draws of a run of :data:`ROWS`, drawn once for the module: the
    same bytes wherever such a run sits (the plot names neither its folder nor its path), so a test
    that needs a plot ampguard drew writes these instead of drawing it again (~1 s of CPU each)."""
    run = make_run(tmp_path_factory.mktemp("drawn"), "a")
    return report.plot_run(run / "steps.csv", run / "report.png").read_bytes()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


# ---------------------------------------------------------------------------- the mark


def test_every_plot_ampguard_draws_carries_its_mark_and_someone_elses_png_does_not(tmp_path, drawn):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    plotted = tmp_path / "report.png"
    plotted.write_bytes(drawn)  # what report.plot_run(a / "steps.csv", ...) draws (the module's: not drawn again)
    overlay = compare.plot_overlay(compare.load_runs([a, b]), tmp_path / "cmp.png")
    for png in (plotted, overlay):
        assert report.png_text(png)["Software"] == f"ampguard {__version__}"
        assert report.drawn_by_ampguard(png)
    assert report.png_text(overlay)["Title"] == "ampguard compare: a, b"
    someones_png(tmp_path / "figure.png")
    assert report.png_text(tmp_path / "figure.png")["Software"].startswith("Matplotlib")
    assert not report.drawn_by_ampguard(tmp_path / "figure.png")


def test_png_text_reads_the_chunks_before_the_image_and_trusts_no_broken_one(tmp_path):
    png = tmp_path / "x.png"
    sig = b"\x89PNG\r\n\x1a\n"
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))  # 1 x 1 pixel, 8-bit grey
    mark = chunk(b"tEXt", b"Software\0ampguard 9")
    png.write_bytes(sig + header + chunk(b"prVt", b"\0" * 40) + mark + chunk(b"IEND", b""))  # another chunk first
    assert report.png_text(png) == {"Software": "ampguard 9"} and report.drawn_by_ampguard(png)
    png.write_bytes(sig + header + chunk(b"IDAT", b"...") + mark)  # after the image data
    assert report.png_text(png) == {} and not report.drawn_by_ampguard(png)
    png.write_bytes(sig + header + mark[:-4] + b"\0\0\0\0")  # its CRC does not match
    assert report.png_text(png) == {} and not report.drawn_by_ampguard(png)
    png.write_bytes(sig + header + mark[:-6])  # cut short
    assert report.png_text(png) == {} and not report.drawn_by_ampguard(png)
    png.write_bytes(sig + header + chunk(b"tEXt", b"Software\0ampguardian"))  # not the mark's word
    assert not report.drawn_by_ampguard(png)
    png.write_bytes(sig + struct.pack(">I", 2**31) + b"IHDR")  # a length past the end
    assert report.png_text(png) == {}
    png.write_bytes(sig + chunk(b"IHDR", bytes(13)) + mark)  # a header no picture has (0 x 0)
    assert report.png_text(png) == {} and not report.drawn_by_ampguard(png)
    png.write_bytes(b"GIF89a" + mark)
    assert report.png_text(png) is None and not report.drawn_by_ampguard(png)


@pytest.mark.parametrize("kind", [b"tEXt", b"zTXt", b"iTXt"])
def test_a_png_that_names_its_software_twice_is_nobodys(tmp_path, kind):
    # review_clarity10 #8: Pillow keeps a repeated keyword's last text, the reader before it the
    # first; either way a program adding its own Software chunk beside the mark would make someone's
    # picture read as ampguard's plot, to be overwritten
    png = tmp_path / "x.png"
    sig, end = b"\x89PNG\r\n\x1a\n", chunk(b"IDAT", b"...") + chunk(b"IEND", b"")
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    mark = chunk(b"tEXt", b"Software\0ampguard 9")
    data = {b"tEXt": b"Software\0GIMP", b"zTXt": b"Software\0\0" + zlib.compress(b"GIMP"),
            b"iTXt": b"Software\0\0\0\0\0GIMP"}[kind]
    for chunks in ([chunk(kind, data), mark], [mark, chunk(kind, data)], [mark, mark]):
        png.write_bytes(sig + header + b"".join(chunks) + end)
        assert "Software" not in report.png_text(png) and not report.drawn_by_ampguard(png)
    png.write_bytes(sig + header + chunk(kind, data.replace(b"Software", b"Title")) + mark + end)
    assert report.png_text(png) == {"Title": "GIMP", "Software": "ampguard 9"} and report.drawn_by_ampguard(png)


def test_the_mark_of_a_picture_too_large_to_decode_is_read_without_decoding_it(tmp_path):
    # 20000 x 20000 pixels: Pillow's Image.open refuses it (a "decompression bomb"); png_text reads its chunks
    png = tmp_path / "x.png"
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"tEXt", b"Software\0ampguard 9") + chunk(b"IDAT", b"..."))
    assert report.png_text(png) == {"Software": "ampguard 9"} and report.drawn_by_ampguard(png)


# ---------------------------------------------------------------------------- what may be overwritten


@pytest.mark.parametrize("verb", ["report", "compare"])
def test_a_png_ampguard_did_not_draw_is_refused_and_one_it_drew_is_not(tmp_path, verb, drawn):
    a = make_run(tmp_path, "a")
    csv_path = a / "steps.csv" if verb == "report" else None
    figure = tmp_path / "figure1.png"
    before = someones_png(figure)
    with pytest.raises(InputError) as err:
        report.check_plot_path(figure, csv_path, verb=verb)
    assert str(err.value) == f"{verb}: --out {figure} exists and is not a plot ampguard drew; refusing to overwrite it"
    assert figure.read_bytes() == before
    (tmp_path / "earlier.png").write_bytes(drawn)  # what report.plot_run(a / "steps.csv", ...) draws
    report.check_plot_path(tmp_path / "earlier.png", csv_path, verb=verb)  # drawn again


@pytest.mark.parametrize("marked", [False, True])
def test_another_runs_report_png_is_refused_the_runs_own_is_drawn_again(tmp_path, marked, drawn):
    a, b = make_run(tmp_path, "a"), make_run(tmp_path, "b")
    for run in (a, b):  # by an older ampguard (no mark), or by this one
        (run / "report.png").write_bytes(drawn) if marked else someones_png(run / "report.png")  # (plot_run's bytes)
    theirs = (b / "report.png").read_bytes()
    for png, csv_path, verb in ((b / "report.png", a / "steps.csv", "report"), (b / "report.png", None, "compare"),
                                (a / "report.png", None, "compare")):
        with pytest.raises(InputError) as err:
            report.check_plot_path(png, csv_path, verb=verb)
        assert str(err.value) == f"{verb}: --out {png} is the plot of the run in {png.parent}; name another file"
    assert (b / "report.png").read_bytes() == theirs
    report.check_plot_path(a / "report.png", a / "steps.csv", given=False)  # report of run a: its own plot
    report.check_plot_path(a / "report.png", a / ".." / "a" / "steps.csv")  # (however the path is written)


def test_a_run_folders_report_png_is_refused_before_it_exists_and_a_bare_folders_is_not(tmp_path):
    a = make_run(tmp_path, "a")
    (b := tmp_path / "b").mkdir()
    (b / "config.yaml").write_text("steps: 1\n")  # a run killed before its first step: config.yaml only
    with pytest.raises(InputError, match="is the plot of the run in"):
        report.check_plot_path(b / "report.png", a / "steps.csv")
    (c := tmp_path / "c").mkdir()  # no run's file: its report.png is any file name
    report.check_plot_path(c / "report.png", a / "steps.csv")
    someones_png(c / "report.png")
    with pytest.raises(InputError, match="is not a plot ampguard drew"):
        report.check_plot_path(c / "report.png", a / "steps.csv")


def test_report_refuses_someones_png_at_the_default_path_too(tmp_path, capsys):
    csv_path = tmp_path / "data.csv"
    csv_path.write_text("\n".join([HEADER, *ROWS]) + "\n", encoding="utf-8")
    before = someones_png(tmp_path / "data.png")
    with pytest.raises(InputError) as err:
        report.run(csv_path)
    assert str(err.value) == (f"report: the plot {tmp_path / 'data.png'} exists and is not a plot ampguard drew; "
                              "refusing to overwrite it")
    assert (tmp_path / "data.png").read_bytes() == before and capsys.readouterr().out == ""


def test_an_unmarked_png_that_appears_while_compare_draws_is_not_replaced(tmp_path, monkeypatch):
    import matplotlib.figure

    runs = compare.load_runs([make_run(tmp_path, "a"), make_run(tmp_path, "b")])
    out = tmp_path / "cmp.png"
    savefig = matplotlib.figure.Figure.savefig
    theirs = []

    def savefig_then_someone_writes(self, *args, **kwargs):
        savefig(self, *args, **kwargs)
        if not theirs:
            monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
            theirs.append(someones_png(out))  # a real PNG, not ampguard's

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig_then_someone_writes)
    with pytest.raises(InputError) as err:
        compare.plot_overlay(runs, out)
    assert str(err.value) == f"compare: --out {out} exists and is not a plot ampguard drew; refusing to overwrite it"
    assert out.read_bytes() == theirs[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "cmp.png"]


# ---------------------------------------------------------------------------- the clip rate


def summary_line(capsys) -> str:
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("max rolling"))


@pytest.mark.parametrize("bare", [False, True])
def test_the_clip_rate_is_the_runs_whatever_max_norm_is_given(tmp_path, capsys, bare):
    # review 9 #7: --max-norm (help: "clip threshold line") recomputed the summary's clip rate:
    # 0.500 for this run, 0.000 with --max-norm 0 or 100
    a = make_run(tmp_path, "a", config={"precision": "bf16", "max_norm": 1.0})
    if bare:  # a CSV alone (a user's loop's): what it shows, post-clip below pre-clip
        (a / "config.yaml").unlink()
    target = a / "steps.csv" if bare else a
    lines = []
    for max_norm in (None, 0.0, 1.0, 100.0, 1e-3):
        assert report.run(target, max_norm=max_norm, plot=False) == 0  # (the summary is the point)
        lines.append(summary_line(capsys))
    assert "clip rate 0.500," in lines[0]  # 3 of 6 steps
    assert lines == [lines[0]] * 5


def test_thresholds_given_that_judge_the_alerts_again_are_said_and_fail_rate_changes_nothing(tmp_path, capsys):
    a = make_run(tmp_path, "a", config={"precision": "bf16", "monitor": {"min_steps": 0, "window": 2}})
    report.run(a, plot=False)  # (the summary is the point)
    own = summary_line(capsys)
    assert "alert episodes 1, clip rate" in own
    for fail_rate in (0.0, 0.5, 1.0):
        report.run(a, fail_rate=fail_rate, plot=False)  # a line on the plot, nothing else
        assert summary_line(capsys) == own
    report.run(a, alert_rate=0.6, plot=False)
    assert "alert episodes 0 (re-judged at --alert-rate 0.6), clip rate 0.500," in summary_line(capsys)
    report.run(a, window=1000, min_steps=0, plot=False)
    assert "(window 1000), alert episodes 1 (re-judged at --window 1000, --min-steps 0)," in summary_line(capsys)


@pytest.mark.parametrize("card", ["missing", "a folder", "not text"])
def test_a_finished_run_without_a_readable_card_is_judged_whole_as_its_run_end_event_says(tmp_path, capsys, card):
    # review_28b: the end-of-run ALERT of a run too short to arm the alarm (min_steps) was dropped
    # when RUN.md could not be read, though the run_end event a few lines before said "finished"
    rows = [f"{step},0.1,,,nan,1,non_finite_loss,1.0" if step == 2 else f"{step},0.1,0.5,0.5,0.3,0,,1.0"
            for step in range(1, 5)]
    a = make_run(tmp_path, "a", rows, {"precision": "bf16", "steps": 4, "monitor": {"min_steps": 100}})
    report.run(a, plot=False)
    assert "alert episodes 1, clip rate" in summary_line(capsys)
    (a / "RUN.md").unlink()
    if card == "a folder":
        (a / "RUN.md").mkdir()
    elif card == "not text":
        (a / "RUN.md").write_bytes(b"\xff\xfe\x00garbage")
    (a / "events.jsonl").write_text('{"step": 4, "event": "run_end", "message": "finished: 4 steps"}\n')
    report.run(a, plot=False)
    assert "alert episodes 1, clip rate" in summary_line(capsys)
    (a / "events.jsonl").write_text('{"step": 4, "event": "run_end", "message": "stopped at step 4: ..."}\n')
    report.run(a, plot=False)  # (a stop, even at the last step, is not judged whole: as the run did)
    assert "alert episodes 0, clip rate" in summary_line(capsys)


def test_a_csv_without_pre_clip_norms_has_no_clip_rate(tmp_path, capsys):
    csv_path = tmp_path / "trainer.csv"  # a stock Trainer's: post-clip norm only
    csv_path.write_text("\n".join([HEADER, "1,0.1,,0.5,,0,,1.0", "2,0.1,,0.7,,0,,1.0"]) + "\n", encoding="utf-8")
    report.run(csv_path)
    assert "clip rate n/a (no pre- and post-clip norms in the CSV), scale" in summary_line(capsys)


def test_report_judges_the_alerts_with_the_runs_clear_rate(tmp_path, capsys):
    # review_clarity10 #9: report built its RunMonitor's arguments by hand, apart from build_monitor,
    # and left monitor.clear_rate out. The rolling rate falls to 0.2 between the two bursts: that
    # clears the ALERT at the default level (0.8 x 0.3), so the second burst pages again, but not at
    # the run's 0.01, under which the run itself counted one episode
    skipped = [1] * 4 + [0] * 8 + [1] * 4 + [0] * 14
    rows = [f"{step},0.1,,,nan,1,non_finite_loss,1.0" if skip else f"{step},0.1,0.5,0.5,0.3,0,,1.0"
            for step, skip in enumerate(skipped, start=1)]
    monitor = {"window": 10, "alert_rate": 0.3, "min_steps": 0}
    for clear_rate, episodes in ((None, 2), (0.01, 1)):
        a = make_run(tmp_path / str(clear_rate), "a", rows, {"precision": "bf16",
                                                            "monitor": {**monitor, "clear_rate": clear_rate}})
        report.run(a, plot=False)
        assert f"alert episodes {episodes}, clip rate" in summary_line(capsys)
    # an --alert-rate given below the run's clear_rate: the ALERT clears at the rate given
    report.run(a, alert_rate=0.005, plot=False)
    assert "alert episodes 1 (re-judged at --alert-rate 0.005), clip rate" in summary_line(capsys)


def test_a_replay_follows_a_resumes_clear_rate_and_a_default_clear_level_follows_alert_rate():
    # a resume that changed monitor.clear_rate (or alert_rate, with clear_rate null) changed when the
    # live run's ALERT cleared; the replay must clear it where the run did
    from ampguard.report import Row, replay

    skipped = [False] * 3 + [True] * 3 + [False] * 6  # window 4: rates 0 ... 1, 0.75, 0.5, 0.25, 0
    rows = [Row(s, 0.1, None if k else 1.0, None if k else 1.0, float("nan") if k else 0.5, k,
                "non_finite_loss" if k else "", 1.0) for s, k in enumerate(skipped, start=1)]

    def clears(**kwargs):
        m = replay(rows, window=4, alert_rate=0.5, scaler_enabled=False, min_steps=0, **kwargs)
        return m.alert_episodes, m.alerting, m.clear_rate

    assert clears() == (1, False, 0.4)  # cleared at 0.25 (step 8)
    # clear_rate 0.5 -> 0.1 from step 7: the rate 0.25 at step 8 no longer clears; 0 at step 10 does
    change = {"key": "monitor.clear_rate", "old": 0.5, "new": 0.1, "step": 6}
    m = replay(rows[:8], window=4, alert_rate=0.5, scaler_enabled=False, min_steps=0, policy=[change])
    assert (m.alerting, m.clear_rate) == (True, 0.1)
    # alert_rate 0.5 -> 0.2 with clear_rate null: the clear level goes with it, 0.4 -> 0.16
    change = {"key": "monitor.alert_rate", "old": 0.5, "new": 0.2, "step": 6}
    m = replay(rows[:8], window=4, alert_rate=0.5, scaler_enabled=False, min_steps=0, policy=[change])
    assert m.alerting and m.clear_rate == pytest.approx(0.16)


def test_no_plot_prints_the_summary_and_writes_nothing(tmp_path, capsys):
    a = make_run(tmp_path, "a", config={"precision": "bf16"})
    before = sorted(p.name for p in a.iterdir())
    assert report.run(a, plot=False) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "plot: not drawn (--no-plot)" and "summary: steps=6" in out
    assert sorted(p.name for p in a.iterdir()) == before  # no report.png, nothing else
    with pytest.raises(InputError) as err:  # --out names a plot that --no-plot would not draw
        report.run(a, out=tmp_path / "x.png", plot=False)
    assert str(err.value) == "report: --out says where to draw the plot and --no-plot draws none; give one of them"
    assert not (tmp_path / "x.png").exists()


def test_an_alert_rate_given_sets_a_resumes_clear_rate_change_aside(tmp_path, capsys):
    # review_session10 #1: a resume's clear_rate change (0.2, above the --alert-rate 0.05 given) was
    # still replayed on every row: the ALERT went up and down every other step
    import json

    skipped = [1] * 6 + [0] * 4 + [1] * 10 + [0] * 20
    rows = [f"{step},0.1,,,nan,1,non_finite_loss,1.0" if skip else f"{step},0.1,0.5,0.5,0.3,0,,1.0"
            for step, skip in enumerate(skipped, start=1)]
    a = make_run(tmp_path, "a", rows, {"precision": "bf16", "monitor": {"window": 10, "alert_rate": 0.3,
                                                                         "clear_rate": 0.2, "min_steps": 0}})
    change = {"step": 3, "event": "policy_change", "key": "monitor.clear_rate", "old": 0.1, "new": 0.2}
    (a / "events.jsonl").write_text(json.dumps(change) + "\n", encoding="utf-8")
    report.run(a, alert_rate=0.05, plot=False)
    # at 0.05 (clearing at 0.05 too, the given rate being below the run's level) the rate is above it from
    # step 1 to 29: one episode
    assert "alert episodes 1 (re-judged at --alert-rate 0.05), clip rate" in summary_line(capsys)


def test_a_config_written_before_clear_rate_existed_reads_as_clearing_at_alert_rate(tmp_path):
    # review_session10 #3: report judged a run made before the ALERT had a clear level with the new
    # default (0.8 x alert_rate) and counted fewer episodes than the run's own card
    import yaml

    from ampguard.config import read_run_config

    data = yaml.safe_load(dump_config(validate({"monitor": {"alert_rate": 0.1}})))
    del data["monitor"]["clear_rate"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    assert read_run_config(tmp_path / "config.yaml").monitor.clear_rate == 0.1
    data["monitor"]["clear_rate"] = None  # written since: the default, 0.8 x alert_rate
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    assert read_run_config(tmp_path / "config.yaml").monitor.clear_rate is None


def test_a_csv_named_like_a_plot_is_told_so_not_called_its_own_plot(tmp_path):
    # (review 48c: "the plot x.png is the CSV itself; refusing to overwrite it" for the input itself)
    data = tmp_path / "x.png"
    data.write_text(",".join(CSV_COLUMNS) + "\n1,0.1,1,1,0.5,0,,1\n", encoding="utf-8")
    before = data.read_bytes()
    with pytest.raises(InputError, match=r"^report: .*x\.png is named as a plot \(\.png\) but holds no PNG: the plot "
                                         r"beside it would be the CSV itself; give --out another \.png, or --no-plot$"):
        report.run(data)
    assert data.read_bytes() == before
    report.run(data, plot=False)  # (read as the CSV it is)
