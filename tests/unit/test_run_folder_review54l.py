"""Review 54l: the edges of a new run folder's making (``RunPaths.new_run_dir``) and of the takeover
of a folder a killed start-up left at the name (``_take_killed_start``): a stop signal just after the
rename let go of the lock before the folder was removed (a same-name start-up took the folder over,
then lost it to this process's removal); one just after the staging folder was made left it; the
takeover trusted ``flock`` to show a holder on another machine, refused a rerun while ``report``
polled the lock, and judged names, not kinds nor owners."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from ampguard import run_folder
from ampguard.config import validate
from ampguard.errors import InputError
from ampguard.run_folder import LOCK_FILE, RunPaths


def _config(runs, name):
    return validate({"log": {"dir": str(runs), "name": name}})


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _killed(runs, name) -> RunPaths:
    """What a start-up killed just after its rename left at ``runs/name``: its folder, with the lock
    file its process wrote (its pid, one that runs no more now, and this host), held by nobody."""
    killed = RunPaths.new_run_dir(_config(runs, name), lock=True)
    os.close(killed._lock)  # (the kernel lets go as the process ends)
    lock = killed.dir / LOCK_FILE
    lock.write_text(lock.read_text().replace(str(os.getpid()), str(_ended_pid()), 1))
    return killed


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_stop_just_after_the_rename_removes_the_folder_before_it_lets_go(tmp_path, monkeypatch):
    # the folder at its name, unlocked, was "a killed start-up's": a same-name start-up took it over and
    # put its own folder there, and this process's removal (its run id read a moment before) deleted it
    runs = tmp_path / "runs"
    real, seen = run_folder._remove_created, []

    def removing(created, run_dir):
        if run_dir in created:  # (the folder at its name is about to be removed)
            seen.append(RunPaths.existing(run_dir).writer())
            try:  # (another start-up of the name, in this moment)
                RunPaths.new_run_dir(_config(runs, "a"), lock=True)
                seen.append("taken")
            except InputError as err:
                seen.append(str(err))
        real(created, run_dir)

    def stopped(paths):  # (a Ctrl-C as train's on_made is told)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_folder, "_remove_created", removing)
    with pytest.raises(KeyboardInterrupt):
        RunPaths.new_run_dir(_config(runs, "a"), on_made=stopped, lock=True)
    assert seen == [str(os.getpid()), f"run folder {runs / 'a'} already exists; choose another log.name"]
    assert not runs.exists()


def test_a_stop_just_after_the_staging_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    real = pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.name.startswith(".new-run.tmp-"):
            raise KeyboardInterrupt  # (a Ctrl-C landing as mkdir returns)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        RunPaths.new_run_dir(_config(tmp_path / "runs", "a"), lock=True)
    assert _names(tmp_path) == []  # (.new-run.tmp-PID-RANDOM was left in runs/, and runs/ with it)
