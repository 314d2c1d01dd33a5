"""Review 52m: a signal while a run's closing lines are printed changed its decided exit code (a
finished run 143, a guard's stop 143 for its 3); a SIGTERM in the teardown after a start-up's
Ctrl-C killed the process (-15); a Ctrl-C in report's matplotlib import was swallowed (exit 0)."""

from __future__ import annotations

import importlib
import os
import signal
import time

from helpers import in_fork

from ampguard.errors import ExitCode

LINEAR = ["--set", "task.name=linear", "--set", "device=cpu", "--set", "precision=fp32", "--set", "steps=3",
          "--set", "eval.enabled=false", "--set", "log.plot=false"]


def test_a_signal_while_the_closing_lines_are_printed_leaves_the_runs_code(cli, monkeypatch, tmp_path):
    from ampguard import train as train_module
    from ampguard.signals import Interrupted

    def interrupted(result):
        raise Interrupted(ExitCode.TERMINATED)  # (a SIGTERM as "summary:" is printed)

    monkeypatch.setattr(train_module, "finish", interrupted)
    code, out, err = cli("train", *LINEAR, "--set", "log.name=f")
    assert code == ExitCode.OK and "interrupted" not in err, (code, err)
    code, out, err = cli("train", *LINEAR, "--set", "log.name=g", "--inject", "nan_loss@2", "--strict")
    assert code == ExitCode.GUARD, (code, err)
    assert (tmp_path / "runs" / "f" / "RUN.md").read_text().count("**finished: 3 steps**") == 1


def test_a_sigterm_once_the_code_is_settled_is_ignored():
    # (the teardown after a start-up's Ctrl-C: SIGTERM kept its default, and one then killed the process)
    from ampguard.signals import settled

    def child() -> str:
        settled(5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        return "alive"

    code, said = in_fork(child)
    assert (code, said) == (0, "alive"), said


def test_a_ctrl_c_in_reports_matplotlib_import_stops_it(cli, monkeypatch, tmp_path):
    assert cli("train", *LINEAR, "--set", "log.name=r")[0] == 0

    real_import, pressed = importlib.import_module, []

    def import_module(name, *args):  # (an import the Ctrl-C lands in; Python wraps the interrupt raised inside an
        if name.startswith("matplotlib") and not pressed:  # import in a RuntimeError, which matplotlib's `except
            pressed.append(name)  # Exception` around its 3-D import swallowed; report imports matplotlib.figure, review
            try:                  # 55t; once: a second Ctrl-C in the hold leaves at once, os._exit(130), review 58m)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            except BaseException:  # noqa: BLE001 - as swallowed there
                pass
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    code, out, err = cli("report", tmp_path / "runs" / "r")
    assert code == ExitCode.INTERRUPTED, (code, out, err)
