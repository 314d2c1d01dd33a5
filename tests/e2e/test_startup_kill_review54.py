"""Review 54c: a SIGKILL in ``ampguard train``'s start-up, after the new run folder was made and before
its ``config.yaml`` was in place, left ``runs/<name>/`` empty (or holding only the dead process's
``.config.yaml.tmp-*``): a rerun with that ``log.name`` was refused ("already exists", exit 2) and
``report`` said "no per-step CSV". The folder is now made under a temporary name beside it and renamed
into place once its config and run id are written (and its lock taken): a kill there leaves the name
free; and a folder that a kill after that left holding nothing of a run, its lock held by nobody, is
taken by the rerun, with a warning line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

from helpers import ag, one_error_line, ok, read_rows, snapshot_of, train

HERE = Path(__file__).resolve().parent
LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "eval.enabled=false",
          "--set", "log.plot=false", "--set", "steps=2"]


def _killed_in_start_up(runs: Path, name: str, phase: str) -> None:
    """``ampguard train`` with ``log.name=name``, SIGKILLed at ``phase`` of tests/e2e/pause_in_startup.py:
    ``config_write``, as it is about to write the new folder's ``config.yaml``; ``run_folder``, right
    after the folder took its name (its config, run id and lock in it), before its logs opened."""
    marker = runs.parent / "paused"
    proc = warm.Popen([sys.executable, str(HERE / "pause_in_startup.py"), str(marker), phase, "train",
                       *LINEAR, "--set", f"log.dir={runs}", "--set", f"log.name={name}"],
                      cwd=runs.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never reached its config.yaml"
            time.sleep(0.02)
        proc.kill()  # (SIGKILL: no handler, no taking back)
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("phase", ["config_write", "run_folder"])
def test_a_start_up_killed_before_its_logs_opened_leaves_the_name_free(tmp_path, phase):
    runs = tmp_path / "runs"
    _killed_in_start_up(runs, "s", phase)
    run = runs / "s"
    code, out, err = train(runs, "s", *LINEAR)  # (it was: "run folder .../runs/s already exists; choose ...")
    assert code == 0, out + err
    if phase == "run_folder":  # (the folder had its name: taken, said)
        assert f"ampguard: warning: run folder {run} held nothing of a run: a start-up killed before its logs " \
            "opened (pid " in err, err
    else:  # (nothing had the name)
        assert "warning" not in err, err
    assert [r["step"] for r in read_rows(run / "steps.csv")] == ["1", "2"]
    assert {"config.yaml", "run-id", "RUN.md", "steps.csv"} <= {p.name for p in run.iterdir()}
    ok(ag("report", run))
    # a real run's folder is still its own: refused, left as it was
    before = snapshot_of(run)
    line = one_error_line(train(runs, "s", *LINEAR))
    assert line == f"ampguard: error: run folder {run} already exists; choose another log.name", line
    assert snapshot_of(run) == before
