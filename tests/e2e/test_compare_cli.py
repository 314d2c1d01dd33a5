"""``ampguard compare`` on real runs: the lesson's exercise (the same model at several clip
thresholds, then compare), run the way the README's recipe runs it. The table must say what each
run card says; bad input is one line and exit 2 with nothing written."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path

import pytest

from helpers import card_table, marked, png_size, snapshot_of, someones_png

import ampguard.report
from ampguard.cli import main

MAX_NORMS = ("0.5", "1", "5")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The README's recipe: one linear fp16 run per max_norm, an Inf at step 10 in each."""
    root = tmp_path_factory.mktemp("sweep")
    with pytest.MonkeyPatch.context() as mp:
        # the runs' own report.png is not what is tested here: skip drawing it
        mp.setattr(ampguard.report, "plot_run", lambda csv_path, png_path, **kw: Path(png_path))
        for max_norm in MAX_NORMS:
            code = main(["train", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=20",
                         "--set", "log.every=1000", "--set", f"max_norm={max_norm}", "--inject", "inf_grad@10",
                         "--set", f"log.dir={root / 'runs'}", "--set", f"log.name=clip-{max_norm}"])
            assert code == 0
    return root / "runs"


@pytest.fixture(scope="module")
def overlay(sweep, tmp_path_factory):
    """``ampguard compare`` of the three runs, ``--out cmp.png`` given between the run folders (review
    53b: taken as after them), drawn once for the module (~1 s of CPU a plot): (exit code, stdout,
    stderr, the folder it ran in, the sweep's snapshot before it, after it)."""
    here = tmp_path_factory.mktemp("overlay")
    runs = [sweep / f"clip-{m}" for m in MAX_NORMS]
    before = snapshot_of(sweep)
    out, err, old = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(here)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["compare", os.fspath(runs[0]), "--out", "cmp.png", *map(os.fspath, runs[1:])])
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue(), here, before, snapshot_of(sweep)


def compare_table(out: str) -> dict[str, list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("|") and not set(line) <= {"|", "-"}]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in cells}


def test_compare_says_what_each_run_card_says_and_draws_the_overlay(sweep, overlay):
    runs = [sweep / f"clip-{m}" for m in MAX_NORMS]
    code, out, err, here, before, after = overlay  # (the module's compare of the three runs)
    assert code == 0, err
    assert err == ""
    assert png_size(here / "cmp.png") == (1200, 1100)
    assert out.splitlines()[-1] == "plot: cmp.png"
    assert after == before  # the run folders are only read
    table = compare_table(out)
    assert table[""] == [f"clip-{m}" for m in MAX_NORMS]
    assert table["max_norm"] == list(MAX_NORMS)
    for i, run in enumerate(runs):
        card = card_table((run / "RUN.md").read_text(encoding="utf-8"))
        col = {key: cells[i] for key, cells in table.items()}
        assert col["ended"] == "finished: 20 steps"
        assert col["precision"] == card["precision"].split()[0] == "fp16"
        assert col["processes"] == card["processes"] == "1"  # (a 2-rank run's global batch is twice as large)
        assert col["steps / updates"] == f"{card['steps attempted']} / {card['updates applied']}" == "20 / 19"
        assert col["skips"] == card["skipped steps"] == "1 (non_finite_grad=1)"
        assert col["max rolling skip rate"] == card["max rolling skip rate"]
        assert col["clip rate"] == card["clip rate (whole run)"].split()[0]
        verdict, final = re.fullmatch(r"(\w+) \(final scale (\S+)\)", card["scale health"]).groups()
        assert col["scale health"] == f"{verdict} (final {final})"
        assert verdict == "stable"  # one halving at step 10
        first, final_loss, best = re.fullmatch(r"first (\S+), final (\S+), best (\S+)", card["loss of applied steps"]).groups()
        assert col["loss final / best"] == f"{final_loss} / {best}"
        final_val, best_val = re.fullmatch(r"final (\S+), best (\S+)", card["held-out val_loss"]).groups()
        assert col["val_loss final / best"] == f"{final_val} / {best_val}"
    # the clip threshold is what differs: a lower max_norm clips at least as many steps
    rates = [float(r) for r in table["clip rate"]]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]


