"""Stop signals: SIGTERM (what SLURM and Kubernetes send) is handled as Ctrl-C is, and signals that
arrive while a run writes its last checkpoint and run card wait for them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import read_rows

HERE = Path(__file__).resolve().parent
LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "eval.enabled=false"]


def _spawn(cwd: Path, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rows(path: Path) -> list[dict[str, str]]:
    return read_rows(path) if path.exists() else []


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before the test could signal it:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the run")
        time.sleep(0.02)


def _card(run: Path) -> dict[str, str]:
    rows = {}
    for line in (run / "RUN.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def test_sigterm_stops_at_a_step_boundary_with_checkpoint_card_and_exit_143(tmp_path):
    run = tmp_path / "runs" / "t"
    proc = _spawn(tmp_path, "-m", "ampguard", "train", *LINEAR, "--set", "steps=100000", "--set", "log.name=t",
                  "--set", "checkpoint.every=0")
    _wait_for(lambda: len(_rows(run / "steps.csv")) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, out + err
    assert "Traceback" not in err
    n = len(_rows(run / "steps.csv"))
    assert _card(run)["ended"] == f"interrupted (SIGTERM) after step {n}"
    assert (run / "checkpoints" / f"step-{n:08d}.pt").is_file()
    assert f"interrupted after step {n}" in err

    resumed = subprocess.run([sys.executable, "-m", "ampguard", "train", "--resume", str(run), "--set",
                              f"steps={n + 3}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [int(r["step"]) for r in _rows(run / "steps.csv")] == list(range(1, n + 4))


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGINT, signal.SIGINT], [signal.SIGTERM, signal.SIGINT]])
def test_signals_while_the_run_card_is_written_wait_for_it(tmp_path, signals):
    marker = tmp_path / "closing"
    run = tmp_path / "runs" / "c"
    proc = _spawn(tmp_path, str(HERE / "pause_in_report.py"), str(marker), "train", *LINEAR, "--set", "steps=5",
                  "--set", "log.name=c")
    _wait_for(marker.exists, proc)
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.05)
    marker.with_name("closing.go").write_text("go", encoding="utf-8")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err  # the run had finished: a signal while closing changes nothing
    assert "Traceback" not in err
    assert _card(run)["ended"] == "finished: 5 steps"
    assert (run / "report.png").is_file()


PAUSE_IN_STARTUP = HERE / "pause_in_startup.py"


@pytest.mark.parametrize("phase", ["torch_import", "building", "run_folder", "before_step_1"])
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tmp_path, phase):
    # each Ctrl-C lands in its phase every time: pause_in_startup.py holds the run there until the
    # test has sent it (see its docstring for where each phase is)
    marker, runs = tmp_path / "paused", tmp_path / "runs"
    proc = _spawn(tmp_path, str(PAUSE_IN_STARTUP), str(marker), phase, "train", *LINEAR, "--set", "steps=100000",
                  "--set", "log.name=s")
    _wait_for(marker.exists, proc)
    assert marker.read_text(encoding="utf-8") == f"{phase} {proc.pid}"
    proc.send_signal(signal.SIGINT)
    marker.with_name("paused.go").write_text("go", encoding="utf-8")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    if phase in ("torch_import", "building"):  # held through the import, or before the run folder: nothing written
        assert err == "ampguard: interrupted\n" and out == ""
        assert not runs.exists()
    elif phase == "run_folder":  # before the run's own handlers: it stops at once, no step, no logs
        assert err == "ampguard: interrupted\n"
        # the new folder held the config alone, nothing of a run: it is taken back (it was left behind,
        # and a rerun with the same log.name was refused as "already exists")
        assert out.splitlines()[-1] == "run folder: runs/s removed (nothing was run)", out
        assert not runs.exists()
    else:  # before_step_1: the run's handler holds it to the end of step 1, then closes it as a stop does
        run = runs / "s"
        assert err.splitlines()[-1] == "interrupted after step 1; 1 complete rows in runs/s/steps.csv", err
        assert [r["step"] for r in _rows(run / "steps.csv")] == ["1"]
        assert _card(run)["ended"] == "interrupted (Ctrl-C) after step 1"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001.pt"]
