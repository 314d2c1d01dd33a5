"""Review 52c: what ``report`` and ``compare`` leave unsaid or behind. A damaged line inside
events.jsonl was passed over in silence (a rollback or a resume lost from the replay, report's counts
off the card's); rows missing at the end of a finished run's steps.csv got no note, and the replay
judged the shortened rows whole as the run's end; a bare CSV's end-of-run judgement was left out
unsaid; a temporary file a killed report or train left in the run folder stayed there for ever.
Tiny linear runs on the CPU, in-process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import ag, ok, train

from ampguard import compare, report


def _notes(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("note: ")]


def _report_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("max rolling skip rate"))


def _dead_pid() -> int:
    """The pid of a process that has ended (a killed report's, a killed train's)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------- finding 1


def test_a_damaged_line_inside_events_jsonl_is_said_once_in_report_and_compare(tmp_path):
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=10", "--set", "checkpoint.every=5",
             "--set", "log.plot=false"))
    run = tmp_path / "run"
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt", "--set", "steps=12"))
    log = run / "events.jsonl"
    lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"event": "resume"' in line)
    lines[at] = lines[at][:20] + "\x00" + lines[at][21:]  # (one byte of the resume's line flipped)
    log.write_text("".join(lines), encoding="utf-8")
    said = (f"note: {log} has 1 unreadable line (line {at + 1}): the rollbacks, resumes and policy changes it "
            "held are not replayed")
    out = ok(ag("report", run, "--no-plot"))
    assert _notes(out) == [said], out
    assert compare.load_run(run).notes == [said.removeprefix("note: ")]


def test_a_torn_last_line_of_events_jsonl_is_no_damage(tmp_path):
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=6", "--set", "log.plot=false"))
    run = tmp_path / "run"
    with (run / "events.jsonl").open("a", encoding="utf-8") as f:
        f.write('{"step": 6, "event": "sto')  # (a write a kill cut short: no newline)
    assert _notes(ok(ag("report", run, "--no-plot"))) == []


def test_damaged_lines_are_counted_and_the_first_named(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"step": 1, "event": "run_start"}\nnot json\n\n["a list"]\n'
                                           '{"step": 2, "event": "run_end", "message": "finish', encoding="utf-8")
    log = report.LoggedEvents(tmp_path)
    assert [e["step"] for e in log.events()] == [1] and log.unreadable() == [2, 4]  # (a blank line holds nothing)
    note = [n for n in report.reading_notes(Path("steps.csv"), [], [], log) if "unreadable" in n]
    assert note == [f"{tmp_path / 'events.jsonl'} has 2 unreadable lines (the first at line 2): the rollbacks, "
                    "resumes and policy changes they held are not replayed"]


# ---------------------------------------------------------------------------- finding 2


def _finished_run(tmp_path: Path) -> Path:
    # 3 skips in 30 steps: the rolling ALERT never arms (min_steps 100); the judgement at the end raises it
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=30", "--set", "log.plot=false",
             "--inject", "inf_grad@1,2,3"))
    return tmp_path / "run"


def _keep_rows(run: Path, rows: int, torn: str = "") -> None:
    csv = run / "steps.csv"
    lines = csv.read_text(encoding="utf-8").splitlines(keepends=True)
    csv.write_text("".join(lines[:rows + 1]) + torn, encoding="utf-8")


def test_rows_missing_at_the_end_of_a_finished_run_are_said_and_not_judged_as_its_end(tmp_path):
    run = _finished_run(tmp_path)
    assert "alert episodes 1," in _report_line(ok(ag("report", run, "--no-plot")))  # (the run's card: 1)
    _keep_rows(run, 10)
    out = ok(ag("report", run, "--no-plot"))
    said = f"{run / 'steps.csv'} ends at step 10, the run ended at step 30 (its card): steps 11-30 have no row"
    assert _notes(out) == [f"note: {said}"], out
    assert "alert episodes 0," in _report_line(out)  # (3 skips in 10 rows were not the run's end)
    loaded = compare.load_run(run)
    assert loaded.notes == [said] and loaded.monitor.alert_episodes == 0


def test_a_torn_row_in_the_middle_of_a_finished_run_says_the_steps_after_it_missing_too(tmp_path):
    run = _finished_run(tmp_path)
    _keep_rows(run, 10, torn="11,0.1,0.5")
    notes = _notes(ok(ag("report", run, "--no-plot")))
    assert notes[0].startswith(f"note: the last line of {run / 'steps.csv'} is torn")
    assert notes[1:] == [f"note: {run / 'steps.csv'} ends at step 10, the run ended at step 30 (its card): "
                         "steps 11-30 have no row"]


def test_a_finished_run_without_its_card_reads_its_end_from_run_end(tmp_path):
    run = _finished_run(tmp_path)
    (run / "RUN.md").unlink()
    _keep_rows(run, 29)
    out = ok(ag("report", run, "--no-plot"))
    assert f"note: {run / 'steps.csv'} ends at step 29, the run ended at step 30 (its run_end event): step 30 has " \
           "no row" in _notes(out), out


# ---------------------------------------------------------------------------- finding 3


def test_a_bare_csv_says_its_rows_were_not_judged_as_a_finished_run(tmp_path):
    csv = tmp_path / "demo.csv"
    out = ok(ag("demo", "--csv", csv, "--steps", "30", "--inject", "inf_grad@5,6,7"))
    assert "ALERT 30 skip rate" in out  # (the demo's own judgement at its end)
    out = ok(ag("report", csv, "--no-plot"))
    assert f"note: {csv} has no run card or run_end event beside it: its rows are not judged as a finished run's " \
           "(an ALERT a short run raises at its end is not counted)" in _notes(out), out


def test_a_finished_run_folder_has_no_such_note(tmp_path):
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=4", "--set", "log.plot=false"))
    assert not [n for n in _notes(ok(ag("report", tmp_path / "run", "--no-plot"))) if "not judged" in n]


# ---------------------------------------------------------------------------- finding 5


def test_report_removes_the_partial_plot_a_killed_report_left_and_keeps_a_live_ones(tmp_path, capsys):
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=4", "--set", "log.plot=false"))
    run = tmp_path / "run"
    dead = run / f".report.png.tmp-{_dead_pid()}-0123456789abcdef"
    live = run / f".report.png.tmp-{1}-fedcba9876543210"  # (pid 1 runs as long as the machine does)
    other = run / f".RUN.md.tmp-{_dead_pid()}-00ff"  # (not the plot's: report writes no card)
    for path in (dead, live, other):
        path.write_bytes(b"\x89PNG half")
    assert report.run(run) == 0
    assert not dead.exists() and live.exists() and other.exists() and (run / "report.png").is_file()


def test_a_resume_removes_what_a_killed_run_left_half_written_in_its_folder(tmp_path):
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=4", "--set", "checkpoint.every=2",
             "--set", "log.plot=false"))
    run = tmp_path / "run"
    pid = _dead_pid()
    left = [run / f".{name}.tmp-{pid}-0123456789abcdef" for name in ("RUN.md", "config.yaml", "report.png")]
    live = run / ".report.png.tmp-1-fedcba9876543210"  # (a report drawing now: pid 1 is alive)
    for path in (*left, live):
        path.write_bytes(b"half")
    ok(ag("train", "--resume", run, "--set", "steps=6"))
    assert [p.name for p in left if p.exists()] == [] and live.exists()
