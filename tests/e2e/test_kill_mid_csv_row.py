"""A real SIGKILL in the middle of writing a row of steps.csv (the guard edge case "kill mid-write
of the CSV"): every complete row stays as it was written, ``ampguard report`` leaves the torn last
line out and says so, and ``--resume`` drops it (and the rows after its checkpoint) and appends
the rest, so the file ends byte for byte as an uninterrupted run's.

The kill lands inside the row every time: ``pause_in_csv.py`` runs ``ampguard train`` with the
write of step 5's row cut after its first half (one ``write`` on the unbuffered file, as a write
the kernel left partial would leave it), drops a marker there and waits for the SIGKILL.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

from helpers import ag, ok, read_rows

from ampguard import checkpoint as ckpt

PAUSE_IN_CSV = Path(__file__).with_name("pause_in_csv.py")
KILLED_AT = 5  # the row the kill cuts; checkpoints every 3 steps: the resume starts from step 3
ARGS = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "steps=8", "--set", "eval.every=2",
        "--set", "checkpoint.every=3", "--set", "log.every=1000", "--set", "log.plot=false"]  # (no plot read)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_kill_in_the_middle_of_a_csv_row_leaves_whole_rows_and_a_torn_line_report_and_resume_drop(
        tmp_path, monkeypatch):
    args = [*ARGS, "--set", f"log.dir={tmp_path / 'runs'}"]
    run, ref = tmp_path / "runs" / "K", tmp_path / "runs" / "REF"
    marker, stderr = tmp_path / "paused", tmp_path / "stderr.txt"
    with stderr.open("wb") as err:  # a file, not a pipe: a full pipe would block the run
        proc = warm.Popen([sys.executable, str(PAUSE_IN_CSV), str(marker), str(KILLED_AT), "train", *args,
                           "--set", "log.name=K"],
                          cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    try:
        # the same run, never killed, trained in this process while the child imports torch (no wait on it)
        monkeypatch.chdir(tmp_path)
        ok(ag("train", *args, "--set", "log.name=REF"))
        deadline = time.monotonic() + 120  # only a hang runs into it
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if not marker.exists():
            _kill(proc)
            pytest.fail(f"the row of step {KILLED_AT} never paused (exit {proc.returncode}):\n{stderr.read_text()}")
        paused = json.loads(marker.read_text(encoding="utf-8"))
        assert paused["pid"] == proc.pid
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        _kill(proc)

    ref_lines = (ref / "steps.csv").read_bytes().splitlines(keepends=True)
    assert [int(r["step"]) for r in read_rows(ref / "steps.csv")] == list(range(1, 9))
    assert ref_lines[KILLED_AT].decode() == paused["line"]  # the row the kill cut, as the run would have written it

    # what the kill left: the header and rows 1..4 byte for byte, then half of row 5 and no newline
    killed = (run / "steps.csv").read_bytes()
    whole = b"".join(ref_lines[:KILLED_AT])
    torn = paused["written"].encode()
    assert killed == whole + torn, killed
    assert torn and not torn.endswith(b"\n") and len(torn) < len(ref_lines[KILLED_AT]) - 1
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == [ckpt.checkpoint_name(3)]
    assert not (run / "RUN.md").exists()  # killed: no run card

    # report: the torn line is left out with its note, the four whole rows are the run
    code, out, err = ag("report", run)
    assert code == 0, out + err
    assert f"note: the last line of {run / 'steps.csv'} is torn (no newline: a write cut short), left out: " \
           f"{paused['written'][:40]!r}" in out, out
    assert "summary: steps=4 updates=4 skips=0 (none)" in out, out
    assert (run / "steps.csv").read_bytes() == killed  # report reads, never repairs

    # resume from step 3: row 4 (after the checkpoint) and the torn line go, 4..8 are appended once
    out = ok(ag("train", "--resume", run))
    assert "resuming from step-00000003.pt, step 3" in out, out
    assert [int(r["step"]) for r in read_rows(run / "steps.csv")] == list(range(1, 9))  # no duplicate, no gap
    assert (run / "steps.csv").read_bytes() == (ref / "steps.csv").read_bytes()
    code, out, err = ag("report", run)
    assert code == 0 and "torn" not in out and "summary: steps=8 updates=8 skips=0 (none)" in out, out + err
