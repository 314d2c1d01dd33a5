"""Review 54c: a new run folder is made under a temporary name beside it and renamed into place once
its ``config.yaml`` and ``run-id`` are in it (``RunPaths.new_run_dir``): a start-up stopped while it
writes them leaves nothing at the name, and what a SIGKILL left there (a hidden ``.new-run.tmp-PID-RANDOM``
folder) is removed by a later start-up once its process has ended; a folder a kill after the rename
left holding nothing of a run, its lock held by nobody, is taken by the next run of that name. (The
kill itself, in a real process: tests/e2e/test_startup_kill_review54.py.)"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ampguard.config import validate
from ampguard.errors import AmpguardWarning, InputError
from ampguard.files import STALE_AFTER_S
from ampguard.run_folder import LOCK_FILE, RunPaths


def _config(runs, name=None):
    return validate({"log": {"dir": str(runs), **({"name": name} if name else {})}})


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_stop_while_the_folder_is_written_leaves_nothing(tmp_path, monkeypatch):
    def stopped(self, config):  # (a Ctrl-C landing as config.yaml is written)
        raise KeyboardInterrupt

    monkeypatch.setattr(RunPaths, "write_config", stopped)
    told = []
    with pytest.raises(KeyboardInterrupt):
        RunPaths.new_run_dir(_config(tmp_path / "runs", "a"), on_made=told.append)
    assert told == [] and sorted(tmp_path.iterdir()) == []  # (runs/a was left, holding nothing of a run)


def test_the_folder_appears_whole_and_a_taken_name_is_refused(tmp_path):
    runs = tmp_path / "runs"
    paths = RunPaths.new_run_dir(_config(runs, "a"))
    assert sorted(p.name for p in runs.iterdir()) == ["a"]
    assert sorted(p.name for p in paths.dir.iterdir()) == ["config.yaml", "run-id"]
    (runs / "empty").mkdir()  # (an empty folder is a name taken too: rename(2) would replace it)
    for name in ("a", "empty"):
        with pytest.raises(InputError, match="already exists; choose another log.name"):
            RunPaths.new_run_dir(_config(runs, name))
    assert sorted(p.name for p in runs.iterdir()) == ["a", "empty"]
    stamped = [RunPaths.new_run_dir(_config(runs)).dir.name for _ in range(3)]  # (a timestamp: made unique)
    assert len(set(stamped)) == 3


def test_what_a_killed_start_up_left_is_removed_once_its_process_ended(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    dead, old = _ended_pid(), time.time() - STALE_AFTER_S - 60
    left = {
        f".x.tmp-{dead}-00dd": old,  # not a run folder being made (another tool's): kept
        f".new-run.tmp-{dead}-00aa": old,  # a dead process's, long untouched: removed
        f".new-run.tmp-{dead}-00bb": None,  # a dead process's, touched now (another machine's, maybe): kept
        f".new-run.tmp-{os.getpid()}-00cc": old,  # a running process's: kept
    }
    for name, when in left.items():
        (runs / name).mkdir()
        (runs / name / "config.yaml").write_text("x\n")
        if when is not None:
            os.utime(runs / name, (when, when))
    RunPaths.new_run_dir(_config(runs, "d"))
    assert sorted(p.name for p in runs.iterdir()) == sorted({*left, "d"} - {f".new-run.tmp-{dead}-00aa"})


def test_a_folder_a_killed_start_up_left_at_its_name_is_taken_and_no_other(tmp_path):
    runs = tmp_path / "runs"
    killed = RunPaths.new_run_dir(_config(runs, "k"), lock=True)  # (its process killed: its lock let go)
    os.close(killed._lock)
    lock = killed.dir / LOCK_FILE  # (the pid it names runs no more: review 54l)
    lock.write_text(lock.read_text().replace(str(os.getpid()), str(_ended_pid()), 1))
    killed_id = killed.run_id()
    (killed.dir / f".config.yaml.tmp-{_ended_pid()}-00ff").write_text("x")  # (an older ampguard's leftover)
    with pytest.warns(AmpguardWarning, match=f"run folder {killed.dir} held nothing of a run: a start-up killed "):
        paths = RunPaths.new_run_dir(_config(runs, "k"), lock=True)
    assert paths.dir == killed.dir and sorted(p.name for p in paths.dir.iterdir()) == [LOCK_FILE, "config.yaml",
                                                                                        "run-id"]
    assert paths.run_id() != killed_id and sorted(p.name for p in runs.iterdir()) == ["k"]
    # its lock held (a start-up that lives), something of a run in it, or nothing ampguard made: refused
    for name in ("csv", "empty"):
        (runs / name).mkdir()
    for name in ("config.yaml", LOCK_FILE, "steps.csv"):
        (runs / "csv" / name).write_text("step\n")
    RunPaths.new_run_dir(_config(runs, "api"))  # (the API's Trainer takes no lock: nothing says it ended)
    for name in ("k", "csv", "empty", "api"):
        before = sorted(p.name for p in (runs / name).iterdir())
        with pytest.raises(InputError, match="already exists; choose another log.name"):
            RunPaths.new_run_dir(_config(runs, name), lock=True)
        assert sorted(p.name for p in (runs / name).iterdir()) == before
    paths.unlock()