@pytest.mark.parametrize("case", ["one run", "no run card", "a csv", "missing", "twice", "existing out", "not png",
                                  "step past int64"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(cli, sweep, tmp_path, case):
    a, b = sweep / "clip-0.5", sweep / "clip-1"
    half, huge = tmp_path / "half-run", tmp_path / "huge"
    shutil.copytree(b, half)
    (half / "RUN.md").unlink()  # a run killed before its end
    shutil.copytree(b, huge)  # (review 58c F3: a step past 2**63 - 1, which report's plot cannot hold, was read)
    lines = (huge / "steps.csv").read_text(encoding="utf-8").splitlines()
    lines[-1] = f"{2**63}," + lines[-1].split(",", 1)[1]
    (huge / "steps.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "old.png").write_bytes(b"keep me")
    argv, expected = {
        "one run": ([a], "compare: needs at least two run folders, got 1"),
        "no run card": ([a, half], f"compare: {half} has no run card RUN.md; is it a run folder?"),
        "a csv": ([a, b / "steps.csv"], f"compare: {b / 'steps.csv'} is not a folder"),
        "missing": ([a, tmp_path / "nope"], f"compare: no such folder {tmp_path / 'nope'}"),
        "twice": ([a, a], f"compare: {a} is given twice"),
        "existing out": ([a, b, "--out", "old.png"], "compare: --out old.png exists and is not a PNG; refusing to "
                                                     "overwrite it"),
        "not png": ([a, b, "--out", "cmp.svg"], "compare: --out cmp.svg: the plot is a PNG; name a .png file"),
        "step past int64": ([a, huge, "--out", "cmp.png"], f"compare: {huge / 'steps.csv'} line 21: step {2**63} is past "
                                                           f"the last step number ({2**63 - 1})"),
    }[case]
    before_here, before_runs = snapshot_of(tmp_path), snapshot_of(sweep)
    code, out, err = cli("compare", *argv)
    assert code == 2
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"ampguard: error: {expected}")
    assert "Traceback" not in err
    assert snapshot_of(tmp_path) == before_here and snapshot_of(sweep) == before_runs


def test_compare_without_runs_is_a_usage_error(cli):
    code, out, err = cli("compare")
    assert code == 2 and len(err.splitlines()) == 1
    assert err == "ampguard: error: compare: the following arguments are required: RUN_DIR\n"


def test_losses_of_both_signs_near_the_float_maximum_still_draw(cli, sweep, tmp_path):
    # review #8: an edited steps.csv with losses of 1e308 and -1e308 crashed `compare --out` (exit 1, a
    # traceback from matplotlib); it draws the loss panel on a symmetric log axis now
    edited = tmp_path / "edited"
    shutil.copytree(sweep / "clip-1", edited)
    lines = (edited / "steps.csv").read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    loss = header.index("loss")
    for i, value in ((1, "1e308"), (2, "-1e308")):
        cells = lines[i].split(",")
        cells[loss] = value
        lines[i] = ",".join(cells)
    (edited / "steps.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, out, err = cli("compare", sweep / "clip-0.5", edited, "--out", "cmp.png")
    assert (code, err) == (0, "")
    assert png_size(tmp_path / "cmp.png") == (1200, 1100)
    assert out.splitlines()[-1] == "plot: cmp.png"


def test_run_folders_whose_names_are_not_utf8_are_compared_and_reported(sweep, tmp_path, monkeypatch):
    # a folder renamed to bytes that are not UTF-8: matplotlib could not draw the name (exit 1, a
    # traceback), and printing its path failed under a UTF-8 locale (strict); paths print as their bytes
    odd = tmp_path / os.fsdecode(b"clip-\xff")
    shutil.copytree(sweep / "clip-1", odd)
    monkeypatch.chdir(tmp_path)

    def cli(*argv):
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")  # a UTF-8 locale's stdout
        with contextlib.redirect_stdout(out):
            code = main([os.fspath(a) for a in argv])
        # put back: main() runs in-process (a notebook's stdout is the caller's)
        assert out.errors == "strict", argv
        out.flush()
        return code, out.buffer.getvalue()

    code, out = cli("compare", odd, sweep / "clip-5", "--out", "cmp.png")
    assert code == 0
    assert compare_table(out.decode("utf-8"))[""][0] == "clip-\ufffd"  # the table names it as it can be shown
    assert png_size(tmp_path / "cmp.png") == (1200, 1100)
    code, out = cli("report", odd)  # (cli checks its stdout's errors put back to strict after each)
    assert code == 0 and out.splitlines()[-1] == b"plot: " + os.fsencode(odd / "report.png")
    assert png_size(odd / "report.png")[0] > 0


def test_a_table_with_a_name_an_ascii_console_escapes_still_lines_up(sweep, tmp_path, monkeypatch):
    # an ASCII console prints "clip-\u00e4" as "clip-\\xe4": the column was padded to the name's
    # len (6), printed 9 wide, and every later column of the header row was pushed right
    named = tmp_path / "clip-\u00e4"
    shutil.copytree(sweep / "clip-1", named)
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")  # LANG=C's stdout
    with contextlib.redirect_stdout(out):
        assert main(["compare", os.fspath(named), os.fspath(sweep / "clip-5")]) == 0
    out.flush()
    lines = [line for line in out.buffer.getvalue().decode("ascii").splitlines() if line.startswith("|")]
    assert lines[0].split("|")[2].strip() == "clip-\\xe4"
    assert len({len(line) for line in lines}) == 1, lines
    assert len({tuple(i for i, c in enumerate(line) if c == "|") for line in lines}) == 1, lines


def test_compare_draws_an_earlier_plot_again_as_report_does(cli, sweep, overlay, tmp_path):
    # walkthrough: re-running the lesson's sweep failed at compare ("--out ... already exists"),
    # while report draws its plot again; both now redraw a plot ampguard drew and refuse any other file
    runs = [sweep / "clip-0.5", sweep / "clip-5"]
    code, _, err, here, _, _ = overlay  # an overlay compare drew (the module's, of the three runs: not drawn again)
    assert code == 0, err
    shutil.copyfile(here / "cmp.png", tmp_path / "cmp.png")
    first = (tmp_path / "cmp.png").read_bytes()
    code, out, err = cli("compare", *runs[::-1], "--out", "cmp.png")  # other runs, in another order: another title
    assert (code, err) == (0, "") and out.splitlines()[-1] == "plot: cmp.png"
    assert png_size(tmp_path / "cmp.png") == (1200, 1100) and (tmp_path / "cmp.png").read_bytes() != first
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    own = tmp_path / "run"  # review: a run folder's own report.png is no earlier overlay to draw again
    shutil.copytree(runs[0], own)
    (own / "report.png").write_bytes(first)
    code, out, err = cli("compare", *runs, "--out", own / "report.png")
    assert code == 2 and err.strip() == (f"ampguard: error: compare: --out {own / 'report.png'} is the plot of the run "
                                         f"in {own}; name another file") and (own / "report.png").read_bytes() == first


def test_an_empty_config_yaml_is_refused_not_read_as_the_defaults(cli, tmp_path):
    # an fp16 run whose config.yaml was emptied showed as "bf16 / no loss scaler" in compare, and
    # report judged it with the defaults: a run writes every setting there, so empty is refused
    for name in ("a", "b"):
        code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=2", "--set", "precision=fp32",
                             "--set", f"log.name={name}", "--set", "log.plot=false")  # (no plot read: ~1 s each)
        assert code == 0, err
    (tmp_path / "runs" / "a" / "config.yaml").write_text("")
    for argv in (("compare", "runs/a", "runs/b"), ("report", "runs/a")):
        code, out, err = cli(*argv)
        assert code == 2 and err.splitlines() == [
            f"ampguard: error: {'compare: ' if argv[0] == 'compare' else ''}config file runs/a/config.yaml: empty; "
            "a run's config.yaml holds every setting"], err






def test_compare_overwrites_only_a_plot_ampguard_drew(cli, sweep, tmp_path):
    # review 9 #2: the help says "nothing else is overwritten", yet --out replaced any PNG (a user's
    # figure); a PNG without ampguard's mark is refused now, as is any run folder's report.png
    runs = [sweep / "clip-0.5", sweep / "clip-5"]
    own = tmp_path / "run"
    shutil.copytree(sweep / "clip-1", own)
    assert cli("report", own)[0] == 0  # its report.png: marked as ampguard's, and still the run's
    someones_png(tmp_path / "fig2.png")
    before_here, before_runs = snapshot_of(tmp_path), snapshot_of(sweep)
    for out, said in (("fig2.png", "--out fig2.png exists and is not a plot ampguard drew; refusing to overwrite it"),
                      (own / "report.png", f"--out {own / 'report.png'} is the plot of the run in {own}; name "
                                           "another file")):
        code, stdout, err = cli("compare", *runs, "--out", out)
        assert (code, stdout) == (2, "") and err.splitlines() == [f"ampguard: error: compare: {said}"], err
    assert snapshot_of(tmp_path) == before_here and snapshot_of(sweep) == before_runs

    # a plot ampguard drew (report's: own's report.png, not drawn a second time) is drawn again by compare
    shutil.copyfile(own / "report.png", tmp_path / "cmp.png")
    code, out, err = cli("compare", *runs, "--out", "cmp.png")
    assert (code, err) == (0, "") and out.splitlines()[-1] == "plot: cmp.png"
    assert png_size(tmp_path / "cmp.png") == (1200, 1100)
    assert marked(own / "report.png") and marked(tmp_path / "cmp.png")
    assert b"tEXtTitle\0ampguard compare: clip-0.5, clip-5" in (tmp_path / "cmp.png").read_bytes()


def test_out_between_the_run_folders_is_taken_as_after_them(overlay):
    # review 53b: `compare A --out x.png B` refused B ("unrecognized arguments"); the module's
    # compare is `compare A --out cmp.png B C` (drawn once: test_compare_says_what_each_run_card_says...)
    code, out, err, here, _, _ = overlay
    assert code == 0, err
    assert compare_table(out)[""] == [f"clip-{m}" for m in MAX_NORMS]
    assert png_size(here / "cmp.png") == (1200, 1100)
