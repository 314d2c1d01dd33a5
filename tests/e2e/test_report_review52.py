"""Review 52c: what ``report`` and ``compare`` leave unsaid or behind. A damaged line inside
events.jsonl was passed over in silence (a rollback or a resume lost from the replay, report's counts
off the card's); rows missing at the end of a finished run's steps.csv got no note, and the replay
judged the shortened rows whole as the run's end; a bare CSV's end-of-run judgement was left out
unsaid; a temporary file a killed report or train left in the run folder stayed there for ever.
Tiny linear runs on the CPU, in-process."""

from __future__ import annotations

import subprocess
import sys
from helpers import ag, ok, train

from ampguard import report


def _dead_pid() -> int:
    """The pid of a process that has ended (a killed report's, a killed train's)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


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
